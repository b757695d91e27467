"""Plans between checkpoint files: ``ckptshim plan`` and ``ckptshim convert --like``.

No framework call is involved, just a source checkpoint and a target layout -- another
checkpoint, or what a ``module:function`` of the user's returns (:mod:`ckptshim.loading.like`).
The rules are the ones a load through that backend would use: JAX's when either side is a JAX
tree (``/`` keys), torch's otherwise -- with the model the source's ``config.json`` (else the
``--like`` folder's) describes: transformers' conversion mapping of it, as a load without a
module uses, or the decoder hub's composition between two producers' names (MaxText's among them).
"""

from __future__ import annotations

from pathlib import Path

from ckptshim.formats.base import Checkpoint
from ckptshim.formats.detect import open_checkpoint
from ckptshim.formats.hf_dir import config_of, model_config
from ckptshim.inventory import Entry, Inventory, join_key
from ckptshim.loading import like as like_spec
from ckptshim.loading.producers import model_names, producer, producer_config
from ckptshim.log import logger
from ckptshim.planner import Plan
from ckptshim.planner import plan as make_plan
from ckptshim.rules import Rules
from ckptshim.rules.context import LoadContext
from ckptshim.rules.profiles import rules_for


def target_layout(like: str | Path) -> tuple[Inventory, str]:
    """The inventory ``like`` describes and its key separator (``.`` torch, ``/`` JAX)."""
    if like_spec.is_callable_spec(like):
        return like_spec.target_inventory(str(like))
    target = open_checkpoint(like)
    target.close()  # the inventory is all a plan needs
    return target.inventory, target.key_sep


def plan_onto(source: Checkpoint, like: str | Path, rules: Rules | None = None, *,
              stored_dtypes: bool = False) -> Plan:
    """How the open checkpoint ``source`` maps onto the layout of ``like`` (metadata only).

    With ``stored_dtypes``, a target array whose dtype in ``like`` differs from the one the source
    stores it in takes the stored one: the plan then casts nothing (``convert`` copies bytes).
    """
    target, target_sep = target_layout(like)
    source_config = config_of(source)
    if source_config is None:
        source_config = producer_config(source.path)
    like_config = None if like_spec.is_callable_spec(like) else model_config(like)
    source.inventory.model_type = _model_type(source_config)
    target.model_type = _model_type(like_config) or target.model_type
    if rules is None:
        config = source_config if source_config is not None else like_config
        call = "jax" if "/" in (source.key_sep, target_sep) else "torch"
        rules = rules_for(LoadContext(source.inventory, target, call, model_config=config,
                                      producer=producer(source.path),
                                      target_config=like_config if source_config is not None else None))
    plan = make_plan(source.inventory, target, rules)
    casts = plan.casts() if stored_dtypes else {}
    if not casts:
        return plan
    first = next(iter(casts.values()))
    logger.info("%d arrays keep the dtype %s stores them in (e.g. %s: %s, where %s has %s); nothing is cast",
                len(casts), source.path, join_key(first.target, source.key_sep), first.source_dtype, like,
                first.target_dtype)
    target = Inventory([Entry(e.key, e.shape, casts[e.key].source_dtype if e.key in casts else e.dtype, e.location)
                        for e in target.values()], target.source, target.model_type)
    return make_plan(source.inventory, target, rules)


def plan_onto_model(source: Checkpoint) -> Plan | None:
    """For a checkpoint whose producer stores other names than its model's (Megatron-Core), the
    plan onto the model's own names (:func:`~ckptshim.loading.producers.model_names`), which
    ``convert`` writes without ``--like``; ``None`` where the stored names are the model's."""
    view = model_names(source)
    if view is None:
        return None
    target, note = view
    logger.info("%s: %s", source.path, note)
    rules = rules_for(LoadContext(source.inventory, target, "torch", producer=producer(source.path)))
    return make_plan(source.inventory, target, rules)


def _model_type(config: dict | None) -> str | None:
    """The ``model_type`` a ``config.json`` names (``None`` when it names none)."""
    model_type = (config or {}).get("model_type")
    return model_type if isinstance(model_type, str) else None
