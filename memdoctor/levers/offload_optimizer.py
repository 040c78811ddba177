"""Optimizer-state offload: ``optimizer.step`` run on host copies of the parameters and gradients, so
the optimizer creates and keeps its state on the host (see ``memdoctor.levers.offload`` for why this
way). The script's optimizer object, its ``param_groups`` and its parameter objects stay as they are.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memdoctor.levers.offload_host import (
    HostFlags,
    fused_refusal,
    host_buffer,
    optimizer_params,
    state_to,
    synchronize,
)
from memdoctor.patching import Undo, set_attr


class OptimizerOffload:
    """``optimizer.step`` run on host copies of the parameters and gradients: the state lives on the host.

    ``resident``: parameters that already live on the host (``ParameterOffload``): they step in place.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        host: str | torch.device = "cpu",
        resident: Iterable[Any] = (),
    ) -> None:
        self.optimizer = optimizer
        self.host = torch.device(host)
        self.resident = {id(p) for p in resident}
        self.notes: list[str] = []
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def refusal(self) -> str | None:
        """Why this optimizer cannot step on the host faithfully, or None."""
        if isinstance(self.optimizer, torch.optim.LBFGS):
            return "LBFGS evaluates its closure several times per step; offload runs it once, before the step"
        return None

    def install(self) -> Undo:
        why = self.refusal()
        if why is not None:
            raise ValueError(why)
        refused = fused_refusal(self.optimizer, lambda p: True, self.host)
        if refused is not None:
            raise ValueError(refused)
        flags = HostFlags(self.optimizer, self.host)
        flags.apply()
        self.notes = flags.notes
        opt = self.optimizer
        original = opt.step
        offload = self

        def step(self_opt: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
            loss = None
            if closure is not None:  # as the optimizers of torch.optim (but LBFGS) do: once, first
                with torch.enable_grad():
                    loss = closure()
            moved = offload._to_host()
            try:
                flags.apply()  # groups a load_state_dict brought since
                state_to(self_opt, lambda p: offload.host)  # state a checkpoint loaded onto the device
                original()
            finally:
                offload._back(moved)
            return loss

        # An LR scheduler built before marked the step it wrapped; keep the mark (else it warns). A bound
        # method, so that a scheduler built later wraps it the same way (memdoctor.levers.autocast too).
        if getattr(original, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        step_undo = set_attr(opt, "step", types.MethodType(step, opt))

        def undo() -> None:
            step_undo()
            flags.undo()
            state_to(opt, lambda p: p.device)  # the original step expects its state beside the parameters

        return undo

    def _to_host(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Copy each device parameter with a gradient, and the gradient, to its host buffers (queued, then
        one synchronise); swap ``p.data`` / ``p.grad`` to them. Returns (param, device data, device grad)."""
        queued = []
        devices = set()
        for _, p in optimizer_params(self.optimizer):
            if p.grad is None or id(p) in self.resident:
                continue
            master, grad_buffer = self._buffer(p)
            master.copy_(p.detach(), non_blocking=True)
            if grad_buffer is None:  # a sparse gradient: copied as it is
                host_grad = p.grad.to(self.host)
            else:
                host_grad = grad_buffer.copy_(p.grad, non_blocking=True)
            queued.append((p, master, host_grad))
            devices.add(p.device)
        synchronize(devices)
        moved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        for p, master, host_grad in queued:
            data, grad = p.data, p.grad
            p.grad = None  # a gradient must sit on its parameter's device: unset it across the swap
            p.data = master
            p.grad = host_grad
            moved.append((p, data, grad))
        return moved

    def _back(self, moved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> None:
        """Copy the updated host values into the device storage and swap the device tensors back. The
        copies are queued on the stream; the next step's copies to the host queue after them."""
        for p, data, grad in moved:
            data.copy_(p.data, non_blocking=True)
            p.grad = None
            p.data = data
            p.grad = grad

    def _buffer(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The parameter's host master copy and gradient buffer, made once (again if a shape changed)."""
        master, grad_buffer = self._buffers.get(id(p), (None, None))
        grad = p.grad
        assert grad is not None
        if master is None or master.shape != p.shape or master.dtype != p.dtype:
            master = host_buffer(p, self.host)
            grad_buffer = None
        if grad.is_sparse:
            grad_buffer = None
        elif grad_buffer is None or grad_buffer.shape != grad.shape or grad_buffer.dtype != grad.dtype:
            grad_buffer = host_buffer(grad, self.host)
        self._buffers[id(p)] = (master, grad_buffer)
        return master, grad_buffer
