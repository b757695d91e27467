"""Multi-process JAX on localhost: launching N processes of a script under real
``jax.distributed`` (2 forced CPU devices each, gloo CPU collectives), and joining from inside one.

Used by ``tests/test_jax_multiprocess.py`` (its worker, ``tests/workers/jax_multiprocess_worker.py``)
and by ``bench/bench_multiprocess.py``. A launched script is started as ``script <process id>
<process count> <coordinator port> <args...>`` and calls :func:`join` first.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from support.processes import environment

#: Devices each process forces on its CPU backend.
DEVICES_PER_PROCESS = 2


@dataclass(frozen=True)
class Launch:
    """How the processes ended: their exit codes and output (stdout and stderr together), and
    whether they had to be killed for running past the timeout."""

    returncodes: list[int]
    logs: list[str]
    hung: bool
    seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, count: int, args: Sequence[str] = (), timeout: float = 600,
           extra_env: Mapping[str, str] = {}) -> Launch:
    """Run ``count`` processes of ``script`` together; every one is killed if they are not all
    done within ``timeout`` seconds. ``CKPTSHIM_*`` settings of this process are not passed on
    (a test's own ``CKPTSHIM_LOG`` must not change what the processes print), ``extra_env`` is."""
    env = environment({"XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
                       "JAX_PLATFORMS": "cpu"})
    env = {k: v for k, v in env.items() if not k.startswith("CKPTSHIM_")} | dict(extra_env)
    port = free_port()
    start = time.monotonic()
    processes = [subprocess.Popen([sys.executable, script, str(i), str(count), str(port), *args],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(count)]
    logs, hung = [], False
    for process in processes:
        try:
            logs.append(process.communicate(timeout=max(timeout - (time.monotonic() - start), 1))[0])
        except subprocess.TimeoutExpired:
            hung = True
            for other in processes:
                other.kill()
            logs = [p.communicate()[0] for p in processes]
            break
    return Launch([p.returncode for p in processes], logs, hung, time.monotonic() - start)


def join() -> tuple[int, int, list[str]]:
    """In a launched process: join the others (``jax.distributed.initialize`` with the
    coordinator on localhost, gloo collectives); this process's id, the count, the other args."""
    import jax

    process, count, port = (int(arg) for arg in sys.argv[1:4])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=process)
    return process, count, sys.argv[4:]
