"""Autocast around the model's forward, and fp16 loss scaling without the script calling a GradScaler.

Loss scaling is ``torch.amp.GradScaler`` itself, driven from three places the script already calls:
its ``loss.backward()`` (scaled through ``memdoctor.levers.backward``), its ``optimizer.step()`` (the
optimizer's ``step`` becomes ``scaler.step(optimizer)`` + ``scaler.update()``: unscale, skip the step on
inf/NaN, adjust the scale) and ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` (which first
unscale, as the GradScaler recipe asks, so a clipping threshold means what the script meant).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memdoctor.capture.loopshape import find_loss
from memdoctor.capture.precision import autocast_now
from memdoctor.config import GradScalerSettings
from memdoctor.levers.targets import optimizers_of
from memdoctor.patching import Undo, set_attr, wrap_forward

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def device_type(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


def autocast_forward(
    model: nn.Module,
    precision: str,
    say: Callable[[str], None] | None = None,
    on_kept: Callable[[], None] | None = None,
) -> Undo:
    """Run ``model``'s forward (and so a loss it computes) under ``torch.autocast`` in ``precision``.

    Where the script already calls the model inside its own ``torch.autocast`` for that device, its
    autocast is kept and nothing is added: of the same dtype a second context would change nothing,
    and of another dtype it would silently change the precision the script chose (a bf16 script run
    in fp16 without its own loss scaling). That case is said once through ``say``. ``on_kept`` is called
    the first time the script's autocast is kept, of any dtype (fp16 loss scaling then stands down: a
    script autocasting by itself scales its loss itself, or chose not to)."""
    dtype = DTYPES[precision]
    told: list[bool] = []

    def forward(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # the device at call time: the script may move the model after building its optimizer
        device = device_type(model)
        own = autocast_now(device)
        if own is not None:
            if not told:
                told.append(True)
                if on_kept is not None:
                    on_kept()
                if say is not None and own != dtype:
                    say(
                        f"precision {precision} not applied: the script calls {type(model).__name__} under "
                        f"its own {str(own).removeprefix('torch.')} autocast, which is kept"
                    )
            return inner(*args, **kwargs)
        with torch.autocast(device_type=device, dtype=dtype):
            out = inner(*args, **kwargs)
        return out if find_loss(out).loss is not None else to_float32(out)

    return wrap_forward(model, forward)


def to_float32(out: Any) -> Any:
    """A forward's 16-bit outputs as fp32, where it returned no loss: the script computes the loss from
    them outside the autocast memdoctor added, in the fp32 code it wrote, where a loss such as
    ``BCELoss`` with fp32 targets refuses a 16-bit input (dcgan's discriminator: "Found dtype Float but
    expected Half"). accelerate's ``convert_outputs_to_fp32`` does the same for its own autocast; it
    costs an fp32 copy of the outputs. Tensors, and tuples, lists and plain dicts of them; anything
    else is returned as it is."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
    if type(out) in (tuple, list):
        return type(out)(to_float32(x) for x in out)
    if type(out) is dict:
        return {k: to_float32(v) for k, v in out.items()}
    return out


class LossScaling:
    """fp16 loss scaling for ``model``'s optimizers (patched when the model is found, and again at the
    first backward for any built since; the GradScaler is made at the first backward)."""

    def __init__(self, settings: GradScalerSettings, model: nn.Module, fail: Callable[[str], None]) -> None:
        self.settings = settings
        self.scaler: torch.amp.GradScaler | None = None  # made at the first backward, on the model's device
        self.model = model
        self._fail = fail
        self.optimizers: list[torch.optim.Optimizer] = []
        self._undo: list[Undo] = []
        self._stepping = False
        self.off = False  # the script keeps its own autocast (``autocast_forward``): no scaling of ours
        self.steps = 0  # optimizer steps taken through the GradScaler (``summary``)

    def stand_down(self) -> None:
        """The script runs its own autocast, which is kept: leave its loss and optimizer steps alone."""
        self.off = True

    def install(self) -> Undo:
        utils = torch.nn.utils
        for name in ("clip_grad_norm_", "clip_grad_value_"):
            self._undo.append(set_attr(utils, name, self._unscaling(getattr(utils, name))))
        return self.remove

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale (a device tensor: no host sync)."""
        if self.off:
            return loss
        if self.scaler is None:
            s = self.settings
            self.scaler = torch.amp.GradScaler(  # now: the model is on the device it trains on
                device_type(self.model), init_scale=s.init_scale, growth_interval=s.growth_interval
            )
            self.attach()  # optimizers built since the model was found
            if not self.optimizers:
                self._fail(
                    "precision: fp16: no optimizer of the model exists at its first backward, so "
                    "memdoctor cannot drive loss scaling; build the optimizer before training, or use "
                    "precision: bf16"
                )
        return self.scaler.scale(loss)

    def current_scale(self, like: torch.Tensor) -> torch.Tensor:
        if self.off:
            return torch.ones((), dtype=torch.float32, device=like.device)
        assert self.scaler is not None
        return self.scaler.scale(torch.ones((), dtype=torch.float32, device=like.device))

    def attach(self) -> None:
        """Drive the GradScaler from the ``step`` of each optimizer of the model not yet patched. Called
        when the model is found (its optimizer was just built), so that even a first ``step(closure)``
        whose closure runs the first backward (Lightning) goes through the GradScaler."""
        for opt in optimizers_of(self.model):
            if all(o is not opt for o in self.optimizers):
                self.optimizers.append(opt)
                self._undo.append(self._patch_step(opt))

    def _patch_step(self, opt: torch.optim.Optimizer) -> Undo:
        original = opt.step
        scaling = self

        def step(self_opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if scaling._stepping:  # GradScaler.step calling the optimizer's own step
                return original(*args, **kwargs)
            closure = kwargs.pop("closure", None) or (args[0] if args else None)
            scaling._stepping = True
            try:
                # GradScaler takes no closure (Lightning passes one: forward + backward): run it first,
                # as Lightning's own mixed-precision plugin does, then step on its gradients
                loss = None
                if closure is not None:
                    with torch.enable_grad():
                        loss = closure()
                scaler = scaling.scaler
                if scaler is None:  # no backward yet: nothing is scaled
                    out = original() if closure is not None else original(*args, **kwargs)
                elif closure is not None:
                    out = scaler.step(self_opt)
                else:
                    out = scaler.step(self_opt, *args, **kwargs)
                if scaler is not None:
                    scaler.update()
                    scaling.steps += 1
            finally:
                scaling._stepping = False
            return loss if closure is not None else out

        # An LR scheduler built before marked the step it wrapped; keep the mark, or it warns that the
        # step was overridden. A bound method, so that a scheduler built later can wrap it the same way.
        if getattr(original, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        return set_attr(opt, "step", types.MethodType(step, opt))

    def summary(self) -> str | None:
        """The end-of-run line: how many optimizer steps the GradScaler drove and its scale now (one host
        sync, at the end), so a run shows that loss scaling was active; None when it stood down."""
        if self.off:
            return None
        if self.scaler is None or not self.steps:
            return "NOT applied: fp16 loss scaling: no optimizer step of the model ran after a backward"
        return (
            f"fp16 loss scaling: {self.steps} optimizer step(s) through torch.amp.GradScaler, scale "
            f"{self.settings.init_scale:g} at the start, {self.scaler.get_scale():g} at the end"
        )

    def _unscaling(self, clip: Callable[..., Any]) -> Callable[..., Any]:
        def clip_unscaled(*args: Any, **kwargs: Any) -> Any:
            for opt in self.optimizers:
                with contextlib.suppress(RuntimeError):  # already unscaled since the last step
                    if self.scaler is not None:
                        self.scaler.unscale_(opt)
            return clip(*args, **kwargs)

        clip_unscaled.__wrapped__ = clip  # type: ignore[attr-defined]
        return clip_unscaled
