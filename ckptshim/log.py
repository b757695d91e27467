"""Logging: one INFO line per shimmed load, the whole plan at DEBUG.

The ``ckptshim`` logger is silent unless the application configures logging or
``CKPTSHIM_LOG`` asks for a stderr handler.
"""

from __future__ import annotations

import logging

from ckptshim import config

logger = logging.getLogger("ckptshim")
_HANDLER_NAME = "ckptshim-env"


def configure_from_env() -> None:
    """Attach a stderr handler at the level ``CKPTSHIM_LOG`` names (once)."""
    level = config.log_level()
    if level is None or any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if level == "debug" else logging.INFO)


def report_load(where: str, plan, sep: str = ".") -> None:
    """Log what a load changed: a summary at INFO (only when something changed), the plan at DEBUG."""
    from ckptshim.plan.explain import explain, summary

    if plan.is_identity:
        logger.debug("%s: checkpoint already matches; nothing to change", where)
        return
    logger.info("%s: %s", where, summary(plan))
    if logger.isEnabledFor(logging.DEBUG):
        for line in explain(plan, sep):
            logger.debug("  %s", line)
