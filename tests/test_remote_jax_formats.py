"""The JAX side's msgpack/zarr family in ``gs://``, read by ckptshim as from a local copy.

Real fixtures (T5X legacy and Orbax-era steps, a PaxML run, Flax 0.6.11 legacy msgpack files) and
real Orbax saves (per-leaf zarr items) are uploaded once per module to the local GCS emulator.
Each remote load must equal, bit for bit, the same load from the local copy; completeness is
checked as locally; a tensorstore spec leaving the step is refused; and where names match, the
framework's own restore runs.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax.training import checkpoints as flax_checkpoints

import ckptshim
from ckptshim import cli
from ckptshim.api import open_checkpoint
from ckptshim.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptshim.formats import detect, orbax, t5x as t5x_format
from ckptshim.inventory import flatten
from ckptshim.loading import jax as jax_loading
from ckptshim.storage import Location
from support.fixtures import copy_fixture
from support.markers import QUIET
from support.native import same_failure, without_and_with
from support.paxml_flax_writer import pax_payload, write_with_orbax
from support.t5x_site import standin_t5x
from support.trees import assert_same, flat
from test_flax_legacy import LAYERS, on_disk, scanned_state, state_dict_values
from test_formats_t5x_paxml import T5X
from test_paxml import PAX, STEP
from test_t5x import _placeholder_step, assert_manifest

pytestmark = [QUIET, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Local copies of every fixture, as they will be laid out in the bucket."""
    root = tmp_path_factory.mktemp("jax_formats")
    copy_fixture(f"{T5X}/legacy_checkpointer", root / "t5x")
    copy_fixture(f"{T5X}/orbax_checkpoint_manager", root / "t5x")
    pax = copy_fixture(f"{PAX}/checkpoints/{STEP}", root / "pax")
    for folder in (pax, pax / "state"):  # what PaxML's Orbax manager writes into a gs:// step and its items
        (folder / "commit_success.txt").write_text("done")
    copy_fixture("flax_0.6.11_legacy_msgpack/legacy_msgpack", root / "flax")
    placeholder = _placeholder_step(root / "made")  # T5X's Orbax path with Orbax < 0.5: PLACEHOLDER:// leaves
    (placeholder / "commit_success.txt").write_text("done")
    shutil.rmtree(root / "made" / "src")
    stored = open_checkpoint(pax / "state")
    try:  # PaxML's FLAX checkpoint type: one msgpack payload in the state item
        write_with_orbax(root / "paxflax/checkpoint_1/state",
                         pax_payload({key: stored.read(entry).copy() for key, entry in stored.inventory.items()}))
    finally:
        stored.close()
    return root


@pytest.fixture(scope="module")
def remote(gcs_server, local):
    """The same tree in a fresh bucket, uploaded as plain objects; its URL."""
    import fsspec

    bucket = f"{gcs_server.new_bucket()}/run"
    upload(local, bucket)
    return bucket


def upload(folder, url: str) -> None:
    """Every file below ``folder`` to the prefix ``url``, in parallel (the emulator answers one
    upload at a time slowly; fsspec's ``put`` sends them one after another)."""
    import fsspec

    fs = fsspec.filesystem("gs")
    fs.pipe({f"{url}/{file.relative_to(folder).as_posix()}": file.read_bytes()
             for file in folder.rglob("*") if file.is_file()})
    fs.invalidate_cache()


def both(local, remote, relative: str) -> tuple[str, str]:
    return f"{remote}/{relative}", str(local / relative)


LEGACY = "t5x/legacy_checkpointer/checkpoint_0"
ORBAX_ERA = "t5x/orbax_checkpoint_manager/checkpoint_0"


# -- T5X ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lazy", [False, True])
def test_load_t5x_checkpoint_of_an_orbax_era_step_in_gs_equals_the_local_load(local, remote, lazy):
    with standin_t5x() as t5x:
        loaded = [t5x.load_t5x_checkpoint(where, lazy_parameters=lazy) for where in both(local, remote, ORBAX_ERA)]
        by_dir = t5x.load_t5x_checkpoint(f"{remote}/t5x/orbax_checkpoint_manager", step=0, lazy_parameters=lazy)
    if lazy:
        loaded = [{k: v.get() for k, v in flat(tree).items()} for tree in loaded]
        by_dir = {k: v.get() for k, v in flat(by_dir).items()}
    assert_same(flat(loaded[0]), flat(loaded[1]))
    assert_same(flat(by_dir), flat(loaded[1]))
    assert_manifest(loaded[0])


def test_t5x_checkpointer_restores_an_orbax_era_step_in_gs_as_the_local_copy(local, remote):
    from test_t5x import TrainState

    there, here = both(local, remote, ORBAX_ERA)
    with standin_t5x() as t5x:
        template = t5x.load_t5x_checkpoint(here)
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), template)
        restored = [t5x.Checkpointer(TrainState(abstract), None, where.rsplit("/", 1)[0]).restore(step=0).state
                    for where in (there, here)]
        by_path = t5x.Checkpointer(TrainState(abstract), None, "unused").restore(path=there).state
    assert all(isinstance(v, jax.Array) for v in flat(restored[0]).values())
    assert_same(flat(restored[0]), flat(restored[1]))
    assert_same(flat(by_path), flat(restored[1]))
    assert_manifest(restored[0])


def test_cli_plans_and_converts_a_legacy_t5x_step_in_gs_as_its_local_copy(local, remote, tmp_path, capsys):
    from safetensors.numpy import load_file

    there, here = both(local, remote, LEGACY)
    plans = []
    for where in (there, here):
        assert cli.main(["plan", where, "--like", f"{remote}/{ORBAX_ERA}"]) == 0
        plans.append(capsys.readouterr().out.replace(where, "SOURCE"))
    assert plans[0] == plans[1]
    outs = [tmp_path / "there.safetensors", tmp_path / "here.safetensors"]
    for where, out in zip((there, here), outs):
        assert cli.main(["convert", where, str(out), "--to", "safetensors"]) == 0
    converted = [load_file(out) for out in outs]
    assert converted[0].keys() == converted[1].keys() and converted[0]
    assert all(converted[0][k].tobytes() == converted[1][k].tobytes() for k in converted[1])


def test_load_t5x_checkpoint_of_a_legacy_step_in_gs_is_t5xs_own(local, remote):
    """A legacy step (its ``checkpoint`` file says so) is T5X's to load wherever it is; real T5X
    reads it through ``gfile``, the stand-in only from a local path: it fails alike, with and
    without ckptshim."""
    with standin_t5x() as t5x:
        native, shimmed = without_and_with(lambda: t5x.load_t5x_checkpoint(f"{remote}/{LEGACY}"))
    same_failure(native, shimmed)


def test_orbax_restores_a_legacy_t5x_step_in_gs_as_the_local_copy(local, remote):
    """On GCS, Orbax alone refuses the step: it wants the ``commit_success.txt`` that T5X's
    legacy checkpointer never writes. ckptshim checks the step by T5X's own rule and restores it."""
    there, here = both(local, remote, LEGACY)
    assert detect.detect(there, backend="jax") is t5x_format
    ckptshim.uninstall()
    try:
        with ocp.PyTreeCheckpointer() as checkpointer, pytest.raises(ValueError, match="Found incomplete checkpoint"):
            checkpointer.restore(there)
    finally:
        ckptshim.install()
    with ocp.PyTreeCheckpointer() as checkpointer:
        as_stored = [checkpointer.restore(where) for where in (there, here)]
    assert_same(flat(as_stored[0]), flat(as_stored[1]))
    assert_manifest(as_stored[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), as_stored[1])
    with ocp.StandardCheckpointer() as checkpointer:
        into = [checkpointer.restore(where, abstract) for where in (there, here)]
    assert all(isinstance(v, jax.Array) for v in flat(into[0]).values())
    assert_same(flat(into[0]), flat(into[1]))


def _legacy_copy(local, gcs_server, edit) -> tuple[str, object]:
    """The legacy step uploaded to a fresh bucket after ``edit(step folder)``; (URL, local copy)."""
    step = local.parent / f"edited-{gcs_server.new_bucket().rsplit('/', 1)[1]}" / "checkpoint_0"
    shutil.copytree(local / LEGACY, step)
    edit(step)
    url = f"{gcs_server.new_bucket()}/checkpoint_0"
    upload(step, url)
    return url, step


def test_a_legacy_step_missing_a_chunk_in_gs_is_incomplete_as_locally(local, gcs_server):
    def drop_a_chunk(step):
        chunk = sorted(p for p in step.rglob("*") if p.is_file() and p.parent != step and p.name != ".zarray")[0]
        chunk.unlink()

    url, step = _legacy_copy(local, gcs_server, drop_a_chunk)
    there, here = (t5x_format.open_checkpoint(where) for where in (Location.of(url), step))
    assert not there.complete and there.all_problems() == here.all_problems()
    with standin_t5x(), ocp.PyTreeCheckpointer() as checkpointer, pytest.raises(CorruptCheckpointError,
                                                                              match="missing"):
        checkpointer.restore(url)


def test_a_legacy_spec_leaving_the_step_prefix_in_gs_is_refused(local, gcs_server):
    def point_outside(step):
        tree = msgpack.unpackb((step / "checkpoint").read_bytes(), raw=False, strict_map_key=False)
        target = tree["optimizer"]["target"]
        spec = next(node for node in flatten(target, is_leaf=lambda n: isinstance(n, dict) and "kvstore" in n).values()
                    if isinstance(node, dict))
        spec["kvstore"]["path"] = "../elsewhere/" + spec["kvstore"]["path"]
        (step / "checkpoint").write_bytes(msgpack.packb(tree, use_bin_type=True))

    url, step = _legacy_copy(local, gcs_server, point_outside)
    for where in (Location.of(url), step):
        with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint folder"):
            t5x_format.open_checkpoint(where)


@pytest.mark.parametrize("relative, fmt", [
    (LEGACY, "t5x"), (ORBAX_ERA, "t5x"), ("t5x/orbax_checkpoint_manager", "t5x"),
    ("made/old_orbax/checkpoint_0/state", "orbax"), (f"pax/{STEP}", "paxml"), (f"pax/{STEP}/state", "paxml"),
    ("paxflax", "paxml-flax"), ("paxflax/checkpoint_1/state/checkpoint", "paxml-flax"),
    ("flax/legacy_msgpack", "flax-msgpack"), ("flax/legacy_msgpack/checkpoint_1", "flax-msgpack")])
def test_cli_inspects_each_layout_in_gs_as_its_local_copy(local, remote, capsys, relative, fmt):
    import json

    answers = []
    for where, root in zip(both(local, remote, relative), (remote, str(local))):
        assert cli.main(["inspect", where, "--json"]) == 0
        answers.append(json.loads(capsys.readouterr().out.replace(root, "ROOT")))  # a file is named in full
    there, here = answers
    assert there["format"] == here["format"] == fmt and there["complete"]
    for field in ("entries", "total_bytes", "files", "problems", "version"):
        assert there[field] == here[field], field


# -- Orbax's older layouts ------------------------------------------------------------------------------


def test_a_pre_metadata_placeholder_item_in_gs_reads_as_the_local_copy(local, remote):
    there, here = both(local, remote, "made/old_orbax/checkpoint_0")
    with standin_t5x() as t5x:
        loaded = [t5x.load_t5x_checkpoint(where) for where in (there, here)]
    assert_same(flat(loaded[0]), flat(loaded[1]))
    assert_manifest(loaded[0])
    item = orbax.open_checkpoint(Location.of(f"{there}/state"))
    assert item.version == "legacy aggregate" and item.complete


@pytest.fixture(scope="module")
def per_leaf(gcs_server, tmp_path_factory):
    """A per-leaf zarr item (``use_ocdbt=False``) saved by Orbax into the bucket and locally."""
    tree = {"layers_0": {"w": jnp.arange(6, dtype=jnp.float32)}, "layers_1": {"w": jnp.ones(6, jnp.float32)}}
    url, path = f"{gcs_server.new_bucket()}/per-leaf", tmp_path_factory.mktemp("per_leaf") / "item"
    for where in (url, path):
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as checkpointer:
            checkpointer.save(where, args=ocp.args.PyTreeSave(tree))
    return url, path, tree


def test_a_per_leaf_item_in_gs_is_stacked_by_ckptshim_as_locally(per_leaf, monkeypatch):
    url, path, tree = per_leaf
    opened = []
    run = jax_loading.Prepared.run
    monkeypatch.setattr(jax_loading.Prepared, "run", lambda self: opened.append(self.checkpoint.path) or run(self))
    stacked = {"layers": {"w": jax.ShapeDtypeStruct((2, 6), jnp.float32)}}
    with ocp.StandardCheckpointer() as checkpointer:
        restored = [checkpointer.restore(where, stacked) for where in (url, path)]
        assert [str(where) for where in opened] == [url, str(path)]
        assert_same(flat(restored[0]), flat(restored[1]))
        np.testing.assert_array_equal(np.asarray(restored[0]["layers"]["w"]),
                                      np.stack([tree["layers_0"]["w"], tree["layers_1"]["w"]]))
        opened.clear()
        same = checkpointer.restore(url, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree))
    assert opened == [] and flat(same).keys() == flat(tree).keys()  # names matching: Orbax's own restore
    assert_same(flat(same), flat(tree))


def test_a_per_leaf_item_in_gs_without_its_commit_file_is_incomplete(per_leaf):
    import fsspec

    url, _, _ = per_leaf
    fs = fsspec.filesystem("gs")
    copy = f"{url}-uncommitted"
    fs.copy(url, copy, recursive=True)
    fs.rm(f"{copy}/commit_success.txt")
    fs.invalidate_cache()
    item = orbax.open_checkpoint(Location.of(copy))
    assert item.version == "per-leaf zarr2" and not item.complete
    assert any("commit_success.txt: missing" in problem for problem in item.all_problems())


# -- PaxML and Flax -------------------------------------------------------------------------------------


def test_a_paxml_state_in_gs_restores_as_the_local_copy(local, remote):
    with ocp.StandardCheckpointer() as checkpointer:
        restored = [checkpointer.restore(where) for where in both(local, remote, f"pax/{STEP}/state")]
    assert flat(restored[0]) and flat(restored[0]).keys() == flat(restored[1]).keys()
    assert_same(flat(restored[0]), flat(restored[1]))


def test_flax_restore_checkpoint_from_gs_into_a_scanned_state_equals_the_local_restore(local, remote):
    there, here = both(local, remote, "flax/legacy_msgpack")
    target = scanned_state(on_disk(local / "flax/legacy_msgpack/checkpoint_2"))
    restored = [flax_checkpoints.restore_checkpoint(where, target=target) for where in (there, here)]
    assert restored[0].step == restored[1].step == 2
    values = [{k: v for k, v in state_dict_values(state).items() if k != "step"} for state in restored]
    assert_same(*values)
    kernel = restored[0].params["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]
    assert isinstance(kernel, jax.Array) and kernel.shape == (32, LAYERS, 64)


def test_a_flax_restore_from_gs_whose_names_match_is_flaxs_own(local, remote, monkeypatch):
    """Flax reads URLs only through TensorFlow's gfile (not installed here): alone, it finds no
    checkpoint at the URL and returns the target as given. A restore whose names match is Flax's
    own with ckptshim too, with the same outcome; ckptshim restores nothing itself."""
    from flax import serialization

    url = f"{remote}/flax/legacy_msgpack"
    stored = serialization.msgpack_restore((local / "flax/legacy_msgpack/checkpoint_2").read_bytes())
    target = jax.tree.map(np.zeros_like, stored)
    ran = []
    monkeypatch.setattr(jax_loading.Prepared, "run", lambda self: ran.append(self))
    outcomes = []
    try:
        for hooked in (False, True):
            (ckptshim.install if hooked else ckptshim.uninstall)()
            outcomes.append(flat(flax_checkpoints.restore_checkpoint(url, target=target)))
    finally:
        ckptshim.install()
    assert ran == []
    assert_same(outcomes[0], outcomes[1])
    assert_same(outcomes[1], flat(target))


# -- stored bits through the block reads -------------------------------------------------------------


def _every_dtype_tree() -> dict:
    values = np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6)
    return {"f32": values, "bf16": jnp.asarray(values, jnp.bfloat16), "f16": values.astype(np.float16),
            "i8": np.arange(-12, 12, dtype=np.int8).reshape(4, 6), "flag": values > 0}


@pytest.mark.parametrize("layout", ["orbax", "flax msgpack"])
def test_convert_from_gs_gives_the_stored_bits_of_every_dtype_as_locally(gs_bucket, tmp_path, layout):
    """``convert`` reads a bucket a window of blocks at a time into buffers of the stored dtype
    (bfloat16 as its uint16 bits); a format that copies by value (tensorstore, a msgpack leaf)
    must still write the stored bytes there, not each value cast to an integer (1.0 became
    9.18e-41 once, with exit code 0)."""
    from flax import serialization
    from safetensors.numpy import load_file

    tree, here, there = _every_dtype_tree(), tmp_path / "here", f"{gs_bucket}/there"
    if layout == "orbax":
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(here, tree)
            checkpointer.save(there, tree)
    else:
        here.mkdir()
        (here / "checkpoint_1").write_bytes(serialization.to_bytes(tree))
        upload(here, there)
    outs = [tmp_path / "there.safetensors", tmp_path / "here.safetensors"]
    for where, out in zip((there, str(here)), outs):
        assert cli.main(["convert", where, str(out), "--to", "safetensors", "--no-progress"]) == 0
    converted, expected = [load_file(out) for out in outs], {key: np.asarray(value) for key, value in tree.items()}
    for got in converted:
        assert got.keys() == expected.keys()
        assert all(got[key].tobytes() == expected[key].tobytes() for key in expected), layout
