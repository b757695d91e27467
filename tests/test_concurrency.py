"""Hooks under threads: concurrent loads, and hooks switched on and off while a load runs.

Two threads load different checkpoints into different models through the hooks at the same
moment, and both get every bit right. A thread that keeps installing and uninstalling the torch
hook (ckptshim.hooks.registry) while another loads never exposes a half-patched function: each
load runs either shimmed (and succeeds) or as torch's own (and raises torch's own error for the
keys it cannot match), never anything else. And an uninstall that lands while another thread's
import is patching DCP's state-dict setters leaves neither of them patched.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch import nn

import ckptshim  # noqa: F401  (hooks attach as torch modules import)
from ckptshim.hooks import registry
from support.fixtures import FIXTURES, fixture_module
from support.markers import QUIET

pytestmark = QUIET
DCP = FIXTURES / "torch_dcp_single"
build = fixture_module("torch_dcp_single/dcp_tiny_model.py").build

REFERENCE = torch.load(DCP / "torch_save" / "model.pt", weights_only=True)


def _plain(key: str) -> str:
    return key.replace("_orig_mod.", "")


def _run_together(*jobs: Callable[[], None], timeout: float = 120) -> None:
    """Start every job at the same moment on its own thread; re-raise the first failure."""
    barrier = threading.Barrier(len(jobs))
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        barrier.wait()
        try:
            job()
        except BaseException as error:  # noqa: BLE001  (reported to the test below)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    if errors:
        raise errors[0]


def test_threads_load_different_checkpoints_through_the_hooks():
    """``dcp.load`` into a compiled model, ``load_state_dict`` stacking layers into another, and an
    Orbax restore stacking the legacy per-leaf checkpoint, all at once, each several times."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    import torch.distributed.checkpoint as dcp

    from support.trees import flat, scanned_expected
    from test_atomicity import PerLayer, Stacked

    compiled = torch.compile(build(seed=5)).state_dict()
    stacked = Stacked()
    per_layer = PerLayer().state_dict()
    scanned = FIXTURES / "orbax_0.12.8_scanned/standard_checkpointer_scanned"
    with ocp.StandardCheckpointer() as checkpointer:
        target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                        checkpointer.restore(scanned))
    restored = []

    def dcp_load() -> None:
        for _ in range(3):
            dcp.load({"model": compiled}, checkpoint_id=DCP / "dcp_plain")

    def module_load() -> None:
        for _ in range(20):
            stacked.load_state_dict(per_layer)

    def orbax_restore() -> None:
        for _ in range(3):
            with ocp.StandardCheckpointer() as checkpointer:
                restored.append(checkpointer.restore(FIXTURES / "orbax_0.2.3_unscanned/pytree_checkpointer", target))

    _run_together(dcp_load, module_load, orbax_restore)
    for key, value in compiled.items():
        assert torch.equal(value, REFERENCE[_plain(key)]), key
    for i in range(3):
        assert torch.equal(stacked.layers.weight[i], per_layer[f"layers.{i}.weight"])
        assert torch.equal(stacked.layers.bias[i], per_layer[f"layers.{i}.bias"])
    with ocp.PyTreeCheckpointer() as checkpointer:
        as_stored = flat(checkpointer.restore(FIXTURES / "orbax_0.2.3_unscanned/pytree_checkpointer"))
    expected = scanned_expected(as_stored, 3, lambda key: 1)
    assert len(restored) == 3
    for tree in restored:
        assert set(flat(tree)) == set(expected)
        for key, value in flat(tree).items():
            assert np.asarray(value).tobytes() == np.ascontiguousarray(expected[key]).tobytes(), key


def test_hooks_switched_on_and_off_while_another_thread_loads():
    model = torch.compile(build(seed=7))
    original = registry_original()
    outcomes = {"shimmed": 0, "native": 0}
    done = threading.Event()

    def toggle() -> None:
        try:
            while not done.is_set():  # each state held about as long as one load takes
                registry.uninstall(["torch"])
                time.sleep(0.002)
                registry.install(["torch"])
                time.sleep(0.002)
        finally:
            registry.install(["torch"])

    def load() -> None:
        try:
            for _ in range(150):
                for value in model.state_dict().values():
                    value.detach().zero_()
                try:
                    model.load_state_dict(REFERENCE)
                except RuntimeError as error:  # torch's own loader: the compiled names do not match
                    assert "Missing key(s)" in str(error) and not isinstance(error, ckptshim.ShimError), error
                    outcomes["native"] += 1
                    continue
                for key, value in model.state_dict().items():
                    assert torch.equal(value, REFERENCE[_plain(key)]), key
                outcomes["shimmed"] += 1
        finally:
            done.set()

    _run_together(toggle, load)
    assert outcomes["shimmed"] + outcomes["native"] == 150, outcomes
    assert outcomes["shimmed"] and outcomes["native"], f"the toggling never met a load: {outcomes}"
    patched = nn.Module.__dict__["load_state_dict"]
    assert registry.states()["torch"].startswith("active")
    assert getattr(patched, "__wrapped__", None) is original, "left half-patched"
    registry.uninstall(["torch"])
    assert nn.Module.__dict__["load_state_dict"] is original
    registry.install(["torch"])


def registry_original():
    """torch's own ``load_state_dict``, whether or not the hook is on now."""
    function = nn.Module.__dict__["load_state_dict"]
    return getattr(function, "__wrapped__", function)


def test_uninstall_during_a_late_patch_leaves_no_setter_patched(monkeypatch):
    """``set_model_state_dict``/``set_state_dict`` are patched when their module is imported,
    on the importing thread and outside the registry's lock. An uninstall that lands half-way
    through that must not leave one setter patched and the hook reported off."""
    import torch.distributed.checkpoint.state_dict as setters

    from ckptshim.hooks import torch_dcp
    from ckptshim.hooks.seam import Patches

    registry.install(["torch-dcp"])
    registry.uninstall(["torch-dcp"])
    originals = {name: setters.__dict__[name] for name in ("set_model_state_dict", "set_state_dict")}
    assert not any(hasattr(f, "__wrapped__") for f in originals.values())
    first_done, uninstalled = threading.Event(), threading.Event()
    wrap = Patches.wrap

    def slow_wrap(self, owner, attribute, wrapper):
        wrap(self, owner, attribute, wrapper)
        if owner is setters and attribute == "set_model_state_dict":
            first_done.set()
            uninstalled.wait(1.0)  # an uninstall now may slip in between the two setters

    monkeypatch.setattr(Patches, "wrap", slow_wrap)

    def late_import() -> None:  # what the import callback does once the module finishes importing
        monkeypatch.setattr(torch_dcp, "_wanted", True)
        torch_dcp._patch_setters(setters)

    def uninstall() -> None:
        first_done.wait(5.0)
        torch_dcp.uninstall()
        uninstalled.set()

    try:
        _run_together(late_import, uninstall)
        left = [name for name, function in originals.items() if setters.__dict__[name] is not function]
        assert not left, f"{left} left patched although the hook was uninstalled"
    finally:
        torch_dcp.uninstall()
        registry.install(["torch-dcp"])
