"""Multi-process JAX loads: every process ends a load the same way, or none goes on.

Under ``jax.distributed`` each process plans the load itself, from the same metadata. That
needs no communication -- the plan is a pure function of the checkpoint's metadata and of the
target tree's keys, shapes, dtypes and shardings, which an SPMD program builds identically on
every process -- and a refusal found from metadata (a missing file, a layer count that does
not fit) is found by every process alike. Broadcasting one process's plan instead would cost a
round trip per load and still leave each process to check the files it reads itself.

What metadata cannot foresee ends a load on one process alone: a chunk that only its shards
read is damaged, its local disk lacks a file, or a bug. The others would return and then wait
forever in their next collective (or in Orbax's own barriers, had they chosen Orbax's restore).
So at two points of each load -- once it is planned (what each process decided: ckptshim's
restore, the framework's own -- because it reads the load itself or because ckptshim has no
plan for it -- or a refusal) and once ckptshim's reads are done -- every process
posts its outcome in jax's distributed key-value store and reads every other's, within
``CKPTSHIM_AGREEMENT_TIMEOUT`` seconds: a failure anywhere is raised everywhere, naming the
process and its reason; a process that never reports is named too. With one process nothing
is posted.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ckptshim import config
from ckptshim.errors import InternalError, NoPlan, PeerError, ShimError

#: Rounds this process has posted, per load and stage. SPMD programs load in the same order on
#: every process, so (load, stage, number) names the same round everywhere; keeping a count per
#: load means one load a process skipped (a hook turned off there) cannot shift the others.
_ROUNDS: dict[tuple[str, str], Iterator[int]] = {}
_FAILED = "failed: "
#: The decision posted where ckptshim has no plan (:class:`~ckptshim.errors.NoPlan`).
NO_PLAN = "no plan: the framework's own call"


@dataclass
class Outcome:
    """What this process reports for one round: its decision (set by the caller), or a failure."""

    decision: str = "done"


def _client() -> Any | None:
    """jax's distributed runtime client when this is one of several processes, else ``None``."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized() or jax.process_count() < 2:
        return None
    from jax._src import distributed  # the client Orbax's own multihost utilities use

    return distributed.global_state.client


@contextmanager
def agreeing(where: str, stage: str) -> Iterator[Outcome]:
    """Run the body, then agree with every other process on how ``stage`` of the load at
    ``where`` ended; raise :class:`~ckptshim.errors.PeerError` if another process failed or
    decided otherwise. A failure of the body is posted and raised on this process; one that is
    not a :class:`ShimError` (a bug) becomes an :class:`InternalError` here, so that this process
    does not fall back to the framework's own loader alone while the others stop."""
    client = _client()
    outcome = Outcome()
    if client is None:
        yield outcome
        return
    import jax

    rounds = _ROUNDS.setdefault((where, stage), itertools.count())
    key = f"ckptshim/{hashlib.sha1(where.encode()).hexdigest()[:16]}/{stage}/{next(rounds)}"
    me = jax.process_index()
    try:
        yield outcome
    except NoPlan:  # a decision like any other: every process leaves the load to the framework
        client.key_value_set(f"{key}/{me}", NO_PLAN)
        _require_same(client, key, me, jax.process_count(), NO_PLAN, where, stage)
        raise
    except ShimError as error:
        client.key_value_set(f"{key}/{me}", f"{_FAILED}{type(error).__name__}: {error}")
        raise
    except Exception as error:
        client.key_value_set(f"{key}/{me}", f"{_FAILED}{type(error).__name__}: {error}")
        raise InternalError(f"{where}: {stage} failed on process {me} with an internal error "
                            f"({type(error).__name__}: {error}); this is a bug in ckptshim, please "
                            "report it with this traceback. The other processes stop too.") from error
    client.key_value_set(f"{key}/{me}", outcome.decision)
    _require_same(client, key, me, jax.process_count(), outcome.decision, where, stage)


def _require_same(client: Any, key: str, me: int, count: int, mine: str, where: str, stage: str) -> None:
    deadline = time.monotonic() + config.agreement_timeout()
    problems = []
    for other in range(count):
        if other == me:
            continue
        left_ms = max(int((deadline - time.monotonic()) * 1000), 1)
        try:
            theirs = client.blocking_key_value_get(f"{key}/{other}", left_ms)
        except Exception:  # jax's runtime error for DEADLINE_EXCEEDED (or a coordinator gone)
            problems.append(f"process {other} did not report within {config.agreement_timeout():g} s "
                            "(it may have hung, crashed or be loading something else)")
            continue
        if theirs.startswith(_FAILED):
            problems.append(f"process {other} failed: {theirs[len(_FAILED):]}")
        elif theirs != mine:
            problems.append(f"process {other} decided {theirs!r} where process {me} decided {mine!r}")
    if problems:
        raise PeerError(f"{where}: {stage} did not succeed on every process, so process {me} stops "
                        "too:\n  " + "\n  ".join(problems))
