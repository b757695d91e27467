"""The hub's profile: a load between two producers' names of one decoder-only transformer.

Each producer is one :class:`~ckptshim.rules.decoder.Naming` (Hugging Face's here, the others in
their own modules: torchtitan's, Meta's original layout's, Megatron-Core's GPTModel's, torchtune's,
litgpt's, MaxText's, GPT-NeoX's and Hugging Face's GPT-NeoX); a load
from one into another is :func:`~ckptshim.rules.decoder.pair`'s composition through the
canonical model. The profile fires only where the key sets prove it: the checkpoint holds one
producer's names (Megatron-Core's stacked arrays only where its ``metadata.json`` says it wrote
them) and the target another's, or the loading layer read both off more than the load plans
(a GPT-NeoX pipeline stage: :attr:`~ckptshim.rules.context.LoadContext.names`). The head counts come from the checkpoint's own model description
(``config.json``, ``params.json``, Megatron's run config) and, where the target has one, from the
target's; two that disagree are refused, naming both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptshim.inventory import Inventory, KeyPath
from ckptshim.rules import Paired, Rules
from ckptshim.rules.context import LoadContext
from ckptshim.rules.decoder import HUGGING_FACE, Dims, Naming, agreeing, pair, read_dims
from ckptshim.rules.roots import root_prefix
from ckptshim.rules.profiles import litgpt, maxtext, megatron_core, meta_llama, neox, torchtitan, torchtune

#: Every producer's names, in the order a side is recognised.
NAMINGS: tuple[Naming, ...] = (HUGGING_FACE, torchtitan.NAMES, meta_llama.NAMES, megatron_core.NAMES, torchtune.NAMES,
                                litgpt.NAMES, litgpt.LEGACY, maxtext.NAMES, *neox.NAMINGS)


def side(inventory: Inventory, stacked: bool = False, root: KeyPath = ()) -> Naming | None:
    """The one producer whose names ``inventory`` holds (layer 0's first row, below ``root``),
    ``None`` for none or several."""
    found = [naming for naming in NAMINGS if naming.marks(inventory, root)
             or stacked and naming.stacked and naming.units(inventory, True)]
    return found[0] if len(found) == 1 else None


def sides(context: LoadContext) -> tuple[Naming, Naming] | None:
    """The checkpoint's producer and the target's, where they are two (else ``None``). The
    checkpoint's names may be below a root prefix the target lacks (litgpt's ``{"model": ...}``,
    a Lightning module's attribute): the planner sets it aside (:mod:`ckptshim.rules.roots`) and
    plans the re-keyed checkpoint with these rules."""
    megatron = context.producer == megatron_core.PRODUCER
    jax = context.backend == "jax"
    if context.backend != "torch" and not megatron and not jax:
        return None
    if context.names is not None:
        return context.names
    target = side(context.target)
    if target is None:
        return None
    source = side(context.source, megatron) or _below_root(context.source, context.target)
    if source is None or source is target or jax and maxtext.NAMES not in (source, target):
        return None
    return source, target


def _below_root(source: Inventory, target: Inventory) -> Naming | None:
    """The producer whose names ``source`` holds below a root prefix ``target`` lacks (looked for
    only once the target's names are known and the checkpoint's are not at its top)."""
    root = root_prefix(source, target)
    return side(source, root=root.prefix) if root is not None and root.side == "checkpoint" else None


@dataclass(frozen=True, eq=False)  # holds the model configs
class DecoderLayout:
    """The :class:`~ckptshim.rules.Layout` of one load between two producers' names."""

    source_names: Naming
    target_names: Naming
    config: Mapping[str, Any] | None
    target_config: Mapping[str, Any] | None
    stacked: bool

    def pair(self, source: Inventory, target: Inventory, rules: Rules) -> Paired:
        names = torchtitan.variants(self.source_names, self.target_names, source, target, self.config)
        names = torchtune.variants(*names, self.config, self.target_config, source)
        names = maxtext.variants(*names, source, target, self.config or self.target_config)
        names = neox.variants(*names, source, target)
        return pair(*names, source, target, self._dims, self.stacked, rules.strict)

    def _dims(self) -> Dims | str:
        dims = agreeing(read_dims(self.config), read_dims(self.target_config))
        if dims is not None:
            return dims
        return torchtitan.NO_CONFIG if torchtitan.NAMES in (self.source_names, self.target_names) else (
            "{target} is laid out from {source} per head, and the head counts come from the checkpoint's own "
            "model description (config.json, params.json, Megatron's run_config.yaml or litgpt's model_config.yaml), which this load has "
            "none of; keep it beside the checkpoint")


@dataclass(frozen=True)
class DecoderProfile:
    """A decoder from one producer's names into another's, through the canonical model."""

    name: str = "decoder hub"

    def applies(self, context: LoadContext) -> bool:
        return sides(context) is not None

    def rules(self, context: LoadContext) -> Mapping[str, Any]:
        source, target = sides(context)
        return {"layouts": (DecoderLayout(source, target, context.model_config, context.target_config,
                                          context.producer == megatron_core.PRODUCER),)}


PROFILE = DecoderProfile()
