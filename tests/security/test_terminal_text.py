"""Text from a checkpoint reaching a terminal: every surface shows it through one function
(``ckptshim.keytext.shown``), which escapes what a terminal would act on as ``repr`` does.

Before: a key, file or object name holding an OSC sequence (``ESC ] 0 ; x BEL``: "set the window
title to x"), a carriage return or a newline reached the terminal raw through ``inspect``,
``plan``, the INFO table of a load, error messages (a missing shard's name) and a bucket
marker's list of missing objects: a hostile checkpoint could rewrite what its user sees (hide a
line, print a fake "complete"). Each surface here prints a name holding ``\\x1b]0;x\\x07``; the
output holds no raw escape byte, and shows the name escaped.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import fsspec
import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

import ckptshim  # noqa: E402,F401  (the hooks)
from ckptshim import cli  # noqa: E402
from ckptshim.errors import ShimError  # noqa: E402
from support.markers import QUIET  # noqa: E402

pytestmark = [QUIET, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

TITLE = "\x1b]0;x\x07"
ESCAPED = "\\x1b]0;x\\x07"
NAME = f"attn{TITLE}"


def _clean(text: str) -> None:
    """No byte a terminal acts on (ESC, BEL, CR), and the hostile name shown escaped."""
    assert not {"\x1b", "\x07", "\r"} & set(text), repr(text[-3000:])
    assert ESCAPED in text, text[-3000:]


def _tensors(*names: str) -> dict[str, torch.Tensor]:
    return {name: torch.arange(6, dtype=torch.float32).reshape(2, 3) + i for i, name in enumerate(names)}


def test_shown_escapes_as_repr_and_keeps_every_printable_name_as_it_is() -> None:
    from ckptshim.keytext import shown

    for plain in ("model.layers.0.w", "décodeur/couche_中/ä", "a b", "back\\slash", "it's \"q\""):
        assert shown(plain) is plain or shown(plain) == plain
    assert shown(f"a{TITLE}b") == f"a{ESCAPED}b"
    assert shown("line\nfake complete\rx\tz\u200b\udcff") == "line\\nfake complete\\rx\\tz\\u200b\\udcff"


def test_inspect_shows_a_hostile_key_escaped(tmp_path: Path, capsys) -> None:
    save_file(_tensors(f"layers.0.{NAME}.weight", "layers.0.ok"), tmp_path / "model.safetensors")
    assert cli.main(["inspect", str(tmp_path / "model.safetensors")]) == 0
    _clean(capsys.readouterr().out)


def test_inspect_lists_keys_holding_any_control_character_each_on_its_row(tmp_path: Path, capsys) -> None:
    """``\x1f`` is what ``inspect``'s table joins its cells with while grouping rows (before: a
    key holding it crashed ``inspect``); a newline would start a row of the checkpoint's making;
    ``07`` is a name as written (before: shown as ``7``, escaped or not)."""
    names = ["cells\x1fsplit.w", "row\nfake  float32  (1,)  4 B", "bell.07.w"]
    save_file(_tensors(*names) | {f"{NAME}.w": torch.zeros(1)}, tmp_path / "model.safetensors")
    assert cli.main(["inspect", str(tmp_path / "model.safetensors")]) == 0
    out = capsys.readouterr().out
    _clean(out)
    rows = [line.split()[0] for line in out.splitlines()[1:5]]
    assert sorted(rows) == sorted(["cells\\x1fsplit.w", "row\\nfake", "bell.07.w", f"attn{ESCAPED}.w"]), out


def test_plan_shows_a_hostile_key_escaped(tmp_path: Path, capsys) -> None:
    save_file(_tensors(f"_orig_mod.{NAME}.weight"), tmp_path / "source.safetensors")
    save_file(_tensors(f"{NAME}.weight"), tmp_path / "target.safetensors")
    cli.main(["plan", str(tmp_path / "source.safetensors"), "--like", str(tmp_path / "target.safetensors")])
    _clean(capsys.readouterr().out)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_parameter(NAME, nn.Parameter(torch.zeros(2, 3)))


def test_the_info_table_of_a_load_shows_a_hostile_key_escaped(caplog) -> None:
    """``load_state_dict`` of a compiled model's state dict (``_orig_mod.``): ckptshim renames,
    and says so in one INFO record."""
    model = _Model()
    with caplog.at_level(logging.INFO, logger="ckptshim"):
        model.load_state_dict({f"_orig_mod.{NAME}": torch.ones(2, 3)})
    assert torch.equal(getattr(model, NAME), torch.ones(2, 3))
    _clean("\n".join(record.getMessage() for record in caplog.records))


def test_a_refusal_through_a_hook_shows_hostile_keys_escaped() -> None:
    """Two stored keys that both mean the model's one parameter: ckptshim's own refusal."""
    with pytest.raises(ShimError) as refused:
        _Model().load_state_dict({f"_orig_mod.{NAME}": torch.ones(2, 3), f"module.{NAME}": torch.ones(2, 3)})
    _clean(str(refused.value))


def _hf_folder_missing_a_shard(folder: Path) -> str:
    """A Hugging Face folder whose index names a shard that is not there (a hostile name)."""
    folder.mkdir()
    missing = f"model-{TITLE}.safetensors"
    save_file(_tensors("a.weight"), folder / "model-1.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a.weight": "model-1.safetensors", "b.weight": missing}}))
    return missing


def test_a_missing_shards_name_is_escaped_in_inspect_and_in_the_error(tmp_path: Path, capsys) -> None:
    _hf_folder_missing_a_shard(tmp_path / "hf")
    assert cli.main(["inspect", str(tmp_path / "hf")]) == 1
    out = capsys.readouterr().out
    _clean(out)
    assert f"model-{ESCAPED}.safetensors: missing" in out
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "safetensors",
                     "--no-progress"]) == 1
    _clean(capsys.readouterr().err)


def test_a_markers_list_of_missing_objects_is_escaped(bucket: str, tmp_path: Path, capsys) -> None:
    """A folder ``convert`` wrote to a bucket, its marker then listing an object of a hostile name
    that is not there: ``inspect``'s refusal lists it, escaped."""
    save_file(_tensors("a.weight"), tmp_path / "model.safetensors")
    url = f"{bucket}/converted"
    assert cli.main(["convert", str(tmp_path / "model.safetensors"), url, "--to", "dcp", "--no-progress"]) == 0
    fs, path = fsspec.core.url_to_fs(url)
    marker = json.loads(fs.cat_file(f"{path}/ckptshim-complete.json"))
    marker["objects"][f"{TITLE}\nfake.distcp"] = 5
    fs.pipe_file(f"{path}/ckptshim-complete.json", json.dumps(marker).encode())
    fs.invalidate_cache()
    capsys.readouterr()
    assert cli.main(["inspect", url]) == 1
    err = capsys.readouterr().err
    _clean(err)
    assert f"{ESCAPED}\\nfake.distcp: missing" in err
