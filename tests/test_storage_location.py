"""ckptshim.storage: one Location type for local paths and s3:// / gs:// objects -- names that
pathlib would collapse kept, containment, tensorstore specs, and reads (stat, bounded listing,
byte ranges checked against sizes) against the local file system and real local S3 and GCS
servers (tests/support/object_stores.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.parse
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ckptshim.errors import CorruptCheckpointError, ShimError, UnsafeCheckpointError
from ckptshim.storage import ByteRange, Location, UnsupportedLocation, objects, read_ranges
from ckptshim.storage.location import REMOTE_OCDBT_READS

# -- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["gs://bucket/ckpt/step_1", "s3://bucket/a/b.distcp", "gcs://bucket/x"])
def test_a_url_stays_a_url(url):
    assert str(Path(url)) != url  # what a pathlib.Path does to it
    location = Location.of(url)
    assert str(location) == url and location.is_remote
    assert str(Location.of(url + "/")) == url  # a trailing slash names the same prefix
    assert Location.of(location) is location


def test_names_of_remote_locations():
    root = Location.of("gs://bucket/runs/ckpt")
    assert str(root / "step_1/_METADATA") == "gs://bucket/runs/ckpt/step_1/_METADATA"
    assert (root / "step_1").name == "step_1" and root.name == "ckpt"
    assert str(root.parent) == "gs://bucket/runs" and str(root.parent.parent.parent) == "gs://bucket"
    assert Location.of("s3://bucket").name == "" and str(Location.of("s3://bucket") / "x") == "s3://bucket/x"
    assert (root / "a/b").relative_to(root) == "a/b"


@pytest.mark.parametrize("part", ["..", "a/../b", "./a", "a//b", "/etc/passwd", "a\0b", ""])
def test_remote_joins_refuse_names_an_http_client_would_rewrite(part):
    with pytest.raises(ValueError, match="cannot join"):
        Location.of("s3://bucket/ckpt") / part


def test_local_locations_are_paths(tmp_path):
    root = Location.of(tmp_path)
    assert root.path == tmp_path and os.fspath(root / "a") == str(tmp_path / "a")
    assert (root / "a").parent == root and (root / "a").name == "a"
    assert Location.of(f"file://{tmp_path}") == root


def test_a_remote_location_is_no_local_path():
    remote = Location.of("gs://bucket/ckpt")
    with pytest.raises(TypeError, match="object storage"):
        os.fspath(remote)
    with pytest.raises(TypeError):
        open(remote, "rb")  # noqa: SIM115 -- never a relative file named gs:


@pytest.mark.parametrize("url", ["http://host/ckpt", "hf://org/model", "az://container/x", "memory://x"])
def test_other_urls_are_unsupported_not_refused(url):
    """A URL ckptshim cannot read is for the framework to read: not a ShimError (a refusal)."""
    with pytest.raises(UnsupportedLocation, match="ckptshim reads local paths and s3://") as caught:
        Location.of(url)
    assert not isinstance(caught.value, ShimError)


def test_a_url_without_bucket():
    with pytest.raises(ValueError, match="names no bucket"):
        Location.of("gs:///ckpt")


# -- containment ---------------------------------------------------------------------------------


@pytest.mark.parametrize("other, inside", [
    ("gs://bucket/ckpt", True), ("gs://bucket/ckpt/a/b", True), ("gcs://bucket/ckpt/a", True),
    ("gs://bucket/ckpt-old/a", False), ("gs://bucket/other", False), ("gs://other/ckpt/a", False),
    ("s3://bucket/ckpt/a", False), ("gs://bucket/ckpt/../other", False), ("gs://bucket/ckpt//a", False),
])
def test_remote_containment_is_bucket_and_prefix(other, inside):
    root = Location.of("gs://bucket/ckpt")
    assert Location.of(other).inside(root) is inside
    if not inside:
        with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint gs://bucket/ckpt"):
            Location.of(other).require_inside(root)


@pytest.mark.parametrize("relative", ["../other/x", "a/../../x", "/abs/x", "gs://other/x", "a\0"])
@pytest.mark.parametrize("root", ["gs://bucket/ckpt", "LOCAL"])
def test_child_refuses_what_leaves_the_checkpoint(root, relative, tmp_path):
    root = Location.of(tmp_path if root == "LOCAL" else root)
    with pytest.raises(UnsafeCheckpointError, match="lies outside the checkpoint"):
        root.child(relative)


def test_a_local_child_may_not_leave_by_a_link(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "secret").write_bytes(b"x")
    (tmp_path / "ckpt" / "data").symlink_to(tmp_path / "secret")
    (tmp_path / "ckpt" / "inner").symlink_to(tmp_path / "ckpt")
    root = Location.of(tmp_path / "ckpt")
    with pytest.raises(UnsafeCheckpointError, match="real path is elsewhere"):
        root.child("data")
    assert root.child("inner/x").name == "x"  # a link that stays inside is fine


def test_kvstore_specs_round_trip(monkeypatch, tmp_path):
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    gs, s3, local = Location.of("gs://b/ckpt/1"), Location.of("s3://b/ckpt"), Location.of(tmp_path)
    assert gs.kvstore_spec() == {"driver": "gcs", "bucket": "b", "path": "ckpt/1/"}
    assert s3.kvstore_spec(ocdbt=True) == {"driver": "ocdbt", "base": {
        "driver": "s3", "bucket": "b", "path": "ckpt/", "endpoint": "http://127.0.0.1:9"}, **REMOTE_OCDBT_READS}
    assert local.kvstore_spec(ocdbt=True) == {"driver": "ocdbt", "base": local.kvstore_spec()}
    assert local.kvstore_spec() == {"driver": "file", "path": str(tmp_path.resolve()) + "/"}
    for location in (gs, s3, local):
        assert Location.of_kvstore(location.kvstore_spec()).inside(location)
        assert Location.of_kvstore(location.kvstore_spec(ocdbt=True)).inside(location)
    assert Location.of_kvstore("gs://b/ckpt/1/|ocdbt:") == gs


@pytest.mark.parametrize("spec", [
    {"driver": "gcs", "bucket": "other", "path": "ckpt/a/"},
    {"driver": "gcs", "bucket": "b", "path": "ckpt/../secrets/"},
    {"driver": "s3", "bucket": "b", "path": "ckpt/a/"},
    {"driver": "ocdbt", "base": "gs://b/elsewhere/"},
    {"driver": "http", "base_url": "http://example.invalid/"},
    {"driver": "memory"},
    {"driver": "file", "path": "/etc/"},
    "gs://b/ckpt/a|zip:x",
])
def test_a_kvstore_spec_leaving_the_checkpoint_is_refused(spec):
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint gs://b/ckpt"):
        Location.of("gs://b/ckpt").require_kvstore_inside(spec)


def test_importing_storage_imports_no_client_or_framework():
    code = ("import sys, ckptshim.storage; "
            "print(sorted(m for m in ('torch', 'jax', 'fsspec', 'tensorstore', 's3fs', 'gcsfs') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- reading, locally and from the real servers --------------------------------------------------


@dataclass
class Place:
    root: Location
    put: Callable[[str, bytes], None]


@pytest.fixture(params=["local", "s3", "gs"])
def place(request, tmp_path) -> Place:
    """An empty checkpoint folder or prefix, and a way to store a file in it."""
    if request.param == "local":
        folder = tmp_path / "ckpt"
        folder.mkdir()

        def put(name: str, data: bytes) -> None:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)

        return Place(Location.of(folder), put)
    server = request.getfixturevalue({"s3": "s3_server", "gs": "gcs_server"}[request.param])
    root = Location.of(server.new_bucket()) / "ckpt"
    fs = objects.filesystem(request.param)
    return Place(root, lambda name, data: fs.pipe(f"{root.bucket}/{root.key}/{name}", data))


DATA = bytes(range(256)) * 40  # 10,240 bytes


def test_stat_and_kinds(place):
    place.put("a.bin", DATA)
    place.put("sub/b.bin", b"xyz")
    info = (place.root / "a.bin").stat()
    assert (info.size, info.kind) == (len(DATA), "file")
    assert (place.root / "sub").is_dir() and not (place.root / "sub").is_file()
    assert (place.root / "a.bin").is_file() and (place.root / "a.bin").exists()
    assert not (place.root / "missing").exists() and not (place.root / "missing").is_file()
    with pytest.raises(FileNotFoundError):
        (place.root / "missing").stat()


def test_listing_by_prefix_with_a_limit(place):
    for name in ("b", "a", "c/d", "c/e/f"):
        place.put(name, name.encode())
    listed = place.root.list()
    assert [(i.location.relative_to(place.root), i.kind) for i in listed] == [
        ("a", "file"), ("b", "file"), ("c", "directory")]
    assert place.root.list(3) == listed  # exactly the limit is fine
    everything = {i.location.relative_to(place.root): i.size for i in place.root.list(recursive=True) if i.kind == "file"}
    assert everything == {"a": 1, "b": 1, "c/d": 3, "c/e/f": 5}
    with pytest.raises(CorruptCheckpointError, match=r"holds more than 2 entries.*Point it at the checkpoint itself"):
        place.root.list(2)
    with pytest.raises(CorruptCheckpointError, match="more than 3 entries"):
        place.root.list(3, recursive=True)
    with pytest.raises(FileNotFoundError):
        (place.root / "nothing-here").list()


def test_byte_ranges_are_exact(place):
    place.put("a.bin", DATA)
    where = place.root / "a.bin"
    assert where.read(0, 10) == DATA[:10] and where.read(1000, 3000) == DATA[1000:4000]
    assert where.read(len(DATA) - 5, 5) == DATA[-5:] and where.read(7, 0) == b""
    out = np.zeros(64, np.uint16)
    where.read_into(256, out)
    assert out.tobytes() == DATA[256:384]
    assert where.read_bytes(limit=len(DATA)) == DATA
    assert where.head(8) == DATA[:8] and where.head(10**6) == DATA


@pytest.mark.parametrize("start, length", [(len(DATA) - 5, 6), (len(DATA), 1), (len(DATA) + 100, 10)])
def test_a_range_past_the_end_says_the_object_is_truncated(place, start, length):
    place.put("a.bin", DATA)
    with pytest.raises(CorruptCheckpointError, match=rf"bytes {start}..{start + length} were asked for, but it "
                                                     rf"holds {len(DATA)} bytes; it is truncated.*Re-copy"):
        (place.root / "a.bin").read(start, length)


def test_reads_of_what_is_missing_or_too_large(place):
    place.put("a.bin", DATA)
    with pytest.raises(FileNotFoundError):
        (place.root / "missing.bin").read(0, 1)
    with pytest.raises(FileNotFoundError):
        (place.root / "missing.bin").read(0, 0)
    with pytest.raises(CorruptCheckpointError, match=r"is 10,240 bytes, more than the 1,024 ckptshim reads"):
        (place.root / "a.bin").read_bytes(limit=1024)


def recorded_streams(monkeypatch) -> dict:
    """What the store's streamed requests were: ``pieces`` (``(start, end)`` each) and ``most``
    in flight at once (the client's own requests still run, against the real server)."""
    flight: dict = {"now": 0, "most": 0, "pieces": []}

    def counted(stream):
        async def streaming(fs, piece, sink):
            flight["now"] += 1
            flight["most"] = max(flight["most"], flight["now"])
            flight["pieces"].append((piece.start, piece.end))
            try:
                await stream(fs, piece, sink)
            finally:
                flight["now"] -= 1
        return streaming

    monkeypatch.setattr(objects, "_STREAMS", {scheme: counted(stream) for scheme, stream in objects._STREAMS.items()})
    return flight


def test_many_ranges_in_bounded_parallel_pieces(place, monkeypatch):
    """Ranges over several objects, those of one object that overlap fetched as one run, split
    into pieces (a small piece size stands in for 16 MiB), at most MAX_PARALLEL_READS pieces in
    flight (each streamed in chunks smaller than itself); into buffers or as bytes."""
    monkeypatch.setattr(objects, "PIECE_BYTES", 1000)
    monkeypatch.setattr(objects, "MAX_PARALLEL_READS", 4)
    monkeypatch.setattr(objects, "CHUNK_BYTES", 300)
    flight = recorded_streams(monkeypatch)
    blobs = {f"o{i}": bytes((i * 7 + j) % 251 for j in range(3000 + 500 * i)) for i in range(3)}
    for name, blob in blobs.items():
        place.put(name, blob)
    wanted = [(name, start, length) for name, blob in blobs.items()
              for start, length in ((0, len(blob)), (17, 2500), (len(blob) - 1, 1), (5, 0))]
    ranges = [ByteRange(place.root / name, start, length) for name, start, length in wanted]
    got = read_ranges(ranges)
    assert [bytes(g) for g in got] == [blobs[n][s:s + n_] for n, s, n_ in wanted]
    buffers = [np.empty(length, np.uint8) for _, _, length in wanted]
    assert read_ranges(ranges, buffers) is None
    assert [b.tobytes() for b in buffers] == [blobs[n][s:s + n_] for n, s, n_ in wanted]
    if place.root.is_remote:
        assert 1 < flight["most"] <= 4
        assert len(flight["pieces"]) == 2 * sum(-(-len(blob) // 1000) for blob in blobs.values())


def test_a_stored_name_that_would_leave_the_prefix_is_refused(s3_server):
    """A bucket may hold ``ckpt/x/../../secret``; an HTTP client would fetch ``secret`` for it."""
    import urllib.request

    root = Location.of(s3_server.new_bucket()) / "ckpt"
    upload = f"{s3_server.endpoint}/{root.bucket}/ckpt/x/%2E%2E/%2E%2E/secret"
    urllib.request.urlopen(urllib.request.Request(upload, data=b"s", method="PUT"), timeout=30).read()
    with pytest.raises(UnsafeCheckpointError, match=r"ckpt/x/\.\./\.\./secret lies outside the checkpoint"):
        root.list(recursive=True)


def test_ranges_must_fit_their_buffers(place):
    place.put("a.bin", DATA)
    with pytest.raises(ValueError, match="a buffer of 3 bytes for a range of 4"):
        read_ranges([ByteRange(place.root / "a.bin", 0, 4)], [bytearray(3)])
    with pytest.raises(ValueError, match="read-only"):
        read_ranges([ByteRange(place.root / "a.bin", 0, 4)], [b"1234"])


# -- local files: regular ones only, never blocking ----------------------------------------------


def test_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "chunk")
    where = Location.of(tmp_path) / "chunk"
    assert where.stat().kind == "fifo" and not where.is_file()
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            where.read(0, 1)
        except BaseException as error:  # noqa: BLE001 -- handed to the test thread
            outcome.append(error)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert isinstance(outcome[0], UnsafeCheckpointError) and "is a named pipe (FIFO), not a regular file" in str(outcome[0])


def test_a_folder_is_no_file_to_read(tmp_path):
    with pytest.raises(UnsafeCheckpointError, match="is a directory, not a regular file"):
        Location.of(tmp_path).read(0, 1)


def test_nearby_ranges_are_one_run_and_far_ones_are_not(place, monkeypatch):
    """Ranges of one object within MERGE_GAP of each other are one request; farther apart, two.
    Each buffer gets exactly its own bytes."""
    if not place.root.is_remote:
        pytest.skip("runs are how object stores are read")
    monkeypatch.setattr(objects, "MERGE_GAP", 100)
    requests = recorded_streams(monkeypatch)["pieces"]
    place.put("a.bin", DATA)
    wanted = [(0, 10), (60, 40), (150, 10), (1000, 24)]  # gaps 50, 50: one run; then 840: another
    got = read_ranges([ByteRange(place.root / "a.bin", start, length) for start, length in wanted])
    assert [bytes(g) for g in got] == [DATA[s:s + n] for s, n in wanted]
    assert sorted(requests) == [(0, 160), (1000, 1024)]


def test_a_dropped_connection_is_retried_and_a_missing_object_is_not(place, monkeypatch):
    """A piece whose connection fails mid-answer (after some of its bytes were written) is fetched
    again from its start, and the buffers hold exactly its bytes; a missing object is reported
    at once (the client's ``FileNotFoundError``), never retried."""
    if not place.root.is_remote:
        pytest.skip("retries are how object stores are read")
    monkeypatch.setattr(objects, "CHUNK_BYTES", 1000)
    place.put("a.bin", DATA)
    tries: list[int] = []
    dropped: list[bool] = []

    def flaky(stream):
        async def streaming(fs, piece, sink):
            tries.append(piece.start)
            if not dropped:
                dropped.append(True)
                sink.write(b"\xff" * 1000)  # a partial, wrong answer, then the connection drops
                raise ConnectionResetError("the server went away")
            await stream(fs, piece, sink)
        return streaming

    monkeypatch.setattr(objects, "_STREAMS", {scheme: flaky(stream) for scheme, stream in objects._STREAMS.items()})
    out = np.zeros(4000, np.uint8)
    (place.root / "a.bin").read_into(100, out)
    assert out.tobytes() == DATA[100:4100] and tries == [100, 100]
    tries.clear()
    with pytest.raises(FileNotFoundError):
        (place.root / "missing.bin").read(0, 10)
    assert tries == [0]


def test_a_client_without_the_streaming_helpers_reads_through_fsspecs_own_ranged_read(place, monkeypatch):
    """Where the installed s3fs/gcsfs lacks a private helper the streamed reads use, ranges are
    read by the client's own ``_cat_file``, bytes exact, a short object still named as such."""
    if not place.root.is_remote:
        pytest.skip("a client's helpers are an object store's")
    monkeypatch.setattr(objects, "_NEEDS", {scheme: ("_not_in_any_release",) for scheme in objects._NEEDS})
    monkeypatch.setattr(objects, "_STREAMS", {scheme: None for scheme in objects._STREAMS})  # never called
    place.put("a.bin", DATA)
    wanted = [(0, 10), (60, 40), (1000, 24), (len(DATA) - 7, 7)]
    got = read_ranges([ByteRange(place.root / "a.bin", start, length) for start, length in wanted])
    assert [bytes(g) for g in got] == [DATA[s:s + n] for s, n in wanted]
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        (place.root / "a.bin").read(len(DATA) - 5, 6)


# -- a snapshot of a prefix: one listing and the first reads, in one round ------------------------


def test_a_snapshot_answers_as_the_store_does_without_asking_it_again(place, monkeypatch):
    """Inside ``snapshot.listed``, every stat, listing and read of the fetched objects below the
    prefix answers what the store answers outside it, without a request; an object larger than
    its bound, or not fetched, is read from the store; one the listing lacks is not there."""
    from ckptshim.storage import snapshot

    for name, data in {"a.bin": DATA, "big.bin": DATA, "c/d": b"xyz", "c/e/f": b"12345"}.items():
        place.put(name, data)
    fetch = {"a.bin": 1 << 20, "big.bin": 100, "missing": 100}

    def answers() -> list:
        root = place.root
        return [root.stat().kind, (root / "a.bin").stat(), (root / "c").stat().kind, (root / "c").is_dir(),
                (root / "missing").exists(), (root / "c/e").is_dir(), root.list(), root.list(recursive=True),
                (root / "c").list(), (root / "a.bin").read_bytes(len(DATA)), (root / "a.bin").read(7, 20),
                (root / "big.bin").read(0, 4), bytes((root / "a.bin").whole())]

    outside = answers()
    if not place.root.is_remote:
        with snapshot.listed(place.root, fetch) as taken:
            assert taken is None  # a disk answers each question without a round trip
        return
    asked: list[str] = []
    for method in ("stat", "list", "read_ranges", "whole"):
        original = getattr(objects.FsspecObjects, method)
        monkeypatch.setattr(objects.FsspecObjects, method,
                            lambda self, *a, _m=method, _o=original: asked.append(_m) or _o(self, *a))
    with snapshot.listed(place.root, fetch) as taken:
        assert sorted(taken.fetched) == ["a.bin"]
        asked.clear()
        assert answers() == outside
        assert asked == ["read_ranges"]  # big.bin's 4 bytes: its fetch stopped at 100 bytes of 10,240
        with pytest.raises(FileNotFoundError):
            (place.root / "missing").stat()
        with pytest.raises(CorruptCheckpointError, match="more than 2 entries"):
            place.root.list(2)
        with pytest.raises(CorruptCheckpointError, match=r"bytes 10235..10245 were asked for.*truncated"):
            (place.root / "a.bin").read(len(DATA) - 5, 10)
        with snapshot.listed(place.root / "c", {"d": 10, "e/f": 3}) as inner:  # below it: no listing
            assert inner.files == {"d": 3, "e/f": 5} and inner.fetched == {"d": b"xyz"}
    asked.clear()
    assert (place.root / "a.bin").stat().size == len(DATA) and asked == ["stat"]  # the store's again


def test_a_prefix_that_cannot_be_listed_takes_no_snapshot(place):
    from ckptshim.storage import snapshot

    with snapshot.listed(place.root / "nothing-here", {"x": 10}) as taken:
        assert taken is None
        with pytest.raises(FileNotFoundError):
            (place.root / "nothing-here" / "x").stat()


def test_objects_checked_in_turn_are_read_a_window_at_a_time(place, monkeypatch):
    """``reading_ahead`` under a snapshot: objects read whole in a known order come a window of
    the store's read-ahead bytes at a time, each window in one batch; the bytes are the objects'."""
    from ckptshim.storage import snapshot

    chunks = {f"w/{i}": bytes([i]) * (10 + i) for i in range(5)}
    for name, data in chunks.items():
        place.put(name, data)
    if not place.root.is_remote:
        with snapshot.reading_ahead(place.root / "w", [str(i) for i in range(5)]):
            assert [bytes((place.root / name).whole()) for name in chunks] == list(chunks.values())
        return
    monkeypatch.setattr(objects, "READ_AHEAD_BYTES", 25)  # two of them at a time
    batches: list[int] = []
    original = objects.FsspecObjects.read_ranges
    monkeypatch.setattr(objects.FsspecObjects, "read_ranges",
                        lambda self, ranges, buffers: batches.append(len(ranges)) or original(self, ranges, buffers))
    with snapshot.listed(place.root), snapshot.reading_ahead(place.root / "w", [str(i) for i in range(5)]):
        assert [bytes((place.root / name).whole()) for name in chunks] == list(chunks.values())
        assert (place.root / "w/1").read(3, 4) == chunks["w/1"][3:7]  # a window from it again: w/1, w/2
    assert batches == [2, 2, 1, 2]


def test_a_prefix_below_a_snapshot_with_nothing_in_it_is_not_there(place):
    from ckptshim.storage import snapshot

    place.put("a.bin", b"x")
    with snapshot.listed(place.root), snapshot.listed(place.root / "empty") as below:
        assert not (place.root / "empty").exists()
        assert below is None or below.files == {}
