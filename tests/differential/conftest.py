"""The differential suite's set-up, and its count.

``pytest -q tests`` ends with ``N loads compared, N identical or refused cleanly`` (every load the
suite compared, and how many kept ckptshim's promises; see ``compare_loads``), followed by how
many fell under each verdict.
"""

from __future__ import annotations

from compare_loads import TALLY


def pytest_terminal_summary(terminalreporter) -> None:
    if not TALLY["compared"]:
        return
    terminalreporter.write_line(f"{TALLY['compared']} loads compared, {TALLY['clean']} identical or refused cleanly")
    verdicts = {k: v for k, v in TALLY.items() if k not in ("compared", "clean")}
    terminalreporter.write_line("  " + "; ".join(f"{count} {verdict}" for verdict, count in sorted(verdicts.items())))
