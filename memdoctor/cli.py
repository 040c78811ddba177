"""The ``memdoctor`` command line: ``main(argv) -> int``, testable in-process.

Each subcommand is a ``Command`` in the ``COMMANDS`` list: its options (``configure``) and what it does
(``run``). ``main`` is the only place that catches errors: a ``MemdoctorError`` becomes one line on
stderr and its exit code; anything else is a bug, reported as such (traceback with ``--debug``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from memdoctor import exitcodes
from memdoctor.errors import MemdoctorError, OutputError, ScriptError, UsageError
from memdoctor.outputs import display_path, profile_output_dir, report_output_dir
from memdoctor.units import format_bytes, parse_size
from memdoctor.version import __version__

PROG = "memdoctor"
_BUG_LINE = "this is a bug in memdoctor; please report it with the trace"
_ORDER_HINT = (
    "memdoctor's own options go before the script, or between the script and --; the script's arguments "
    "follow the script, or the -- when there is one"
)


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, how to add its options and what it does."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    passes_args_through: bool = False  # everything after its target goes to the user's script


# ----------------------------------------------------------------------------------------- entry points


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
        _say(f"error: {_one_line(exc)}")
        return exc.exit_code
    except KeyboardInterrupt:
        _say("interrupted")
        return exitcodes.INTERRUPTED
    except Exception as exc:
        if debug:
            traceback.print_exc()
        _say(f"internal error: {type(exc).__name__}: {_one_line(exc)}")
        hint = "" if debug else " (run with --debug or MEMDOCTOR_DEBUG=1 to see the traceback)"
        print(_BUG_LINE + hint, file=sys.stderr)
        return exitcodes.INTERNAL_ERROR


def _exit_code(code: object) -> int:
    if code is None:
        return exitcodes.OK
    return code if isinstance(code, int) else exitcodes.USAGE_ERROR


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# ----------------------------------------------------------------------------------------- parsing


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        if message.startswith("unrecognized arguments"):
            message = f"{message}\n({_ORDER_HINT})"
        super().error(message)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """memdoctor's parser, and each subcommand's parser by name."""
    parser = _Parser(prog=PROG, description="Profile a PyTorch training script's memory, layer by layer.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also MEMDOCTOR_DEBUG=1)")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
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


def split_script_args(parser: argparse.ArgumentParser, tokens: list[str]) -> ScriptSplit:
    """Split ``profile``'s tokens into memdoctor's options, the script (or ``-m MODULE``) and its arguments.

    The first positional token is the script. memdoctor's options come before it, or between it and a
    ``--``; the script's arguments are everything after that ``--``, or, when no ``--`` follows the
    script, everything after the script. A ``--`` before the script ends memdoctor's options: the next
    token is the script and the rest is passed as is. ``-m MODULE`` stands where the script would.
    """
    own: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":
            rest = tokens[i + 1 :]
            return ScriptSplit(own, (rest[0] if rest else None), rest[1:], separated=True)
        if tok == "-m" or (tok.startswith("-m") and not tok.startswith("--")):
            n = 2 if tok == "-m" else 1
            return _after_target([*own, *tokens[i : i + n]], None, tokens[i + n :])
        if not tok.startswith("-") or tok == "-":
            return _after_target(own, tok, tokens[i + 1 :])
        own.append(tok)
        if _takes_value(parser, tok) and i + 1 < len(tokens):
            own.append(tokens[i + 1])
            i += 1
        i += 1
    return ScriptSplit(own, None, [], separated=False)


@dataclass(frozen=True)
class ScriptSplit:
    own: list[str]  # memdoctor's options (with -m MODULE)
    script: str | None
    script_args: list[str]
    separated: bool  # a -- separated memdoctor's options from the script's arguments


def _after_target(own: list[str], script: str | None, rest: list[str]) -> ScriptSplit:
    if "--" not in rest:
        return ScriptSplit(own, script, rest, separated=False)
    j = rest.index("--")
    return ScriptSplit([*own, *rest[:j]], script, rest[j + 1 :], separated=True)


def _takes_value(parser: argparse.ArgumentParser, tok: str) -> bool:
    action = parser._option_string_actions.get(tok)  # argparse keeps no public lookup
    return action is not None and action.nargs != 0


def _arg_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """Turn a converter that raises ``UsageError``/``ValueError`` into an argparse type (exit 2)."""

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except (UsageError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = convert.__name__
    return parse


def _count(minimum: int) -> Callable[[str], int]:
    def count(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise ValueError(f"must be at least {minimum}, got {value}")
        return value

    return count


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"must be a positive number of seconds, got {text!r}")
    return value


# ----------------------------------------------------------------------------------------- profile

_PROFILE_USAGE = f"{PROG} profile [options] (SCRIPT | -m MODULE) [--] [SCRIPT ARGS ...]"
_PROFILE_EPILOG = f"""\
examples:
  {PROG} profile train.py --steps 5 -- --batch-size 32 --lr 3e-5
  {PROG} profile --budget 8GiB -o bert-report train.py --batch-size 32
  {PROG} profile -m mypackage.train --epochs 1

memdoctor's own options go before the script, or between the script and --.
The script's arguments follow the script, or the -- when there is one.

exit codes:
{exitcodes.describe()}
"""


def _script_command(p: argparse.ArgumentParser, usage: str, epilog: str) -> None:
    """What ``profile`` and ``run`` share: their help layout and the script (or ``-m MODULE``) to run."""
    p.usage, p.epilog = usage, epilog
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("script", nargs="?", metavar="SCRIPT", help="the training script, run as `python SCRIPT`")
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module instead, as `python -m MODULE`")


def configure_profile(p: argparse.ArgumentParser) -> None:
    _script_command(p, _PROFILE_USAGE, _PROFILE_EPILOG)
    p.add_argument(
        "--steps",
        type=_arg_type(_count(1)),
        default=5,
        metavar="N",
        help="optimizer steps to profile (default: 5)",
    )
    p.add_argument(
        "--warmup",
        type=_arg_type(_count(0)),
        default=1,
        metavar="N",
        help="steps to run first, left out of the headline figures (default: 1)",
    )
    p.add_argument(
        "--budget",
        type=_arg_type(parse_size),
        metavar="SIZE",
        help="emulate a GPU with SIZE memory (e.g. 8GiB): caps the process on a larger GPU",
    )
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="DIR",
        help="output folder (default: ./memdoctor-report, or the first free memdoctor-report-N)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into an existing, non-empty output folder (only memdoctor's own files are overwritten; "
        "nothing is deleted)",
    )
    p.add_argument(
        "--timeout",
        type=_arg_type(_seconds),
        metavar="SECONDS",
        help="stop the script after SECONDS and keep what was measured (exit code 124)",
    )
    p.add_argument(
        "--detail",
        choices=("auto", "all"),
        default="auto",
        help="which steps record the per-module ledger: auto (default) on CUDA the warm-up, first and last "
        "profiled steps, the others being timing steps with only the optimizer hooks, so that step times "
        "are the script's own; on a CPU every step. 'all': every step",
    )
    p.add_argument(
        "--collect",
        type=_arg_type(_collectors),
        default="all",
        metavar="all|none|NAME,...",
        help="instruments beyond the memory ledger: all (default), none (the memory ledger and gradient "
        "norms only), or a comma list of device, nvtx, data, transfers, histograms, flops",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="after the report, apply its plan (memdoctor.yaml) and profile again under the same budget "
        "(into OUT/verify); the report then shows the measured peak and step time beside the predicted "
        "ones, and a plan that does not fit is re-planned from what was measured",
    )
    rounds = "with --verify: at most N verified runs (re-plans) when a plan does not fit (default: 3)"
    p.add_argument("--verify-rounds", type=_arg_type(_count(1)), default=3, metavar="N", help=rounds)
    p.add_argument(
        "--reprofile",
        type=_arg_type(_count(0)),
        default=3,
        metavar="N",
        help="when the run runs out of memory before its forward finishes (the modules after it unmeasured), "
        "profile it again at micro-batches of 1/2, 1/4, ... of the batch (gradient accumulation, into "
        "OUT/reprofile), at most N runs, and plan from the first that measures every module, scaled back "
        "to the full batch (default: 3; 0: never)",
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="profile with a memdoctor.yaml plan applied, as `memdoctor run` applies it (docs/config.md)",
    )
    p.add_argument(
        "--time-depth",
        type=_arg_type(_time_depth),
        default=None,
        metavar="N|auto|all",
        help="time module calls down to call depth N (default auto: at most ~96 timed calls a forward, "
        "chosen after the first step; 'all' times every module, at more overhead). Memory is accounted "
        "for every module whatever the depth",
    )


def profile_command(ns: argparse.Namespace) -> int:
    _check_target(ns, "profile")
    _warn_about_passed_options(ns)
    out = profile_output_dir(ns.output, force=ns.force)
    if out.note:
        _say(out.note)
    supervisor = importlib.import_module("memdoctor.launch.supervisor")
    request = supervisor.ProfileRequest(
        script=None if ns.module is not None else ns.script,
        module=ns.module,
        args=list(ns.script_args),
        out_dir=out.path,
        warmup=ns.warmup,
        steps=ns.steps,
        budget_bytes=ns.budget,
        timeout_s=ns.timeout,
        time_depth=ns.time_depth,
        detail=ns.detail,
        collect=ns.collect,
        progress=importlib.import_module("memdoctor.launch.progress").wanted(),
        config=None if ns.config is None else _config_mapping(ns.config),
    )
    target = f"-m {ns.module}" if ns.module is not None else ns.script
    _say(f"profiling {target}: {ns.warmup} warm-up + {ns.steps} steps, writing to {display_path(out.path)}")
    result = supervisor.run_profile(request)
    try:
        print_summary(
            result.summary, _read_trace(result.trace_path), status=result.status, message=result.message
        )
    except Exception as exc:  # the files are written: a bug in this table must not change the exit code
        _say(f"internal error printing the summary: {type(exc).__name__}: {_one_line(exc)}; {_BUG_LINE}")
    written = getattr(result, "written", None) or [result.trace_path, result.report_path, result.summary_path]
    if getattr(ns, "reprofile", 0):
        result, more = reprofile_profile(request, result, ns.reprofile, supervisor.run_profile)
        written = [*written, *more]
    if getattr(ns, "verify", False):
        written = [*written, *verify_profile(request, result, ns.verify_rounds, supervisor.run_profile)]
    print_written(written)
    return int(result.exit_code)


def reprofile_profile(
    request: Any, result: Any, rounds: int, run: Callable[[Any], Any]
) -> tuple[Any, list[Path]]:
    """When the run died of OOM before its forward finished: re-profile at smaller micro-batches
    (``memdoctor.launch.reprofile``), record the result in the first trace and re-render its report,
    summary and memdoctor.yaml, which now plan from the re-profile. (the result with the new summary,
    the files the re-profiles wrote); the exit code stays the first run's."""
    from memdoctor.launch.reprofile import RECORD_NAME, needed, reprofile

    trace = _read_trace(result.trace_path)
    if trace is None or result.summary is None or not needed(trace, result):
        return result, []
    record = reprofile(trace, result.summary, request, run, _say, max_rounds=rounds)
    paths = _record_and_render(trace, result.trace_path, RECORD_NAME, record, request.out_dir)
    summary = json.loads(paths["summary"].read_text(encoding="utf-8"))
    files = _round_files(request.out_dir, record, ("trace.jsonl.gz", "summary.json", "report.html"))
    return replace(result, summary=summary), files


def verify_profile(request: Any, result: Any, rounds: int, run: Callable[[Any], Any]) -> list[Path]:
    """``profile --verify``: verify the first run's plan (``memdoctor.launch.verify``), record the result
    in the first trace and re-render its report; the files the rounds wrote. The exit code stays the
    first run's: it says how the profiled script ended."""
    from memdoctor.launch.verify import RECORD_NAME, VERIFIABLE_EXIT_CODES, verify

    trace = _read_trace(result.trace_path)
    if trace is None or result.summary is None or result.exit_code not in VERIFIABLE_EXIT_CODES:
        _say(f"verify: not verified: the profiled run ended with {result.status}; fix that first")
        return []
    record = verify(trace, result.summary, request, run, _say, max_rounds=rounds)
    _record_and_render(trace, result.trace_path, RECORD_NAME, record, request.out_dir)
    names = ("trace.jsonl.gz", "summary.json", "report.html", "memdoctor.yaml")
    return _round_files(request.out_dir, record, names)


def _record_and_render(trace: Any, path: Path, name: str, record: dict[str, Any], out_dir: Path) -> Any:
    """Write the run-wide ``record`` into the first run's trace (atomically) and re-render its report,
    ``summary.json`` and memdoctor.yaml from it; their paths."""
    from memdoctor.report import write_report
    from memdoctor.trace import save_trace

    trace.collected[name] = record
    save_trace(trace, path)
    return write_report(trace, out_dir)


def _round_files(out_dir: Path, record: dict[str, Any], names: Sequence[str]) -> list[Path]:
    """The files ``names`` in the folder of each round of ``record`` (its ``trace`` is relative)."""
    return [(out_dir / r["trace"]).parent / name for r in record["rounds"] for name in names]


_MEMDOCTOR_PROFILE_OPTIONS = (
    "--steps",
    "--warmup",
    "--budget",
    "-o",
    "--output",
    "--force",
    "--timeout",
    "--time-depth",
    "--detail",
    "--collect",
    "--verify",
    "--verify-rounds",
    "--reprofile",
    "--config",
)


def _config_mapping(path: Path) -> dict[str, Any]:
    """The validated config as the mapping the child installs (a bad config stops here, exit 2)."""
    from memdoctor.config import load_config

    return load_config(path).as_dict()


def _collectors(text: str) -> list[str]:
    from memdoctor.capture.collectors import parse_names

    try:
        return parse_names(text)
    except ValueError as exc:
        raise UsageError(f"--collect: {exc}") from None


def _time_depth(text: str) -> int | None:
    if text == "auto":
        return None
    if text == "all":
        return 10_000
    if not text.isdigit():
        raise UsageError(f"--time-depth takes a whole number, 'auto' or 'all', not {text!r}")
    return int(text)


def _warn_about_passed_options(ns: argparse.Namespace) -> None:
    """``memdoctor profile train.py --steps 3`` gives --steps to the script; say so, it may be a slip."""
    if ns.separated:
        return
    passed = [a for a in ns.script_args if a.split("=", 1)[0] in _MEMDOCTOR_PROFILE_OPTIONS]
    if passed:
        _say(
            f"note: {', '.join(passed)} after the script goes to the script; to give it to memdoctor, put "
            f"it before the script, or end memdoctor's options with -- (profile train.py --steps 3 -- ARGS)"
        )


def _read_trace(path: Path | None) -> Any:
    from memdoctor.trace import read_trace  # imported late: the CLI starts without the trace module

    return read_trace(path)


_EXECUTABLE_MAGIC = (b"\x7fELF", b"MZ", b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe", b"\xca\xfe\xba\xbe")
_PYTHON_BINARY_SUFFIXES = (".pyc", ".pyz", ".zip")


def check_script(path: Path) -> None:
    """Refuse, with a clear message, what ``python SCRIPT`` could not run as a training script."""
    if not path.exists():
        raise UsageError(f"{path}: no such file")
    if path.is_dir():
        raise UsageError(f"{path}: is a folder, not a script; give the training script, or use -m MODULE")
    if not path.is_file():
        raise UsageError(f"{path}: not a regular file")
    try:
        with path.open("rb") as fh:
            head = fh.read(8192)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    if head.startswith(_EXECUTABLE_MAGIC):
        raise UsageError(f"{path}: is a compiled program, not a Python script; memdoctor runs Python scripts")
    if b"\0" in head and path.suffix not in _PYTHON_BINARY_SUFFIXES:
        raise UsageError(f"{path}: looks like a binary file, not a Python script")
    first = head.split(b"\n", 1)[0]
    if first.startswith(b"#!") and b"python" not in first:
        interpreter = first[2:].decode(errors="replace").strip()
        raise UsageError(
            f"{path}: is a script for {interpreter!r}, not Python; profile the Python script it runs instead"
        )
    if path.suffix == ".ipynb" or (head.lstrip().startswith(b"{") and b'"cells"' in head):
        # JSON is almost valid Python: run as a script, a notebook would fail in confusing ways.
        raise UsageError(
            f"{path}: is a Jupyter notebook, not a script; export it first "
            f"(jupyter nbconvert --to script {path.name}) and profile the .py file"
        )
    if path.suffix not in _PYTHON_BINARY_SUFFIXES:
        check_syntax(path)


def check_syntax(path: Path) -> None:
    """Compile the script here (nothing runs) so that a syntax error is one line and costs no
    profiling run: the child would only start torch to fail the same way."""
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:  # IndentationError and TabError too
        where = f"{path}:{exc.lineno}" if exc.lineno else str(path)
        raise ScriptError(
            f"{where}: {type(exc).__name__}: {exc.msg}; the script does not compile, nothing was run"
        ) from None
    except (ValueError, OSError) as exc:  # null bytes, unreadable
        raise UsageError(f"{path}: cannot compile it as Python ({_one_line(exc)})") from None


def check_module_name(name: str) -> None:
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise UsageError(f"{name!r} is not a module name; -m takes a dotted name such as mypackage.train")


# ----------------------------------------------------------------------------------------- run

_RUN_USAGE = f"{PROG} run --config PATH [options] (SCRIPT | -m MODULE) [--] [SCRIPT ARGS ...]"
_RUN_EPILOG = f"""\
examples:
  {PROG} run --config memdoctor-report/memdoctor.yaml train.py -- --batch-size 32
  {PROG} run --config memdoctor.yaml -m mypackage.train --epochs 3

Runs the script to its end with the plan applied at runtime (the script is not edited); one line per
applied part is printed at the start. A part that cannot be applied stops the run with one line naming
it (exit code 2). Otherwise the exit code is the script's. How each part is applied: docs/config.md.
"""


def configure_run(p: argparse.ArgumentParser) -> None:
    _script_command(p, _RUN_USAGE, _RUN_EPILOG)
    p.add_argument(
        "--config",
        type=Path,
        required=True,
        metavar="PATH",
        help="the plan: a memdoctor.yaml (docs/config.md)",
    )


def run_command(ns: argparse.Namespace) -> int:
    from memdoctor.config import load_config

    config = load_config(ns.config)
    _check_target(ns, "run")
    launch = importlib.import_module("memdoctor.launch.run")
    _say(launch.describe(config, ns.config))
    return int(launch.run_script(config, None if ns.module else ns.script, ns.module, list(ns.script_args)))


def _check_target(ns: argparse.Namespace, command: str) -> None:
    if ns.module is not None:
        check_module_name(ns.module)
    elif ns.script is not None:
        check_script(Path(ns.script))
    else:
        raise UsageError(
            f"give the script to {command} ({PROG} {command} train.py) or a module with -m MODULE"
        )


# ----------------------------------------------------------------------------------------- report


def configure_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, metavar="TRACE", help="a trace.jsonl.gz, or the folder holding one")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="DIR",
        help="output folder (default: beside the trace, or <trace folder>/rerender-N when a report is "
        "already there)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite report.html and summary.json in the output folder (nothing else is touched)",
    )
    p.add_argument(
        "--salvage",
        action="store_true",
        help="read a trace that was cut short (no end record: a crashed in-process run, a .partial file) "
        "up to its last whole record; the report says it is incomplete",
    )
    p.epilog = "exit codes: 0 written; 2 usage or output folder error; 3 unreadable trace"


def report_command(ns: argparse.Namespace) -> int:
    from memdoctor.trace import TRACE_FILENAME, load_trace

    path: Path = ns.trace
    if path.is_dir() and (path / TRACE_FILENAME).is_file():
        path = path / TRACE_FILENAME
    trace = load_trace(path, salvage=ns.salvage)
    if trace.end is None:  # --salvage of a run that never finished: say so in the report
        msg = "the trace has no end record: the run was cut short (or is still running)"
        trace.end = {"message": msg, "steps_recorded": len(trace.steps)}  # no status: not known
    out = report_output_dir(path, ns.output, force=ns.force)
    if out.note:
        _say(out.note)
    report = importlib.import_module("memdoctor.report")
    try:
        written = report.write_report(trace, out.path)
    except OSError as exc:
        raise OutputError(f"{out.path}: cannot write the report ({exc.strerror or exc})") from None
    summary = report.build_summary(trace)
    print_summary(summary, trace, status=summary.get("status"), message=(trace.end or {}).get("message"))
    print_written(list(written.values()))
    return exitcodes.OK


# ----------------------------------------------------------------------------------------- plan


def configure_plan(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, metavar="TRACE", help="a trace.jsonl.gz, or the folder holding one")
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--budget", type=_arg_type(parse_size), metavar="SIZE", help="memory the plan must fit, e.g. 8GiB"
    )
    target.add_argument(
        "--gpu",
        metavar="NAME",
        help="plan for a listed card (rtx2070, t4, a100-80gb, ...; see docs/planner.md)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="DIR",
        help="also write the plan as DIR/memdoctor.yaml (see docs/config.md)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing DIR/memdoctor.yaml")
    p.epilog = (
        "without --budget or --gpu: the profiled run's budget, else its GPU. "
        "exit codes: 0 planned (also when nothing fits: the output says so); 2 usage error; "
        "3 unreadable trace"
    )


def plan_command(ns: argparse.Namespace) -> int:
    import json

    from memdoctor.cards import find_card
    from memdoctor.plan.planner import card_table
    from memdoctor.plan.summarize import doctor, summary_target
    from memdoctor.plan.target import Target
    from memdoctor.report import build_summary
    from memdoctor.trace import TRACE_FILENAME, load_trace

    path: Path = ns.trace
    if path.is_dir() and (path / TRACE_FILENAME).is_file():
        path = path / TRACE_FILENAME
    trace = load_trace(path)
    summary = build_summary(trace)
    target: Target | None = summary_target(summary)
    if ns.gpu:
        card = find_card(ns.gpu)
        target = Target(card.usable_bytes, card)
    elif ns.budget:
        target = Target(ns.budget)
    if target is None:
        raise UsageError(f"{path}: the run had no budget and no GPU: give --budget SIZE or --gpu NAME")
    out = doctor(trace, summary, target)
    if out["plan"] is None:
        raise UsageError(f"{path}: cannot plan: {out['reason']}")
    written = write_plan_config(ns.output, trace, {**summary, "plan": out["plan"]}, force=ns.force)
    if ns.json:
        cards = card_table(out["workload"], target.margin, out["lever_priority"]["order"])
        doc = {
            "plan": out["plan"],
            "findings": out["findings"],
            "ninegrid": out["ninegrid"],
            "lever_priority": out["lever_priority"],
            "cards": cards,
        }
        print(json.dumps(doc, indent=2, sort_keys=True))
        if written is not None:
            _say(f"Wrote {written}")  # stderr: stdout stays one JSON document
        return exitcodes.OK
    print_plan(out, card_table(out["workload"], target.margin, out["lever_priority"]["order"]))
    print_written([written])
    return exitcodes.OK


def write_plan_config(
    out_dir: Path | None, trace: Any, summary: dict[str, Any], *, force: bool
) -> Path | None:
    """``DIR/memdoctor.yaml`` for ``memdoctor plan -o DIR``: atomic, never over an existing file without
    --force (the same policy as the report's files)."""
    if out_dir is None:
        return None
    from memdoctor.config import CONFIG_FILENAME, config_for_summary, dump_config
    from memdoctor.outputs import ensure_writable
    from memdoctor.report.render import atomic_write

    target = out_dir / CONFIG_FILENAME
    if target.exists() and not force:
        raise UsageError(f"{target} exists: give --force to overwrite it, or another -o DIR")
    config = config_for_summary(trace, summary)
    if config is None:
        return None
    ensure_writable(out_dir)
    atomic_write(target, dump_config(config))
    return target


def print_plan(out: dict[str, Any], cards: list[dict[str, Any]]) -> None:
    """The plan in a few lines, the findings and the card table, on stdout."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    plan = out["plan"]
    table = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    for key, value in _plan_rows(plan):
        table.add_row(f"[bold]{key}[/bold]", escape(value))
    console.print(table)
    for line in plan["advice"]:
        console.print(escape(f"- {line}"))
    for f in out["findings"]:
        console.print(escape(f"finding [{f['severity']}] {f['rule']}: {f['title']}: {f['evidence']}"))
    console.print(_cards_table(cards, Table))


def _plan_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    where = f" ({plan['card']})" if plan["card"] else ""
    margin = f"{format_bytes(plan['limit_bytes'])} after a {plan['safety_margin']:.0%} margin"
    ratio = plan["predicted_step_time_ratio"]
    rows = [
        ("budget", f"{format_bytes(plan['budget_bytes'])}{where}, {margin}"),
        ("measured peak", format_bytes(plan["measured_peak_bytes"])),
    ]
    if plan["fits_as_is"]:
        verdict = "fits as it is"
    elif plan["fits"]:
        verdict = "fits with: " + "; ".join(plan["levers"])
    else:
        verdict = "nothing modelled fits"
    rows.append(("plan", verdict))
    rows.append(("predicted peak", f"{format_bytes(plan['predicted_reserved_bytes'])} reserved"))
    rows.append(("step time", "unknown from this trace" if ratio is None else f"x{ratio:.2f} (predicted)"))
    if plan["config"]["checkpoint"]:
        rows.append(("checkpoint", ", ".join(plan["config"]["checkpoint"])))
    return rows


def _cards_table(cards: list[dict[str, Any]], table_cls: Any) -> Any:
    from rich import box
    from rich.markup import escape

    table = table_cls(title="which card do I need", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col, justify in (("card", "left"), ("memory", "right"), ("verdict", "left"), ("predicted", "right")):
        table.add_column(col, justify=justify, overflow="fold")
    table.add_column("step time", justify="right")
    for c in cards:
        verdict = c["verdict"] + (": " + "; ".join(c["levers"]) if c["levers"] else "")
        ratio = c["predicted_step_time_ratio"]
        table.add_row(
            escape(c["card"]),
            format_bytes(c["memory_bytes"]),
            escape(verdict),
            format_bytes(c["predicted_reserved_bytes"]),
            "unknown" if ratio is None else f"x{ratio:.2f}",
        )
    return table


# ----------------------------------------------------------------------------------------- check, diff


def configure_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, metavar="TRACE", help="a trace.jsonl.gz, or a report folder")
    p.add_argument(
        "--max-peak", type=_arg_type(parse_size), metavar="SIZE", help="the peak memory allowed, e.g. 7.5GiB"
    )
    p.add_argument(
        "--max-step-time-ratio",
        type=_arg_type(_positive_float),
        metavar="X",
        help="the step time allowed, as a multiple of --baseline's (e.g. 1.1)",
    )
    p.add_argument("--baseline", type=Path, metavar="TRACE", help="the run to compare the step time with")
    p.epilog = (
        "exit codes: 0 within the limits; 7 a limit is exceeded (one line says by how much); "
        "2 usage error; 3 unreadable trace"
    )


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def check_command(ns: argparse.Namespace) -> int:
    from memdoctor.compare import check_run, load_run

    baseline = load_run(ns.baseline) if ns.baseline is not None else None
    verdict = check_run(load_run(ns.trace), ns.max_peak, ns.max_step_time_ratio, baseline)
    for line in verdict.lines:
        print(line)
    return exitcodes.OK if verdict.ok else exitcodes.LIMIT_EXCEEDED


def configure_diff(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", type=Path, metavar="A", help="the first run: a trace.jsonl.gz or a report folder")
    p.add_argument("b", type=Path, metavar="B", help="the second run")
    p.add_argument("-o", "--output", type=Path, metavar="DIR", help="also write DIR/diff.html")
    p.epilog = "exit codes: 0 compared; 2 usage or output folder error; 3 unreadable trace"


def diff_command(ns: argparse.Namespace) -> int:
    from memdoctor.compare import diff_runs, load_run
    from memdoctor.report.diff import DIFF_FILENAME, render_diff_html
    from memdoctor.report.render import atomic_write

    data = diff_runs(load_run(ns.a), load_run(ns.b))
    print_diff(data)
    if ns.output is not None:
        target = Path(ns.output) / DIFF_FILENAME
        try:
            Path(ns.output).mkdir(parents=True, exist_ok=True)
            atomic_write(target, render_diff_html(data))
        except OSError as exc:
            raise OutputError(f"{ns.output}: cannot write {DIFF_FILENAME} ({exc.strerror or exc})") from None
        print_written([target])
    return exitcodes.OK


def print_diff(data: dict[str, Any]) -> None:
    """The comparison as terminal tables: headline figures, categories, most-changed layers."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from memdoctor.report.diff import format_delta, format_value

    console = Console(highlight=False)
    console.print(f"A: {escape(data['a']['path'])}\nB: {escape(data['b']['path'])}")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("", "A", "B", "B - A"):
        table.add_column(col, justify="left" if not col else "right")
    for row in [*data["rows"], *data["categories"]]:
        a, b = format_value(row["a"], row["unit"]), format_value(row["b"], row["unit"])
        table.add_row(escape(row["label"]), a, b, format_delta(row))
    console.print(table)
    if data["layers"]:
        layers = Table(title="layers whose memory changed most", title_justify="left", box=box.SIMPLE_HEAD)
        longest = max(len(row["name"]) for row in data["layers"])
        layers.add_column("layer", overflow="fold", min_width=min(longest, 40))
        for col in ("activations A", "activations B", "parameters A", "parameters B"):
            layers.add_column(col, justify="right")
        for row in data["layers"]:
            vals = (row["activation_a"], row["activation_b"], row["param_a"], row["param_b"])
            layers.add_row(escape(row["name"]), *("-" if v is None else format_bytes(v) for v in vals))
        console.print(layers)


# ----------------------------------------------------------------------------------------- terminal output

_TOP_LAYERS = 5


def print_summary(
    summary: dict[str, Any] | None, trace: Any = None, *, status: str | None, message: str | None
) -> None:
    """A short table of the run (from ``summary.json``'s data) and its biggest layers, on stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    table = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    for key, value in _summary_rows(summary or {}, status, message):
        table.add_row(f"[bold]{key}[/bold]", value)
    console.print(table)
    layers = biggest_layers(summary or {}, trace, _TOP_LAYERS)
    if layers:
        console.print(_layers_table(layers, Table))


def _summary_rows(summary: dict[str, Any], status: str | None, message: str | None) -> list[tuple[str, str]]:
    from rich.markup import escape

    device = summary.get("device") or {}
    rows = []
    if device:
        rows.append(("device", escape(_device_text(device))))
    if "steps_profiled" in summary:
        rows.append(("steps profiled", str(summary["steps_profiled"])))
    if summary.get("peak_memory_bytes") is not None:
        rows.append(("peak memory", _peak_text(summary)))
    categories = summary.get("categories") or {}
    if categories:
        parts = [
            f"{name.replace('_', ' ')} {format_bytes(v)}" for name, v in categories.items() if v is not None
        ]
        if parts:  # none before a first step: no empty row
            rows.append(("at the peak", ", ".join(parts)))
    status_text = status or summary.get("status") or "unknown"
    rows.append(("status", escape(f"{status_text}: {message}" if message else status_text)))
    if summary.get("headline"):
        rows.append(("verdict", escape(str(summary["headline"]))))
    return rows


def _device_text(device: dict[str, Any]) -> str:
    name = device.get("name") or device.get("kind") or "unknown"
    text = (
        f"{name}, {format_bytes(device['total_memory_bytes'])}" if device.get("total_memory_bytes") else name
    )
    if device.get("memory_cap_bytes"):
        text += f" (capped to {format_bytes(device['memory_cap_bytes'])} by --budget)"
    return text


def _peak_text(summary: dict[str, Any]) -> str:
    """``1.20 GiB of 8.00 GiB budget (15%)``; the limit is the budget, the cap, or a GPU's memory."""
    peak, device = summary["peak_memory_bytes"], summary.get("device") or {}
    limits = [
        (summary.get("budget_bytes"), "budget"),
        (device.get("memory_cap_bytes"), "cap"),
        (device.get("total_memory_bytes") if device.get("kind") == "cuda" else None, "on the GPU"),
    ]
    limit, label = next(((n, label) for n, label in limits if n), (None, ""))
    if not limit:
        return format_bytes(peak)
    return f"{format_bytes(peak)} of {format_bytes(limit)} {label} ({100 * peak / limit:.0f}%)"


def biggest_layers(summary: dict[str, Any], trace: Any, n: int) -> list[dict[str, Any]]:
    """The ``n`` layers holding the most activation bytes (submodules included).

    With the trace, the candidates are the layers the report's bar chart shows (the model opened down
    to its repeated blocks: ``encoder.layer.0`` ... rather than ``bert`` or single ``Linear`` layers);
    without it, every module of the summary except the roots.
    """
    rows = {row.get("name"): row for row in summary.get("layers") or []}
    candidates = [row for row in rows.values() if row.get("depth", 1) and row.get("name")]
    if trace is not None and trace.models:
        analysis = importlib.import_module("memdoctor.analysis")
        bars = analysis.top_layers(trace, analysis.peak_step(trace), limit=len(rows) + 1)
        candidates = [_bar_row(bar, rows.get(bar["name"], {})) for bar in bars if not bar.get("own")]
    candidates = [row for row in candidates if (row.get("activation_bytes") or 0) > 0]
    return sorted(candidates, key=lambda row: -(row.get("activation_bytes") or 0))[:n]


def _bar_row(bar: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    return {
        **row,
        "name": bar["name"],
        "type": bar.get("type"),
        "activation_bytes": bar.get("activations"),
        "param_bytes": bar.get("parameters"),
    }


def _layers_table(layers: list[dict[str, Any]], table_cls: Any) -> Any:
    from rich import box
    from rich.markup import escape

    longest = max(len(str(layer.get("name"))) for layer in layers)
    table = table_cls(
        title="biggest layers by activation memory",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    # Names wrap, never get cut: they are what the user acts on; the type column gives way first.
    table.add_column("layer", overflow="fold", min_width=min(longest, 40))
    table.add_column("type", overflow="ellipsis", max_width=14)
    for col in ("activations", "parameters", "fwd / bwd ms"):
        table.add_column(col, justify="right")
    for layer in layers:
        table.add_row(
            escape(str(layer.get("name"))),
            escape(str(layer.get("type") or "")),
            format_bytes(layer.get("activation_bytes")),
            format_bytes(layer.get("param_bytes")),
            f"{_ms(layer.get('forward_ms'))} / {_ms(layer.get('backward_ms'))}",
        )
    return table


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def print_written(paths: Sequence[Path | str | None]) -> None:
    for path in paths:
        if path is not None and Path(path).exists():
            print(f"Wrote {path}")


# ----------------------------------------------------------------------------------------- the list

COMMANDS: list[Command] = [
    Command(
        "profile",
        "run a training script for a few steps and write its per-layer memory report",
        configure_profile,
        profile_command,
        passes_args_through=True,
    ),
    Command(
        "run",
        "run a training script to its end with a memdoctor.yaml plan applied, unmodified",
        configure_run,
        run_command,
        passes_args_through=True,
    ),
    Command(
        "report", "re-render report.html and summary.json from a trace file", configure_report, report_command
    ),
    Command("plan", "plan for a memory budget or a GPU from a recorded trace", configure_plan, plan_command),
    Command(
        "check",
        "exit non-zero when a recorded run's peak memory (or step time) exceeds a limit: a CI guard",
        configure_check,
        check_command,
    ),
    Command(
        "diff",
        "compare two recorded runs side by side (terminal, and HTML with -o)",
        configure_diff,
        diff_command,
    ),
]
