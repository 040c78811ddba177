"""Awareness of ``torch.amp.GradScaler``: the loss scale of each step, and the steps it skipped.

Why: fp16 training (the only mixed precision of a Turing card) runs its optimizer through
``scaler.step(optimizer)``, which *skips* ``optimizer.step()`` when the scaled gradients overflowed,
as they usually do in the first steps while the scaler lowers its scale. memdoctor delimits training
steps by optimizer-step hooks, so without this a skipped step would merge with the next one and look
like gradient accumulation, its Inf gradients like a diverging model, and every gradient recorded in
backward (fp32 ones too) would be read as unscaled.

There is no public hook on ``GradScaler.step``, so ``GradScaler.step`` is wrapped (and restored exactly
on ``remove``). The wrapper keeps a device-side copy of the scale used for the step's backward (the
private ``_scale`` tensor, read only if present: no ``get_scale()``, which would synchronise with the
GPU) and tells the session when the optimizer did not step. ``torch.cuda.amp.GradScaler`` and the
scalers of HF Trainer, accelerate and Lightning are subclasses that inherit ``step``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memdoctor import patching

OnStep = Callable[[Any], None]  # called with the device scale tensor (or None) before the scaler steps
OnSkipped = Callable[[Any], None]  # called with the optimizer whose step the scaler skipped


class ScalerWatch:
    """Wraps ``torch.amp.GradScaler.step`` while installed."""

    def __init__(self, on_step: OnStep, on_skipped: OnSkipped, optimizer_steps: Callable[[], int]) -> None:
        self._on_step, self._on_skipped, self._count = on_step, on_skipped, optimizer_steps
        self._undo: patching.Undo | None = None

    def install(self) -> None:
        owner = _scaler_class()
        if owner is None or self._undo is not None:
            return
        self._undo = patching.wrap_attr(owner, "step", self._wrap)

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if not _enabled(scaler):
                return original(scaler, optimizer, *args, **kwargs)
            self._on_step(_scale_copy(scaler))
            before = self._count()
            out = original(scaler, optimizer, *args, **kwargs)
            if self._count() == before:  # no optimizer step hook ran: the scaler skipped the step
                self._on_skipped(optimizer)
            return out

        return step

    def remove(self) -> None:
        """Put the original back, unless someone wrapped it again after us (then ours passes through)."""
        if self._undo is not None:
            self._undo()
        self._undo = None


def _scaler_class() -> Any:
    amp = getattr(torch, "amp", None)
    return getattr(amp, "GradScaler", None)


def _enabled(scaler: Any) -> bool:
    try:
        return bool(scaler.is_enabled())
    except Exception:  # an unusual subclass: leave it alone
        return False


def _scale_copy(scaler: Any) -> torch.Tensor | None:
    """A device copy of the current scale (``update()`` changes the scaler's own tensor in place)."""
    scale = getattr(scaler, "_scale", None)  # private: read only when it is a tensor
    if not isinstance(scale, torch.Tensor):
        return None
    return scale.detach().clone()


def read_scale(scale: torch.Tensor | None) -> float | None:
    """The scale as a number; called when the step's GPU work is known to be finished (no stall)."""
    if scale is None:
        return None
    try:
        return float(scale.reshape(-1)[0])
    except Exception:
        return None
