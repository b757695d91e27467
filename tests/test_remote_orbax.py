"""Orbax items in ``gs://`` read by ckptshim, against the real local GCS emulator.

MaxText's two tiny runs (``scan_layers`` on and off, real Orbax saves) are uploaded to a fresh
bucket as they are. Where ckptshim has a plan (unscanned -> scanned), the restore from the bucket
must equal, bit for bit, the same restore from the local copy; where the names match, Orbax's own
restore runs; a folder without ``commit_success.txt`` is refused as Orbax refuses it; and an OCDBT
index pointing outside the item's prefix is refused.
"""

from __future__ import annotations

import json

import jax
import orbax.checkpoint as ocp
import pytest

import ckptshim
from ckptshim.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptshim.formats import base as formats_base, detect, kvstore, orbax
from ckptshim.loading import jax as jax_loading
from ckptshim.storage import Location
from support.fixtures import copy_fixture
from support.maxtext_states import LAYERS, abstract, items, key_data, restored_natively, train_state
from support.markers import QUIET
from support.trees import assert_same, flat

pytestmark = [QUIET, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return items(copy_fixture("maxtext_runs", tmp_path_factory.mktemp("maxtext")))


@pytest.fixture(scope="module")
def remote(gcs_server, local):
    """The same items, uploaded to a fresh bucket of the emulator as plain objects."""
    import fsspec

    bucket = gcs_server.new_bucket()
    fs = fsspec.filesystem("gs")
    urls = {}
    for name, folder in local.items():  # the run's checkpoints/ (steps 0 and 1, each with commit_success.txt)
        urls[name] = f"{bucket}/{name}/checkpoints/1/items"
        fs.put(str(folder.parent.parent), f"{bucket}/{name}/checkpoints", recursive=True)
    fs.invalidate_cache()
    return urls


@pytest.fixture(scope="module")
def native(local):
    return restored_natively(local)


def test_unscanned_into_scanned_from_gs_equals_the_local_restore(local, remote, native, monkeypatch):
    opened = []
    monkeypatch.setattr(jax_loading.Prepared, "run", _recording(jax_loading.Prepared.run, opened))
    target = abstract(train_state(native["tiny_scanned"]))
    with ocp.StandardCheckpointer() as checkpointer:
        from_bucket = checkpointer.restore(remote["tiny_unscanned"], target)
        from_disk = checkpointer.restore(local["tiny_unscanned"], target)
    assert [str(where) for where in opened] == [remote["tiny_unscanned"], str(local["tiny_unscanned"])]
    assert_same(flat(from_bucket), flat(from_disk))
    leaf = from_bucket["params"]["params"]["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]
    assert isinstance(leaf, jax.Array) and leaf.shape == (32, LAYERS, 64)


def test_maxtext_manager_restore_from_gs_equals_the_local_restore(local, remote, native, monkeypatch):
    """MaxText's own restore: a ``CheckpointManager`` over the run's ``checkpoints`` prefix, item
    ``items``, the unscanned run into a scanned train state."""
    opened = []
    monkeypatch.setattr(jax_loading.Prepared, "run", _recording(jax_loading.Prepared.run, opened))
    target = abstract(train_state(native["tiny_scanned"]))
    restored = []
    for item in (remote["tiny_unscanned"], str(local["tiny_unscanned"])):
        root = item.rsplit("/", 2)[0]  # .../checkpoints
        with ocp.CheckpointManager(root, item_names=("items",)) as manager:
            restored.append(manager.restore(1, args=ocp.args.Composite(items=ocp.args.StandardRestore(target))))
    assert [str(where) for where in opened] == [remote["tiny_unscanned"], str(local["tiny_unscanned"])]
    assert_same(flat(restored[0]["items"]), flat(restored[1]["items"]))


def test_manager_restore_of_matching_names_from_gs_is_orbaxs_own(remote, native, monkeypatch):
    def refuse(self):
        raise AssertionError("ckptshim restored a checkpoint Orbax reads itself")

    monkeypatch.setattr(jax_loading.Prepared, "run", refuse)
    root = remote["tiny_scanned"].rsplit("/", 2)[0]
    with ocp.CheckpointManager(root, item_names=("items",)) as manager:
        restored = manager.restore(1, args=ocp.args.Composite(items=ocp.args.StandardRestore(
            abstract(native["tiny_scanned"]))))
    assert_same(flat(key_data(restored["items"])), flat(key_data(native["tiny_scanned"])))


def _recording(run, opened):
    def recorded(self):
        opened.append(self.checkpoint.path)
        return run(self)
    return recorded


def test_matching_names_from_gs_are_orbaxs_own_restore(remote, native, monkeypatch):
    def refuse(self):
        raise AssertionError("ckptshim restored a checkpoint Orbax reads itself")

    monkeypatch.setattr(jax_loading.Prepared, "run", refuse)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(remote["tiny_scanned"], abstract(native["tiny_scanned"]))
    assert_same(flat(key_data(restored)), flat(key_data(native["tiny_scanned"])))


def test_missing_commit_file_is_refused_as_orbax_refuses_it(gcs_server, local, native):
    import fsspec

    url = f"{gcs_server.new_bucket()}/items"
    fs = fsspec.filesystem("gs")
    fs.put(str(local["tiny_unscanned"]), url, recursive=True)
    fs.rm(f"{url}/{orbax.COMMIT_SUCCESS}")
    fs.invalidate_cache()
    target = abstract(train_state(native["tiny_scanned"]))
    errors = []
    for hooked in (False, True):
        (ckptshim.install if hooked else ckptshim.uninstall)()
        with ocp.StandardCheckpointer() as checkpointer, pytest.raises(ValueError) as raised:
            checkpointer.restore(url, target)
        errors.append((type(raised.value), str(raised.value)))
    assert errors[0] == errors[1] and "Found incomplete checkpoint" in errors[0][1]
    # ckptshim's own reading says so too (ckptshim inspect, a restore past Orbax's check)
    checkpoint = detect.open_checkpoint(url, backend="jax")
    assert any(orbax.COMMIT_SUCCESS in problem for problem in checkpoint.all_problems())
    with pytest.raises(CorruptCheckpointError, match="commit_success.txt"):
        checkpoint.require_complete()
    # an item of a manager's step that its step's commit file marks complete (what Orbax checks
    # when its manager restores the step) is complete
    step = url.rsplit("/", 1)[0] + "/1"
    fs.put(str(local["tiny_unscanned"]), f"{step}/items", recursive=True)
    fs.rm(f"{step}/items/{orbax.COMMIT_SUCCESS}")
    fs.pipe(f"{step}/{orbax.COMMIT_SUCCESS}", b"Checkpoint commit was successful")
    fs.invalidate_cache()
    assert detect.open_checkpoint(f"{step}/items", backend="jax").complete


def test_remote_item_is_opened_as_the_local_copy(local, remote):
    there = detect.open_checkpoint(remote["tiny_unscanned"], backend="jax")
    here = detect.open_checkpoint(local["tiny_unscanned"], backend="jax")
    assert (there.format, there.version) == (here.format, here.version)
    assert [(e.key, e.shape, e.dtype) for e in there.inventory.values()] == \
        [(e.key, e.shape, e.dtype) for e in here.inventory.values()]
    assert [(f.path, f.size, f.expected_size) for f in there.files] == \
        [(f.path, f.size, f.expected_size) for f in here.files]
    assert there.complete


def test_an_index_leaving_the_prefix_is_refused(remote):
    """OCDBT names its files relative to the item; one that climbs out of the prefix (``..``) is
    refused before tensorstore reads it, remotely as locally; and a kvstore spec naming another
    bucket or prefix than the item's is refused by the item's location."""
    root = Location.of(remote["tiny_unscanned"])
    with pytest.raises(CorruptCheckpointError, match="not a file inside the checkpoint"):
        kvstore._Locations(root).reference("value:..%2F..%2Fother%2F:d/abc:0:10")
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint"):
        root.require_kvstore_inside({"driver": "ocdbt", "base": {"driver": "gcs", "bucket": root.bucket,
                                                                 "path": "tiny_scanned/checkpoints/1/items/"}})
    assert root.require_kvstore_inside(root.kvstore_spec(ocdbt=True)) == root


def test_metadata_larger_than_the_cap_is_not_fetched(remote, monkeypatch):
    monkeypatch.setattr(formats_base, "ALLOWANCE_BYTES", 64)  # what metadata_limit allows beyond the arrays
    with pytest.raises(CorruptCheckpointError, match="_METADATA is .* more than the"):
        detect.open_checkpoint(remote["tiny_unscanned"], backend="jax")


def test_cli_inspects_and_plans_a_gs_item_as_its_local_copy(local, remote, capsys):
    from ckptshim import cli

    answers = []
    for where in (remote["tiny_unscanned"], str(local["tiny_unscanned"])):
        assert cli.main(["inspect", "--json", where]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    there, here = answers
    assert there["path"] == remote["tiny_unscanned"] and there["format"] == "orbax" and there["complete"]
    for field in ("entries", "total_bytes", "files", "writers", "problems", "version"):
        assert there[field] == here[field], field
    plans = []  # the whole train state: its rng state cannot be stacked, and both say so alike
    for where in (remote["tiny_unscanned"], str(local["tiny_unscanned"])):
        code = cli.main(["plan", where, "--like", remote["tiny_scanned"]])
        plans.append((code, capsys.readouterr().out.replace(where, "SOURCE")))
    assert plans[0] == plans[1] and "layers_{0..2}.mlp.wi_0.kernel -> stack(axis=1)" in plans[0][1]


def test_cli_converts_a_gs_item_as_its_local_copy(local, remote, tmp_path):
    from safetensors.numpy import load_file

    from ckptshim import cli

    outs = [tmp_path / "there.safetensors", tmp_path / "here.safetensors"]
    for where, out in zip((remote["tiny_unscanned"], str(local["tiny_unscanned"])), outs):
        assert cli.main(["convert", where, str(out), "--to", "safetensors"]) == 0
    there, here = (load_file(out) for out in outs)
    assert there.keys() == here.keys() and len(there) > 0
    assert all(there[key].dtype == here[key].dtype and there[key].tobytes() == here[key].tobytes() for key in here)


def test_a_missing_data_file_is_refused_before_any_read(gcs_server, local, native):
    """Completeness as locally: every file the OCDBT index names must be in the listing, as large
    as the index says; the error names the file and the arrays it held."""
    import fsspec

    url = f"{gcs_server.new_bucket()}/items"
    fs = fsspec.filesystem("gs")
    fs.put(str(local["tiny_unscanned"]), url, recursive=True)
    lost = sorted(name for name in fs.find(f"{url}/d") if fs.size(name) > 0)[-1]
    fs.rm(lost)
    fs.invalidate_cache()
    with ocp.StandardCheckpointer() as checkpointer, pytest.raises(CorruptCheckpointError) as raised:
        checkpointer.restore(url, abstract(train_state(native["tiny_scanned"])))
    assert f"d/{lost.rsplit('/', 1)[1]}: missing" in str(raised.value)


# -- a manager's item names, in gs:// as on a local disk ------------------------------------------


def _both(remote, local, run):
    """``run(root)`` for the unscanned run's ``checkpoints`` prefix in the bucket, then on disk."""
    return [run(where) for where in (remote["tiny_unscanned"].rsplit("/", 2)[0],
                                     local["tiny_unscanned"].parent.parent)]


def test_manager_restore_without_args_from_gs_reads_maxtexts_items_as_the_local_copy(local, remote):
    """MaxText names its item ``items``; a fresh manager finds no handler for it, so Orbax alone
    fails, remotely as locally; ckptshim restores the item as stored."""
    there, here = _both(remote, local, lambda root: ocp.CheckpointManager(root).restore(1))
    assert list(there.keys()) == list(here.keys()) == ["items"]
    assert_same(flat(there["items"]), flat(here["items"]))


def test_manager_single_item_args_from_gs_read_the_steps_one_train_state_item(local, remote, native):
    target = abstract(train_state(native["tiny_scanned"]))
    there, here = _both(remote, local, lambda root: ocp.CheckpointManager(root).restore(
        1, args=ocp.args.StandardRestore(target)))
    assert_same(flat(there), flat(here))
    assert there["params"]["params"]["decoder"]["layers"]["mlp"]["wi_0"]["kernel"].shape == (32, LAYERS, 64)


def test_composite_args_naming_state_from_gs_read_the_items_item(local, remote, native):
    target = abstract(train_state(native["tiny_scanned"]))
    handler = ocp.CompositeCheckpointHandler()
    there, here = _both(remote, local, lambda root: ocp.Checkpointer(handler).restore(
        f"{root}/1", args=ocp.args.Composite(state=ocp.args.StandardRestore(target))))
    assert list(there.keys()) == ["state"]
    assert_same(flat(there["state"]), flat(here["state"]))
