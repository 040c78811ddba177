"""Which steps record what: warm-up or profiled, the per-module ledger or timing only, and the
allocator's history.

On CUDA ("auto") the warm-up steps and the first and last profiled steps record the per-module ledger;
the steps between are timing steps, with only the optimizer hooks and the allocator's peak, so their
step times are those of the script without memdoctor's per-module work. On a CPU there is no allocator
peak, so every step is detailed; so is every step of a script without an optimizer
(``detail_all``). The allocator's history is recorded for the first step (a script that
runs out of memory usually does so there) and the first and last profiled steps (CUDA only).
"""

from __future__ import annotations

from memdoctor.capture import history
from memdoctor.capture.stepbuild import StepData
from memdoctor.device import Device


class StepSchedule:
    """``warmup`` and ``steps`` as the session runs them (a GAN's second optimizer adds a warm-up step)."""

    def __init__(self, warmup: int, steps: int, device: Device, detail: str) -> None:
        self.steps = steps
        self.device = device
        self.detail: set[int] | None = set() if detail != "all" and device.has_allocator else None
        self.recorder = history.HistoryRecorder() if history.available() and device.kind == "cuda" else None
        self.set_warmup(warmup)

    def set_warmup(self, warmup: int) -> None:
        self.warmup = warmup
        self.history_steps = {0, warmup, warmup + self.steps - 1}
        if self.detail is not None:
            self.detail = set(range(warmup)) | {warmup, warmup + self.steps - 1}

    def detail_all(self) -> None:
        """Record every step from now on in full: steps found from backward passes end where the module
        hooks see a training forward, and timing steps run without them."""
        self.detail = None

    def detailed(self, step: int) -> bool:
        """Whether ``step`` records the per-module ledger (else it is a timing step)."""
        return self.detail is None or step in self.detail

    def start_history(self, data: StepData) -> None:
        """Record the allocator's history for ``data``'s step, if it is one of the steps that do."""
        if self.recorder is None or data.step not in self.history_steps:
            return
        mem = self.device.memory()
        data.history_baseline = mem[0] if mem else 0
        self.recorder.start()

    def stop_history(self, data: StepData) -> None:
        if self.recorder is not None and self.recorder.active:
            data.history = self.recorder.stop()
