"""Fail CI on any test of the peer suites that passes without ckptshim and fails with it, except
those .ci/peer_expected.txt lists (loads ckptshim makes possible, each with its reason).

``python .ci/peer_check.py SUMMARY_JSON`` reads the summary ``../shared/peer/run_peer.py --out``
wrote. An expected difference that no longer occurs is reported too, so the list stays true.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EXPECTED = Path(__file__).with_name("peer_expected.txt")


def expected() -> set[tuple[str, str]]:
    rows = (line.split(maxsplit=2) for line in EXPECTED.read_text().splitlines()
            if line.strip() and not line.startswith("#"))
    return {(row[0], row[1]) for row in rows}


def main(summary_path: str) -> int:
    summary = json.loads(Path(summary_path).read_text())
    allowed = expected()
    worse = {(suite, diff["test"]) for suite, entry in summary.items() for diff in entry.get("diffs", ())
             if diff["off"] == "passed" and diff["on"] != "passed"}
    missing = sorted(suite for suite, entry in summary.items() if "diffs" not in entry)
    for suite, test in sorted(worse - allowed):
        print(f"peer: {suite} {test} passes without ckptshim and fails with it", file=sys.stderr)
    for suite, test in sorted(allowed - worse):
        if "diffs" in summary.get(suite, {}):
            print(f"peer: {suite} {test} is listed in {EXPECTED.name} but no longer differs; remove it")
    for suite in missing:
        print(f"peer: the {suite} suite did not run both ways", file=sys.stderr)
    print(f"peer: {len(worse & allowed)} expected difference(s), {len(worse - allowed)} unexpected")
    return 1 if worse - allowed or missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
