"""``torch.distributed.checkpoint.load`` (and friends) with ckptshim, single process.

Every checkpoint here is written by torch's own ``dcp.save`` (the fixtures, or a fresh save in a
temporary directory), loaded through the real DCP call, and compared bit-exactly.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import ckptshim  # noqa: E402
from ckptshim.errors import CorruptCheckpointError, ShimError, UnsafeCheckpointError  # noqa: E402
from support.fixtures import FIXTURES, array_sha256, copy_fixture, expected_arrays, fixture_module  # noqa: E402
from support.markers import QUIET  # noqa: E402
from support.native import diagnosis, natively, raised, same_error  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint import CheckpointException  # noqa: E402

DCP = FIXTURES / "torch_dcp_single"
build = fixture_module("torch_dcp_single/dcp_tiny_model.py").build

pytestmark = QUIET


@pytest.fixture(autouse=True)
def _hooks_on():
    ckptshim.install()
    yield
    ckptshim.install()


def assert_manifest(state_dict: dict, drop=("_orig_mod", "_checkpoint_wrapped_module")) -> None:
    """Every tensor equals the manifest's value for its plain key, hash for hash."""
    expected = expected_arrays("torch_dcp_single")
    assert len(state_dict) == len(expected)
    for key, value in state_dict.items():
        plain = ".".join(part for part in key.split(".") if part not in drop)
        assert array_sha256(value.detach().numpy()) == expected[plain]["sha256"], key


def reference() -> dict:
    return torch.load(DCP / "torch_save/model.pt", weights_only=True)


class Float8StyleLinear(nn.Linear):
    """Stands in for torchao's Float8Linear: a Linear subclass that keeps the parameter names."""

    def forward(self, x):
        return nn.functional.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16)).to(x.dtype)


def float8_swap(module: nn.Module) -> nn.Module:
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, Float8StyleLinear(child.in_features, child.out_features, child.bias is not None))
        else:
            float8_swap(child)
    return module


def module_from(tensors: dict) -> nn.Module:
    """A module whose state dict is exactly ``tensors`` (keys become submodule paths)."""
    root = nn.Module()
    for key, value in tensors.items():
        *path, leaf = key.split(".")
        node = root
        for part in path:
            if part not in node._modules:
                node.add_module(part, nn.Module())
            node = node._modules[part]
        if value.is_floating_point():
            node.register_parameter(leaf, nn.Parameter(value))
        else:
            node.register_buffer(leaf, value)
    return root


def stacked_twin(per_layer: dict, axis: int = 0) -> dict:
    """``layers.{i}.x`` -> ``layers.x`` stacked along ``axis`` (fresh zeros: loads must fill them)."""
    out, groups = {}, {}
    for key, value in per_layer.items():
        parts = key.split(".")
        if parts[0] == "layers":
            groups.setdefault(".".join(["layers"] + parts[2:]), []).append(value)
        else:
            out[key] = torch.zeros_like(value)
    for key, layers in groups.items():
        out[key] = torch.zeros_like(torch.stack(layers, axis))
    return out


def snapshot(state_dict: dict) -> dict:
    return {k: v.clone() for k, v in state_dict.items()}


def unchanged(state_dict: dict, before: dict) -> bool:
    return all(torch.equal(state_dict[k], v) for k, v in before.items())


# -- the scenarios ------------------------------------------------------------------


def test_plain_checkpoint_into_compiled_float8_model():
    model = torch.compile(float8_swap(build(seed=1)))
    state_dict = model.state_dict()
    ckptshim.uninstall()
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: model._orig_mod"):
        dcp.load({"model": state_dict}, checkpoint_id=DCP / "dcp_plain")
    ckptshim.install()
    dcp.load({"model": state_dict}, checkpoint_id=DCP / "dcp_plain")
    assert isinstance(model._orig_mod.layers[0].fc1, Float8StyleLinear)
    assert_manifest(state_dict)


def test_compiled_checkpoint_into_plain_model():
    state_dict = build(seed=1).state_dict()
    dcp.load({"model": state_dict}, checkpoint_id=str(DCP / "dcp_compiled"))
    assert_manifest(state_dict)


def test_partial_load_no_longer_loads_nothing():
    """``allow_partial_load=True`` natively "succeeds" without loading a single tensor."""
    model = torch.compile(build(seed=1))
    state_dict = model.state_dict()
    before = snapshot(state_dict)
    ckptshim.uninstall()
    dcp.load({"model": state_dict}, checkpoint_id=DCP / "dcp_plain",
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert unchanged(state_dict, before)
    ckptshim.install()
    dcp.load({"model": state_dict}, checkpoint_id=DCP / "dcp_plain",
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert_manifest(state_dict)


def nested_wrapped(seed: int) -> nn.Module:
    """torch.compile inside activation checkpointing, per layer (torchtitan's layout)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = build(seed=seed)
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(torch.compile(layer))
    return model


def test_compile_inside_checkpoint_wrapper():
    from torch.distributed.checkpoint import state_dict as dsd  # attribute look-ups see the patch

    model = nested_wrapped(seed=1)
    state_dict = model.state_dict()
    assert "layers.0._orig_mod.fc1.weight" in state_dict  # torch's own names keep _orig_mod
    dcp.load({"model": state_dict}, checkpoint_id=DCP / "dcp_plain")
    assert_manifest(state_dict)

    model = nested_wrapped(seed=2)
    ckptshim.uninstall()
    with pytest.raises(RuntimeError, match="Missing key"):
        dsd.set_model_state_dict(model, reference())
    ckptshim.install()
    dsd.set_model_state_dict(model, reference())
    assert_manifest(dsd.get_model_state_dict(model))


def test_top_level_model_name_either_way():
    for checkpoint in ("dcp_plain_toplevel", "dcp_plain"):
        nested = build(seed=1).state_dict()
        dcp.load({"model": nested}, checkpoint_id=DCP / checkpoint)
        assert_manifest(nested)
        flat = build(seed=1).state_dict()
        dcp.load(flat, checkpoint_id=DCP / checkpoint)
        assert_manifest(flat)


def test_callers_planner_still_runs():
    class Counting(dcp.DefaultLoadPlanner):
        def __init__(self):
            super().__init__()
            self.committed = 0

        def commit_tensor(self, read_item, tensor):
            self.committed += 1
            super().commit_tensor(read_item, tensor)

    planner = Counting()
    state_dict = torch.compile(build(seed=1)).state_dict()
    dcp.load({"model": state_dict}, checkpoint_id=DCP / "dcp_plain", planner=planner)
    assert planner.committed == len(state_dict)
    assert_manifest(state_dict)


def test_every_alias_is_shimmed():
    from torch.distributed.checkpoint import state_dict_loader

    for load in (dcp.load, state_dict_loader.load):
        state_dict = torch.compile(build(seed=1)).state_dict()
        load({"model": state_dict}, checkpoint_id=DCP / "dcp_plain")
        assert_manifest(state_dict)
    state_dict = torch.compile(build(seed=1)).state_dict()
    dcp.load({"model": state_dict}, dcp.FileSystemReader(DCP / "dcp_plain"))  # the old argument order
    assert_manifest(state_dict)
    for legacy in (dcp.load_state_dict, state_dict_loader.load_state_dict):
        state_dict = torch.compile(build(seed=1)).state_dict()
        legacy({"model": state_dict}, dcp.FileSystemReader(DCP / "dcp_plain"), no_dist=True)
        assert_manifest(state_dict)


def test_set_state_dict_renames_optimizer_state():
    from torch.distributed.checkpoint import state_dict as dsd

    source = build(seed=0)
    optimizer = torch.optim.Adam(source.parameters())
    source(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = dsd.get_state_dict(source, optimizer)
    target = nested_wrapped(seed=5)
    target_optimizer = torch.optim.Adam(target.parameters())
    dsd.set_state_dict(target, target_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    trained = source.state_dict()
    assert all(torch.equal(value, trained[key.replace("_orig_mod.", "")])
               for key, value in target.state_dict().items())
    moments = [s["exp_avg"] for s in target_optimizer.state_dict()["state"].values()]
    assert len(moments) == len(list(source.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(
        moments, [optimizer.state[p]["exp_avg"] for p in source.parameters()]))


def test_set_model_state_dict_stacks_per_layer_state_into_the_model_in_place():
    from torch.distributed.checkpoint import state_dict as dsd

    model = module_from(stacked_twin(reference()))
    storage = {key: value.data_ptr() for key, value in model.state_dict().items()}
    dsd.set_model_state_dict(model, reference())
    ref = reference()
    for key, value in model.state_dict().items():
        assert value.data_ptr() == storage[key], key  # written in place, no new tensor
        if key.startswith("layers."):
            leaf = key[len("layers."):]
            assert all(torch.equal(value[i], ref[f"layers.{i}.{leaf}"]) for i in range(2)), key
        else:
            assert torch.equal(value, ref[key]), key


def test_python_objects_load_and_unsafe_ones_are_refused(tmp_path):
    dcp.save({"model": reference(), "meta": {"step": 7, "lrs": [0.1, 0.01]}}, checkpoint_id=tmp_path / "safe")
    target = {"model": torch.compile(build(seed=1)).state_dict(), "meta": {"step": 0, "lrs": []}}
    dcp.load(target, checkpoint_id=tmp_path / "safe")
    assert target["meta"] == {"step": 7, "lrs": [0.1, 0.01]}
    assert_manifest(target["model"])

    dcp.save({"model": reference(), "meta": {"where": Path("/tmp")}}, checkpoint_id=tmp_path / "unsafe")
    target = {"model": build(seed=1).state_dict(), "meta": {"where": None}}
    before = snapshot(target["model"])
    with pytest.raises(CheckpointException) as raised:
        dcp.load(target, checkpoint_id=tmp_path / "unsafe")
    (error, _trace), = raised.value.failures.values()
    assert isinstance(error, UnsafeCheckpointError) and "'meta.where'" in str(error), error
    assert unchanged(target["model"], before) and target["meta"] == {"where": None}


# -- stacked and per-layer layouts, bytes read once -------------------------------------------


def _rchar() -> int:
    return int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])


def _bytes_read(load) -> int:
    load()  # warm: lazy imports and first-call set-up read files too
    before = _rchar()
    load()
    return _rchar() - before


def test_per_layer_fixture_into_stacked_model_and_back(tmp_path):
    stacked = stacked_twin(reference())
    model = module_from(stacked)
    state_dict = model.state_dict()
    dcp.load({"model": state_dict}, checkpoint_id=DCP / "dcp_plain")
    ref = reference()
    for key, value in state_dict.items():
        if key.startswith("layers."):
            leaf = key[len("layers."):]
            assert all(torch.equal(value[i], ref[f"layers.{i}.{leaf}"]) for i in range(2)), key
        else:
            assert torch.equal(value, ref[key]), key
    dcp.save({"model": state_dict}, checkpoint_id=tmp_path / "stacked")
    per_layer = torch.compile(build(seed=9)).state_dict()
    dcp.load({"model": per_layer}, checkpoint_id=tmp_path / "stacked")
    assert_manifest(per_layer)


@pytest.mark.parametrize("axis", [0, 1])
def test_each_chunk_is_read_once(tmp_path, axis):
    torch.manual_seed(0)
    layers = 8
    per_layer = {f"layers.{i}.{name}": torch.randn(shape) for i in range(layers)
                 for name, shape in (("w", (256, 256)), ("b", (256,)))}
    payload = sum(v.nbytes for v in per_layer.values())
    dcp.save({"model": per_layer}, checkpoint_id=tmp_path / "per_layer")
    stacked = stacked_twin(per_layer, axis)
    read = _bytes_read(lambda: dcp.load({"model": stacked}, checkpoint_id=tmp_path / "per_layer",
                                        planner=dcp.DefaultLoadPlanner()))
    assert all(torch.equal(stacked["layers.w"].select(axis, i), per_layer[f"layers.{i}.w"]) for i in range(layers))
    assert payload <= read < payload * 1.05 + 64 * 1024, (read, payload)

    dcp.save({"model": stacked}, checkpoint_id=tmp_path / "stacked")
    back = {key: torch.zeros_like(value) for key, value in per_layer.items()}
    read = _bytes_read(lambda: dcp.load({"model": back}, checkpoint_id=tmp_path / "stacked"))
    assert all(torch.equal(back[key], value) for key, value in per_layer.items())
    assert payload <= read < payload * 1.05 + 64 * 1024, (read, payload)  # stock: once per layer


# -- other formats through dcp.load -----------------------------------------------------------


def test_load_from_torch_save_file():
    state_dict = torch.compile(build(seed=1)).state_dict()
    dcp.load({"model": state_dict}, checkpoint_id=DCP / "torch_save/model.pt")
    assert_manifest(state_dict)


def test_load_from_safetensors_file_and_hf_directory(tmp_path):
    from safetensors.torch import save_file

    save_file(reference(), tmp_path / "model.safetensors")
    state_dict = torch.compile(build(seed=1)).state_dict()
    dcp.load({"model": state_dict}, checkpoint_id=tmp_path / "model.safetensors")
    assert_manifest(state_dict)

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "tiny"}')
    save_file(reference(), hf / "model.safetensors", metadata={"format": "pt"})
    state_dict = build(seed=1).state_dict()
    dcp.load(state_dict, checkpoint_id=hf)
    assert_manifest(state_dict)


# -- bad input: a clear error, nothing changed ------------------------------------------------


def _copy(tmp_path: Path, name: str = "dcp_plain") -> Path:
    return copy_fixture(f"torch_dcp_single/{name}", tmp_path)


def _refused(checkpoint: Path, kind: type[ShimError], match: str, model_seed: int = 1) -> None:
    model = torch.compile(build(seed=model_seed))
    state_dict = model.state_dict()
    before = snapshot(state_dict)
    with pytest.raises(CheckpointException) as raised:
        dcp.load({"model": state_dict}, checkpoint_id=checkpoint)
    (error, _trace), = raised.value.failures.values()
    assert isinstance(error, kind) and match in str(error), error
    assert unchanged(state_dict, before)


def test_missing_rank_file(tmp_path):
    copy = _copy(tmp_path)
    (copy / "__0_0.distcp").unlink()
    _refused(copy, CorruptCheckpointError, "__0_0.distcp: missing")


def test_truncated_rank_file(tmp_path):
    copy = _copy(tmp_path)
    data = (copy / "__0_0.distcp").read_bytes()
    (copy / "__0_0.distcp").write_bytes(data[: len(data) - 5000])
    _refused(copy, CorruptCheckpointError, "bytes, but its metadata needs 446506")


class _Marker:
    """Pickles as a call that would create a file; ckptshim must never make that call."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def test_tampered_metadata_is_refused_not_run(tmp_path):
    copy = _copy(tmp_path)
    metadata = dcp.FileSystemReader(DCP / "dcp_plain").read_metadata()  # the trusted original
    metadata.planner_data["model.pos_emb"] = _Marker(tmp_path / "pwned")
    with open(copy / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    _refused(copy, UnsafeCheckpointError, "posix.mkdir")
    assert not (tmp_path / "pwned").exists()


def test_shape_mismatch_is_dcps_own_error_with_a_note(tmp_path):
    """No plan mends a shape: DCP's own planner refuses it, its own error on the rank (type and
    text), and ckptshim's diagnosis rides on that error as a note; nothing is written."""
    model = build(seed=1)
    model.layers[1].fc1 = nn.Linear(64, 256)
    state_dict = model.state_dict()
    before = snapshot(state_dict)
    load = lambda: dcp.load({"model": state_dict}, checkpoint_id=DCP / "dcp_plain")  # noqa: E731
    error = same_error(raised(load), raised(lambda: natively(load)))
    assert isinstance(error, ValueError) and "Size mismatch" in str(error)
    assert "layers.1.fc1.weight: target shape (256, 64)" in diagnosis(error)
    assert "loads in no mode" in diagnosis(error)
    assert unchanged(state_dict, before)


def test_foreign_file_that_is_damaged(tmp_path):
    data = (DCP / "torch_save/model.pt").read_bytes()
    (tmp_path / "model.pt").write_bytes(data[: len(data) // 2])
    state_dict = build(seed=1).state_dict()
    before = snapshot(state_dict)
    with warnings.catch_warnings(), pytest.raises(CheckpointException) as raised:
        warnings.simplefilter("ignore")
        dcp.load(state_dict, checkpoint_id=tmp_path / "model.pt")
    (error, _trace), = raised.value.failures.values()
    assert isinstance(error, ShimError)
    assert unchanged(state_dict, before)


def test_only_ckptshims_own_bugs_count_as_internal():
    """What counts as a bug inside ckptshim (raised as an InternalError, never handed to DCP's
    own load, which would unpickle the checkpoint) and what is a refusal or torch's own error."""
    from torch.distributed.checkpoint.api import _wrap_exception

    from ckptshim.hooks.torch_dcp import _is_internal
    from ckptshim.inventory import dtype_name

    def failure(call) -> CheckpointException:
        try:
            call()
        except Exception as error:
            return CheckpointException("plan", {0: _wrap_exception(error)})
        raise AssertionError("did not raise")

    assert _is_internal(failure(lambda: dtype_name("no-such-dtype")))  # raised in ckptshim's code
    assert not _is_internal(failure(lambda: ckptshim.plan(DCP / "missing", DCP / "dcp_plain")))  # ShimError
    assert not _is_internal(failure(lambda: torch.zeros(2).view(3)))  # torch's own error
