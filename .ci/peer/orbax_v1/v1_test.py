"""Orbax's own tests of its v1 API, as the installed orbax-checkpoint wheel ships them.

The wheel carries the v1 test bodies as base classes: ``CheckpointerTestBase.Test`` (``ocp.v1``'s
``training.Checkpointer``, ``save``/``load``/``load_pytree``/``load_checkpointables`` and their
async forms, metadata, custom checkpointables) and ``ManagerCompatibilityTestBase`` (v1 loading
the v0 ``CheckpointManager`` checkpoints the wheel ships). Orbax's repository binds each to its
test runner in files the wheel leaves out. This module is that binding and nothing else: every
test body is Orbax's, run by ``.ci/run`` with ckptshim imported and without it
(``../shared/peer/run_peer.py``, suite ``orbax_v1``).
"""

from orbax.checkpoint.experimental.v1._src.testing.compatibility import manager_compatibility_test_base
from orbax.checkpoint.experimental.v1._src.training import checkpointer_test_base


class CheckpointerTest(checkpointer_test_base.CheckpointerTestBase.Test):
    pass


class ManagerCompatibilityTest(manager_compatibility_test_base.ManagerCompatibilityTestBase):
    pass
