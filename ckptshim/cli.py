"""The ``ckptshim`` command: inspect, plan, convert checkpoints; run legacy scripts; doctor.

Exit codes: 0 ok, 1 a problem was found (incomplete, unreadable or non-matching checkpoint),
2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import ckptshim

from ckptshim import extras
from ckptshim.errors import DOCS_URL, ShimError
from ckptshim.inventory import size_text
from ckptshim.keytext import group_rows, shown, shown_lines

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


#: ``inspect`` lists a checkpoint's files one by one up to this many; beyond, per writer only.
LISTED_FILES = 64
#: The widest key column ``inspect`` pads to; a longer key gets a line of its own (padding every
#: line to the longest key would print one 20 MB key's width 20,000 times).
KEY_COLUMN = 80


def _say(line: str) -> None:
    """Print one line of a report about a checkpoint, whose names may hold anything
    (:func:`~ckptshim.keytext.shown`)."""
    print(shown(line))


def _inspect(args: argparse.Namespace) -> int:
    from ckptshim.api import inspect
    from ckptshim.formats import completeness
    from ckptshim.loading.producers import model_names

    checkpoint = inspect(args.path)
    if args.json:
        from ckptshim.api import describe

        info = describe(checkpoint)
        print(json.dumps(info, indent=1))
        return EXIT_OK if info["complete"] else EXIT_PROBLEM
    inventory = checkpoint.inventory
    _say(f"{checkpoint.path}: {checkpoint.format} (version {checkpoint.version}), "
         f"{len(inventory)} arrays, {size_text(inventory.total_bytes)}")
    view = model_names(checkpoint)
    if view is not None:  # stored under other names than the model's (Megatron-Core's stacked layers)
        inventory, note = view
        _say(f"  {len(inventory)} arrays {note}:")
    sep = checkpoint.key_sep
    # per-layer keys of one dtype and shape are one row: layers.{0..63}.w, and how many arrays
    rows = group_rows((sep.join(e.key), e.dtype, str(tuple(e.shape)), size_text(e.nbytes))
                      for e in inventory.values())
    width = min(max((len(cells[0]) for cells, _ in rows), default=0), KEY_COLUMN)
    for (name, dtype, shape, size), count in rows:
        if len(name) > width:  # folded: the key alone, its columns under the column's width
            _say(f"  {name}")
            name = ""
        _say(f"  {name:<{width}}  {dtype:<9} {shape:<18} {size}" + (f" each, {count} arrays" if count > 1 else ""))
    if len(checkpoint.files) <= LISTED_FILES:
        for f in checkpoint.files:
            _say(f"  file {f.path}: {'missing' if f.size is None else size_text(f.size)}")
            for line in f.contents:
                _say(f"    {line}")
    if checkpoint.files:
        for line in completeness.lines(completeness.by_writer(checkpoint.files)):
            _say(f"  {line}")
    if checkpoint.complete:
        _say("complete")
    else:
        _say("INCOMPLETE:")
        for problem in checkpoint.all_problems():
            _say(f"  {problem}")
    return EXIT_OK if checkpoint.complete else EXIT_PROBLEM


def _plan(args: argparse.Namespace) -> int:
    from ckptshim.api import plan
    from ckptshim.planner import explain, headline, summary, table

    result = plan(args.source, args.like)
    sep = "/" if args.sep == "/" else "."
    first = headline(result, sep)
    if args.json:
        print(json.dumps({"summary": summary(result), "complete": result.complete, "headline": first,
                          "lines": explain(result, sep),
                          "missing": [sep.join(k) for k in result.missing],
                          "unexpected": [sep.join(k) for k in result.unexpected],
                          "mismatched": [m.describe(sep) for m in result.mismatched]}, indent=1))
    else:
        if first:
            _say(first)
        _say(summary(result))
        for line in table(result, sep):
            _say(f"  {line}")
        _say("plan:")
        for line in explain(result, sep):
            _say(f"  {line}")
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
    print(f"ckptshim {info['ckptshim']['version']} ({info['ckptshim']['location']})")
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


def _docs(args: argparse.Namespace) -> int:
    pages = {path.stem: path for path in sorted(DOCS_DIR.glob("*.md"))}
    if args.page is None:
        for name, path in pages.items():
            title = next((line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#")), "")
            print(f"{name:<16} {title}")
        return EXIT_OK
    page = pages.get(args.page.removesuffix(".md"))
    if page is None:
        print(f"ckptshim: no documentation page {args.page!r}; there are: {', '.join(pages)}", file=sys.stderr)
        return EXIT_PROBLEM
    print(page if args.path else page.read_text(), end="\n" if args.path else "")
    return EXIT_OK


#: Said under every command's help: where the rest is.
EPILOG = ("exit codes: 0 ok, 1 a problem was found (the message says what), 2 a usage error; "
          "`run` exits with the command's own status. Documentation: "
          + ("`ckptshim docs` lists its pages, `ckptshim docs PAGE` prints one" if DOCS_URL is None else DOCS_URL))
#: The documentation pages, shipped inside the package (``docs/*.md`` of the repository).
DOCS_DIR = Path(__file__).resolve().parent / "docs"
CHECKPOINT = ("a file or folder in any format ckptshim reads: a torch.save file, a safetensors file, "
              "a Hugging Face model folder, a torch.distributed.checkpoint (DCP) folder, an Orbax "
              "checkpoint (item, step folder or CheckpointManager root), Flax msgpack, T5X, PaxML, "
              "a DeepSpeed/GPT-NeoX pipeline folder")
LIKE = ("another checkpoint (any format SOURCE may be), or MODULE:FUNCTION: a function importable "
        "from the current folder or PYTHONPATH that takes no arguments and returns a torch "
        "nn.Module, a state dict, or a JAX tree (jax.ShapeDtypeStruct leaves, e.g. from "
        "jax.eval_shape, are enough)")


def _command(commands, name: str, summary: str, description: str, **kwargs) -> argparse.ArgumentParser:
    return commands.add_parser(name, help=summary, description=f"{summary}. {description}",
                               epilog=EPILOG, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptshim", epilog=EPILOG,
        description="Load old and foreign deep-learning checkpoints into today's PyTorch and JAX "
                    "code. `import ckptshim` in your script turns the hooks on; this command "
                    "inspects, plans and converts checkpoints, and runs unedited scripts with the "
                    "hooks. `ckptshim COMMAND --help` describes each command.")
    parser.add_argument("--version", action="version",
                        version=f"ckptshim {ckptshim.__version__} (Python {sys.version.split()[0]}, {sys.executable})",
                        help="print ckptshim's version (and the Python it runs in) and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     help="what to do (`ckptshim COMMAND --help` for its arguments):")

    inspect = _command(commands, "inspect", "describe a checkpoint from its metadata",
                       "Prints its format and version, every array (key, dtype, shape, bytes), the "
                       "files it consists of and whether it is complete. No tensor bytes are read. "
                       "Exit 1 when the checkpoint is incomplete.")
    inspect.add_argument("path", metavar="CHECKPOINT", help=f"the checkpoint: {CHECKPOINT}")
    inspect.add_argument("--json", action="store_true",
                         help="print one JSON object (path, format, version, entries, total_bytes, "
                              "files, complete, problems) instead of the table")
    inspect.set_defaults(run=_inspect)

    plan = _command(commands, "plan", "dry run: how SOURCE would load into the layout of --like",
                    "Prints what would be renamed, stacked, split, synthesized or dropped, with "
                    "layer ranges compressed; reads no tensor bytes. Exit 1 when the plan leaves "
                    "something the target needs without a value.")
    plan.add_argument("source", metavar="SOURCE", help=f"the checkpoint to load: {CHECKPOINT}")
    plan.add_argument("--like", required=True, metavar="TARGET", help=f"the layout to load into: {LIKE}")
    plan.add_argument("--json", action="store_true",
                      help="print one JSON object (summary, complete, lines, missing, unexpected, "
                           "mismatched) instead of the text")
    plan.add_argument("--sep", default=".", choices=[".", "/"],
                      help="join key components with this when printing: '.' as torch names "
                           "tensors (default), '/' as JAX tree paths")
    plan.set_defaults(run=_plan)

    convert = _command(commands, "convert", "write SOURCE in another format, atomically",
                       "The arrays are copied bit for bit (never cast), one at a time, into a "
                       "temporary folder beside DESTINATION that is renamed into place when "
                       "complete; SOURCE is only read.")
    convert.add_argument("source", metavar="SOURCE", help=f"the checkpoint to read: {CHECKPOINT}")
    convert.add_argument("destination", metavar="DESTINATION",
                         help="where to write: a folder (or, for --to safetensors, a file ending "
                              "in .safetensors); it must not exist unless --force")
    convert.add_argument("--to", required=True, choices=["safetensors", "dcp", "orbax"],
                         help="output format: safetensors (one file), dcp (written by torch's own "
                              "writer; needs torch) or orbax (written by Orbax's own handler, as "
                              "StandardCheckpointer.save does; needs jax and orbax-checkpoint)")
    convert.add_argument("--like", metavar="TARGET",
                         help=f"map the arrays onto this layout first, with the plan `plan` shows: {LIKE}")
    convert.add_argument("--force", action="store_true",
                         help="replace DESTINATION if it exists (only once the new one is complete)")
    convert.add_argument("--no-progress", action="store_true",
                         help="never show the progress bar (it is shown only when stderr is a terminal)")
    convert.set_defaults(run=_convert)

    run = _command(commands, "run", "run a command with the hooks in every Python process it starts",
                   "Puts a bootstrap sitecustomize first on PYTHONPATH so that the command and every "
                   "Python it starts (torchrun workers included) import ckptshim; the command "
                   "itself is unedited.",
                   usage="ckptshim run [--disable-hooks NAMES] [--strict] [--log {info,debug}] -- COMMAND ...")
    run.add_argument("--disable-hooks", metavar="NAMES",
                     help="comma-separated hooks to leave off (CKPTSHIM_DISABLE_HOOKS); "
                          "`ckptshim doctor` lists them")
    run.add_argument("--strict", action="store_true",
                     help="every guess is an error (CKPTSHIM_STRICT=1)")
    run.add_argument("--log", choices=["info", "debug"],
                     help="print each load's one-line summary (info) or its whole plan (debug) on "
                          "stderr (CKPTSHIM_LOG)")
    run.add_argument("command_line", nargs=argparse.REMAINDER, metavar="COMMAND",
                     help="the command to run and its arguments, after `--`, e.g. "
                          "`-- torchrun --nproc_per_node=8 train.py`")
    run.set_defaults(run=_run)

    doctor = _command(commands, "doctor", "ckptshim's and the frameworks' versions, and what each hook does here",
                      "Versions come from package metadata (nothing is imported); each hook is "
                      "ready, active, gated (version outside its range), absent, disabled or "
                      "failed, with the reason. Always exits 0.")
    doctor.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    doctor.set_defaults(run=_doctor)

    docs = _command(commands, "docs", "print a page of ckptshim's documentation",
                    "The pages ship inside the package, so this works offline and matches the "
                    "installed version. Without PAGE, lists the pages.")
    docs.add_argument("page", nargs="?", metavar="PAGE", help="the page to print, e.g. pytorch, maxtext, safety")
    docs.add_argument("--path", action="store_true", help="print the page's file path instead of its text")
    docs.set_defaults(run=_docs)

    for name, func, text, description in (
            ("enable-venv", _enable_venv, "make every Python of this virtual environment import ckptshim",
             "Writes ckptshim.pth into site-packages; Python runs its import line at every start-up."),
            ("disable-venv", _disable_venv, "undo enable-venv",
             "Removes the ckptshim.pth that enable-venv wrote (never one written by someone else).")):
        sub = _command(commands, name, text, description)
        sub.add_argument("--site-packages", metavar="DIR",
                         help="the site-packages folder to write in (default: this Python's)")
        if name == "enable-venv":
            sub.add_argument("--force", action="store_true",
                             help="write it even for a Python that is not a virtual environment's")
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
        print(f"ckptshim: {shown_lines(str(error))}", file=sys.stderr)
        return EXIT_PROBLEM
    except ModuleNotFoundError as error:  # a framework the command needs, found missing on the way
        needs_extra = extras.missing(error, f"ckptshim {args.command}")
        if needs_extra is None:
            raise
        print(f"ckptshim: {needs_extra}", file=sys.stderr)
        return EXIT_PROBLEM
    except BrokenPipeError:  # `ckptshim inspect ... | head`: the reader left, which is fine
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
