"""The DeepSpeed seam reads exactly the files DeepSpeed would, with DeepSpeed's own pattern semantics.

``PipelineModule.load_state_dir(load_dir)`` finds each layer's files with
``glob.glob(os.path.join(load_dir, "layer_XX-") + "*model_states.pt")`` and unpickles them with
``torch.load(weights_only=False)``; the engine's ``load_checkpoint`` passes it
``os.path.join(load_dir, tag)``, the tag read from ``latest``. A tag holding glob characters --
``global_step[1]`` -- is a pattern: it matches ``global_step1``. ckptshim listed the folder
literally, found nothing it knew (or a clean checkpoint), and handed the call to DeepSpeed,
which unpickled the other folder's files. Each attack runs the real ``load_state_dir`` in a
worker process; the layer files DeepSpeed must never reach hold a stored ``os.mkdir``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ckptshim.cli import main  # noqa: E402
from ckptshim.errors import UnsafeCheckpointError  # noqa: E402
from ckptshim.formats import deepspeed_pipeline, detect  # noqa: E402
from hostile import Mkdir  # noqa: E402
from support.fixtures import FIXTURES, writable_copy  # noqa: E402
from support.processes import run_pipeline_loads  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

CLEAN = FIXTURES / "neox_deepspeed/pp1_mp1/checkpoint/global_step0"


def _clean(folder: Path) -> Path:
    return writable_copy(CLEAN, folder)


def _hostile(folder: Path, marker: Path) -> Path:
    """A NeoX step folder whose layer 2 also holds a stored ``os.mkdir(marker)``."""
    _clean(folder)
    layer = torch.load(folder / "layer_02-model_00-model_states.pt", weights_only=True)
    torch.save({**layer, "extra": Mkdir(marker)}, folder / "layer_02-model_00-model_states.pt")
    return folder


def test_glob_reaching_another_folder_is_refused_and_a_folder_matching_only_itself_loads(tmp_path):
    """In one worker (the real ``PipelineModule.load_state_dir``):

    - ``global_step[1]``, empty, beside a hostile ``global_step1``: before, nothing ckptshim
      knew, so DeepSpeed's own call ran -- and its glob unpickled ``global_step1``;
    - ``global_step[1]`` holding a clean checkpoint that fits natively: before, ckptshim read
      it and handed the call on, and DeepSpeed read ``global_step1`` instead;
    - ``global_step*``, no such folder: the pattern matches ``global_step1``;
    - the control: a folder ``step*`` whose pattern matches only itself loads as DeepSpeed
      loads it (natively, the same logits as the same files under a plain name).
    """
    marker = tmp_path / "PWNED"
    root = tmp_path / "ckpt"
    _hostile(root / "global_step1", marker)
    (root / "empty").mkdir(parents=True)
    empty = root / "empty" / "global_step[1]"
    empty.mkdir()
    shutil.copytree(root / "global_step1", root / "empty" / "global_step1")
    clean_shadow = _clean(root / "shadow" / "global_step[1]")
    _hostile(root / "shadow" / "global_step1", marker)
    starred = root / "star" / "global_step*"
    _hostile(root / "star" / "global_step1", marker)
    itself, plain = _clean(root / "own" / "step*"), _clean(root / "plain" / "global_step0")

    pytest.importorskip("deepspeed")
    outcomes = run_pipeline_loads(tmp_path, [empty, clean_shadow, starred, itself, plain])
    assert not marker.exists(), "DeepSpeed unpickled files ckptshim had not read"
    for outcome, folder in zip(outcomes[:3], (empty, clean_shadow, starred)):
        assert "glob characters" in outcome.get("error", "") and str(folder) in outcome["error"], outcome
        assert "global_step1" in outcome["error"]
    assert outcomes[3] == {"shimmed": False} and outcomes[4] == {"shimmed": False}, outcomes[3:]
    assert np.array_equal(np.load(tmp_path / "step*.npy"), np.load(tmp_path / "global_step0.npy"))


def test_inspect_of_a_latest_tag_that_is_a_pattern_is_refused(tmp_path, capsys):
    """``latest`` names ``global_step[1]``, which exists (a clean checkpoint) beside
    ``global_step1``: the engine would hand ``ckpt/global_step[1]`` to ``load_state_dir``, whose
    glob reads ``global_step1``. ``inspect`` cannot say what DeepSpeed would load: refused."""
    root = tmp_path / "ckpt"
    _clean(root / "global_step[1]")
    _hostile(root / "global_step1", tmp_path / "PWNED")
    (root / "latest").write_text("global_step[1]")
    with pytest.raises(UnsafeCheckpointError, match="glob characters"):
        detect.open_checkpoint(root)
    assert main(["inspect", str(root)]) == 1
    assert "global_step1" in capsys.readouterr().err
    assert not (tmp_path / "PWNED").exists()


def test_latest_tag_whose_pattern_matches_only_itself_reads(tmp_path):
    """The control: ``latest`` names ``step*``, a pattern that matches only its own folder: it
    reads as the clean checkpoint. ``step[1]`` matches no folder at all (the pattern means
    ``step1``, which does not exist): DeepSpeed's glob would find nothing there, and that is
    refused too."""
    root = tmp_path / "ckpt"
    _clean(root / "step*")
    (root / "latest").write_text("step*")
    checkpoint = detect.open_checkpoint(root)
    assert checkpoint.complete and len(checkpoint.inventory) == len(detect.open_checkpoint(CLEAN).inventory)
    (root / "latest").write_text("step[1]")
    shutil.move(root / "step*", root / "step[1]")
    with pytest.raises(UnsafeCheckpointError, match="matches no folder"):
        detect.open_checkpoint(root)


@pytest.mark.parametrize("name, layer", [
    ("layer_05-model_00-model_states.pt", 5), ("layer_05-model_states.pt", 5), ("layer_100-x-model_states.pt", 100),
    ("layer_5-model_states.pt", None), ("layer_005-model_states.pt", None), ("layer_٠٥-model_states.pt", None),
    (".layer_05-model_states.pt", None), ("layer_05model_states.pt", None), ("layer_05-model_states.pt\n", None),
    ("layer_05-\nmodel_states.pt", 5),
])
def test_layer_file_names_are_glob_s(name, layer, tmp_path):
    """A name is a layer file of layer ``i`` exactly when DeepSpeed's glob for ``i`` finds it:
    ``layer_5-`` and ``layer_005-`` (and other digits than ASCII) are no layer's, so ckptshim
    never reads as a layer a file DeepSpeed would not load."""
    import glob
    import os

    (tmp_path / name).write_bytes(b"")
    globbed = [i for i in range(200) if glob.glob(os.path.join(tmp_path, f"layer_{i:02d}-") + "*model_states.pt")]
    assert globbed == ([] if layer is None else [layer])
    assert [p.name for p in deepspeed_pipeline.files_deepspeed_reads(tmp_path, range(200))] == ([] if layer is None else [name])
