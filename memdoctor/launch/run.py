"""``memdoctor run``'s parent side: start the script in a child with the plan, wait, pass its exit code on.

A child process rather than this one, so that the script runs exactly as ``python SCRIPT ARGS`` (its
own ``__main__``, ``sys.argv``, ``sys.path[0]``) and the allocator setting is in the environment before
anything can start CUDA. Ctrl-C reaches the child from the terminal; this process waits for it. A
SIGTERM or SIGHUP sent to memdoctor alone (``timeout``, ``docker stop``) is passed on to the script,
which ends as it would under that signal; if memdoctor is killed outright, the script gets SIGTERM
from the kernel (``PR_SET_PDEATHSIG``, Linux): it never runs on without memdoctor.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from memdoctor.config import PlanConfig
from memdoctor.exitcodes import SIGNAL_BASE
from memdoctor.launch.run_child import ENV_VAR


def run_script(config: PlanConfig, script: str | None, module: str | None, args: list[str]) -> int:
    """Run the script to its end with ``config`` applied; the script's exit code (128 + N for signal N)."""
    env = dict(os.environ)
    env[ENV_VAR] = json.dumps({"config": config.as_dict(), "script": script, "module": module, "args": args})
    env.setdefault("PYTHONUNBUFFERED", "1")
    if config.allocator is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = config.allocator  # read once, when CUDA starts in the child
    proc = subprocess.Popen([sys.executable, "-m", "memdoctor.launch.run_child"], env=env)
    forwarded = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s]

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in forwarded}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child gets Ctrl-C
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return SIGNAL_BASE - code if code < 0 else code


def describe(config: PlanConfig, path: Path) -> str:
    """The start line: which plan, from where."""
    fits = config.provenance.fits
    note = {None: "", True: " (planned to fit)", False: " (the closest plan: not predicted to fit)"}[fits]
    verified = config.provenance.verified
    if verified is False:  # profile --verify saw no config fit: never "planned to fit"
        note = " (NOT verified to fit: profile --verify measured no config that fits; see its header)"
    elif verified:
        note = " (measured to fit by profile --verify)"
    return f"applying {path}{note}"
