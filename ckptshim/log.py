"""Logging: one INFO line per shimmed load, the whole plan at DEBUG.

The ``ckptshim`` logger is silent unless the application configures logging or
``CKPTSHIM_LOG`` asks for a stderr handler. Every process that loads logs its own summary (each
rank of a torchrun job loads its own shards); once torch.distributed is initialised each line
starts with ``rank N:``, so the ranks' interleaved lines on one terminal can be told apart.
"""

from __future__ import annotations

import logging
import sys

from ckptshim import config

logger = logging.getLogger("ckptshim")
_HANDLER_NAME = "ckptshim-env"


def _distributed_rank() -> int | None:
    """This process's torch.distributed rank, or ``None`` when no process group is initialised.

    Looks only at an already imported ``torch.distributed``: logging never imports torch.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank()


class _RankPrefix(logging.Filter):
    """Prefix each record with the torch.distributed rank, whatever handler prints it."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _distributed_rank()
        if rank is not None:
            record.msg = f"rank {rank}: {record.msg}"
        return True


logger.addFilter(_RankPrefix())


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

