"""Why a plan does not fit, in words: the telling reason first, keys grouped, advice that fits.

A refusal is read by someone whose load just failed. Its first line says what kind of misfit it
is -- a checkpoint of another model (each side's ``config.json`` names a different
``model_type``), a folder of optimizer state where model weights were wanted, or keys that differ
by name, shape or dtype -- and its advice is for that case only: a shape loads in no mode, so
a non-strict load is never offered for one; a non-strict load is offered only where the caller's
framework has one (``lenient`` names it). Per-layer keys are grouped into ``{0..63}`` ranges by
the one function that groups keys everywhere (:func:`ckptshim.keytext.group`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ckptshim.errors import NoPlan, PlanError
from ckptshim.inventory import Inventory, KeyPath, join_key
from ckptshim.keytext import group
from ckptshim.rules.training_state import optimizer_state_key

#: How many lines (a group of per-layer keys is one) a refusal lists per kind before it stops.
MAX_LISTED = 12
#: How many grouped candidates :func:`nearest` compares a missing key with.
_MAX_CANDIDATES = 5000


class Plan(Protocol):
    """What a refusal reads of a plan (:class:`ckptshim.planner.plan.Plan` is one, and calls this
    module from its ``require_complete``: a protocol keeps the import one way)."""

    @property
    def source(self) -> Inventory: ...
    @property
    def target(self) -> Inventory: ...
    @property
    def missing(self) -> tuple[KeyPath, ...]: ...
    @property
    def unexpected(self) -> tuple[KeyPath, ...]: ...
    @property
    def mismatched(self) -> tuple[Any, ...]: ...  # of planner.plan.Mismatch
    @property
    def hints(self) -> Mapping[KeyPath, str]: ...
    @property
    def complete(self) -> bool: ...


@dataclass(frozen=True)
class Refusal:
    """What :meth:`Plan.require_complete` raises: the error type and its message."""

    error: type[PlanError]
    message: str


def refusal(plan: Plan, sep: str = ".", *, allow_missing: bool = False, allow_unexpected: bool = False,
            lenient: str = "") -> Refusal | None:
    """The refusal for ``plan`` (``None`` when it fits, given what the caller allows).

    ``lenient`` is how the caller's framework accepts missing and unexpected keys (torch's
    ``load_state_dict(..., strict=False)``); the advice offers it for names, never for shapes.
    A cast ``CKPTSHIM_STRICT`` forbids is a :class:`~ckptshim.errors.PlanError` (the user's own
    refusal, where the framework would cast); the rest is :class:`~ckptshim.errors.NoPlan`, the
    framework's to load or refuse.
    """
    missing = () if allow_missing else plan.missing
    unexpected = () if allow_unexpected else plan.unexpected
    shapes = [m for m in plan.mismatched if not m.of_dtype]
    dtypes = [m for m in plan.mismatched if m.of_dtype]
    if not (missing or unexpected or shapes or dtypes):
        return None
    other_model = _other_model(plan)
    optimizer = None if other_model else _optimizer_state(plan, sep)
    first = other_model or optimizer
    lines = [f"checkpoint {plan.source.source or '(source)'} does not fit target "
             f"{plan.target.source or '(target)'}:" + (f" {first}" if first else "")]
    cut = False
    if shapes:
        listed = group(m.describe(sep) for m in shapes)
        lines.append(f"{len(shapes)} key(s) match by name but not by shape:")
        lines += [f"  {text}" for text, _ in listed[:MAX_LISTED]]
        cut |= len(listed) > MAX_LISTED
    if missing:
        listed = _missing_lines(plan, missing, sep, guess=not (other_model or optimizer))
        lines.append(f"{len(missing)} key(s) the target needs are not in the checkpoint:")
        lines += [f"  {text}" for text in listed[:MAX_LISTED]]
        cut |= len(listed) > MAX_LISTED
    if unexpected:
        listed = group(join_key(key, sep) for key in unexpected)
        lines.append(f"{len(unexpected)} checkpoint key(s) the target has no place for:")
        lines += [f"  {text}" for text, _ in listed[:MAX_LISTED]]
        cut |= len(listed) > MAX_LISTED
    if dtypes:
        lines.append(f"{len(dtypes)} key(s) match by name and shape but not by dtype, and the "
                     "cast is not allowed (CKPTSHIM_STRICT=1 refuses every narrowing cast):")
        listed = group(m.describe(sep) for m in dtypes)
        lines += [f"  {text}" for text, _ in listed[:MAX_LISTED]]
        cut |= len(listed) > MAX_LISTED
    if cut:
        lines.append(f"(lists cut at {MAX_LISTED} lines; `ckptshim plan` shows every key)")
    lines += _advice(plan, bool(missing or unexpected), bool(shapes), bool(dtypes),
                     other_model is not None, optimizer is not None, lenient)
    return Refusal(PlanError if dtypes else NoPlan, "\n".join(lines))


def headline(plan: Plan, sep: str = ".") -> str | None:
    """What a plan's misfit is at heart, where one line says it: a checkpoint of another model,
    or optimizer state where model weights were wanted (``None`` otherwise). A refusal starts
    with it, and ``ckptshim plan`` prints it first."""
    if plan.complete:  # the load works: whatever the names say, the checkpoint fits
        return None
    return _other_model(plan) or _optimizer_state(plan, sep)


def _advice(plan: Plan, names: bool, shapes: bool, dtypes: bool, other_model: bool, optimizer: bool,
            lenient: str) -> list[str]:
    advice = []
    if other_model:
        advice.append(f"Load a checkpoint of a {plan.target.model_type:.60} model, or build the model "
                      f"from the checkpoint's own config.json (a {plan.source.model_type:.60} model).")
    elif optimizer:
        advice.append("Load the model's weights from the model's own checkpoint (Accelerate saves "
                      "it beside this folder, as pytorch_model_fsdp_0), or load this folder into an "
                      "optimizer's state dict (torch.distributed.checkpoint.state_dict."
                      "get_optimizer_state_dict, then set_optimizer_state_dict).")
    else:
        if shapes:
            advice.append("A key whose shape differs loads in no mode, strict or not: build the "
                          "target with the checkpoint's configuration, or leave that key out.")
        if names:
            advice.append("The names differ and no rule of ckptshim maps them: rename the keys to "
                          "the target's before loading"
                          + (f", or load non-strictly ({lenient}), which leaves what is missing as "
                             "the target was initialised and ignores what has no place" if lenient else "")
                          + ". `ckptshim plan CHECKPOINT --like TARGET` lists every key.")
    if dtypes:
        advice.append("Save the checkpoint in the model's dtypes or build the model in the "
                      "checkpoint's, or unset CKPTSHIM_STRICT to let the values be cast.")
    return advice


def _other_model(plan: Plan) -> str | None:
    """The headline for a checkpoint of another model: both sides name a ``model_type``, and
    they differ (what transformers says as ``You are using a model of type gpt2 to instantiate a
    model of type llama``)."""
    source, target = plan.source.model_type, plan.target.model_type
    if not (isinstance(source, str) and isinstance(target, str)) or source == target:
        return None
    return (f"the checkpoint is a model of type {source:.60}, the target a model of type "
            f"{target:.60}: a checkpoint of another model, which no rule turns into this one.")


def _optimizer_state(plan: Plan, sep: str) -> str | None:
    """The headline for optimizer state loaded where model weights are wanted: most checkpoint
    keys are an optimizer's per-parameter values, and no target key is one."""
    held = [key for key in plan.source if optimizer_state_key(key)]
    if not held or 2 * len(held) < len(plan.source) or any(optimizer_state_key(k) for k in plan.target):
        return None
    names = sorted({key[-1] for key in held})
    state = held[0][:held[0].index("state") + 1]
    return (f"the checkpoint holds optimizer state ({join_key(state, sep)}{sep}<parameter>{sep}"
            f"{names[0]}: {', '.join(names)}), not model weights.")


def _missing_lines(plan: Plan, missing: Sequence[KeyPath], sep: str, guess: bool) -> list[str]:
    """The missing keys grouped, each with what a profile knows it is made from (grouped with
    it: its layer number is the key's), or (when ``guess``) the checkpoint's nearest keys."""
    # each group of checkpoint keys is compared by its first key, and shown grouped
    pool = {members[0]: text for text, members in group(join_key(k, sep) for k in (plan.unexpected or tuple(plan.source)))}
    hinted = {key: f"{join_key(key, sep)} ({plan.hints[key]})" for key in missing if key in plan.hints}
    explained = set(hinted.values())
    lines = []
    for index, (text, members) in enumerate(group(hinted.get(key) or join_key(key, sep) for key in missing)):
        if guess and index < MAX_LISTED and members[0] not in explained:
            near = [pool[key] for key in nearest(members[0], list(pool), sep)]
            text += f" (nearest in checkpoint: {', '.join(near)})" if near else ""
        lines.append(text)
    return lines


def nearest(text: str, candidates: Sequence[str], sep: str = ".", n: int = 3) -> list[str]:
    """The candidate keys most like the key ``text``: those of the same last component first,
    then by text similarity."""
    leaf = text.rsplit(sep, 1)[-1]
    same_leaf = [c for c in candidates if c.rsplit(sep, 1)[-1] == leaf]
    pool = (same_leaf or list(candidates))[:_MAX_CANDIDATES]
    return difflib.get_close_matches(text, pool, n=n, cutoff=0.4)
