"""What a load's destination is, described once before planning and handed to the planner and
the executors: a JAX target tree and its leaves (:mod:`.jax_tree`), the plain tensors behind
wrappers and subclasses (:mod:`.tensors`), and which of the target's buffers derive how, checked on
real values (:mod:`.derived`). Nothing here writes a destination."""
