"""The local S3 and GCS servers the remote tests run against (tests/support/object_stores.py):
started on free ports, gone when stopped or when the process that started them dies, and the
GCS emulator answering as GCS does where tensorstore and gcsfs depend on it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import quote, urlsplit

import pytest

from support import object_stores
from support.processes import environment


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


EVERY_SERVER = [(scheme, server) for scheme, servers in object_stores.SERVERS.items() for server in servers]


@pytest.mark.parametrize("scheme, server", EVERY_SERVER)
def test_a_server_dies_with_the_process_that_started_it(scheme, server):
    """A test process killed outright (no teardown runs) leaves no server behind: the server's
    standard input closes and it exits, its port freed (fake-gcs-server's binary, a process of
    its own under it, is stopped with it)."""
    code = ("import sys; from support import object_stores; "
            f"store = object_stores.start({scheme!r}, {server!r}); print(store.pid, store.endpoint, flush=True); sys.stdin.read()")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=environment(), text=True)
    try:
        pid, endpoint = parent.stdout.readline().split()
        pid = int(pid)
        assert not _gone(pid, 0.5), "the server did not start"
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        parent.stdin.close()
        parent.stdout.close()
    assert _gone(pid, 20), f"the {server} server outlived the process that started it"
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", urlsplit(endpoint).port)) != 0


@pytest.mark.parametrize("scheme, server", EVERY_SERVER)
def test_stop_ends_the_server_and_frees_its_port(scheme, server):
    store = object_stores.start(scheme, server)
    port = urlsplit(store.endpoint).port
    bucket = store.new_bucket()
    assert bucket.startswith(f"{scheme}://ckpt-")
    store.stop()
    assert not store.alive() and store._process.returncode == 0
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0


# -- the GCS emulator, as GCS answers ------------------------------------------------------------


def _call(method: str, url: str, data: bytes | None = None, headers: dict | None = None):
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


@pytest.fixture
def gcs_object(gcs_server):
    bucket = gcs_server.new_bucket()[len("gs://"):]
    status, _, body = _call("POST", f"{gcs_server.endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media&name=a/x",
                            b"0123456789", {"Content-Type": "application/octet-stream"})
    assert status == 200
    return gcs_server.endpoint, bucket, json.loads(body)["generation"]


def test_downloads_carry_the_generation(gcs_object):
    endpoint, bucket, generation = gcs_object
    status, headers, body = _call("GET", f"{endpoint}/storage/v1/b/{bucket}/o/{quote('a/x', safe='')}?alt=media",
                                  headers={"Range": "bytes=2-4"})
    assert (status, body) == (206, b"234")
    assert headers["x-goog-generation"] == generation and headers["x-goog-stored-content-length"] == "10"


def test_preconditions_are_kept(gcs_object):
    endpoint, bucket, generation = gcs_object
    media = f"{endpoint}/storage/v1/b/{bucket}/o/{quote('a/x', safe='')}?alt=media"
    assert _call("GET", media + f"&ifGenerationNotMatch={generation}")[0] == 304
    assert _call("GET", media + f"&ifGenerationMatch={generation}")[0] == 200
    upload = f"{endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media&name=a/x"
    assert _call("POST", upload + "&ifGenerationMatch=0", b"new")[0] == 412  # exists already
    assert _call("POST", upload.replace("a/x", "a/y") + "&ifGenerationMatch=0", b"new")[0] == 200


def test_objects_move(gcs_object):
    endpoint, bucket, _ = gcs_object
    status, _, body = _call("POST", f"{endpoint}/storage/v1/b/{bucket}/o/{quote('a/x', safe='')}/moveTo/o/"
                                    f"{quote('b/z', safe='')}")
    assert status == 200 and json.loads(body)["name"] == "b/z"
    assert _call("GET", f"{endpoint}/storage/v1/b/{bucket}/o/{quote('a/x', safe='')}")[0] == 404
    assert _call("GET", f"{endpoint}/storage/v1/b/{bucket}/o/{quote('b/z', safe='')}?alt=media")[2] == b"0123456789"


def test_uploads_are_told_to_continue(gcs_object):
    """curl (tensorstore) sends ``Expect: 100-continue`` and waits for the interim answer."""
    endpoint, bucket, _ = gcs_object
    host, port = urlsplit(endpoint).hostname, urlsplit(endpoint).port
    with socket.create_connection((host, port), timeout=10) as connection:
        connection.sendall((f"POST /upload/storage/v1/b/{bucket}/o?uploadType=media&name=c HTTP/1.1\r\n"
                            f"Host: {host}:{port}\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n").encode())
        assert connection.recv(64).startswith(b"HTTP/1.1 100 Continue")
