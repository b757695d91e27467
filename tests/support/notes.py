"""What ckptshim added to a framework's own exception: its PEP 678 notes (see ``hooks/seam.py``)."""

from __future__ import annotations

from ckptshim.hooks.seam import NOTE_PREFIX


def diagnosis(error: BaseException) -> str:
    """ckptshim's notes on ``error``, without their prefix, one per line ('' if it added none)."""
    return "\n".join(note[len(NOTE_PREFIX):] for note in getattr(error, "__notes__", ())
                     if note.startswith(NOTE_PREFIX))
