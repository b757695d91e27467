"""One load, run twice -- through the framework alone (``ckptshim.uninstall()``) and with ckptshim
-- and the two outcomes judged against ckptshim's promises (docs/safety.md, "Never worse than
native"):

- **the framework loads**: ckptshim loads identically -- the same values in every destination
  tensor, the same return value. It may load *more* only where the framework left keys missing
  or unexpected, and then its plan says why (an INFO summary): each key the framework wrote holds
  the same value, each key ckptshim adds holds the checkpoint's value, and its missing and
  unexpected keys are among the framework's. It may refuse only where the framework loaded a
  value that is not the checkpoint's (a silent wrong load), with a ``ShimError`` -- or where
  names are ambiguous (``AmbiguousNameError``: two keys for one name, one key with two
  readings): loading by exact names, as the framework does, is then right or wrong by luck,
  and no name tells which.
- **the framework raises**: ckptshim loads (its plan says why, and every value it writes is the
  checkpoint's), or raises a ``ShimError`` with the destination unchanged, or -- where it has no
  plan and steps aside -- the framework's call raises its very own error (type and text; for
  DCP, each rank's), leaving what the framework leaves, with ckptshim's diagnosis at most added
  as a note. ckptshim's "no plan" itself (``NoPlan``) never reaches the caller.
- **the return value**: where ckptshim said nothing, it is the framework's; where it loaded more,
  a non-strict ``load_state_dict``'s ``_IncompatibleKeys`` list no key the framework does not,
  and every tied twin (one tensor under two names) the framework reports missing stays missing:
  its value is its twin's through one storage, and callers (``safetensors.torch.load_model``)
  rely on the list.

``truth`` is what the checkpoint holds for each destination key, known independently of
ckptshim (the file read by its own library, a fixture's manifest hash, a generated module's own
values); a value written anywhere else is wrong. :data:`TALLY` counts every comparison for the suite's summary line.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import ckptshim
from ckptshim.errors import NOTE_PREFIX, AmbiguousNameError, NoPlan, ShimError

#: ``compared``: loads judged; ``clean``: those that kept every promise; then one count per verdict.
TALLY: Counter[str] = Counter()

#: A value as compared: its kind, dtype, shape and bytes.
Print = tuple[str, str, tuple[int, ...], bytes]


def fingerprint(value: Any) -> Print:
    """What two values must share to be the same value: kind, dtype, shape and every byte (a
    typed JAX PRNG key by its key data, as the fixtures' manifests hash it)."""
    if type(value).__module__.startswith("torch"):
        import torch

        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return "torch", str(value.dtype), tuple(value.shape), data
    kind = type(value).__name__
    if type(value).__module__.startswith("jax"):
        import jax

        kind = "jax"
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            kind, value = f"jax key {value.dtype}", jax.random.key_data(value)
    array = np.asarray(value)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return kind, str(array.dtype), array.shape, np.ascontiguousarray(array).tobytes()


def holds(expected: Print | str | None, value: Print) -> bool:
    """Whether ``value`` is the checkpoint's: equal to its fingerprint, or to its manifest's sha256."""
    if isinstance(expected, str):
        return hashlib.sha256(value[3]).hexdigest() == expected
    return expected == value


@dataclass
class Outcome:
    """What one run of a load did: its return value or error, the values it left, what ckptshim said."""

    result: Any = None
    error: BaseException | None = None
    values: dict[str, Print] = field(default_factory=dict)      # destination/result values after
    destination: dict[str, Print] = field(default_factory=dict)  # the caller's own values after
    said: list[str] = field(default_factory=list)               # ckptshim's INFO lines
    shared: frozenset[str] = frozenset()                        # keys whose value is another key's too (tied)


@dataclass(frozen=True)
class Load:
    """A load to compare.

    ``fresh()`` builds the caller's destination anew, the same every time; ``call(destination)``
    makes the framework call; ``destination_values(destination)`` are the caller's own tensors or
    arrays (what a load may write in place); ``loaded_values(destination, result)`` what the load
    produced, by key (for torch the destination itself, for JAX the returned tree);
    ``truth`` the checkpoint's value for each key it holds (fingerprints, or the sha256 of its
    bytes from a fixture's manifest); ``complete``: a
    successful load must fill every key of the truth (a strict load); ``trained``: checkpoint keys
    the destination has no place for that hold no derived value (neither what a derivable-buffer
    rule recomputes nor a buffer the destination does not persist), which a strict load must not
    leave out without a word.
    """

    name: str
    fresh: Callable[[], Any]
    call: Callable[[Any], Any]
    destination_values: Callable[[Any], Mapping[str, Any]]
    loaded_values: Callable[[Any, Any], Mapping[str, Any]]
    truth: Mapping[str, Print | str]
    complete: bool = False
    trained: frozenset[str] = frozenset()


@contextmanager
def ckptshim_says() -> Iterator[list[str]]:
    """The INFO lines ckptshim logs meanwhile."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("ckptshim")
    handler, level = Keep(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def prints(values: Mapping[str, Any]) -> dict[str, Print]:
    return {key: fingerprint(value) for key, value in values.items()}


def run(load: Load, shimmed: bool) -> tuple[dict[str, Print], Outcome]:
    """Run ``load`` once on a fresh destination; the destination's values before, and the outcome."""
    destination = load.fresh()
    own = load.destination_values(destination)
    before = prints(own)
    by_object: Counter[int] = Counter(map(id, own.values()))
    outcome = Outcome(shared=frozenset(key for key, value in own.items() if by_object[id(value)] > 1))
    if not shimmed:
        ckptshim.uninstall()
    try:
        with ckptshim_says() as said:
            try:
                outcome.result = load.call(destination)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as error:  # noqa: BLE001 - every outcome is compared (DCP's are BaseExceptions)
                outcome.error = error
    finally:
        if not shimmed:
            ckptshim.install()
    outcome.said = said
    outcome.destination = prints(load.destination_values(destination))
    if outcome.error is None:
        outcome.values = prints(load.loaded_values(destination, outcome.result))
    return before, outcome


def raised_as(error: BaseException) -> tuple:
    """An error as its caller can tell it: its type and text -- for DCP's ``CheckpointException``,
    each rank's own error's type and text (its text prints the frames each passed through, and a
    frame of ckptshim's planner wrapping the framework's own is no change the caller sees). Notes
    are not part of it: ckptshim adds its diagnosis there."""
    failures = getattr(error, "failures", None)
    if failures:
        return type(error), tuple(sorted((str(rank), type(e).__name__, str(e)) for rank, (e, _) in failures.items()))
    return type(error), str(error)


def noted(error: BaseException) -> bool:
    """Whether ckptshim put its diagnosis on the framework's error (or on a rank's)."""
    failures = getattr(error, "failures", None) or {}
    return any(note.startswith(NOTE_PREFIX) for e in [error, *(e for e, _ in failures.values())]
               for note in getattr(e, "__notes__", ()))


def refusal(error: BaseException | None) -> ShimError | None:
    """ckptshim's refusal itself, or the one DCP's ``CheckpointException`` carries from every rank."""
    if isinstance(error, ShimError):
        return error
    failures = getattr(error, "failures", None) or {}
    found = [exc for exc, _ in failures.values() if isinstance(exc, ShimError)]
    return found[0] if found and len(found) == len(failures) else None


def compare(load: Load) -> str:
    """Run ``load`` natively and with ckptshim; the verdict, or an ``AssertionError`` saying which
    promise broke. Counted in :data:`TALLY`."""
    TALLY["compared"] += 1
    before, native = run(load, shimmed=False)
    again, shim = run(load, shimmed=True)
    assert again == before, f"{load.name}: fresh() built two different destinations"
    verdict = _judge(load, before, native, shim)
    TALLY["clean"] += 1
    TALLY[verdict] += 1
    return verdict


def _judge(load: Load, before: dict[str, Print], native: Outcome, shim: Outcome) -> str:
    name = load.name
    if shim.error is not None:
        assert not isinstance(refusal(shim.error), NoPlan), \
            f"{name}: ckptshim's 'no plan' reached the caller instead of the framework's own call: {shim.error}"
        if refusal(shim.error) is None:  # left to the framework: the very same failure
            assert native.error is not None and raised_as(shim.error) == raised_as(native.error), \
                f"{name}: ckptshim raised {shim.error!r}, not the framework's own error (the framework: {native.error!r})"
            assert shim.destination == native.destination, f"{name}: left to the framework, but wrote otherwise"
            return "left to the framework, identically" + (", with ckptshim's note" if noted(shim.error) else "")
        assert shim.destination == before, f"{name}: ckptshim refused ({shim.error}) but changed the destination"
        if native.error is None:
            if isinstance(refusal(shim.error), AmbiguousNameError):
                return "refused as ambiguous; the framework loads by exact names"
            wrong = _wrong(load, before, native)
            assert wrong, f"{name}: ckptshim refused a load the framework performs rightly: {shim.error}"
            return "refused; the framework loads wrong values"
        return "refused cleanly"
    if native.error is None and shim.values == native.values and shim.destination == native.destination \
            and _same_result(shim.result, native.result):
        return "identical"
    assert shim.said, (f"{name}: ckptshim's load differs from the framework's "
                       f"({native.error or native.result!r}), yet it reported no plan")
    wrong = _wrong(load, before, shim)
    assert not wrong, f"{name}: ckptshim loaded values that are not the checkpoint's: {wrong[:5]}"
    _require_reported(load, before, shim)
    if native.error is not None:
        return "loaded where the framework raises, with a plan"
    for key, value in native.values.items():
        if value != before.get(key) and holds(load.truth.get(key), value):
            assert shim.values.get(key) == value, f"{name}: {key} differs from the framework's load"
    if hasattr(native.result, "missing_keys"):
        assert set(shim.result.missing_keys) <= set(native.result.missing_keys), \
            f"{name}: ckptshim reports missing keys the framework does not ({shim.result})"
        assert set(shim.result.unexpected_keys) <= set(native.result.unexpected_keys), \
            f"{name}: ckptshim reports unexpected keys the framework does not ({shim.result})"
        twins = [key for key in native.result.missing_keys if key in shim.shared]
        assert set(twins) <= set(shim.result.missing_keys), \
            f"{name}: the framework reports the tied twins {twins[:5]} missing (they hold their twin's " \
            f"value through one storage), ckptshim does not ({shim.result})"
    return "loaded more than the framework, with a plan"


def _same_result(a: Any, b: Any) -> bool:
    """Return values compared: torch's ``_IncompatibleKeys`` and ``None`` as they are, trees by
    structure (their leaves are compared as values)."""
    if a is None or hasattr(a, "missing_keys"):
        return a == b
    import jax

    return str(jax.tree_util.tree_structure(a)) == str(jax.tree_util.tree_structure(b))


def _wrong(load: Load, before: dict[str, Print], outcome: Outcome) -> list[str]:
    """Keys the load gave a value that is not the checkpoint's (a value kept as it was is not
    given; one the checkpoint does not hold is always wrong)."""
    return [key for key, value in outcome.values.items()
            if value != before.get(key) and not holds(load.truth.get(key), value)]


def _require_reported(load: Load, before: dict[str, Print], outcome: Outcome) -> None:
    """A successful load leaves no checkpoint value behind unannounced: a strict one fills every
    key, a non-strict one lists each key it did not fill among the missing."""
    unfilled = [key for key, expected in load.truth.items()
                if key not in outcome.values or not holds(expected, outcome.values[key])]
    if load.complete:
        assert not unfilled, f"{load.name}: a strict load left {unfilled[:5]} without the checkpoint's values"
        assert not load.trained, f"{load.name}: a strict load succeeded without {sorted(load.trained)[:5]}, " \
                                 "trained values the destination has no place for"
    elif hasattr(outcome.result, "missing_keys"):
        silent = [key for key in unfilled if key not in outcome.result.missing_keys]
        assert not silent, f"{load.name}: {silent[:5]} keep their old values, and are not reported missing"


def module_tensors(module: Any) -> dict[str, Any]:
    """Every tensor a load into a torch module may write: its state dict's, and the buffers it
    does not persist (which no load may change)."""
    values = dict(module.state_dict(keep_vars=True))
    for path, submodule in module.named_modules(remove_duplicate=False):
        for name in submodule._non_persistent_buffers_set:
            buffer = submodule._buffers.get(name)
            if buffer is not None:
                values[f"(not persistent) {path}.{name}"] = buffer
    return values
