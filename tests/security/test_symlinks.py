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
