"""Work that a number in a checkpoint chose, bounded by the bytes the checkpoint holds.

Before: a Megatron-Core ``torch_dist`` folder of a few KiB whose ``.metadata`` declares a stacked
layer axis of 10^12 made ``inspect`` list 10^12 per-layer names (``model_names``, one entry per
declared layer): past 1 GB within 30 s, then for ever. So did an axis of 10^12 layers of no
elements each. Each attack runs in a confined child (memory and time capped).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hostile import confined, read_dcp_metadata, write_dcp_metadata
from support.fixtures import FIXTURES

torch = pytest.importorskip("torch")

MEGATRON = FIXTURES / "megatron_core/torch_dist/tp1_pp1"
STACKED = "decoder.layers.self_attention.linear_qkv.weight"


def _declaring_layers(tmp_path: Path, layers: int, empty: bool) -> Path:
    """The real Megatron-Core fixture, its ``.metadata`` (torch's own classes) declaring
    ``layers`` stacked layers for one key: each as stored, or of no elements (``empty``)."""
    folder = tmp_path / "megatron"
    shutil.copytree(MEGATRON, folder)
    metadata = read_dcp_metadata(folder)
    record = metadata.state_dict_metadata[STACKED]
    rest = [0] * (len(record.size) - 1) if empty else list(record.size[1:])
    record.size = torch.Size([layers, *rest])
    write_dcp_metadata(folder, metadata)
    assert sum(f.stat().st_size for f in folder.iterdir()) < 2**20  # a small folder
    return folder


def _inspect(folder: Path):
    return confined(f"""
        import sys
        from ckptshim.cli import main
        sys.exit(main(["inspect", {str(folder)!r}]))
        """, memory_mb=1500, seconds=60)


@pytest.mark.parametrize("empty", [False, True], ids=["stored-layers", "empty-layers"])
def test_a_declared_layer_count_beyond_the_bytes_stored_is_refused(tmp_path: Path, empty: bool) -> None:
    outcome = _inspect(_declaring_layers(tmp_path, 10**12, empty))
    assert not outcome.timed_out and not outcome.signalled, outcome
    assert outcome.returncode == 1, outcome.stderr[-2000:]
    assert STACKED in outcome.stderr and "1,000,000,000,000 stacked layers" in outcome.stderr
    assert "Traceback" not in outcome.stderr
    assert outcome.peak_rss_mb < 1000


def test_the_layers_the_files_hold_are_listed_as_before(tmp_path: Path) -> None:
    """The control: the fixture's own count (4) lists each layer under the model's names."""
    layers = read_dcp_metadata(MEGATRON).state_dict_metadata[STACKED].size[0]
    outcome = _inspect(_declaring_layers(tmp_path, layers, False))
    assert outcome.returncode == 0, outcome.stderr[-2000:]
    assert f"decoder.layers.{{0..{layers - 1}}}.self_attention.linear_qkv.weight" in outcome.stdout
