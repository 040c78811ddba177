"""Writing the session's steps as trace records, without making the script wait for the GPU.

Resolving a step's CUDA events waits for the GPU, so a finished step waits in ``pending`` until its
events have completed, and is written then: the script keeps running ahead of the GPU as it does
without memdoctor. A part of ``ProfileSession`` (it reads the session's models and ledger).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memdoctor.capture import gradscaler
from memdoctor.capture.compiled import CompileWatch
from memdoctor.capture.stepbuild import StepData, build_step
from memdoctor.trace import StepRecord

if TYPE_CHECKING:
    from memdoctor.capture.session import ProfileSession


class StepWriter:
    """Finished steps waiting for their GPU work (``pending``) and the records written (``records``)."""

    def __init__(self, session: ProfileSession) -> None:
        self.session = session
        self.pending: list[tuple[StepData, int, bool]] = []  # (step, samples it has, complete)
        self.records: list[StepRecord] = []
        self.compiled = CompileWatch()  # what torch.compile did while the session ran

    def provisional(self, data: StepData) -> None:
        """Write the step now, marked complete; if a second optimizer steps before the next forward,
        the step's final record (same step number) replaces this one when the trace is read."""
        s = self.session
        data.fold_micro()
        rec = build_step(
            data,
            upto=len(data.samples),
            device=s.device,
            index=s._index,
            parents={m.info.index: m.info.parents for m in s.models},
            warmup=data.step < s.warmup,
            complete=True,
            param_ptrs=s._ledger.param_ptrs,
            release=False,
            engines=s._engines.categories(),
        )
        s.sink(self.step_record(rec, data))

    def ready(self, *, wait: bool) -> None:
        """Write finished steps whose GPU work is done; with wait=True, all of them (synchronising)."""
        while self.pending:
            data, upto, complete = self.pending[0]
            if not wait and not self.session.device.ready(data.samples[upto - 1].marker):
                return
            self.pending.pop(0)
            self.write(data, complete=complete, upto=upto)

    def write(self, data: StepData, *, complete: bool, upto: int) -> StepRecord:
        s = self.session
        data.fold_micro()
        rec = build_step(
            data,
            upto=upto,
            device=s.device,
            index=s._index,
            parents={m.info.index: m.info.parents for m in s.models},
            warmup=data.step < s.warmup,
            complete=complete,
            param_ptrs=s._ledger.param_ptrs,
            detailed=s.detailed(data.step),
            engines=s._engines.categories(),
        )
        self.records.append(rec)
        s.sink(self.step_record(rec, data))
        self.compiled.update(s.emit)
        return rec

    def step_record(self, rec: StepRecord, data: StepData) -> dict[str, Any]:
        """The step's trace record, with its gradient-norm summary (``grad_norm``, null where not
        measured), the time in torch.distributed's collectives (``collectives``, with a process group
        only) and what the collectors measured (``collectors``, extra ``modules`` columns)."""
        out = rec.to_record()
        out["grad_norm"] = data.grad_norm_field
        if data.scaler_stepped:  # the step's GPU work is done here: reading the scale does not stall
            scale = gradscaler.read_scale(data.loss_scale)
            out["grad_scaler"] = {"scale": scale, "skipped": data.scaler_skipped}
        collectives = self.session._collectives.step_field(rec.step)
        if collectives is not None:
            out["collectives"] = collectives
        fields = self.session._calls.step_fields(rec.step, out["modules"])
        if fields:
            out["collectors"] = fields
        return out
