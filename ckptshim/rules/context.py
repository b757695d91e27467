"""What a load is, for choosing its rules: one :class:`LoadContext`, and the :class:`Profile`
protocol each model family and each call's conventions implement.

A loading module builds the context once per load -- the checkpoint's inventory and the model
config it carries (read once, when the checkpoint was opened), the target's inventory and what
the live target knows (:class:`~ckptshim.rules.TargetFacts`), and the kind of call -- and hands
it to :func:`ckptshim.rules.profiles.rules_for`, which folds every profile that applies over the
defaults. Nothing patches the rules afterwards: a policy of a model family is its profile's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ckptshim.inventory import Inventory
from ckptshim.rules import NO_FACTS, TargetFacts

if TYPE_CHECKING:
    from ckptshim.rules.decoder import Naming

#: The kinds of call ckptshim plans for: torch loads that check the values they drop
#: (``load_state_dict``, ``set_model_state_dict``, a DeepSpeed stage, a plan between files),
#: ``dcp.load`` (which reads only what the state dict asks for, and checks nothing while it
#: plans), and JAX restores into pytrees.
CALLS = ("torch", "dcp", "jax")


@dataclass(frozen=True, eq=False)  # holds the model config dict
class LoadContext:
    """One load, as the rules see it.

    - ``source``: the checkpoint's inventory (an opened checkpoint's, or a state dict's);
    - ``target``: what the caller wants filled;
    - ``call``: the kind of call (:data:`CALLS`);
    - ``facts``: what the live target knows beyond its inventory;
    - ``model_config``: the checkpoint's own model description (a Hugging Face ``config.json``,
      beside the weights or, for a plan between files, beside the ``--like`` side), read once
      when the checkpoint was opened; ``None`` when there is none;
    - ``producer``: who wrote the checkpoint, where its own metadata says so (Megatron-Core's
      ``metadata.json``: :data:`~ckptshim.rules.profiles.megatron_core.PRODUCER`), else ``None``;
      a profile keyed on it never fires on key names alone;
    - ``target_config``: the target's own model description where it has one (the ``--like``
      folder's ``config.json``, a transformers model's config), so that two sides' head counts
      are checked against each other; ``None`` when there is none;
    - ``names``: the checkpoint's and the target's producer names on the decoder hub
      (:class:`~ckptshim.rules.decoder.Naming`), where the loading layer read them off more than
      the inventories here hold: a GPT-NeoX pipeline stage plans only its own layers of both
      sides, and layer 0, by which the hub recognises names, may be another stage's.
    """

    source: Inventory
    target: Inventory
    call: str
    facts: TargetFacts = NO_FACTS
    model_config: Mapping[str, Any] | None = None
    producer: str | None = None
    target_config: Mapping[str, Any] | None = None
    names: tuple[Naming, Naming] | None = None

    def __post_init__(self) -> None:
        if self.call not in CALLS:
            raise ValueError(f"no rules for a {self.call!r} call; choose one of {', '.join(CALLS)}")

    @property
    def backend(self) -> str:
        """Whose key conventions the two sides follow: ``"torch"`` (``.`` keys) or ``"jax"`` (``/``)."""
        return "jax" if self.call == "jax" else "torch"


class Profile(Protocol):
    """A named body of knowledge about one convention or model family.

    ``applies`` looks at the context only (key marks, the call, the model config), cheaply: it runs
    on every load. ``rules`` gives what the profile adds, as :meth:`~ckptshim.rules.Rules.extend`
    keyword arguments (collections are extended, scalars set), folded over the defaults in the
    order of :data:`ckptshim.rules.profiles.PROFILES`.
    """

    name: str

    def applies(self, context: LoadContext) -> bool: ...

    def rules(self, context: LoadContext) -> Mapping[str, Any]: ...


@dataclass(frozen=True, eq=False)
class MarkedProfile:
    """A profile that adds the same rules to every load of one ``backend`` whose two inventories
    carry its ``marks`` (a family's key names on either side)."""

    name: str
    backend: str
    marks: Callable[[Inventory, Inventory], bool]
    adds: Mapping[str, Any]

    def applies(self, context: LoadContext) -> bool:
        return context.backend == self.backend and self.marks(context.source, context.target)

    def rules(self, context: LoadContext) -> Mapping[str, Any]:
        return self.adds
