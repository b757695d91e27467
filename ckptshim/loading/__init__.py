"""The loading layer: what the caller passed, plus the checkpoint, into a prepared, checked load.

Between the hooks (which only read their caller's arguments) and the executors (which only
write what a plan says), one module per backend decides: which format reads the checkpoint,
what the target is (a module's tensors, a state dict, a pytree), which rules apply
(:func:`ckptshim.rules.profiles.rules_for`), the plan, and every check that must pass before a
byte is written. Hooks, the API and the CLI share these paths.
"""
