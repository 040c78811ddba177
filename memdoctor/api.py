"""Profiling inside your own process: ``with memdoctor.profile(): train()``.

For notebooks and scripts that cannot be run by ``memdoctor profile`` (an existing launcher, a
training function called from a larger program). The same session, collectors, trace and report as
the command line, without the supervising process, so a hard crash (a segfault) takes the trace's end
with it; everything written up to that point stays readable (``memdoctor report`` salvages it).

    import memdoctor

    with memdoctor.profile("memdoctor-report", steps=5) as prof:
        train()
    print(prof.report_path)

On leaving the block every hook is removed and every patched function restored, whether the block
finished, raised, or the requested steps were reached first (then profiling stops there and the
training carries on unprofiled). An exception raised in the block is recorded and re-raised.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from memdoctor.errors import UsageError
from memdoctor.launch.faults import close_session, exception_fields, is_oom, one_line
from memdoctor.trace import (
    PARTIAL_SUFFIX,
    TRACE_FILENAME,
    TraceWriter,
    event_record,
    load_trace,
    make_end,
)
from memdoctor.trace.redact import redact_argv
from memdoctor.units import parse_size


class profile:  # lower case: used as ``with memdoctor.profile(...)``, like torch.profiler.profile
    """Profile the training steps run inside the ``with`` block (see the module docstring)."""

    def __init__(
        self,
        output: str | os.PathLike[str] | None = None,
        *,
        steps: int = 5,
        warmup: int = 1,
        collect: str | list[str] = "all",
        budget: int | str | None = None,
        force: bool = False,
        detail: str = "auto",
        time_depth: int | None = None,
    ) -> None:
        from memdoctor.capture.collectors import parse_names

        if steps < 1 or warmup < 0:
            raise UsageError("memdoctor.profile: steps must be >= 1 and warmup >= 0")
        if detail not in ("auto", "all"):
            raise UsageError(f"memdoctor.profile: detail is 'auto' or 'all', not {detail!r}")
        self.output = Path(output) if output is not None else None
        self.steps, self.warmup, self.force = steps, warmup, force
        self.detail, self.time_depth = detail, time_depth
        try:
            self.collect = (
                parse_names(collect) if isinstance(collect, str) else parse_names(",".join(collect))
            )
        except ValueError as exc:
            raise UsageError(f"memdoctor.profile: {exc}") from None
        self.budget_bytes = parse_size(budget) if isinstance(budget, str) else budget
        self.out_dir: Path | None = None
        self.trace_path: Path | None = None
        self.report_path: Path | None = None
        self.summary_path: Path | None = None
        self.summary: dict[str, Any] | None = None
        self.status: str | None = None
        self._session: Any = None
        self._writer: Any = None
        self._out: Any = None
        self.output_error: str | None = None  # the outputs that could not be written, and what was kept
        self._partial: Path | None = None
        self._t0 = 0.0

    # ----------------------------------------------------------------------------------------------
    def __enter__(self) -> profile:
        from memdoctor.outputs import profile_output_dir

        self._t0 = time.monotonic()
        self._out = profile_output_dir(self.output, force=self.force)  # claimed until _finish
        try:
            return self._start()
        except BaseException:
            self._out.release()
            raise

    def _start(self) -> profile:
        """Everything after the folder claim; a failure here releases the folder (``__enter__``)."""
        from memdoctor.capture.session import ProfileSession
        from memdoctor.device import default_device
        from memdoctor.launch.profile_child import start_run

        self.out_dir = self._out.path
        self.trace_path = self.out_dir / TRACE_FILENAME
        self._partial = self.trace_path.with_name(TRACE_FILENAME + PARTIAL_SUFFIX)
        device = default_device()
        cfg = {
            "command": {
                "argv": redact_argv(list(sys.argv[1:])),
                "script": sys.argv[0] or None,
                "module": None,
                "cwd": os.getcwd(),
                "in_process": True,
            },
            "warmup": self.warmup,
            "steps": self.steps,
            "budget_bytes": self.budget_bytes,
            "collect": self.collect,
        }
        collectors, header = start_run(cfg, device)
        self._writer = TraceWriter(self._partial, on_error=self._write_failed)
        self._writer.write(header)
        self._session = ProfileSession(
            steps=self.steps,
            warmup=self.warmup,
            sink=self._writer.write,
            device=device,
            on_done=self._reached_steps,
            time_depth=self.time_depth,
            detail=self.detail,
            collectors=collectors,
        )
        self._session.start()
        return self

    def _write_failed(self, exc: OSError) -> None:
        """A trace write failed inside the training's own calls: never raise into it. In your own
        process memdoctor cannot stop the script, so the training runs on unrecorded (the hooks stay
        until the block ends, writing nothing); the steps flushed before stay in the trace."""
        reason = exc.strerror or str(exc) or type(exc).__name__
        print(
            f"memdoctor: error: cannot write {self._partial} ({reason}); recording stopped, the training "
            "carries on unprofiled",
            file=sys.stderr,
        )

    def _reached_steps(self) -> None:
        self._session.stop()
        n = self._session.steps_recorded
        self._writer.write(event_record("stopped", f"stopped profiling after {n} steps, as requested"))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        session, writer = self._session, self._writer
        try:
            if exc is not None:
                where = close_session(session)
                if isinstance(exc, KeyboardInterrupt):
                    writer.write(event_record("interrupted", "interrupted (Ctrl-C)", where))
                    self.status = "interrupted"
                else:
                    self.status = "oom" if is_oom(exc) else "exception"
                    writer.write(event_record(self.status, one_line(exc), where, **exception_fields(exc)))
            else:
                done = session._done
                session.finish()
                if not done:
                    writer.write(event_record("script_finished", "the profiled block ended", session.where()))
                self.status = "completed" if done else "script_finished"
        finally:
            session.stop()
            writer.close()
            try:
                self._finish()
            finally:
                self._out.release()

    def _finish(self) -> None:
        """Close the trace (end record, atomic save) and write the report and summary."""
        from memdoctor.launch.saving import failure_line, save_outputs

        assert self._partial is not None and self.trace_path is not None and self.out_dir is not None
        trace = load_trace(self._partial, salvage=True)
        steps = sum(1 for s in trace.steps if s.complete)
        if self._writer.failed is not None:
            self.status = "output_failed"
        trace.end = make_end(
            status=self.status,
            message=_message(self.status, steps, trace),
            steps_recorded=steps,
            duration_s=time.monotonic() - self._t0,
        )
        saved = save_outputs(trace, self.out_dir, self._partial)
        self.output_error = failure_line(saved, steps)
        if self.output_error:
            print(f"memdoctor: error: {self.output_error}", file=sys.stderr)
        self.trace_path = saved.paths.get("trace", saved.kept)
        self.report_path, self.summary_path = saved.paths.get("report"), saved.paths.get("summary")
        self.summary = json.loads(self.summary_path.read_text()) if self.summary_path else None


def _message(status: str | None, steps: int, trace: Any) -> str:
    last = next((e for e in reversed(trace.events) if e.get("kind") in ("oom", "exception")), None)
    if status == "completed":
        return f"profiled {steps} steps"
    if status == "script_finished":
        return f"the profiled block ended after {steps} steps"
    if status == "interrupted":
        return f"interrupted after {steps} steps"
    if status == "output_failed":
        return f"the trace could not be written after {steps} steps: recording stopped"
    return f"{(last or {}).get('message', 'the block raised')} (after {steps} steps)"
