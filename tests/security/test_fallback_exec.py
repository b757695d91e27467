"""Code execution through a fallback: a parser's ordinary exception must not hand the checkpoint
to DCP's or DeepSpeed's own loader, which unpickles everything else in it without limits.

Each checkpoint here is written by torch's own ``dcp.save``/``torch.save`` and then altered so
that ckptshim's parser meets something ordinary Python code trips over (a ``TypeError``, an
``OverflowError``) *before* it reaches the object that runs code; the object is a stored
``os.mkdir(marker)`` reduce. Before the trust boundary, the hooks counted such an exception as
a bug in ckptshim and re-ran the call with the framework's loader: the marker appeared.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import ckptshim  # noqa: E402
from hostile import (Mkdir, add_chunk_file, read_dcp_metadata, refusal, torch_saved,  # noqa: E402
                     write_dcp_metadata)
from support.fixtures import FIXTURES, copy_fixture  # noqa: E402
from support.processes import run_pipeline_loads  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(autouse=True)
def _hooks_on():
    ckptshim.install()
    yield


def _saved_with_object(tmp_path: Path) -> tuple[Path, Path]:
    """A DCP folder (dcp.save, one process) holding two tensors and a stored object that
    creates ``marker`` when unpickled."""
    folder, marker = tmp_path / "ckpt", tmp_path / "PWNED"
    state = {"w": torch.arange(8.0).reshape(2, 4), "v": torch.ones(3), "obj": Mkdir(marker)}
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    return folder, marker


def _replace_chunk(folder: Path, fqn: str, archive: bytes) -> None:
    """Store ``fqn``'s chunk as ``archive`` in a rank file that sorts before the original (so
    ckptshim meets it before the stored object), and point ``.metadata`` at it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    metadata = read_dcp_metadata(folder)
    ((offset, length),) = add_chunk_file(folder, "__00.distcp", [archive])
    for index in list(metadata.storage_data):
        if index.fqn == fqn:
            metadata.storage_data[index] = _StorageInfo("__00.distcp", offset, length)
    write_dcp_metadata(folder, metadata)


def _load(folder: Path, *keys: str) -> None:
    state = {"w": torch.zeros(2, 4), "v": torch.zeros(3), "obj": 0}
    dcp.load({key: state[key] for key in keys}, checkpoint_id=folder, no_dist=True)


def _assert_refused_without_running_code(call, marker: Path, folder: Path) -> str:
    with pytest.raises(BaseException) as info:
        call()
    error = refusal(info.value)
    assert error is not None, f"not a ckptshim refusal: {type(info.value).__name__}: {info.value}"
    assert not marker.exists(), "the checkpoint ran code: the framework's own loader unpickled it"
    assert str(folder) in str(error)
    return str(error)


def test_chunk_ordereddict_with_a_values_attribute_does_not_fall_back(tmp_path):
    """A chunk archive whose OrderedDict carries ``values = 5`` (set through BUILD): ckptshim's
    tree walk called ``.values()`` -> TypeError -> DCP's own load -> the object's reduce ran."""
    folder, marker = _saved_with_object(tmp_path)
    state = collections.OrderedDict(w=torch.arange(8.0).reshape(2, 4))
    state.values = 5  # an instance attribute: torch.save writes it as BUILD state
    _replace_chunk(folder, "w", torch_saved(state))
    message = _assert_refused_without_running_code(lambda: _load(folder, "w", "obj"), marker, folder)
    assert "values" in message


def test_infinite_offset_in_metadata_does_not_fall_back(tmp_path):
    """``float('inf')`` as a storage offset in ``.metadata``: ``int()`` raised OverflowError,
    which the hook took for a bug and re-ran with DCP's reader (which loaded the object)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    folder, marker = _saved_with_object(tmp_path)
    metadata = read_dcp_metadata(folder)
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == "v":
            metadata.storage_data[index] = _StorageInfo(info.relative_path, float("inf"), info.length)
    write_dcp_metadata(folder, metadata)
    message = _assert_refused_without_running_code(lambda: _load(folder, "w", "obj"), marker, folder)
    assert "inf" in message and "not a size" in message


def test_build_on_the_tensor_record_cannot_undo_its_check(tmp_path):
    """A chunk whose tensor record is followed by BUILD ``{'offset': -1}``: the frozen record
    took the state after its arguments were checked (BUILD writes ``__dict__``), and the chunk
    was read from one element before its storage. torch refuses BUILD on a tensor; so does
    ckptshim, before reading anything."""
    from hostile import (BUILD, EMPTY_DICT, MARK, SETITEMS, floats, integer, program, storage, tensor,
                         text, torch_archive)

    folder, marker = _saved_with_object(tmp_path)
    record = tensor(storage("0", 8), 0, (2, 4), (4, 1)) + EMPTY_DICT + MARK + text("offset") + integer(-1) \
        + SETITEMS + BUILD
    _replace_chunk(folder, "w", torch_archive(program(record), {"0": floats(*range(8))}))
    out = {"w": torch.full((2, 4), 7.0)}
    message = _assert_refused_without_running_code(
        lambda: dcp.load(out, checkpoint_id=folder, no_dist=True), marker, folder)
    assert "BUILD" in message and "__00.distcp" in message
    assert torch.equal(out["w"], torch.full((2, 4), 7.0)), "the destination changed"


def test_control_the_same_checkpoint_unaltered_loads(tmp_path):
    """Without the alteration the load goes through ckptshim and refuses only the object,
    which torch's weights_only unpickler refuses too; the tensors alone load exactly."""
    folder, marker = _saved_with_object(tmp_path)
    out = {"w": torch.zeros(2, 4), "v": torch.zeros(3)}
    dcp.load(out, checkpoint_id=folder, no_dist=True)
    assert torch.equal(out["w"], torch.arange(8.0).reshape(2, 4)) and torch.equal(out["v"], torch.ones(3))
    _assert_refused_without_running_code(lambda: _load(folder, "w", "obj"), marker, folder)


# -- DeepSpeed: the real PipelineModule.load_state_dir, in a worker process -------------------------


def _deepspeed_step(tmp_path: Path, name: str) -> Path:
    return copy_fixture("neox_deepspeed/pp1_mp1/checkpoint/global_step0", tmp_path, name)


def _run_deepspeed(tmp_path: Path, sources: list[Path]) -> list[dict]:
    pytest.importorskip("deepspeed")
    return run_pipeline_loads(tmp_path, sources)


def test_deepspeed_layer_file_that_trips_the_parser_does_not_fall_back(tmp_path):
    """``layer_00``'s state dict carries ``values = 5`` (TypeError in ckptshim's walk) and a later
    layer file holds a stored ``os.mkdir``: the hook fell back to DeepSpeed, whose
    ``torch.load(weights_only=False)`` ran it. Also: a file DeepSpeed's glob loads as layer 2
    (``layer_02-extra-model_states.pt``) that ckptshim did not recognise, beside a checkpoint
    that otherwise fits natively, went to DeepSpeed's loader unread."""
    marker = tmp_path / "PWNED"
    tripping = _deepspeed_step(tmp_path, "tripping")
    first = torch.load(tripping / "layer_00-model_00-model_states.pt", weights_only=True)
    first.values = 5
    torch.save(first, tripping / "layer_00-model_00-model_states.pt")
    later = torch.load(tripping / "layer_02-model_00-model_states.pt", weights_only=True)
    torch.save({**later, "extra": Mkdir(marker)}, tripping / "layer_02-model_00-model_states.pt")

    extra = _deepspeed_step(tmp_path, "extra")
    layer = torch.load(extra / "layer_02-model_00-model_states.pt", weights_only=True)
    torch.save({**layer, "extra": Mkdir(marker)}, extra / "layer_02-extra-model_states.pt")

    outcomes = _run_deepspeed(tmp_path, [tripping, extra])
    assert not marker.exists(), "the checkpoint ran code through DeepSpeed's own loader"
    assert "values" in outcomes[0].get("error", ""), outcomes[0]
    assert "layer_02-extra-model_states.pt" in outcomes[1].get("error", ""), outcomes[1]


def test_deepspeed_step_aside_reads_the_layer_files_first(tmp_path):
    """A Hugging Face folder ckptshim has no plan for (a key the layers need is not in it) is
    DeepSpeed's own load -- which unpickles every ``layer_*model_states.pt`` beside it without
    limits. ckptshim reads those first: one holding a stored ``os.mkdir`` is refused, unrun."""
    from safetensors.torch import load_file, save_file

    marker = tmp_path / "PWNED"
    folder = copy_fixture("neox_deepspeed/pp1_mp1/hf", tmp_path, "hf_lacking_a_key")
    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.endswith("final_layer_norm.weight")},
              folder / "model.safetensors", metadata={"format": "pt"})
    layer = torch.load(FIXTURES / "neox_deepspeed/pp1_mp1/checkpoint/global_step0/layer_02-model_00-model_states.pt",
                       weights_only=True)
    torch.save({**layer, "extra": Mkdir(marker)}, folder / "layer_02-model_00-model_states.pt")

    (outcome,) = _run_deepspeed(tmp_path, [folder])
    assert not marker.exists(), "the checkpoint ran code through DeepSpeed's own loader"
    assert "layer_02-model_00-model_states.pt" in outcome.get("error", ""), outcome
