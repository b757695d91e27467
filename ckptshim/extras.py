"""The optional frameworks, and the extra that installs each.

ckptshim itself needs only numpy, msgpack, wrapt and tqdm; reading some formats and writing
others needs a framework (tensorstore for Orbax, T5X and PaxML arrays, torch to write DCP,
Orbax to write Orbax). Where one is missing, the user is told which extra to install
(``pip install 'ckptshim[torch]'``) instead of meeting a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

from importlib.util import find_spec

from ckptshim.errors import ShimError

#: Top-level module -> (the distribution that provides it, the ckptshim extra that installs it).
PROVIDERS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "torch"),
    "jax": ("jax", "jax"),
    "jaxlib": ("jaxlib", "jax"),
    "ml_dtypes": ("ml_dtypes", "jax"),
    "flax": ("flax", "jax"),
    "orbax": ("orbax-checkpoint", "jax"),
    "tensorstore": ("tensorstore", "jax"),
    "safetensors": ("safetensors", "hf"),
    "transformers": ("transformers", "hf"),
    "deepspeed": ("deepspeed", "deepspeed"),
}


class MissingExtraError(ShimError, ModuleNotFoundError):
    """What was asked needs a framework that is not installed; the message names the extra.

    Also a ``ModuleNotFoundError`` (with ``name`` set), so code that already guards an optional
    import keeps working."""


def missing(error: ModuleNotFoundError, needed_for: str) -> MissingExtraError | None:
    """``error`` (a failed import) as a :class:`MissingExtraError` saying that ``needed_for``
    needs the module and which extra installs it; ``None`` for a module no extra provides."""
    module = error.name or ""
    return _refusal(module, needed_for) if module.partition(".")[0] in PROVIDERS else None


def require(modules: tuple[str, ...], needed_for: str) -> None:
    """Raise a :class:`MissingExtraError` for the first of ``modules`` (each provided by an
    extra) that cannot be imported; looked up without importing it."""
    for module in modules:
        try:
            found = find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            raise _refusal(module, needed_for)


def _refusal(module: str, needed_for: str) -> MissingExtraError:
    distribution, extra = PROVIDERS[module.partition(".")[0]]
    refusal = MissingExtraError(f"{needed_for} needs {distribution}, which is not installed here "
                                f"(no module named {module!r}); install it with: "
                                f"pip install 'ckptshim[{extra}]'")
    refusal.name = module
    return refusal
