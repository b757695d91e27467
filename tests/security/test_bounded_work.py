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


# -- names checked against one listing, never one request per name ---------------------------------


class _Requests:
    """Counts the requests ckptshim's object store makes (stat and listing), each still the real
    client's own call against the local server."""

    def __init__(self, monkeypatch) -> None:
        from ckptshim.storage.objects import FsspecObjects

        self.count = 0
        for name in ("stat", "list"):
            original = getattr(FsspecObjects, name)

            def counted(store, *args, _original=original, **kwargs):
                self.count += 1
                return _original(store, *args, **kwargs)

            monkeypatch.setattr(FsspecObjects, name, counted)


NAMES = 2000


def test_a_marker_naming_thousands_of_objects_in_subfolders_is_checked_by_one_listing(bucket, tmp_path, capsys,
                                                                                        monkeypatch) -> None:
    """Before: one request per name (2,000 names: 27 s; a 16 MiB marker: hours)."""
    import json

    import fsspec
    from safetensors.torch import save_file

    from ckptshim.cli import main

    save_file({"w": torch.ones(3)}, tmp_path / "model.safetensors")
    url = f"{bucket}/converted"
    assert main(["convert", str(tmp_path / "model.safetensors"), url, "--to", "dcp", "--no-progress"]) == 0
    fs, path = fsspec.core.url_to_fs(url)
    marker = json.loads(fs.cat_file(f"{path}/ckptshim-complete.json"))
    fs.pipe_file(f"{path}/sub/kept.bin", b"1234")
    marker["objects"].update({f"sub/{i}/gone.bin": 1 for i in range(NAMES)} | {"sub/kept.bin": 4})
    fs.pipe_file(f"{path}/ckptshim-complete.json", json.dumps(marker).encode())
    fs.invalidate_cache()
    capsys.readouterr()
    requests = _Requests(monkeypatch)
    assert main(["inspect", url]) == 1
    err = capsys.readouterr().err
    assert "sub/0/gone.bin: missing" in err and "sub/999/gone.bin: missing" in err  # both ends (sorted)
    assert "sub/kept.bin" not in err
    assert requests.count <= 10, requests.count


def test_an_index_naming_thousands_of_shards_in_subfolders_is_checked_by_one_listing(bucket, tmp_path, capsys,
                                                                                       monkeypatch) -> None:
    import json

    import fsspec
    from safetensors.torch import save

    from ckptshim.cli import main

    fs, path = fsspec.core.url_to_fs(f"{bucket}/hf")
    fs.pipe_file(f"{path}/config.json", b'{"model_type": "gpt2"}')
    fs.pipe_file(f"{path}/sub/model-0.safetensors", save({"a": torch.ones(3)}))
    weight_map = {"a": "sub/model-0.safetensors"} | {f"k{i}": f"sub/{i}/model.safetensors" for i in range(NAMES)}
    fs.pipe_file(f"{path}/model.safetensors.index.json", json.dumps({"weight_map": weight_map}).encode())
    fs.invalidate_cache()
    requests = _Requests(monkeypatch)
    assert main(["inspect", f"{bucket}/hf"]) == 1
    out = capsys.readouterr().out
    assert all(f"sub/{i}/model.safetensors: missing" in out for i in range(NAMES)), out[-2000:]
    assert requests.count <= 10, requests.count
