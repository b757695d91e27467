"""``gcp-storage-emulator`` (PyPI), made to answer as GCS answers the clients under test.

The emulator serves the GCS JSON API from memory, but as shipped it cannot stand in for GCS
behind tensorstore, gcsfs or Orbax; each difference below is one that a real client trips on:

- media downloads carry no ``x-goog-generation`` header, so tensorstore's ``gcs`` driver fails
  every read with ``Malformed StorageGeneration``;
- the ``ifGeneration[Not]Match`` / ``ifMetageneration[Not]Match`` preconditions that tensorstore
  sends are ignored (a conditional write always succeeds, a conditional read never says 304);
- ``moveTo`` is not routed: gcsfs answers the 501 with six retries and exponential back-off per
  file (about 30 s) before it copies and deletes, so a DCP save to ``gs://`` crawls;
- it is single-threaded and speaks HTTP/1.0, so it never answers ``Expect: 100-continue`` and a
  curl upload (tensorstore) waits a second for it, and no connection is ever reused;
- every write re-serialises the metadata of every object, which makes a checkpoint of many small
  objects quadratic; and a bucket is created without the settings the request asks for (a
  deleted object is then kept for 7 days of soft deletion, copied in memory).

``serve(host, port)`` returns the patched server, not yet serving. This module runs only inside
the server process that ``support.object_stores`` starts, never in the test process.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from functools import partial
from http import HTTPStatus
from http.server import ThreadingHTTPServer

from gcp_storage_emulator import server as emulator
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import buckets, objects
from gcp_storage_emulator.storage import Storage

Handler = Callable[..., None]

#: One request at a time touches the emulator's storage (plain dicts); only sockets run in parallel.
_STORAGE_LOCK = threading.Lock()


def _object_name(request) -> str | None:
    if request.params and request.params.get("object_id"):
        return request.params["object_id"]
    if "name" in request.query:
        return request.query["name"][0]
    data = request.data
    if isinstance(data, dict) and isinstance(data.get("meta"), dict):
        return data["meta"].get("name")
    return None


def _precondition_status(request, storage, *, reading: bool) -> HTTPStatus | None:
    """The status GCS answers for a request whose preconditions fail, or None. A missing object
    has generation 0 (``ifGenerationMatch=0`` is "create only")."""
    name = _object_name(request)
    if name is None:
        return None
    try:
        current = storage.get_file_obj(request.params["bucket_name"], name)
    except NotFound:
        current = None
    if current is None and reading:
        return None  # the handler answers 404
    generation = int(current["generation"]) if current else 0
    metageneration = int(current["metageneration"]) if current else 0
    for field, value, negated in (("ifGenerationMatch", generation, False),
                                  ("ifGenerationNotMatch", generation, True),
                                  ("ifMetagenerationMatch", metageneration, False),
                                  ("ifMetagenerationNotMatch", metageneration, True)):
        if field not in request.query:
            continue
        matches = int(request.query[field][0]) == value
        if negated and matches:
            return HTTPStatus.NOT_MODIFIED if reading else HTTPStatus.PRECONDITION_FAILED
        if not negated and not matches:
            return HTTPStatus.PRECONDITION_FAILED
    return None


def _with_preconditions(handler: Handler, *, reading: bool) -> Handler:
    @functools.wraps(handler)
    def checked(request, response, storage, *args, **kwargs):
        status = _precondition_status(request, storage, reading=reading)
        if status is not None:
            response.status = status
            return None
        return handler(request, response, storage, *args, **kwargs)

    return checked


def _with_generation_headers(download: Handler) -> Handler:
    """A media download that says which generation it sent, as GCS does."""

    @functools.wraps(download)
    def download_with_generation(request, response, storage, *args, **kwargs):
        download(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = obj["generation"]
            response["x-goog-metageneration"] = obj["metageneration"]
            response["x-goog-stored-content-length"] = str(obj["size"])

    return download_with_generation


def _insert_bucket_as_asked(insert: Handler) -> Handler:
    """Bucket creation that keeps the settings the request carries (soft-delete policy, ...)."""

    @functools.wraps(insert)
    def insert_bucket(request, response, storage, *args, **kwargs):
        insert(request, response, storage, *args, **kwargs)
        bucket = storage.get_bucket(request.data.get("name") or "")
        if response.status == HTTPStatus.OK and bucket is not None:
            response.json(buckets._patch_bucket(bucket, request.data))

    return insert_bucket


def _move(request, response, storage, *args, **kwargs):
    """``objects.move``: the object under its new name in the same bucket, the old name gone."""
    bucket, source, destination = (request.params[k] for k in ("bucket_name", "object_id", "dest_object_id"))
    try:
        moved = objects._copy(request.base_url, storage, bucket, source, bucket, destination)
        storage.delete_file(bucket, source)
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        return
    response.json(moved)


def _serialised(handler: Handler) -> Handler:
    @functools.wraps(handler)
    def locked(*args, **kwargs):
        with _STORAGE_LOCK:
            return handler(*args, **kwargs)

    return locked


def _patch_emulator() -> None:
    """Install the fixes above into the emulator's module-level routing (idempotent)."""
    if getattr(emulator, "_ckptshim_tests_patched", False):
        return
    replacements: dict[Handler, Handler] = {
        objects.download: _with_preconditions(_with_generation_headers(objects.download), reading=True),
        objects.insert: _with_preconditions(objects.insert, reading=False),
        objects.delete: _with_preconditions(objects.delete, reading=False),
        buckets.insert: _insert_bucket_as_asked(buckets.insert),
    }
    # ``objects.get`` with ``alt=media`` and the router's fallback for uploads look these names
    # up in their modules at call time.
    objects.download = replacements[objects.download]
    objects.insert = replacements[objects.insert]
    move_routes = tuple(
        (rf"^{prefix}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$",
         {emulator.POST: _move})
        for prefix in (emulator.settings.API_ENDPOINT, ""))
    emulator.HANDLERS = tuple(
        (pattern, {method: _serialised(replacements.get(handler, handler)) for method, handler in methods.items()})
        for pattern, methods in (*move_routes, *emulator.HANDLERS))
    # Nothing reads the metadata back from an in-memory store; writing it on every change made a
    # checkpoint of n objects cost n^2.
    Storage._write_config_to_file = lambda self: None
    emulator._ckptshim_tests_patched = True


class _RequestHandler(emulator.RequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue for curl's uploads


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def serve(host: str, port: int) -> ThreadingHTTPServer:
    """The patched emulator bound to ``(host, port)`` (port 0: a free one), with an empty
    in-memory store; call ``serve_forever()`` on it, and ``shutdown()`` to stop."""
    _patch_emulator()
    storage = Storage(use_memory_fs=True)
    return _Server((host, port), partial(_RequestHandler, storage))
