"""The lazy hook registry, with real modules written to a temporary folder; seam helpers; errors."""

from __future__ import annotations

import importlib
from importlib import metadata
import logging
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ckptshim.errors import (
    CorruptCheckpointError, InternalError, PlanError, ShimError, UnsafeCheckpointError,
)
from ckptshim.hooks import registry
from ckptshim.hooks.registry import HookSpec
from ckptshim.hooks.seam import Patches, Seam, guarded

REPO = Path(__file__).resolve().parents[1]


# -- fake frameworks ---------------------------------------------------------------------------


class Fake:
    """A trigger module, an integration module and a recorder module, all real files.

    ``recorder.calls`` collects, in order, "trigger imported", "install" and "uninstall".
    """

    def __init__(self, folder: Path, *, install_body: str = "", package: bool = False) -> None:
        tag = uuid.uuid4().hex[:10]
        self.name = f"fake-{tag}"
        self.recorder = f"rec_{tag}"
        self.integration = f"integ_{tag}"
        (folder / f"{self.recorder}.py").write_text("calls = []\n")
        (folder / f"{self.integration}.py").write_text(
            f"import {self.recorder} as rec\n\n"
            "def install():\n"
            f"    {install_body or 'pass'}\n"
            "    rec.calls.append('install')\n\n"
            "def uninstall():\n"
            "    rec.calls.append('uninstall')\n")
        body = f"import {self.recorder} as rec\nrec.calls.append('trigger imported')\nVALUE = 42\n"
        if package:
            (folder / f"fakefw_{tag}").mkdir()
            (folder / f"fakefw_{tag}" / "__init__.py").write_text("")
            (folder / f"fakefw_{tag}" / "checkpoint.py").write_text(body)
            self.trigger = f"fakefw_{tag}.checkpoint"
        else:
            (folder / f"fakefw_{tag}.py").write_text(body)
            self.trigger = f"fakefw_{tag}"
        self.modules = [self.recorder, self.integration, self.trigger, self.trigger.split(".")[0]]

    def spec(self, distribution: str = "ckptshim-no-such-dist", supported=("0", "999"),
             integration: str | None = None) -> HookSpec:
        return HookSpec(self.name, self.trigger, integration or self.integration, distribution,
                        supported)

    @property
    def calls(self) -> list[str]:
        return importlib.import_module(self.recorder).calls

    def install(self, **spec_options) -> None:
        registry.install(specs=(self.spec(**spec_options),))

    def state(self) -> str:
        return registry.states()[self.name]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPTSHIM_DISABLE", raising=False)
    monkeypatch.delenv("CKPTSHIM_DISABLE_HOOKS", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[Fake] = []

    def make(**options) -> Fake:
        made.append(Fake(tmp_path, **options))
        importlib.invalidate_caches()
        return made[-1]

    yield make
    for item in made:
        registry.uninstall([item.name])
        for module in item.modules:
            sys.modules.pop(module, None)


def test_install_before_import_attaches_on_import(fake):
    fw = fake()
    fw.install()
    assert fw.trigger not in sys.modules
    assert fw.integration not in sys.modules  # the integration is imported lazily too
    assert fw.state() == f"waiting for `import {fw.trigger}`"
    assert fw.calls == []

    module = importlib.import_module(fw.trigger)
    assert module.VALUE == 42
    assert fw.calls == ["trigger imported", "install"]  # after the module ran, not before
    assert fw.state() == "active (ckptshim-no-such-dist unknown version)"
    # the notifying loader hands the module its real loader back
    assert type(module.__loader__).__name__ != "_NotifyingLoader"
    assert type(module.__spec__.loader).__name__ != "_NotifyingLoader"


def test_install_for_a_submodule_trigger(fake):
    fw = fake(package=True)
    fw.install()
    importlib.import_module(fw.trigger.split(".")[0])
    assert fw.calls == []  # the package alone is not the trigger
    importlib.import_module(fw.trigger)
    assert fw.calls == ["trigger imported", "install"]


def test_install_after_import_attaches_immediately(fake):
    fw = fake()
    importlib.import_module(fw.trigger)
    assert fw.calls == ["trigger imported"]
    fw.install()
    assert fw.calls == ["trigger imported", "install"]
    assert fw.state().startswith("active")


def test_install_and_uninstall_are_idempotent(fake):
    fw = fake()
    fw.install()
    fw.install()
    importlib.import_module(fw.trigger)
    fw.install()
    assert fw.calls == ["trigger imported", "install"]

    registry.uninstall([fw.name])
    registry.uninstall([fw.name])
    assert fw.calls == ["trigger imported", "install", "uninstall"]
    assert fw.state() == "uninstalled"

    fw.install()  # again after an uninstall: attaches again, once
    fw.install()
    assert fw.calls == ["trigger imported", "install", "uninstall", "install"]
    assert fw.state().startswith("active")


def test_uninstall_before_import_means_it_never_attaches(fake):
    fw = fake()
    fw.install()
    registry.uninstall([fw.name])
    importlib.import_module(fw.trigger)
    assert fw.calls == ["trigger imported"]
    assert fw.state() == "uninstalled"


def test_reinstall_after_the_trigger_is_purged_attaches_on_reimport(fake):
    fw = fake()
    fw.install()
    importlib.import_module(fw.trigger)
    registry.uninstall([fw.name])
    del sys.modules[fw.trigger]
    fw.install()
    importlib.import_module(fw.trigger)
    assert fw.calls == ["trigger imported", "install", "uninstall", "trigger imported", "install"]


def test_install_names_filter(fake):
    fw, other = fake(), fake()
    registry.install(names=[fw.name], specs=(fw.spec(), other.spec()))
    importlib.import_module(fw.trigger)
    importlib.import_module(other.trigger)
    assert fw.calls == ["trigger imported", "install"]
    assert other.calls == ["trigger imported"]
    assert other.name not in registry.states()


def test_ckptshim_disable_skips_every_hook(fake, monkeypatch):
    fw = fake()
    monkeypatch.setenv("CKPTSHIM_DISABLE", "1")
    fw.install()
    importlib.import_module(fw.trigger)
    assert fw.calls == ["trigger imported"]
    assert fw.state() == "disabled by CKPTSHIM_DISABLE"


@pytest.mark.parametrize("value", ["true", "YES", " on "])
def test_ckptshim_disable_spellings(fake, monkeypatch, value):
    fw = fake()
    monkeypatch.setenv("CKPTSHIM_DISABLE", value)
    fw.install()
    assert fw.state() == "disabled by CKPTSHIM_DISABLE"


def test_ckptshim_disable_zero_does_not_disable(fake, monkeypatch):
    fw = fake()
    monkeypatch.setenv("CKPTSHIM_DISABLE", "0")
    fw.install()
    importlib.import_module(fw.trigger)
    assert fw.calls == ["trigger imported", "install"]


def test_ckptshim_disable_hooks_skips_only_named_hooks(fake, monkeypatch):
    fw, other = fake(), fake()
    monkeypatch.setenv("CKPTSHIM_DISABLE_HOOKS", f"orbax, {fw.name} ,t5x")
    registry.install(specs=(fw.spec(), other.spec()))
    importlib.import_module(fw.trigger)
    importlib.import_module(other.trigger)
    assert fw.calls == ["trigger imported"]
    assert fw.state() == "disabled by CKPTSHIM_DISABLE_HOOKS"
    assert other.calls == ["trigger imported", "install"]


def test_version_gate_outside_range_is_not_attached(fake, caplog):
    installed = metadata.version("pytest")
    fw = fake()
    with caplog.at_level(logging.WARNING, logger="ckptshim"):
        fw.install(distribution="pytest", supported=("1.0", "2.0"))
        importlib.import_module(fw.trigger)
    assert fw.calls == ["trigger imported"]
    assert fw.integration not in sys.modules
    assert fw.state() == (f"not attached: pytest {installed} is outside the supported range "
                          ">=1.0,<2.0")
    assert any("outside the supported range" in r.getMessage() for r in caplog.records)


def test_version_gate_inside_range_is_attached(fake):
    installed = metadata.version("pytest")
    major = int(installed.split(".")[0])
    fw = fake()
    fw.install(distribution="pytest", supported=(str(major), str(major + 1)))
    importlib.import_module(fw.trigger)
    assert fw.calls == ["trigger imported", "install"]
    assert fw.state() == f"active (pytest {installed})"


def test_version_gate_upper_bound_is_exclusive(fake):
    installed = metadata.version("pytest")
    release = ".".join(installed.split("+")[0].split(".")[:3])
    fw = fake()
    fw.install(distribution="pytest", supported=("0", release))
    importlib.import_module(fw.trigger)
    assert fw.calls == ["trigger imported"]
    assert fw.state().startswith("not attached")


@pytest.mark.parametrize("version, supported, inside", [
    ("2.13.0+cpu", ("2.4", "3"), True),
    ("2.3.1", ("2.4", "3"), False),
    ("3.0.0", ("2.4", "3"), False),
    ("0.4.26rc1", ("0.4.26", "0.5"), True),
    ("0.4.25.post1", ("0.4.26", "0.5"), False),
    ("2.10", ("2.4", "2.9"), False),  # numeric, not text, comparison
])
def test_version_range_rules(version, supported, inside):
    assert registry.supports_version(version, supported) is inside


def test_failing_install_does_not_break_the_import(fake, caplog):
    fw = fake(install_body="raise RuntimeError('integration bug')")
    fw.install()
    with caplog.at_level(logging.WARNING, logger="ckptshim"):
        module = importlib.import_module(fw.trigger)
    assert module.VALUE == 42
    assert fw.calls == ["trigger imported"]
    assert fw.state() == "failed to attach (see log)"
    assert "failed" in fw.state()
    record = next(r for r in caplog.records if "could not attach" in r.getMessage())
    assert record.levelno == logging.WARNING
    assert record.exc_info is not None and "integration bug" in str(record.exc_info[1])
    registry.uninstall([fw.name])  # nothing was installed: nothing to undo
    assert fw.calls == ["trigger imported"]


def test_missing_integration_module_does_not_break_the_import(fake):
    fw = fake()
    registry.install(specs=(fw.spec(integration=f"no_such_integration_{uuid.uuid4().hex}"),))
    assert importlib.import_module(fw.trigger).VALUE == 42
    assert fw.state() == "failed to attach (see log)"


def test_states_is_a_copy(fake):
    fw = fake()
    fw.install()
    registry.states()[fw.name] = "tampered"
    assert fw.state() == f"waiting for `import {fw.trigger}`"


# -- import cost ---------------------------------------------------------------------------------


def _fresh_python(code: str, **env) -> str:
    environment = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **env}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, env=environment, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_import_ckptshim_imports_neither_torch_nor_jax():
    code = "import ckptshim, sys; print('torch' in sys.modules, 'jax' in sys.modules)"
    assert _fresh_python(code) == "False False"
    assert _fresh_python(code, CKPTSHIM_LOG="debug") == "False False"


def test_import_ckptshim_stays_light():
    code = ("import sys; before = set(sys.modules); import ckptshim; "
            "print(sorted(m for m in set(sys.modules) - before if not m.startswith('ckptshim')))")
    extra = eval(_fresh_python(code))  # noqa: S307 - our own subprocess's repr of a list
    heavy = {"numpy", "wrapt", "inspect", "asyncio", "importlib.metadata", "dataclasses",
             "typing", "logging", "torch", "jax"}
    assert heavy.isdisjoint(extra), sorted(heavy & set(extra))


def test_import_ckptshim_disabled_leaves_import_system_alone():
    code = ("import sys; n = len(sys.meta_path); import ckptshim; "
            "from ckptshim.hooks import registry; "
            "print(len(sys.meta_path) == n, all(s.startswith('disabled') for s in registry.states().values()))")
    assert _fresh_python(code, CKPTSHIM_DISABLE="1") == "True True"


# -- seam: guarded ---------------------------------------------------------------------------

FAKE = Seam("fake", "fake", falls_back=True)


def test_guarded_returns_the_shimmed_result():
    calls = []
    result = guarded(FAKE, lambda: "shimmed", lambda: calls.append("original") or "original")
    assert result == "shimmed"
    assert calls == []


@pytest.mark.parametrize("error", [PlanError("ambiguous"), UnsafeCheckpointError("pickle"),
                                   CorruptCheckpointError("truncated"), ShimError("no")])
def test_guarded_reraises_shim_errors_without_fallback(error, caplog):
    calls = []

    def shimmed():
        raise error

    with caplog.at_level(logging.WARNING, logger="ckptshim"):
        with pytest.raises(type(error)) as info:
            guarded(FAKE, shimmed, lambda: calls.append("original"))
    assert info.value is error
    assert calls == []  # a refusal is final: never fall back to the framework's loader
    assert caplog.records == []


def test_guarded_falls_back_on_other_exceptions_and_warns(caplog):
    calls = []

    def shimmed():
        raise KeyError("bug inside ckptshim")

    with caplog.at_level(logging.WARNING, logger="ckptshim"):
        result = guarded(Seam("orbax", "orbax", falls_back=True), shimmed, lambda: calls.append("original") or "original result")
    assert result == "original result"
    assert calls == ["original"]
    (record,) = [r for r in caplog.records if r.name == "ckptshim"]
    assert record.levelno == logging.WARNING
    assert "internal error in the orbax hook" in record.getMessage()
    assert record.exc_info[0] is KeyError


def test_guarded_does_not_swallow_keyboard_interrupt():
    calls = []

    def shimmed():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        guarded(FAKE, shimmed, lambda: calls.append("original"))
    assert calls == []


def test_guarded_original_errors_propagate():
    def shimmed():
        raise TypeError("bug")

    def original():
        raise FileNotFoundError("framework's own error")

    with pytest.raises(FileNotFoundError, match="framework's own error"):
        guarded(FAKE, shimmed, original)


# -- seam: Patches -----------------------------------------------------------------------------


class Base:
    def greet(self, name):
        return f"hello {name}"

    @classmethod
    def make(cls):
        return cls.__name__

    @staticmethod
    def double(x):
        return 2 * x


class Child(Base):
    def own(self):
        return "own"


class GrandChild(Child):
    pass


def _shouting(calls):
    def wrapper(wrapped, instance, args, kwargs):
        calls.append((type(instance).__name__ if instance is not None else None, args))
        return str(wrapped(*args, **kwargs)).upper()
    return wrapper


def test_patches_wrap_and_restore_own_method():
    calls = []
    originals = dict(vars(Child))
    patches = Patches()
    assert not patches.active
    patches.wrap(Child, "own", _shouting(calls))
    assert patches.active
    assert Child().own() == "OWN"
    assert calls == [("Child", ())]
    patches.restore()
    assert not patches.active
    assert Child().own() == "own"
    assert vars(Child)["own"] is originals["own"]
    patches.restore()  # idempotent
    assert vars(Child)["own"] is originals["own"]


def test_patches_wrap_inherited_method_and_uncover_it():
    calls = []
    patches = Patches()
    patches.wrap(Child, "greet", _shouting(calls))
    assert Child().greet("ann") == "HELLO ANN"
    assert Base().greet("bob") == "hello bob"  # the base class is untouched
    assert calls == [("Child", ("ann",))]
    patches.restore()
    assert "greet" not in vars(Child)
    assert Child().greet("ann") == "hello ann"


def test_patches_wrap_twice_restores_the_very_original():
    original = vars(Base)["greet"]
    patches = Patches()
    patches.wrap(Base, "greet", _shouting([]))
    patches.wrap(Base, "greet", _shouting([]))
    assert Base().greet("x") == "HELLO X"
    patches.restore()
    assert vars(Base)["greet"] is original


def test_patches_wrap_own_classmethod_and_staticmethod():
    calls = []
    patches = Patches()
    patches.wrap(Base, "make", _shouting(calls))
    patches.wrap(Base, "double", _shouting(calls))
    try:
        assert Base.make() == "BASE"
        assert Child.make() == "CHILD"
        assert Base.double(4) == "8"
    finally:
        patches.restore()
    assert Child.make() == "Child" and Base.double(4) == 8
    assert isinstance(vars(Base)["double"], staticmethod)
    assert isinstance(vars(Base)["make"], classmethod)


def test_patches_wrap_inherited_classmethod_keeps_cls():
    patches = Patches()
    patches.wrap(Child, "make", _shouting([]))
    try:
        assert GrandChild.make() == "GRANDCHILD"
    finally:
        patches.restore()


def test_patches_wrap_module_function(tmp_path, monkeypatch):
    name = f"patchme_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("def load(path):\n    return 'loaded ' + path\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    try:
        original = module.load
        patches = Patches()
        patches.wrap(module, "load", _shouting([]))
        assert module.load("ckpt") == "LOADED CKPT"
        patches.restore()
        assert module.load is original
    finally:
        sys.modules.pop(name, None)


# -- errors ------------------------------------------------------------------------------------


def test_shim_error_is_runtime_and_value_error():
    for kind in (ShimError, PlanError, UnsafeCheckpointError, CorruptCheckpointError):
        assert issubclass(kind, RuntimeError) and issubclass(kind, ValueError)


def test_guarded_never_falls_back_where_the_framework_would_unpickle(caplog):
    """DCP's and DeepSpeed's own loaders unpickle without limits: a bug in ckptshim there is an
    InternalError naming the switch that turns the hook off, and the original never runs."""
    calls = []
    seam = Seam("torch-dcp", "torch.distributed.checkpoint.load", falls_back=False)

    def shimmed():
        raise KeyError("bug inside ckptshim")

    with caplog.at_level(logging.WARNING, logger="ckptshim"):
        with pytest.raises(InternalError, match=r"on /ckpt.*KeyError.*CKPTSHIM_DISABLE_HOOKS=torch-dcp") as info:
            guarded(seam, shimmed, lambda: calls.append("original"), "/ckpt")
    assert calls == []
    assert isinstance(info.value, ShimError) and isinstance(info.value.__cause__, KeyError)
