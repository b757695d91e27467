"""The ``ckptshim`` command: inspect and plan (dry run) checkpoints.

Exit codes: 0 ok, 1 a problem was found (incomplete, unreadable or non-matching checkpoint),
2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys

from ckptshim.errors import ShimError

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _inspect(args: argparse.Namespace) -> int:
    from ckptshim.api import describe, inspect

    checkpoint = inspect(args.path)
    info = describe(checkpoint)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(f"{info['path']}: {info['format']} (version {info['version']}), "
              f"{len(info['entries'])} arrays, {_size(info['total_bytes'])}")
        width = max((len(e["key"]) for e in info["entries"]), default=0)
        for e in info["entries"]:
            print(f"  {e['key']:<{width}}  {e['dtype']:<9} {str(tuple(e['shape'])):<18} {_size(e['bytes'])}")
        for f in info["files"]:
            print(f"  file {f['path']}: {'missing' if f['size'] is None else _size(f['size'])}")
            for line in f.get("contents", ()):
                print(f"    {line}")
        print("complete" if info["complete"] else "INCOMPLETE:\n  " + "\n  ".join(info["problems"]))
    return EXIT_OK if info["complete"] else EXIT_PROBLEM


def _plan(args: argparse.Namespace) -> int:
    from ckptshim.api import plan
    from ckptshim.plan import explain, summary

    result = plan(args.source, args.like)
    sep = "/" if args.sep == "/" else "."
    if args.json:
        print(json.dumps({"summary": summary(result), "complete": result.complete,
                          "lines": explain(result, sep),
                          "missing": [sep.join(k) for k in result.missing],
                          "unexpected": [sep.join(k) for k in result.unexpected],
                          "mismatched": [m.describe(sep) for m in result.mismatched]}, indent=1))
    else:
        print(summary(result))
        for line in explain(result, sep):
            print(f"  {line}")
    return EXIT_OK if result.complete else EXIT_PROBLEM


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptshim", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="describe a checkpoint from its metadata")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="one JSON object on stdout")
    inspect.set_defaults(run=_inspect)
    plan = commands.add_parser("plan", help="dry run: how SOURCE would load into the layout of --like")
    plan.add_argument("source")
    plan.add_argument("--like", required=True, help="a checkpoint whose layout is the target")
    plan.add_argument("--json", action="store_true")
    plan.add_argument("--sep", default=".", choices=[".", "/"], help="key separator to print")
    plan.set_defaults(run=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on usage errors and 0 on --help
        return int(exit_.code or 0)
    try:
        return args.run(args)
    except ShimError as error:
        print(f"ckptshim: {error}", file=sys.stderr)
        return EXIT_PROBLEM
    except BrokenPipeError:  # `ckptshim inspect ... | head`: the reader left, which is fine
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
