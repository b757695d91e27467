"""Aliases: two spellings of one name, so either side of a load may use either.

An alias is symmetric -- ``Alias(("embed_out",), ("lm_head",))`` lets a checkpoint that says
``embed_out.weight`` load into a model that says ``lm_head.weight`` and the other way round --
so it is its own inverse. Both spellings are rewritten to ``canonical`` before matching; a model
that uses both spellings at once is ambiguous and the planner says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ckptshim.inventory import KeyPath


@dataclass(frozen=True, slots=True)
class Alias:
    canonical: KeyPath
    other: KeyPath
    where: Literal["prefix", "suffix", "anywhere"] = "anywhere"

    def rewrite(self, key: KeyPath) -> KeyPath:
        """``key`` with ``other`` replaced by ``canonical`` at the allowed places."""
        n = len(self.other)
        if self.where == "prefix":
            return self.canonical + key[n:] if key[:n] == self.other else key
        if self.where == "suffix":
            return key[:-n] + self.canonical if n and key[-n:] == self.other else key
        if not n or self.other[0] not in key:
            return key
        out: list[str] = []
        i = 0
        while i < len(key):
            if key[i:i + n] == self.other:
                out.extend(self.canonical)
                i += n
            else:
                out.append(key[i])
                i += 1
        return tuple(out)
