"""Checks the installer runs at the script's first optimizer step, when what a lever wraps should have
been used: a part that did not apply to that step stops the run, naming it, rather than training on
without it (``memdoctor.levers.install``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from memdoctor.capture.hostoptimizer import OWN_OPTIMIZERS
from memdoctor.levers.targets import optimizers_of
from memdoctor.patching import Undo, wrap_forward


def offloaded_only(fail: Callable[[str], None], root: nn.Module, offloaded: list[Any]) -> Undo:
    """An optimizer of the model built after it was found (a second one) has no offload: the first time
    it steps, stop, naming it, rather than silently keep its state on the device."""
    looked: set[int] = {id(o) for o in offloaded}

    def check(opt: Any, args: Any, kwargs: Any) -> None:
        if id(opt) in looked:
            return
        looked.add(id(opt))
        if opt in optimizers_of(root):
            fail(
                f"optimizer: offload: {type(opt).__name__}, built after the model's first optimizer, is "
                "not offloaded (memdoctor run offloads the optimizers that exist when the model is found)"
            )

    return register_optimizer_step_pre_hook(check).remove


def forward_called(fail: Callable[[str], None], root: nn.Module, part: str) -> Undo:
    """Autocast and micro-batching wrap the model's forward: if the first optimizer step ends and it
    was never called (a LightningModule whose training_step calls ``self.model`` directly), the part
    did not apply to that step, and the run stops naming it before the next."""
    calls = [0]
    stepped = [False]

    def count(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return inner(*args, **kwargs)

    def first_step(opt: Any, args: Any, kwargs: Any) -> None:
        # Spent after the first step, not removed: removing a global step hook from inside it makes
        # the script's step() raise "OrderedDict mutated during iteration" when another global hook
        # follows (torch iterates them live). OWN: memdoctor's own measurement, not the script's step.
        if stepped[0] or opt in OWN_OPTIMIZERS:
            return
        stepped[0] = True
        if not calls[0]:
            fail(
                f"{part}: {type(root).__name__}.forward, which memdoctor wraps, was not called in the "
                "first optimizer step (the script calls a submodule directly?); remove it from the "
                "config, or apply it in code with memdoctor.apply"
            )

    undo = wrap_forward(root, count)
    # after the step: an optimizer step with a closure (Lightning) runs the forward inside it
    handle = register_optimizer_step_post_hook(first_step)

    def remove() -> None:
        handle.remove()
        undo()

    return remove
