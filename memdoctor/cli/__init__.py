"""The memdoctor command line: main(argv) -> int, one module per command in COMMANDS, errors caught only here.
Imports any stage, inside the command functions, so memdoctor --help loads neither torch nor the report.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from memdoctor import exitcodes
from memdoctor.cli import check, diff, plan, profile, report, run, timeline
from memdoctor.cli.arguments import PROG, Command, Parser, split_script_args
from memdoctor.cli.terminal import BUG_LINE, one_line, say
from memdoctor.errors import MemdoctorError
from memdoctor.version import __version__

__all__ = ["COMMANDS", "Command", "build_parser", "main", "main_entry", "parse_args"]

COMMANDS: list[Command] = [
    profile.COMMAND,
    run.COMMAND,
    report.COMMAND,
    plan.COMMAND,
    check.COMMAND,
    diff.COMMAND,
    timeline.COMMAND,
]


def main(argv: Sequence[str] | None = None) -> int:
    """Run memdoctor with ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        ns = parse_args(args)
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        return _exit_code(exc.code)
    return _run_guarded(ns)


def main_entry() -> None:
    """The ``memdoctor`` console script."""
    raise SystemExit(main())


def _run_guarded(ns: argparse.Namespace) -> int:
    debug = bool(getattr(ns, "debug", False)) or os.environ.get("MEMDOCTOR_DEBUG", "") not in ("", "0")
    try:
        return int(ns.command_run(ns))
    except MemdoctorError as exc:
        if debug:
            traceback.print_exc()
        say(f"error: {one_line(exc)}")
        return exc.exit_code
    except KeyboardInterrupt:
        say("interrupted")
        return exitcodes.INTERRUPTED
    except BrokenPipeError:  # the reader of our output stopped reading (``memdoctor plan --json | head``)
        _quiet_stdout()
        return exitcodes.OK
    except Exception as exc:
        if debug:
            traceback.print_exc()
        say(f"internal error: {type(exc).__name__}: {one_line(exc)}")
        hint = "" if debug else " (run with --debug or MEMDOCTOR_DEBUG=1 to see the traceback)"
        print(BUG_LINE + hint, file=sys.stderr)
        return exitcodes.INTERNAL_ERROR


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that Python's flush at exit does not fail on the closed pipe again
    (the way Python's own documentation of SIGPIPE handles it)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture): nothing to flush
        pass


def _exit_code(code: object) -> int:
    if code is None:
        return exitcodes.OK
    return code if isinstance(code, int) else exitcodes.USAGE_ERROR


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """memdoctor's parser, and each subcommand's parser by name."""
    parser = Parser(prog=PROG, description="Profile a PyTorch training script's memory, layer by layer.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also MEMDOCTOR_DEBUG=1)")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    by_name: dict[str, argparse.ArgumentParser] = {}
    for cmd in COMMANDS:
        sub = subs.add_parser(cmd.name, help=cmd.help, description=cmd.help, allow_abbrev=False)
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        cmd.configure(sub)
        sub.set_defaults(command_run=cmd.run)
        by_name[cmd.name] = sub
    return parser, by_name


def parse_args(args: list[str]) -> argparse.Namespace:
    """Parse memdoctor's command line; a pass-through command's script arguments are split off first."""
    parser, subparsers = build_parser()
    i = next((n for n, tok in enumerate(args) if not tok.startswith("-")), None)
    cmd = next((c for c in COMMANDS if i is not None and c.name == args[i]), None)
    if cmd is None or not cmd.passes_args_through:
        return parser.parse_args(args)
    assert i is not None
    split = split_script_args(subparsers[cmd.name], args[i + 1 :])
    ns = parser.parse_args([*args[: i + 1], *split.own])
    ns.script, ns.script_args, ns.separated = split.script, split.script_args, split.separated
    return ns
