"""The ``ckptshim`` command: inspect, plan, convert checkpoints; run legacy scripts; doctor.

Exit codes: 0 ok, 1 a problem was found (incomplete, unreadable or non-matching checkpoint),
2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys

from ckptshim.errors import ShimError
from ckptshim.inventory import size_text

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


#: ``inspect`` lists a checkpoint's files one by one up to this many; beyond, per writer only.
LISTED_FILES = 64
#: The widest key column ``inspect`` pads to; a longer key gets a line of its own (padding every
#: line to the longest key would print one 20 MB key's width 20,000 times).
KEY_COLUMN = 80


def _inspect(args: argparse.Namespace) -> int:
    from ckptshim.api import inspect
    from ckptshim.formats import completeness

    checkpoint = inspect(args.path)
    if args.json:
        from ckptshim.api import describe

        info = describe(checkpoint)
        print(json.dumps(info, indent=1))
        return EXIT_OK if info["complete"] else EXIT_PROBLEM
    inventory = checkpoint.inventory
    print(f"{checkpoint.path}: {checkpoint.format} (version {checkpoint.version}), "
          f"{len(inventory)} arrays, {size_text(inventory.total_bytes)}")
    sep = checkpoint.key_sep
    width = min(max((len(sep.join(e.key)) for e in inventory.values()), default=0), KEY_COLUMN)
    for e in inventory.values():
        name = sep.join(e.key)
        if len(name) > width:  # folded: the key alone, its columns under the column's width
            print(f"  {name}")
            name = ""
        print(f"  {name:<{width}}  {e.dtype:<9} {str(tuple(e.shape)):<18} {size_text(e.nbytes)}")
    if len(checkpoint.files) <= LISTED_FILES:
        for f in checkpoint.files:
            print(f"  file {f.path}: {'missing' if f.size is None else size_text(f.size)}")
            for line in f.contents:
                print(f"    {line}")
    if checkpoint.files:
        for line in completeness.lines(completeness.by_writer(checkpoint.files)):
            print(f"  {line}")
    print("complete" if checkpoint.complete else "INCOMPLETE:\n  " + "\n  ".join(checkpoint.all_problems()))
    return EXIT_OK if checkpoint.complete else EXIT_PROBLEM


def _plan(args: argparse.Namespace) -> int:
    from ckptshim.api import plan
    from ckptshim.planner import explain, summary

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


def _convert(args: argparse.Namespace) -> int:
    from ckptshim.api import convert

    written = convert(args.source, args.destination, to=args.to, like=args.like, force=args.force,
                      progress=False if args.no_progress else None)
    print(f"wrote {written}")
    return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    import os

    from ckptshim import launcher

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    if not command:
        print("ckptshim run: give the command to run after `--`, e.g. "
              "`ckptshim run -- torchrun --nproc_per_node=2 train.py`", file=sys.stderr)
        return EXIT_USAGE
    disabled = [n.strip() for n in (args.disable_hooks or "").split(",") if n.strip()]
    from ckptshim.hooks.registry import HOOKS

    unknown = sorted(set(disabled) - {spec.name for spec in HOOKS})
    if unknown:
        print(f"ckptshim run: no hook named {', '.join(unknown)}; hooks are "
              f"{', '.join(spec.name for spec in HOOKS)}", file=sys.stderr)
        return EXIT_USAGE
    env = launcher.child_environment(os.environ, disable_hooks=disabled, strict=args.strict, log=args.log)
    try:
        return launcher.run(command, env)
    except launcher.LaunchError as error:
        print(f"ckptshim run: {error}", file=sys.stderr)
        return EXIT_USAGE


def _doctor(args: argparse.Namespace) -> int:
    from ckptshim import doctor

    info = doctor.report()
    if args.json:
        print(json.dumps(info, indent=1))
        return EXIT_OK
    print(f"Python {info['python']} ({info['executable']})")
    print("frameworks:")
    for name, version in info["versions"].items():
        print(f"  {name:<17} {version or '-'}")
    print("hooks:")
    for hook in info["hooks"]:
        print(f"  {hook['name']:<10} {hook['status']:<8} {hook['distribution']} {hook['supported']}: {hook['why']}")
    print("environment:", ", ".join(f"{k}={v}" for k, v in info["environment"].items()) or "no CKPTSHIM_* variables set")
    pth = info["venv_pth"]
    print(f"venv .pth: {pth['path']} ({'present' if pth['present'] else 'absent'})")
    return EXIT_OK


def _enable_venv(args: argparse.Namespace) -> int:
    from ckptshim import venv

    print(f"wrote {venv.enable(args.site_packages, force=args.force)}: every Python of this "
          "environment now imports ckptshim (undo with `ckptshim disable-venv`)")
    return EXIT_OK


def _disable_venv(args: argparse.Namespace) -> int:
    from ckptshim import venv

    removed = venv.disable(args.site_packages)
    print(f"removed {removed}" if removed else "nothing to remove: no ckptshim.pth here")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptshim", description=__doc__.splitlines()[0].replace("``", ""),
                                     epilog="exit codes: 0 ok, 1 a problem was found, 2 a usage error "
                                            "(run: the command's own). Docs: docs/cli.md")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="describe a checkpoint from its metadata")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="one JSON object on stdout")
    inspect.set_defaults(run=_inspect)
    plan = commands.add_parser("plan", help="dry run: how SOURCE would load into the layout of --like")
    plan.add_argument("source")
    plan.add_argument("--like", required=True,
                      help="a checkpoint whose layout is the target, or module:function returning "
                           "a model, a state dict or an abstract tree")
    plan.add_argument("--json", action="store_true")
    plan.add_argument("--sep", default=".", choices=[".", "/"], help="key separator to print")
    plan.set_defaults(run=_plan)
    convert = commands.add_parser("convert", help="write SOURCE in another format (atomically)")
    convert.add_argument("source")
    convert.add_argument("destination")
    convert.add_argument("--to", required=True, choices=["safetensors", "dcp", "orbax"])
    convert.add_argument("--like", help="map the arrays onto this checkpoint's layout first")
    convert.add_argument("--force", action="store_true", help="replace DESTINATION if it exists")
    convert.add_argument("--no-progress", action="store_true", help="never show a progress bar")
    convert.set_defaults(run=_convert)
    run = commands.add_parser("run", help="run a command with the hooks in every Python process it starts",
                              usage="ckptshim run [--disable-hooks NAMES] [--strict] [--log LEVEL] -- COMMAND ...")
    run.add_argument("--disable-hooks", metavar="NAMES", help="comma-separated hooks to leave off")
    run.add_argument("--strict", action="store_true", help="every guess is an error (CKPTSHIM_STRICT=1)")
    run.add_argument("--log", choices=["info", "debug"], help="print each load's summary or plan")
    run.add_argument("command_line", nargs=argparse.REMAINDER, metavar="COMMAND")
    run.set_defaults(run=_run)
    doctor = commands.add_parser("doctor", help="framework versions and what each hook does here")
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(run=_doctor)
    for name, func, text in (("enable-venv", _enable_venv, "make every Python of this venv import ckptshim"),
                             ("disable-venv", _disable_venv, "undo enable-venv")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--site-packages", metavar="DIR", help="where to write (default: this Python's)")
        if name == "enable-venv":
            sub.add_argument("--force", action="store_true", help="allow a Python outside a venv")
        sub.set_defaults(run=func)
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
