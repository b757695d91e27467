"""Logging: one INFO line per shimmed load, the whole plan at DEBUG.

The ``ckptshim`` logger is silent unless the application configures logging or
``CKPTSHIM_LOG`` asks for a stderr handler. Every process that loads logs its own summary (each
rank of a torchrun job, each process of a ``jax.distributed`` job, loads its own shards); in
such a job each line starts with ``rank N:`` (torch) or ``process N:`` (JAX), so the
processes' interleaved lines on one terminal can be told apart.

Each line is printed once: the ``CKPTSHIM_LOG`` handler stays quiet for a record that a handler
further up (the root logger's, which the application, absl or a framework may have configured)
already writes to stderr.
"""

from __future__ import annotations

import logging
import sys
import warnings

from ckptshim import config

logger = logging.getLogger("ckptshim")
_HANDLER_NAME = "ckptshim-env"


def _process() -> tuple[str, int] | None:
    """``("rank", N)`` once torch.distributed is initialised, ``("process", N)`` in a JAX job of
    several processes, else ``None``. Looks only at frameworks already imported: logging never
    imports torch or jax."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return "rank", dist.get_rank()
    jax = sys.modules.get("jax")
    distributed = getattr(jax, "distributed", None)
    if distributed is not None and distributed.is_initialized() and jax.process_count() > 1:
        return "process", jax.process_index()
    return None


def first_process() -> bool:
    """Whether this is the process that speaks for a distributed job (rank or process 0), or
    the only one."""
    found = _process()
    return found is None or found[1] == 0


class _ProcessPrefix(logging.Filter):
    """Prefix each record with the process it comes from, whatever handler prints it."""

    def filter(self, record: logging.LogRecord) -> bool:
        found = _process()
        if found is not None:
            record.msg = f"{found[0]} {found[1]}: {record.msg}"
        return True


logger.addFilter(_ProcessPrefix())


class _NotPrintedAbove(logging.Filter):
    """Keep the ``CKPTSHIM_LOG`` handler from printing a record a second time: pass it only when
    no handler it propagates to writes it to stderr as well."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = logger
        while current.propagate and current.parent is not None:
            current = current.parent
            if any(isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stderr
                   and record.levelno >= h.level for h in current.handlers):
                return False
        return True


def configure_from_env() -> None:
    """Attach a stderr handler at the level ``CKPTSHIM_LOG`` names (once); for a value it does
    not know, warn (naming the valid ones) and attach none."""
    try:
        level = config.log_level()
    except ValueError as error:
        warnings.warn(str(error), RuntimeWarning, stacklevel=2)
        return
    if level is None or any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    handler.addFilter(_NotPrintedAbove())
    logger.addHandler(handler)
    logger.setLevel(getattr(logging, level.upper()))
