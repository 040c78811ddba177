"""Micro-batching with gradient accumulation inside the model's forward.

Where the split happens, and why there: the script's loop must keep its iterations, its optimizer steps
and its LR schedule, so the batch is split inside the root model's forward, not in the loader, along
its measured batch dimension (``memdoctor.levers.apply.split_batch``). The
forward runs micro-batches 1..k-1 *and their backward* there (freeing their activations), then runs
micro-batch k and returns its output, whose ``loss`` is the full batch's (the size-weighted mean of the
micro-batch losses). The gradients of micro-batches 1..k-1 wait in ``.grad`` (or aside, see
``_Pending``): when the script backpropagates the returned loss (scaled, divided by its own
accumulation count, or any function of it), the gradient arriving at that loss tells how the script
used it, and they are multiplied by it before micro-batch k's gradients are accumulated onto them. So
the sum is the chain rule's for the whole batch: ``loss.backward()``, ``(loss / n).backward()`` and
``accelerator.backward(loss)`` all get the gradients of the unsplit batch.

Needs: a model that computes its own loss, found wherever its output holds it
(``memdoctor.capture.loopshape.find_loss``: the output itself, a tuple's element such as a minimal GPT
trainer's ``(logits, loss)``, a ``loss`` key or attribute of a dict, dataclass or HF ``ModelOutput``;
the other outputs are joined back along the batch dimension, ``memdoctor.levers.outputs``; a loop that
computes the loss itself is split at the DataLoader instead, ``memdoctor.levers.loopsplit``), a
mean-reduced loss over samples (weights are each micro-batch's share of the
samples; a loss divided by a count the caller passes, HF's ``num_items_in_batch``, is summed as is),
and a script that backpropagates that loss. Otherwise the run stops with a line naming
``accumulation_steps``: a part of the plan is never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memdoctor.capture.loopshape import LossAt, LossPath, batch_layout, find_loss
from memdoctor.errors import ConfigError
from memdoctor.levers.apply import split_batch
from memdoctor.levers.backward import BackwardPatch
from memdoctor.levers.outputs import detached, merge_outputs, nbytes
from memdoctor.patching import Undo, wrap_forward

MAX_KEPT_BYTES = 256 << 20  # earlier micro-batches' outputs (logits) kept for the script, at most


@dataclass
class _Pending:
    """Gradients of micro-batches 1..k-1, waiting for the script's backward of the returned loss.

    ``held`` is None when they are in ``.grad`` (the common case: ``.grad`` was empty before the
    split, as after ``zero_grad()``): then the gradient arriving at the returned loss scales them in
    place, before micro-batch k's gradients are accumulated onto them, so accumulation costs no memory
    beyond the gradients themselves. Otherwise (the script accumulates across iterations) they are held
    apart and added when the backward ends, at the cost of one more set of gradients meanwhile.
    """

    params: list[nn.Parameter]
    held: list[torch.Tensor | None] | None
    unscale: Callable[[torch.Tensor], torch.Tensor] | None
    grad: list[torch.Tensor] = field(default_factory=list)  # d(script's loss)/d(returned loss)

    def arrived(self, grad: torch.Tensor) -> None:
        self.grad.append(grad)
        if self.held is None:
            _scale_all([p.grad for p in self.params if p.grad is not None], self.factor())

    def factor(self) -> torch.Tensor:
        """How the script's backward weighs the returned loss (a device tensor: no sync)."""
        factor = self.grad[0].detach()
        if self.unscale is not None:  # both the earlier and the new gradients carry the loss scale
            factor = factor / self.unscale(factor)
        return factor


def _scale_all(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every gradient by ``factor`` in place: one fused launch where torch has it."""
    if not grads:
        return
    try:
        torch._foreach_mul_(grads, factor)  # public since torch 2.0 in all but name; fallback below
    except (AttributeError, RuntimeError, TypeError):
        for g in grads:
            g.mul_(factor.to(g.dtype))


class _JoinedLoss(torch.autograd.Function):
    """Value: the whole batch's loss. Backward: micro-batch k's share; and the incoming gradient, which
    scales micro-batches 1..k-1's gradients (``_Pending.arrived``), before micro-batch k's arrive."""

    @staticmethod
    def forward(ctx: Any, last: torch.Tensor, weight: float, earlier: torch.Tensor, pending: _Pending) -> Any:
        ctx.weight = weight
        ctx.pending = pending
        return last.detach() * weight + earlier.to(last.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.pending.arrived(grad)
        return grad * ctx.weight, None, None, None


class MicroBatching:
    """Split each training forward of ``model`` into ``parts`` micro-batches (see the module docstring)."""

    def __init__(
        self,
        parts: int,
        backward: BackwardPatch,
        fail: Callable[[str], None],
        say: Callable[[str], None],
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
        current_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
        expected_micro: int | None = None,
    ) -> None:
        self.parts = parts
        self.backward = backward
        self._fail = fail
        self._say = say
        self._scale = scale
        self._current_scale = current_scale
        self._expected_micro = expected_micro
        self._pending: _Pending | None = None
        self._noted_size = False
        self._noted_outputs = False
        self.splits = 0
        self._dim = 0  # the batch dimension of the last split (outputs are joined along it)
        self._layout: list[int | None] | None = None  # each input tensor's batch dimension (first batch)

    def install(self, model: nn.Module) -> Undo:
        self.model = model
        undo_forward = wrap_forward(model, self._forward)
        self.backward.after.append(self._complete)

        def undo() -> None:
            undo_forward()
            if self._complete in self.backward.after:
                self.backward.after.remove(self._complete)

        return undo

    def _forward(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and self.model.training):
            return inner(*args, **kwargs)  # evaluation: nothing to accumulate
        self._never_backpropagated()
        expected = self._expected_micro * self.parts if self._expected_micro else None
        size, dims = batch_layout((args, kwargs), expected, self._layout)
        if size is not None and size < self.parts:
            return inner(*args, **kwargs)  # an epoch's short last batch: smaller than one split needs
        try:
            parts = list(split_batch((args, kwargs), self.parts, size, dims))
        except ConfigError as exc:
            self._fail(f"{exc} (memdoctor run splits the model's inputs)")
            return inner(*args, **kwargs)
        assert size is not None  # split_batch refuses a batch without a size
        self._layout = self._layout or dims  # the first batch is a full one: later ones keep its layout
        agreed = {d for d in dims if d is not None}
        self._dim = agreed.pop() if len(agreed) == 1 else 0
        if kwargs.get("num_items_in_batch") is not None:
            # HF's loss over a count given by the caller: each micro-batch's loss is already its share
            parts = [(part, 1.0) for part, _ in parts]
        self._note_size(size)
        params = [p for p in self.model.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        in_place = all(g is None for g in saved)
        for p in params:
            p.grad = None
        try:
            earlier, outputs = self._run_earlier(inner, parts[:-1])
        except BaseException:
            for p, g in zip(params, saved, strict=True):
                p.grad = g
            raise
        held = None
        if not in_place:
            held = [p.grad for p in params]
            for p, g in zip(params, saved, strict=True):
                p.grad = g
        (last_args, last_kwargs), weight = parts[-1]
        out = inner(*last_args, **last_kwargs)
        found = self._loss_of(out)
        self._pending = _Pending(params, held, self._current_scale)
        joined = _JoinedLoss.apply(found.loss, weight, earlier, self._pending)
        self.splits += 1
        return self._merged(out, outputs, joined, found.path)

    def _never_backpropagated(self) -> None:
        """A training forward whose loss was never backpropagated left its earlier micro-batches'
        gradients in ``.grad``: they would join the next step's, so stop, naming the part."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.held is None and not pending.grad:
            self._fail(
                "accumulation_steps: a training-mode forward's loss was never backpropagated, and its "
                "earlier micro-batches' gradients are in .grad; run evaluation under torch.no_grad() or "
                "model.eval(), or remove accumulation_steps from the config"
            )

    def _run_earlier(self, inner: Callable[..., Any], parts: list[Any]) -> tuple[torch.Tensor, list[Any]]:
        total: torch.Tensor | None = None
        outputs: list[Any] = []
        for (a, kw), weight in parts:
            out = inner(*a, **kw)
            loss = self._loss_of(out).loss
            assert loss is not None
            part = loss * weight
            self.backward.raw(self._scale(part) if self._scale is not None else part)
            total = part.detach() if total is None else total + part.detach()
            outputs.append(detached(out))
            del out, loss, part  # this micro-batch's outputs are not alive during the next one's forward
        assert total is not None
        return total, outputs

    def _loss_of(self, out: Any) -> LossAt:
        found = find_loss(out)
        if found.loss is None:
            why = found.ambiguous or (
                "the model's forward returns no loss (no labels passed, or a model that does not compute one)"
            )
            self._fail(
                f"accumulation_steps: {why}, so memdoctor run cannot split the batch inside it "
                "faithfully; plan again from a profile of this script (memdoctor profile finds where its "
                "loss is and splits at the DataLoader instead), or remove accumulation_steps from the "
                "config, or apply it in code with memdoctor.apply (docs/config.md)"
            )
            raise ConfigError(f"accumulation_steps: {why}")
        return found

    def _complete(self) -> None:
        """After the script's backward: add the held gradients, times d(script's loss)/d(returned loss)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not pending.grad:
            self._fail(
                "accumulation_steps: the script backpropagated something other than the loss the model "
                "returned, so the earlier micro-batches' gradients cannot be combined with it; remove "
                "accumulation_steps from the config, or apply it in code with memdoctor.apply"
            )
            return
        if pending.held is None:
            return  # scaled in place when the gradient arrived
        factor = pending.factor()
        for p, g in zip(pending.params, pending.held, strict=True):
            if g is None:
                continue
            g.mul_(factor.to(g.dtype))
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)

    def _note_size(self, total: int) -> None:
        if self._noted_size or self._expected_micro is None:
            return
        self._noted_size = True
        if total != self._expected_micro * self.parts:
            self._say(
                f"note: the plan's micro-batch was {self._expected_micro} x {self.parts}; this batch of "
                f"{total} is split into {self.parts} micro-batches of about {total // self.parts}"
            )

    def _merged(self, out: Any, earlier: list[Any], loss: torch.Tensor, path: LossPath) -> Any:
        kept = sum(nbytes(o) for o in earlier)
        if kept > MAX_KEPT_BYTES:
            earlier = []
            if not self._noted_outputs:
                self._noted_outputs = True
                self._say(
                    "note: the model's outputs other than the loss hold the last micro-batch only (the "
                    f"earlier ones' would take {kept >> 20} MiB)"
                )
        return merge_outputs(out, earlier, loss, path, self._dim)
