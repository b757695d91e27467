"""Whether a checkpoint holds every byte its metadata needs, per writer, and what a gap costs.

Every format lists the files its metadata refers to (:class:`~ckptshim.formats.base.FileInfo`):
the size each has, the bytes the metadata needs of it, who wrote it -- an OCDBT process folder,
a DCP rank, an array's own zarr folder -- and what it holds. Summed per writer, that answers
"is this 449 GB copy the whole 1.8 TB checkpoint?" from metadata alone; and for each file that
is missing, not a regular file, or too short, the report names the arrays (or the blocks of
them) it costs, so one can tell a lost optimizer moment from a lost embedding.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ckptshim.formats.base import FileInfo, Piece
from ckptshim.inventory import size_text

#: The file of a checkpoint with no more specific writer.
CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class Gap:
    """One file the metadata needs and cannot have: why, and the pieces of arrays it holds."""

    file: str
    problem: str
    costs: tuple[Piece, ...]

    def lost(self, shown: int = 6) -> str:
        """``"3 arrays: params/w [0:4, 0:16], [4:8, 0:16]; params/b; ..."``, the first ``shown``."""
        parts: dict[str, list[str]] = {}
        for piece in self.costs:
            parts.setdefault(piece.key, []).append(piece.part)
        if not parts:
            return "what it holds is not recorded"
        described = [key + (" " + ", ".join(p for p in found if p) if any(found) else "")
                     for key, found in list(parts.items())[:shown]]
        more = f"; and {len(parts) - shown} more" if len(parts) > shown else ""
        return f"{len(parts)} array(s): " + "; ".join(described) + more


@dataclass(frozen=True)
class WriterTotals:
    """What one writer's files hold against what the metadata needs of them."""

    writer: str
    files: int
    files_missing: int
    bytes_needed: int
    bytes_present: int
    gaps: tuple[Gap, ...]

    def line(self) -> str:
        missing = f", {self.files_missing} missing" if self.files_missing else ""
        return (f"{self.writer}: {self.files} file(s){missing}, {size_text(self.bytes_present)} of "
                f"{size_text(self.bytes_needed)} present")


def by_writer(files: Iterable[FileInfo]) -> list[WriterTotals]:
    """Per writer (in order of first appearance), its files' totals and gaps."""
    groups: dict[str, list[FileInfo]] = {}
    for info in files:
        groups.setdefault(info.writer or CHECKPOINT, []).append(info)
    return [WriterTotals(writer, len(found), sum(f.size is None or f.kind != "file" for f in found),
                         sum(f.bytes_needed for f in found), sum(f.bytes_present for f in found),
                         tuple(Gap(f.path, f.problem, _lost(f)) for f in found if f.problem is not None))
            for writer, found in groups.items()]


def _lost(info: FileInfo) -> tuple[Piece, ...]:
    """The pieces a file with a problem cannot give: all of them, or for a short file those
    that run past its end (or whose place in it is not recorded)."""
    if info.size is None or info.kind != "file":
        return info.pieces
    return tuple(p for p in info.pieces if p.offset is None or p.offset + (p.length or 0) > info.size)


def as_json(totals: list[WriterTotals]) -> list[dict]:
    """The report as ``ckptshim inspect --json`` carries it."""
    return [{"writer": t.writer, "files": t.files, "files_missing": t.files_missing,
             "bytes_needed": t.bytes_needed, "bytes_present": t.bytes_present,
             "gaps": [{"file": gap.file, "problem": gap.problem, "lost": gap.lost(),
                       "costs": [str(piece) for piece in gap.costs]} for gap in t.gaps]}
            for t in totals]


def lines(totals: list[WriterTotals], shown_writers: int = 64) -> list[str]:
    """The report as ``ckptshim inspect`` prints it: the totals, each writer's (all of them up to
    ``shown_writers``, beyond that those with gaps), then each gap with what it costs."""
    needed, present = sum(t.bytes_needed for t in totals), sum(t.bytes_present for t in totals)
    files, missing = sum(t.files for t in totals), sum(t.files_missing for t in totals)
    out = [f"{files:,} file(s) from {len(totals):,} writer(s){f', {missing:,} missing' if missing else ''}: "
           f"{size_text(present)} of the {size_text(needed)} the metadata needs are present"]
    out += [f"  {t.line()}" for t in totals if len(totals) <= shown_writers or t.gaps]
    out += [f"  {gap.problem}; costs {gap.lost()}" for t in totals for gap in t.gaps]
    return out
