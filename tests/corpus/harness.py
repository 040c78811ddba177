"""memdoctor's closed loop on one training script, stage by stage, as a user would type it.

``close_the_loop`` runs, each as its own ``python -m memdoctor`` process:

1. ``profile`` (a few steps, no budget): the measured peak;
2. ``plan TRACE --budget B -o DIR --json``, B a fraction of that peak (on a CPU every budget is judged
   against the tensor-accounting ledger, so a budget in KiB is a real constraint there);
3. ``run --config DIR/memdoctor.yaml``: the plan applied to the unmodified script, to its end;
4. ``profile --budget B --verify``: profiled again under B, planned, and the plan measured.

Each stage's outcome is recorded (exit code, the first ``memdoctor: error`` line, whether a Python
traceback or an "internal error" was printed, seconds), never raised: the caller judges. Used by
``tests/test_corpus.py`` on the corpus beside this file and by ``benchmarks/outside_scripts.py`` on
pytorch/examples' own scripts; it imports nothing from memdoctor, so it judges memdoctor from outside.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TRACEBACK = "Traceback (most recent call last)"
INTERNAL = "internal error"


@dataclass
class Stage:
    """One memdoctor command's outcome."""

    name: str
    argv: list[str]
    code: int | None  # None: killed at the harness's timeout
    output: str
    seconds: float  # wall
    cpu_seconds: float = 0.0  # user + system, the command and the processes it waited for

    @property
    def traceback(self) -> bool:
        """memdoctor printed a Python traceback or called its own failure an internal error."""
        return TRACEBACK in self.output or INTERNAL in self.output

    @property
    def error(self) -> str | None:
        """The first line memdoctor printed as an error, if any."""
        for line in self.output.splitlines():
            if line.startswith("memdoctor: error") or f"memdoctor: {INTERNAL}" in line:
                return line
        return None

    def tail(self, lines: int = 12) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


@dataclass
class Loop:
    """The whole loop on one script: each stage that ran, and what the files it wrote say."""

    script: str
    stages: list[Stage] = field(default_factory=list)
    profile: dict[str, Any] | None = None  # profile's summary.json
    plan: dict[str, Any] | None = None  # plan --json's "plan"
    budget_bytes: int | None = None
    verified: dict[str, Any] | None = None  # the verify run's summary.json "verified"
    verify_plan: dict[str, Any] | None = None  # the verify run's summary.json "plan"

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)

    def tracebacks(self) -> list[str]:
        return [f"{s.name}:\n{s.tail(25)}" for s in self.stages if s.traceback]


@dataclass
class Settings:
    """How hard to push: steps profiled, the budget as a fraction of the measured peak, verify rounds."""

    steps: int = 2
    warmup: int = 1
    budget_fraction: float = 0.7
    verify_rounds: int = 2
    timeout_s: float = 900.0
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable


def memdoctor(
    name: str,
    args: list[str],
    cwd: Path,
    settings: Settings,
    *,
    pythonpath: str | None = None,
    timeout_s: float | None = None,
) -> Stage:
    """Run ``python -m memdoctor ARGS`` in ``cwd`` with memdoctor importable from this checkout."""
    env = {**os.environ, **settings.env}
    path = [str(REPO)] + ([pythonpath] if pythonpath else [])
    path += [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONDONTWRITEBYTECODE="1",
        MPLBACKEND="Agg",
    )
    env.pop("MEMDOCTOR_DEBUG", None)  # a traceback must mean a failure, not a debug flag
    argv = [settings.python, "-m", "memdoctor", *args]
    start = time.monotonic()
    code, output, cpu = _call(argv, cwd, env, timeout_s or settings.timeout_s)
    return Stage(name, argv, code, output, time.monotonic() - start, cpu)


def _call(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[int | None, str, float]:
    """Exit code (None when killed at ``timeout_s``), stdout + stderr, and the CPU seconds the command
    and the processes it waited for used (the machine may be shared: wall time alone says little).
    The command runs in its own session, so that a timeout kills every process it started."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    chunks: list[bytes] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    deadline = time.monotonic() + timeout_s
    code: int | None = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            code = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            _, _, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    proc.returncode = code if code is not None else -signal.SIGKILL  # waited for here, not by Popen
    reader.join()
    out = b"".join(chunks).decode(errors="replace")
    if code is None:
        out += f"\n[harness: killed after {timeout_s:.0f} s]"
    return code, out, usage.ru_utime + usage.ru_stime


def _json(path: Path) -> dict[str, Any] | None:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def close_the_loop(
    script: Path,
    script_args: list[str],
    work: Path,
    settings: Settings | None = None,
    *,
    cwd: Path | None = None,
    pythonpath: str | None = None,
    run_timeout_s: float | None = None,
) -> Loop:
    """Profile, plan under a budget below the measured peak, run the plan, and ``--verify``.

    Stops after the first stage that leaves nothing to go on (no trace, no plan); ``run`` and the verify
    run are attempted whenever a plan file exists, whatever the plan says, so that a plan that cannot
    be applied shows up as such. ``run_timeout_s`` stops a script that would run far longer than the
    few steps a profile takes (its run stage then ends with code None)."""
    s = settings or Settings()
    cwd = cwd or work
    work.mkdir(parents=True, exist_ok=True)
    loop = Loop(script=str(script))
    steps = ["--steps", str(s.steps), "--warmup", str(s.warmup)]

    def call(name: str, args: list[str], timeout_s: float | None = None) -> Stage:
        stage = memdoctor(name, args, cwd, s, pythonpath=pythonpath, timeout_s=timeout_s)
        loop.stages.append(stage)
        return stage

    first = work / "profile"
    call("profile", ["profile", *steps, "-o", str(first), str(script), "--", *script_args])
    loop.profile = _json(first / "summary.json")
    peak = (loop.profile or {}).get("peak_memory_bytes")
    if not isinstance(peak, int) or peak <= 0:
        return loop
    loop.budget_bytes = max(1024, int(peak * s.budget_fraction))
    budget = str(loop.budget_bytes)
    planned = work / "plan"
    stage = call("plan", ["plan", str(first), "--budget", budget, "--json", "-o", str(planned), "--force"])
    loop.plan = _plan_json(stage.output)
    config = planned / "memdoctor.yaml"
    if not config.exists():
        return loop
    call("run", ["run", "--config", str(config), str(script), "--", *script_args], run_timeout_s)
    verify = work / "verify"
    args = ["profile", *steps, "--budget", budget, "--verify", "--verify-rounds", str(s.verify_rounds)]
    call("verify", [*args, "-o", str(verify), str(script), "--", *script_args])
    summary = _json(verify / "summary.json") or {}
    loop.verified, loop.verify_plan = summary.get("verified"), summary.get("plan")
    return loop


def _plan_json(output: str) -> dict[str, Any] | None:
    """``plan --json``'s "plan", from its output: the lines from a lone ``{`` to a lone ``}`` (stderr is
    merged in; the ``Wrote`` line follows the JSON)."""
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if line == "{"]
    ends = [i for i, line in enumerate(lines) if line == "}"]
    if not starts or not ends or ends[-1] < starts[0]:
        return None
    try:
        loaded = json.loads("\n".join(lines[starts[0] : ends[-1] + 1]))
    except ValueError:
        return None
    plan = loaded.get("plan") if isinstance(loaded, dict) else None
    return plan if isinstance(plan, dict) else None


# ----------------------------------------------------------------------------------------- judging


def stage_cell(loop: Loop, name: str) -> str:
    """One table cell: how the stage ended, in a few words."""
    stage = loop.stage(name)
    if stage is None:
        return "not reached"
    if stage.traceback:
        return f"TRACEBACK (exit {stage.code})"
    if stage.code is None:
        return "killed at the timeout"
    if name == "plan" and (loop.plan is not None or stage.code == 0):
        return _plan_cell(loop.plan)
    if name == "verify":
        return _verify_cell(stage, loop.verified)
    if stage.code == 0:
        return "ok"
    return f"exit {stage.code}: {_short(stage.error or stage.tail(1))}"


def profile_cell(loop: Loop) -> str:
    s = loop.profile
    stage = loop.stage("profile")
    if s is None:
        return stage_cell(loop, "profile") if stage else "not reached"
    peak = s.get("peak_memory_bytes") or 0
    cell = f"{s.get('status')}, {s.get('steps_profiled')} steps, peak {peak / 1024:.0f} KiB"
    if stage is not None and stage.code != 0:
        cell += f" (exit {stage.code}: {_short(stage.error or str(s.get('headline')))})"
    return cell


def why_nothing_fits(plan: dict[str, Any]) -> str | None:
    """The plan's own reason, else its first piece of advice (where the planner says why)."""
    advice = plan.get("advice") or [None]
    why = plan.get("reason") or advice[0]
    return str(why) if why else None


def _plan_cell(plan: dict[str, Any] | None) -> str:
    if plan is None:
        return "no plan"
    if not plan.get("fits"):
        return f"nothing fits: {_short(str(why_nothing_fits(plan)), 240)}"
    return "fits: " + "; ".join(str(x) for x in plan.get("levers") or ["as is"])


def _verify_cell(stage: Stage, verified: dict[str, Any] | None) -> str:
    if verified is None:
        return f"exit {stage.code}, no verified rounds: {_short(stage.error or stage.tail(1))}"
    history = verified.get("history") or []
    outcomes = ", ".join(f"{h.get('outcome')}({h.get('status')})" for h in history)
    verdict = "fits" if verified.get("fits") else "no round fits"
    return f"exit {stage.code}, {verdict}; rounds: {outcomes}"


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split()).removeprefix("memdoctor: ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def problems(loop: Loop) -> list[str]:
    """Why the loop did not hold on this script: empty when it did.

    It holds when no stage printed a traceback, the profile found steps, and either the plan fits and
    both ``run`` and the verify run succeeded (a verified round fits), or the plan says it does not fit
    and gives its reason."""
    found = [f"traceback in {t}" for t in loop.tracebacks()]
    prof = loop.profile or {}
    if not prof.get("steps_profiled"):
        # a run that found no step holds only where memdoctor says why (e.g. training in a child process)
        if not (prof.get("status_message") or "").partition("; ")[2]:
            found.append(f"profile found no steps: {profile_cell(loop)}")
        return found
    if loop.plan is None:
        found.append(f"plan: no plan JSON ({stage_cell(loop, 'plan')})")
        return found
    if not loop.plan.get("fits"):
        if not why_nothing_fits(loop.plan):
            found.append("plan: nothing fits, and no reason is given")
        return found
    for name in ("run", "verify"):
        stage = loop.stage(name)
        failed = stage is None or stage.code != 0
        if failed or (name == "verify" and not (loop.verified or {}).get("fits")):
            found.append(f"{name}: {stage_cell(loop, name)}")
    return found
