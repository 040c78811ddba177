"""``memdoctor profile``: run a training script for a few steps in a supervised child and write its
per-layer memory report; then, when asked, re-profile and verify (``memdoctor.launch.rounds``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from memdoctor import exitcodes
from memdoctor.cli.arguments import PROG, Command, add_launch_options, arg_type, count, rank_job, seconds
from memdoctor.cli.scripts import add_script_arguments, check_target
from memdoctor.cli.terminal import BUG_LINE, one_line, print_summary, print_written, say
from memdoctor.errors import UsageError
from memdoctor.outputs import display_path, profile_output_dir
from memdoctor.units import parse_size

_PROFILE_USAGE = f"{PROG} profile [options] (SCRIPT | -m MODULE) [--] [SCRIPT ARGS ...]"
_PROFILE_EPILOG = f"""\
examples:
  {PROG} profile train.py --steps 5 -- --batch-size 32 --lr 3e-5
  {PROG} profile --budget 8GiB -o bert-report train.py --batch-size 32
  {PROG} profile --gpu rtx2070 train.py --batch-size 32
  {PROG} profile -m mypackage.train --epochs 1
  {PROG} profile --nproc-per-node 2 train_ddp.py -- --batch-size 32    # every rank, OUT/rank-K/

memdoctor's own options go before the script, or between the script and --.
The script's arguments follow the script, or the -- when there is one.

exit codes:
{exitcodes.describe()}
"""


def configure_profile(p: argparse.ArgumentParser) -> None:
    add_script_arguments(p, _PROFILE_USAGE, _PROFILE_EPILOG)
    _add_run_options(p)
    _add_measure_options(p)
    add_launch_options(p)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """How long to run, under what budget, and where to write."""
    p.add_argument(
        "--steps",
        type=arg_type(count(1)),
        default=5,
        metavar="N",
        help="optimizer steps to profile (default: 5)",
    )
    p.add_argument(
        "--warmup",
        type=arg_type(count(0)),
        default=1,
        metavar="N",
        help="steps to run first, left out of the headline figures (default: 1)",
    )
    p.add_argument(
        "--budget",
        type=arg_type(parse_size),
        metavar="SIZE",
        help="emulate a GPU with SIZE memory (e.g. 8GiB): caps the process on a larger GPU",
    )
    p.add_argument(
        "--gpu",
        metavar="NAME",
        help="plan for a listed card (rtx2070, t4, a100-80gb, ...; docs/planner.md): on a larger GPU caps "
        "the process to the card's memory, and plans with the card's features (bf16 or not, fp16 tensor "
        "cores, PCIe rate, FLOP rate); on a CPU plans for the card without a cap. With --budget: the "
        "smaller of the two memories, the card's features",
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
        type=arg_type(seconds),
        metavar="SECONDS",
        help=f"stop the script after SECONDS and keep what was measured (exit code {exitcodes.TIMEOUT})",
    )


def _add_measure_options(p: argparse.ArgumentParser) -> None:
    """What to measure, and the rounds that follow the first profile (--reprofile, --verify)."""
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
        type=arg_type(_collectors),
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
        "ones; a plan that does not fit is re-planned from what was measured, one memdoctor run refuses "
        "without the refused lever, and memdoctor.yaml becomes the measured config that fits (when none "
        "did, it says so first)",
    )
    rounds = "with --verify: at most N verified runs (re-plans) when a plan does not fit (default: 3)"
    p.add_argument("--verify-rounds", type=arg_type(count(1)), default=3, metavar="N", help=rounds)
    p.add_argument(
        "--reprofile",
        type=arg_type(count(0)),
        default=3,
        metavar="N",
        help="when the run runs out of memory in a step it never finished (in its forward, the modules "
        "after it unmeasured; in the model's own code, the loop's loss, backward or the optimizer step), "
        "profile it again at micro-batches of 1/2, 1/4, ... of the batch (gradient accumulation, into "
        "OUT/reprofile), at most N runs, and plan from the first that measures every module (or finishes "
        "its step), scaled back to the full batch; where no micro-batch split applies, once at the full "
        "batch with every repeated block checkpointed (default: 3; 0: never)",
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="profile with a memdoctor.yaml plan applied, as `memdoctor run` applies it (docs/config.md)",
    )
    p.add_argument(
        "--time-depth",
        type=arg_type(_time_depth),
        default=None,
        metavar="N|auto|all",
        help="time module calls down to call depth N (default auto: at most ~96 timed calls a forward, "
        "chosen after the first step; 'all' times every module, at more overhead). Memory is accounted "
        "for every module whatever the depth",
    )


def profile_command(ns: argparse.Namespace) -> int:
    check_target(ns, "profile")
    job = rank_job(ns)  # --nproc-per-node: a torch.distributed.run job; None for one process
    if job is not None and ns.verify:
        raise UsageError("--verify does not run with --nproc-per-node yet: profile the job, verify a plan")
    ns.budget = card_budget(ns.gpu, ns.budget)  # an unknown card stops here, before any folder is made
    _warn_about_passed_options(ns)
    out = profile_output_dir(ns.output, force=ns.force)
    try:  # the folder is this run's until its last file is written (memdoctor.outputs.FolderClaim)
        if job is not None:
            return _profile_ranks(ns, job, out.path, out.note)
        return _profile(ns, out.path, out.note)
    finally:
        out.release()


def _profile_ranks(ns: argparse.Namespace, job: Any, out_dir: Path, note: str | None) -> int:
    """Every rank profiled as one process is, each into OUT/rank-K; then ranks.json, the merged
    report, and one line per rank (``memdoctor.launch.rank_outcome``)."""
    if note:
        say(note)
    from memdoctor.launch.rank_outcome import outcome_lines, profile_ranks  # the launch layer, late

    request = _request(ns, out_dir, progress=False)
    target = f"-m {ns.module}" if ns.module is not None else ns.script
    say(
        f"profiling {target} on {job.nproc_per_node} processes per node (torch.distributed.run): "
        f"{ns.warmup} warm-up + {ns.steps} steps each, writing rank-K/ folders to {display_path(out_dir)}"
    )
    result = profile_ranks(request, job)
    for line in [*outcome_lines(result), *result.notes, *_not_reprofiled(ns, result)]:
        say(line)
    print_written(result.written)
    return int(result.exit_code)


def _not_reprofiled(ns: argparse.Namespace, result: Any) -> list[str]:
    """The re-profile (on by default) is one process's: a rank that ran out of memory is not re-profiled
    at a smaller micro-batch yet, and the user is told so rather than left to think it was."""
    oom = [e.rank for e in result.entries if e.status == "oom"]
    if not oom or not getattr(ns, "reprofile", 0):
        return []
    ranks = ", ".join(str(r) for r in oom)
    return [
        f"rank {ranks} ran out of memory: the re-profile does not run per rank yet, so its unmeasured "
        "modules stay unmeasured; plan from its trace (memdoctor plan rank-K/trace.jsonl.gz --gpus N)"
    ]


def _request(ns: argparse.Namespace, out_dir: Path, *, progress: bool) -> Any:
    """The one-process request the options describe (a rank's is made from it)."""
    from memdoctor.launch import supervisor  # the launch layer; imported late (--help stays light)

    return supervisor.ProfileRequest(
        script=None if ns.module is not None else ns.script,
        module=ns.module,
        args=list(ns.script_args),
        out_dir=out_dir,
        warmup=ns.warmup,
        steps=ns.steps,
        budget_bytes=ns.budget,
        gpu=_card_key(ns.gpu),
        timeout_s=ns.timeout,
        time_depth=ns.time_depth,
        detail=ns.detail,
        collect=ns.collect,
        progress=progress,
        config=None if ns.config is None else _config_mapping(ns.config),
    )


def _profile(ns: argparse.Namespace, out_dir: Path, note: str | None) -> int:
    if note:
        say(note)
    from memdoctor.launch import progress, supervisor  # the launch layer; imported late (--help stays light)
    from memdoctor.launch.rounds import reprofile_profile, verify_profile

    request = _request(ns, out_dir, progress=progress.wanted())
    target = f"-m {ns.module}" if ns.module is not None else ns.script
    say(f"profiling {target}: {ns.warmup} warm-up + {ns.steps} steps, writing to {display_path(out_dir)}")
    result = supervisor.run_profile(request)
    _say_uncapped(ns.gpu, result)
    written = getattr(result, "written", None) or [result.trace_path, result.report_path, result.summary_path]
    if not _told(result, written):  # the terminal is gone (a SIGHUP): the files say it all
        return int(result.exit_code)
    if _no_more_rounds(result):
        return int(result.exit_code)  # asked to stop, or the disk is full: no further rounds
    if getattr(ns, "reprofile", 0):
        result, more = reprofile_profile(request, result, ns.reprofile, supervisor.run_profile, say)
        written = [*written, *more]
    if getattr(ns, "verify", False):
        written = [*written, *verify_profile(request, result, ns.verify_rounds, supervisor.run_profile, say)]
    print_written(written)
    return int(result.exit_code)


# How a run ends when memdoctor was asked to stop it (Ctrl-C, SIGTERM, SIGHUP): no re-profile or verify.
_STOPPED = ("interrupted", "stopped")


def _no_more_rounds(result: Any) -> bool:
    """Asked to stop (a signal: 128 + N), or an output could not be written: no re-profile or verify."""
    stopped = result.status in _STOPPED or int(result.exit_code) > exitcodes.SIGNAL_BASE
    return stopped or bool(getattr(result, "output_error", None))


def _told(result: Any, written: list[Any]) -> bool:
    """Print the run's table, the line about unwritten files and, for a run that goes no further, the
    files written; False when the terminal cannot be written to (closed: the run was hung up on)."""
    try:
        if getattr(result, "trace_path", None) is not None:
            _print_summary(result)
        if getattr(result, "output_error", None):
            say(f"error: {result.output_error}")
        if _no_more_rounds(result):
            print_written(written)
        sys.stdout.flush()
    except OSError:
        return False
    return True


def _print_summary(result: Any) -> None:
    """The run's table; the files are written: a bug in this table must not change the exit code."""
    from memdoctor.trace import read_trace

    try:
        trace = read_trace(result.trace_path)
        print_summary(result.summary, trace, status=result.status, message=result.message)
    except Exception as exc:
        say(f"internal error printing the summary: {type(exc).__name__}: {one_line(exc)}; {BUG_LINE}")


def card_budget(gpu: str | None, budget: int | None) -> int | None:
    """The memory ``--gpu`` and ``--budget`` leave the run: the card's usable memory, ``--budget``, or
    the smaller of the two when both are given (the card's features plan either way)."""
    if not gpu:
        return budget
    from memdoctor.cards import find_card

    usable = find_card(gpu).usable_bytes
    return usable if budget is None else min(usable, budget)


def _card_key(gpu: str | None) -> str | None:
    from memdoctor.cards import find_card

    return find_card(gpu).key if gpu else None


def _say_uncapped(gpu: str | None, result: Any) -> None:
    """``--gpu`` on a run that did not train on CUDA: the plan is the card's, the memory was not capped."""
    device = (getattr(result, "summary", None) or {}).get("device") or {}
    kind = device.get("kind")
    if gpu and kind not in (None, "cuda"):
        say(
            f"note: --gpu {gpu}: this run trained on the {kind}, whose memory cannot be capped to the "
            "card's; the plan is made for the card's memory and features from what the run measured"
        )
    elif gpu and kind == "cuda" and not device.get("memory_cap_bytes"):
        say(f"note: --gpu {gpu}: this GPU has no more memory than the card, so nothing was capped")


_MEMDOCTOR_PROFILE_OPTIONS = (
    "--steps",
    "--warmup",
    "--budget",
    "--gpu",
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
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
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
        say(
            f"note: {', '.join(passed)} after the script goes to the script; to give it to memdoctor, put "
            f"it before the script, or end memdoctor's options with -- (profile train.py --steps 3 -- ARGS)"
        )


COMMAND = Command(
    "profile",
    "run a training script for a few steps and write its per-layer memory report",
    configure_profile,
    profile_command,
    passes_args_through=True,
)
