"""What a training checkpoint keeps beside the model's weights: an optimizer's state.

Training loops save ``{"model": model.state_dict(), "optimizer": optimizer.state_dict(), ...}``
in one file (``litgpt pretrain`` through Lightning Fabric, nanoGPT's ``ckpt.pt``). An
``Optimizer.state_dict()`` holds, per parameter index, the values the optimizer keeps
(``state.<index>.exp_avg``) -- and its ``param_groups``, no arrays. Such an entry is recognised
by what it holds, never by its name, and is never weights.
"""

from __future__ import annotations

from ckptshim.inventory import Inventory, KeyPath

#: What ``torch.optim`` optimizers keep per parameter (``state_dict()["state"][i]``): Adam(W)'s
#: moments, SGD's momentum, Adagrad's sums, RMSprop's averages, Adadelta's, and every one's step.
OPTIMIZER_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum",
                             "square_avg", "grad_avg", "acc_delta", "ax", "eta", "mu", "prev",
                             "step_size", "mu_product", "step"})


def optimizer_state_key(key: KeyPath) -> bool:
    """Whether ``key`` is a value an optimizer keeps for a parameter: ``state.<param>.<name>``
    (at any depth, as ``{"optimizer": optimizer.state_dict()}`` is saved) with ``<name>`` one
    of :data:`OPTIMIZER_STATE`."""
    return len(key) >= 3 and key[-1] in OPTIMIZER_STATE and "state" in key[:-2]


def optimizer_entries(source: Inventory, target_heads: set[str]) -> frozenset[str]:
    """The checkpoint's top-level entries that are an optimizer's ``state_dict()`` -- every array
    under one is ``<entry>.state.<index>.<name>`` (:data:`OPTIMIZER_STATE`) -- and that the target
    has no entry of (``target_heads``: its keys' first components). One pass over the keys."""
    seen: dict[str, bool] = {}
    for key in source:
        if key[0] in target_heads:
            continue
        seen[key[0]] = seen.get(key[0], True) and len(key) == 4 and key[1] == "state" and key[2].isdigit() \
            and optimizer_state_key(key[1:])
    return frozenset(head for head, optimizer in seen.items() if optimizer)
