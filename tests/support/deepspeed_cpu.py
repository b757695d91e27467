"""DeepSpeed's process group on CPU, as the tests need it: gloo, and nothing compiled.

On the CPU accelerator, ``deepspeed.init_distributed`` JIT-compiles DeepSpeed's shared-memory
allreduce (``deepspeed_shm_comm``) before it sets up the group: 90 to 340 seconds of g++ on two
cores, serialised across processes by a lock file that a killed build leaves behind (every later
``init_distributed`` then waits on it forever). The tests exchange checkpoints, not gradients, so
they take the path DeepSpeed itself takes where that op is not compatible: plain gloo.
"""

from __future__ import annotations

SHARED_MEMORY_OP = "deepspeed_shm_comm"


def init_distributed_on_gloo(**options) -> None:
    """``deepspeed.init_distributed(dist_backend="gloo")`` with the shared-memory op marked
    incompatible, as DeepSpeed marks it off Linux (``deepspeed.comm.torch.build_shm_op``)."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHARED_MEMORY_OP] = False
    deepspeed.init_distributed(dist_backend="gloo", **options)
