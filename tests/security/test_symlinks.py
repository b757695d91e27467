"""A file inside a checkpoint that is a symlink to a file outside it is refused, for every format,
at ``inspect`` and at load -- before anything reads it.

Before, ckptshim followed such links wherever its readers (or tensorstore's) opened a file by
name: a DCP rank file, a per-leaf zarr chunk (``/etc/machine-id`` ended up in a converted
output), a T5X chunk, an OCDBT data file. Each test moves the real file out, links to it, and
checks that nothing is read through the link. The Hugging Face hub cache, whose snapshot files
link into the repository's ``blobs/``, stays allowed (tests/test_cli.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckptshim.cli import main
from ckptshim.errors import UnsafeCheckpointError
from ckptshim.formats import detect
from hostile import refusal
from support.fixtures import FIXTURES, writable_copy

PER_LEAF = FIXTURES / "orbax_0.2.3_unscanned/pytree_checkpointer"

CASES = {
    "dcp-rank-file": (FIXTURES / "torch_dcp_single/dcp_plain", "__0_0.distcp"),
    "per-leaf-zarr-chunk": (PER_LEAF, "params.decoder.decoder_norm.scale/0"),
    "per-leaf-zarr-metadata": (PER_LEAF, "params.decoder.decoder_norm.scale/.zarray"),
    "t5x-chunk": (FIXTURES / "t5x_tiny_decoder/legacy_checkpointer/checkpoint_0",
                  "target.decoder.decoder_norm.scale/0"),
    "ocdbt-data-file": (FIXTURES / "orbax_0.12.8_scanned/standard_checkpointer_scanned",
                        "ocdbt.process_0/d/5b61ef96a1d7f22bd76c93a4341b0f01"),
    "ocdbt-manifest": (FIXTURES / "orbax_0.12.8_scanned/standard_checkpointer_scanned", "manifest.ocdbt"),
    "paxml-chunk": (FIXTURES / "paxml_runs/TinySpmdRepeat/checkpoints/checkpoint_00000001",
                    "state/mdl_vars.params.lm.final_ln.bias/0"),
    "deepspeed-layer-file": (FIXTURES / "neox_deepspeed/pp1_mp1/checkpoint/global_step0",
                             "layer_05-model_00-model_states.pt"),
    "flax-step-file": (FIXTURES / "flax_0.6.11_legacy_msgpack/legacy_msgpack", "checkpoint_2"),
}


def _linked_out(tmp_path: Path, source: Path, member: str) -> tuple[Path, Path]:
    """A copy of ``source`` whose ``member`` is a symlink to the same file moved outside it."""
    root = writable_copy(source, tmp_path / "ckpt")
    inside = root / member
    assert inside.is_file(), member
    outside = tmp_path / "elsewhere" / inside.name
    outside.parent.mkdir()
    shutil.move(inside, outside)
    inside.symlink_to(outside)
    return root, inside


@pytest.mark.parametrize("case", sorted(CASES))
def test_link_out_of_the_checkpoint_is_refused_at_inspect(tmp_path, case, capsys):
    root, link = _linked_out(tmp_path, *CASES[case])
    with pytest.raises(UnsafeCheckpointError, match="outside the directory") as info:
        detect.open_checkpoint(root)
    assert str(link) in str(info.value)
    assert main(["inspect", str(root)]) == 1
    assert "lies outside the directory" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["per-leaf-zarr-chunk", "t5x-chunk", "dcp-rank-file"])
def test_convert_never_writes_a_file_from_outside(tmp_path, case, capsys):
    """The chunk's link points at a stand-in for ``/etc/machine-id`` of the chunk's own size."""
    root, link = _linked_out(tmp_path, *CASES[case])
    secret = b"SECRET-" * (link.resolve().stat().st_size // 7 + 1)
    link.resolve().write_bytes(secret[:link.resolve().stat().st_size])
    assert main(["convert", str(root), str(tmp_path / "out.safetensors"), "--to", "safetensors"]) == 1
    assert "outside" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()


def test_dcp_load_refuses_a_linked_rank_file(tmp_path):
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    import ckptshim

    ckptshim.install()
    root, _ = _linked_out(tmp_path, *CASES["dcp-rank-file"])
    reference = torch.load(FIXTURES / "torch_dcp_single/torch_save/model.pt", weights_only=True)
    state = {"model": {key: torch.zeros_like(value) for key, value in reference.items()}}
    with pytest.raises(BaseException) as info:
        dcp.load(state, checkpoint_id=root, no_dist=True)
    assert refusal(info.value) is not None and "outside" in str(refusal(info.value))
    assert all(not value.any() for value in state["model"].values())


def test_orbax_restore_refuses_a_linked_ocdbt_data_file(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    import ckptshim

    ckptshim.install()
    root, _ = _linked_out(tmp_path, *CASES["ocdbt-data-file"])
    with pytest.raises(ckptshim.ShimError, match="outside"):
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.restore(root)


def test_links_inside_the_checkpoint_are_fine(tmp_path):
    """A link whose target lies inside the checkpoint reads as that file."""
    root = writable_copy(PER_LEAF, tmp_path / "ckpt")
    chunk = root / "params.decoder.decoder_norm.scale" / "0"
    shutil.move(chunk, root / "params.decoder.decoder_norm.scale" / "moved")
    chunk.symlink_to("moved")
    checkpoint = detect.open_checkpoint(root)
    assert checkpoint.complete, checkpoint.all_problems()
    checkpoint.read(checkpoint.inventory[("params", "decoder", "decoder_norm", "scale")])


# -- the Hugging Face hub cache: snapshot files link into the repository's own blobs/ ------------


def _hub_snapshot(tmp_path: Path, values) -> tuple[Path, Path]:
    """A model in a hub-cache repository folder laid out as ``huggingface_hub`` lays it out:
    ``models--tiny--model/{blobs/<hash>, snapshots/<revision>/<file> -> ../../blobs/<hash>}``.
    Returns the snapshot folder and the repository folder."""
    import hashlib
    import json

    from safetensors.numpy import save_file

    repo = tmp_path / "hub" / "models--tiny--model"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    files = {"config.json": json.dumps({"model_type": "gpt_neox"}).encode()}
    save_file(values, tmp_path / "model.safetensors")
    files["model.safetensors"] = (tmp_path / "model.safetensors").read_bytes()
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(Path("../../blobs") / blob)
    return snapshot, repo


@pytest.mark.parametrize("attack", ["blobs-links-to-root", "blobs-links-elsewhere", "snapshots-links-elsewhere",
                                    "revision-links-elsewhere"])
def test_hub_cache_layout_that_leads_out_of_the_cache_is_refused(tmp_path, attack, capsys):
    """A hub-cache snapshot whose ``blobs`` is a link -- to ``/``, through which a snapshot file
    reaches any file of the machine, or to another folder -- or whose ``snapshots`` or revision
    folder is a link. Before: ``blobs`` counted as part of the checkpoint wherever it resolved,
    so ``inspect`` and ``convert`` read a file outside the cache as weights."""
    import numpy as np

    secret = {"w": np.arange(6, dtype=np.float32)}
    snapshot, repo = _hub_snapshot(tmp_path, {"w": np.zeros(6, np.float32)})
    outside = tmp_path / "outside"
    outside.mkdir()
    from safetensors.numpy import save_file

    save_file(secret, outside / "secret.safetensors")
    weights = snapshot / "model.safetensors"
    if attack == "blobs-links-to-root":
        shutil.rmtree(repo / "blobs")
        (repo / "blobs").symlink_to("/")
        weights.unlink()
        weights.symlink_to(Path("../../blobs") / str(outside / "secret.safetensors").lstrip("/"))
    elif attack == "blobs-links-elsewhere":
        shutil.move(repo / "blobs", outside / "blobs")
        shutil.copy(outside / "secret.safetensors", outside / "blobs" / weights.resolve().name)
        (repo / "blobs").symlink_to(outside / "blobs")
    else:  # the folder moved out of the cache; its files' ../../blobs/ then lead to the secret
        link = snapshot.parent if attack == "snapshots-links-elsewhere" else snapshot
        moved = outside / "snapshots" / link.name if attack == "snapshots-links-elsewhere" else outside / "rev"
        moved.parent.mkdir(exist_ok=True)
        shutil.copytree(link, moved, symlinks=True)
        shutil.rmtree(link)
        link.symlink_to(moved)
        target = weights.resolve(strict=False)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(outside / "secret.safetensors", target)
        shutil.copy(repo / "blobs" / (snapshot / "config.json").readlink().name, target.parent)
    with pytest.raises(UnsafeCheckpointError) as info:
        detect.open_checkpoint(snapshot)
    assert "symlink" in str(info.value)
    assert main(["inspect", str(snapshot)]) == 1
    assert main(["convert", str(snapshot), str(tmp_path / "out.safetensors"), "--to", "safetensors"]) == 1
    assert not (tmp_path / "out.safetensors").exists()
    err = capsys.readouterr().err
    assert "symlink" in err and str(repo) in err


def test_hub_cache_snapshot_with_real_folders_reads_its_blobs(tmp_path):
    """The control: the same layout with real folders reads the snapshot's own values."""
    import numpy as np

    values = {"w": np.arange(6, dtype=np.float32)}
    snapshot, _ = _hub_snapshot(tmp_path, values)
    checkpoint = detect.open_checkpoint(snapshot)
    assert checkpoint.complete
    assert checkpoint.read(checkpoint.inventory[("w",)]).tolist() == values["w"].tolist()
