"""What every load says: one INFO summary line when it changed something, the plan at DEBUG."""

from __future__ import annotations

import logging

from ckptshim.keytext import shown
from ckptshim.log import logger
from ckptshim.planner import Plan, explain, summary, table

#: The most rows the INFO table of a load shows; the plan at DEBUG (or ``ckptshim plan``) has all.
INFO_ROWS = 40


def report_load(where: str, plan: Plan, sep: str = ".", *, read_as: str | None = None) -> None:
    """Log what a load changed: a summary and a table of grouped keys at INFO (only when something
    changed), the plan at DEBUG, key paths joined with ``sep`` (``/`` for JAX trees, as Orbax
    spells them).

    Called on every process that loads, never only on a coordinator: each rank reads and
    writes its own part, so each says what it did. ``read_as`` names the checkpoint's format
    when ckptshim reads the bytes itself: that is worth its INFO line even when every key
    already matches (a legacy layout the framework's own reader refuses). What a rule says the
    load loses is a warning.
    """
    where = shown(str(where))
    for warning in plan.warnings:
        logger.warning("%s.", shown(warning))
    if plan.is_identity:
        if read_as is None:
            logger.debug("%s: checkpoint already matches; nothing to change", where)
        else:
            report_read_as_stored(where, read_as)
        return
    if logger.isEnabledFor(logging.INFO):  # one record: its lines stay together between ranks'
        rows = "".join(f"\n  {shown(line)}" for line in table(plan, sep, limit=INFO_ROWS))
        logger.info("%s: %s%s", where, shown(summary(plan, sep)), rows)
    if logger.isEnabledFor(logging.DEBUG):
        for line in explain(plan, sep):
            logger.debug("  %s", shown(line))


def report_read_as_stored(where: str, read_as: str) -> None:
    """Say at INFO that ckptshim itself read a checkpoint the framework cannot, array by array as
    stored: the framework alone would have failed, so the load is ckptshim's doing."""
    logger.info("%s: read by ckptshim as %s; every array as stored", shown(where), read_as)
