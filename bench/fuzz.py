"""Long fuzzing runs of every byte parser (``make fuzz``): the harnesses of tests/fuzz, for minutes.

    python bench/fuzz.py [--seconds 300] [--engine atheris|hypothesis] [NAME ...]

Each harness (default: all) runs in its own process for ``--seconds``. The byte harnesses
(``tests/fuzz/harnesses.py``) start from a real fixture as the seed: with atheris installed
(``make fuzz`` installs it), libFuzzer mutates the seed, guided by coverage of ckptshim's own
modules; a crash -- any exception other than ``ShimError``, a hang past ``--timeout`` seconds,
or memory past ``--rss-mb`` -- stops that harness and leaves the input in ``--out`` as
``<name>-crash-*`` (replay it with ``python bench/fuzz.py --replay FILE NAME``). Without atheris
they run under hypothesis, unseeded, with as many examples as fit in the time; its report names
the failing input. The structure-aware harnesses (``tests/fuzz/structured.py``: pickle opcode
programs, msgpack and JSON trees, compressor frames) always run under hypothesis, each example
within its harness's own time and memory limits, and the whole run under ``--rss-mb`` (a
watchdog ends a child whose resident memory passes it). The exit status is 1 when any harness
crashed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "fuzz"), str(ROOT / "tests")]  # the harnesses, and their support


def _atheris_available() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def run_atheris(name: str, seconds: int, out: Path, timeout: int, rss_mb: int) -> None:
    """Fuzz one harness in this process with libFuzzer; returns only if nothing crashed."""
    import atheris

    with atheris.instrument_imports(include=["ckptshim"]):
        import harnesses

    target = harnesses.Target(harnesses.BY_NAME[name], Path(tempfile.mkdtemp(prefix=f"fuzz-{name}-")))
    corpus = Path(tempfile.mkdtemp(prefix=f"fuzz-corpus-{name}-"))
    (corpus / "seed").write_bytes(target.seed)
    out.mkdir(parents=True, exist_ok=True)
    atheris.Setup([sys.argv[0], str(corpus), f"-max_total_time={seconds}", f"-timeout={timeout}",
                   f"-rss_limit_mb={rss_mb}", f"-max_len={max(4096, 2 * len(target.seed))}",
                   f"-artifact_prefix={out}/{name}-", "-print_final_stats=1"], target)
    atheris.Fuzz()


def run_hypothesis(name: str, seconds: int) -> None:
    """Fuzz one harness with hypothesis for about ``seconds``, in batches of 200 random examples."""
    from hypothesis import HealthCheck, given, settings

    import harnesses
    import structured

    workdir = Path(tempfile.mkdtemp(prefix=f"fuzz-{name}-"))
    if name in structured.BY_NAME:
        harness = structured.BY_NAME[name]
        target, inputs = harness.target(workdir), harness.inputs()
        sample = [inputs.example() for _ in range(5)]
        feed = structured.call
    else:
        byte_target = harnesses.Target(harnesses.BY_NAME[name], workdir)
        target, inputs, sample = byte_target, harnesses.inputs(byte_target.seed), [byte_target.seed] * 5
        feed = _call
    for example in sample:
        feed(target, example)

    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(inputs)
    def fuzz(example) -> None:
        feed(target, example)

    start, runs = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:  # batches of fresh random examples until time is up
        fuzz()
        runs += 1
    print(f"{name}: {runs * 200} examples in {time.perf_counter() - start:.0f} s, no crash", flush=True)


def _call(target, data: bytes) -> None:
    target(data)


def _watch_memory(rss_mb: int) -> None:
    """End this process (exit status 3, saying why) when its resident memory passes ``rss_mb``."""
    import threading

    def watch() -> None:
        while True:
            with open("/proc/self/status") as status:
                rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
            if rss > rss_mb * 1024:
                print(f"memory limit: resident {rss // 1024} MB > --rss-mb {rss_mb}", flush=True)
                os._exit(3)
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()


def replay(path: Path, name: str) -> None:
    """Feed one saved input to a harness: a crash shows its traceback, a refusal passes."""
    import harnesses

    target = harnesses.Target(harnesses.BY_NAME[name], Path(tempfile.mkdtemp(prefix=f"fuzz-{name}-")))
    target(path.read_bytes())
    print(f"{name}: {path} is refused with a ShimError or loads: no crash")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="harnesses to run (default: all)")
    parser.add_argument("--seconds", type=int, default=300, help="per harness (default 300)")
    parser.add_argument("--engine", choices=("atheris", "hypothesis"),
                        default="atheris" if _atheris_available() else "hypothesis")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fuzz")
    parser.add_argument("--timeout", type=int, default=20, help="seconds one input may take")
    parser.add_argument("--rss-mb", type=int, default=4096, help="memory one run may use")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--replay", type=Path, help="run one saved input through NAME and exit")
    args = parser.parse_args()
    if args.one:  # before anything imports ckptshim: atheris instruments it as it is imported
        if args.engine == "atheris":  # the parent passes hypothesis for structured harnesses
            run_atheris(args.names[0], args.seconds, args.out, args.timeout, args.rss_mb)
        else:
            _watch_memory(args.rss_mb)
            run_hypothesis(args.names[0], args.seconds)
        return 0

    import harnesses
    import structured

    parsers = {**{h.name: h.parser for h in harnesses.HARNESSES}, **{h.name: h.parser for h in structured.HARNESSES}}
    unknown = set(args.names) - set(parsers)
    if unknown:
        parser.error(f"unknown harness(es) {sorted(unknown)}; known: {', '.join(parsers)}")
    if args.replay is not None:
        replay(args.replay, args.names[0])
        return 0

    failed = []
    for name in args.names or list(parsers):
        engine = "hypothesis" if name in structured.BY_NAME else args.engine
        print(f"== {name} ({parsers[name]}): {engine}, {args.seconds} s", flush=True)
        child = [sys.executable, __file__, "--one", name, "--seconds", str(args.seconds),
                 "--engine", engine, "--out", str(args.out), "--timeout", str(args.timeout),
                 "--rss-mb", str(args.rss_mb)]
        if subprocess.run(child, env={**os.environ, "JAX_PLATFORMS": "cpu"}).returncode != 0:
            failed.append(name)
    print(f"fuzzed {len(args.names or parsers)} harness(es) for {args.seconds} s each; "
          + (f"CRASHED: {', '.join(failed)} (inputs in {args.out})" if failed else "no crash"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
