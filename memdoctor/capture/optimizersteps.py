"""The session's step boundaries: the global optimizer-step hooks, and the GradScaler's skipped steps.

A training step ends at its optimizer step: after the last optimizer of the cycle ``OptimizerCycle``
learned (a GAN steps two). ``OptimizerSteps`` runs in those hooks, measures what only an optimizer
step shows (gradients complete, optimizer state), and tells the session when to close the step. A part
of ``ProfileSession`` (it reads and closes the session's step in progress).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from memdoctor.capture import gradnorms, gradscaler
from memdoctor.capture.compiled import outside_compiled
from memdoctor.capture.cycle import OptimizerCycle
from memdoctor.capture.hostoptimizer import OWN_OPTIMIZERS

if TYPE_CHECKING:
    from memdoctor.capture.session import ProfileSession


class OptimizerSteps:
    """The optimizer hooks and the GradScaler watch of one session, and the optimizer cycle they learn."""

    def __init__(self, session: ProfileSession) -> None:
        self.session = session
        self.cycle = OptimizerCycle()
        self.notified = -1  # the last step whose collectors heard ``on_optimizer``
        self.handles: list[Any] = []
        self.scaler = gradscaler.ScalerWatch(self.scaler_step, self.scaler_skipped, lambda: self.cycle.count)

    def install(self) -> None:
        self.handles = [
            # Run eagerly from a compiled optimizer.step() (memdoctor.capture.compiled).
            register_optimizer_step_pre_hook(outside_compiled(self.pre)),
            register_optimizer_step_post_hook(outside_compiled(self.post)),
        ]
        self.scaler.install()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.scaler.remove()

    def pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        s = self.session
        if s._done or opt in OWN_OPTIMIZERS:
            return
        if self._compiled_step_ended():
            s._finalize_step()
            if s._done:
                return
        if s._writer.pending:
            s._emit_ready(wait=False)
        s._forward.fault_at = None
        s._ledger.in_opt = True
        if id(opt) not in s._found.known_opts:
            self._discover(opt)
        self.cycle.note(id(opt))
        s._sample("opt_pre", None, 0)
        if self.notified != s._step_index:
            self.notified = s._step_index
            s._calls.each("on_optimizer", s._step_index)
        ledger = s._ledger
        if not s.detailed(s._step_index):
            ledger.grads_live = ledger.count_grads()  # no gradient hooks on timing steps
        else:
            s._data.grad_bytes = s._grads_by_module()
            ledger.grads_live = sum(s._data.grad_bytes.values())
            if s._data.grad_norms is None:  # the step's first optimizer: no parameter updated yet
                # Launched on the device, never read here: build_step reads them once per step.
                s._data.grad_norms = s._calls.guarded("gradient norms", gradnorms.collect, ledger.flat_params)

    def _compiled_step_ended(self) -> bool:
        """Whether this optimizer step starts a new training step that no top-level module call began:
        the step in progress already had its whole optimizer cycle, and no forward was seen since
        the step began. That is a ``torch.compile``'d training-step function (forward, backward and
        ``optimizer.step()`` in one): the module hooks that start steps are traced away inside it
        (``memdoctor.capture.compiled``), so its step ends here, at the next optimizer step, instead
        of never. Only once dynamo compiled something in this session: an eager script's steps keep
        ending at a forward."""
        s = self.session
        data = s._data
        if not data.opt_posts or data.forwards or not self.cycle.done():
            return False
        return s._writer.compiled.compiled_any()

    def post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        s = self.session
        if s._done or opt in OWN_OPTIMIZERS:
            return
        s._ledger.in_opt = False
        s._hooks.rearm()
        s._data.opt_bytes = s._ledger.opt_state_by_module()
        s._sample("opt_post", None, 0)
        s._data.opt_posts += 1
        s._calls.each("on_optimizer_end", s._step_index)
        now, following = s.detailed(s._step_index), s.detailed(s._step_index + 1)
        if not self.cycle.done(last=id(opt)):
            return  # another optimizer of this training step is still to step (a GAN's generator)
        if not (now and following):
            # The next step's hooks differ from this one's: close the step at its optimizer step and
            # switch the module hooks here, outside any forward.
            s._finalize_step()
            s._module_hooks(following)
            if now:
                s._emit_ready(wait=True)  # a ledger step goes to disk at once (see below)
            return
        # A step with the per-module ledger is written as its optimizer step returns, so that a hard
        # crash right after it keeps it. On CUDA that waits for the step's GPU work: only the
        # warm-up, first and last profiled steps pay this; timing steps are written without waiting.
        s._writer.provisional(s._data)

    def scaler_step(self, scale: Any) -> None:
        """A GradScaler is about to step: keep the (device) scale its gradients were multiplied by."""
        s = self.session
        if not s._done:
            s._data.scaler_stepped = True
            s._data.loss_scale = scale

    def scaler_skipped(self, opt: torch.optim.Optimizer) -> None:
        """The GradScaler found Inf/NaN gradients and skipped ``opt.step()``: the training step still
        ends here (forward and backward ran; the script goes on to its next batch), so close it as if
        the optimizer had stepped, marked skipped, instead of merging it into the next step."""
        s = self.session
        if s._done:
            return
        s._data.scaler_skipped = True
        self.pre(opt, (), {})
        self.post(opt, (), {})

    def _discover(self, opt: torch.optim.Optimizer) -> None:
        s = self.session
        if s._found.known_opts and self.cycle.members is None and 0 < s._step_index == s.warmup:
            # A second optimizer that first steps after another's step (a GAN's generator after its
            # discriminator): the steps so far each held a part of a training step, so the first
            # profiled step becomes one more warm-up step, and the profiled steps are whole ones.
            s._schedule.set_warmup(s.warmup + 1)
        if not s._found.known_opts:
            s.emit("steps", {"found_by": "optimizer"})
        s._found.add_optimizer(opt)
