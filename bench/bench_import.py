"""Cost of ``import ckptshim``: ``python bench/bench_import.py [-n 20]``.

Runs ``python -X importtime -c "import ckptshim"`` in a fresh subprocess ``n`` times, reads the
cumulative microseconds Python reports for the ``ckptshim`` package, and prints the median
against the 10 ms budget. Also checks, in one more fresh process, that neither torch nor jax
(nor numpy or wrapt) was imported. Exit status 1 when over budget or when a framework leaked in.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET_US = 10_000
MUST_NOT_IMPORT = ("torch", "jax", "numpy", "wrapt")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSHIM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def import_time_us() -> int:
    """Cumulative microseconds of ``import ckptshim`` in one fresh interpreter."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", "import ckptshim"],
                            capture_output=True, text=True, cwd=REPO, env=_env(), check=True)
    # stderr lines: "import time: self [us] | cumulative | imported package"
    for line in result.stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        parts = [part.strip() for part in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[2] == "ckptshim":
            return int(parts[1])
    raise RuntimeError("no `ckptshim` line in -X importtime output:\n" + result.stderr[-2000:])


def leaked_modules() -> list[str]:
    code = ("import sys, ckptshim; "
            f"print(' '.join(m for m in {MUST_NOT_IMPORT!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, env=_env(), check=True)
    return result.stdout.split()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20, help="fresh interpreters to time")
    args = parser.parse_args()

    import_time_us()  # warm the file system cache and .pyc files; not counted
    samples = sorted(import_time_us() for _ in range(args.n))
    median = statistics.median(samples)
    leaked = leaked_modules()

    print(f"import ckptshim: median {median / 1000:.2f} ms cumulative over {args.n} runs "
          f"(min {samples[0] / 1000:.2f}, max {samples[-1] / 1000:.2f}); "
          f"budget {BUDGET_US / 1000:.0f} ms: {'ok' if median <= BUDGET_US else 'OVER BUDGET'}")
    print("imported by `import ckptshim`: "
          + (", ".join(leaked) + "  <- must not be" if leaked else
             f"none of {', '.join(MUST_NOT_IMPORT)}: ok"))
    return 0 if median <= BUDGET_US and not leaked else 1


if __name__ == "__main__":
    sys.exit(main())
