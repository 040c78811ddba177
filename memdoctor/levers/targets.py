"""Finding the script's model and optimizer while it runs, without the user telling us.

The profiler finds the trained model at the first optimizer step (``memdoctor.capture.discovery``): the
root modules owning the parameters an optimizer steps. That is too late here: checkpointing and
autocast must be in place for the first forward (the one that runs out of memory), and a module's own
forward pre-hook is too late for its first call too (``nn.Module.__call__`` has already chosen the
forward to run). So the same rule is applied one moment earlier, when the script *builds* its optimizer
(``torch.optim.Optimizer.__init__``, which every optimizer calls, wrapped for the run): every plain,
HF-accelerate and Lightning loop builds it before its first training step. The wrapper is removed once
the model is found, and its optimizers are looked up again at the first backward (``optimizers_of``),
when the script has built (and accelerate has wrapped) them all.

A script that updates its parameters by hand builds no optimizer (pytorch/examples' word_language_model):
its model is the first top-level module called with gradients on that the plan describes, found by a
global forward pre-hook. That is the model's first forward already: the parts that wrap its submodules
(checkpointing, parameter offload) apply to it, those that wrap the model's own forward from the next.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from memdoctor.capture.discovery import find_trained_roots, optimizer_params, storage_key
from memdoctor.capture.hostoptimizer import OWN_OPTIMIZERS
from memdoctor.levers.modnames import class_name
from memdoctor.patching import Undo, set_attr


class ModelWatch:
    """Calls ``on_model(root)`` for the first root, of an optimizer the script builds, that
    ``accept(root)`` takes (False: not this one, keep looking; it may also stop the run); calls
    ``on_missing()`` if an optimizer steps before any root was taken. Before any optimizer is built,
    the first top-level module called with gradients on that ``matches`` is the model too."""

    def __init__(
        self,
        accept: Callable[[nn.Module], bool],
        on_model: Callable[[nn.Module], None],
        on_missing: Callable[[], None],
        matches: Callable[[nn.Module], bool] | None = None,
    ) -> None:
        self._accept = accept
        self._on_model = on_model
        self._on_missing = on_missing
        self._matches = matches  # the check, without side effects, for a model met at its forward
        self._undo: list[Undo] = []
        self.model: nn.Module | None = None
        self.found_at_forward = False  # found at its first forward: the script built no optimizer
        self._depth = 0
        self._passed: set[int] = set()  # top-level modules called and not taken
        self._stopped = False

    def start(self) -> Undo:
        original = torch.optim.Optimizer.__init__
        watch = self

        def __init__(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            original(opt, *args, **kwargs)
            if watch.model is None:
                watch._built(opt)

        def first_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if watch._stopped or opt in OWN_OPTIMIZERS:  # OWN: memdoctor's measurement, not the script's
                return
            watch.stop()
            watch._on_missing()

        self._stopped = False
        self._undo = [
            set_attr(torch.optim.Optimizer, "__init__", __init__),
            register_module_forward_pre_hook(self._forward_pre).remove,
            register_module_forward_hook(self._forward_post, always_call=True).remove,
        ]
        # Not removed by ``stop``, which may run inside it: torch iterates its global step hooks while
        # calling them, and a hook removed then makes the script's ``step()`` raise "OrderedDict mutated
        # during iteration" whenever another global hook follows it. Spent, it returns at once.
        step_hook = register_optimizer_step_pre_hook(first_step)

        def close() -> None:
            self.stop()
            step_hook.remove()

        return close

    def stop(self) -> None:
        self._stopped = True
        while self._undo:
            self._undo.pop()()

    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        """A top-level call with gradients on, before any optimizer was built: the model, if the plan
        describes it (a script without an optimizer)."""
        self._depth += 1
        if self._depth > 1 or self.model is not None or not torch.is_grad_enabled():
            return
        if self._matches is None or id(module) in self._passed:
            return
        if self._matches(module):
            self.model, self.found_at_forward = module, True
            self.stop()
            self._on_model(module)
        else:
            self._passed.add(id(module))

    def _forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _built(self, opt: torch.optim.Optimizer) -> None:
        ids = {id(p) for p in optimizer_params(opt)}
        for root in find_trained_roots(ids):
            if self._accept(root):
                self.model = root
                self.stop()
                self._on_model(root)
                return


def describes(
    root: nn.Module, model_class: str | None, module_count: int | None, param_count: int | None
) -> bool:
    """Whether ``root`` is the model a plan was made for, by what the plan's provenance recorded of it
    (each figure only where recorded): its class, and its module and parameter counts as the profiler
    counts them (``memdoctor.capture.discovery.describe_model``: modules once each, parameters once per
    storage). A script with several models (a GAN's generator and discriminator, built and first
    stepped in either order) then gets the plan applied to the model it names, not to the first one
    whose optimizer it builds: dcgan's two models both have ``main.0`` ... ``main.N``."""
    if model_class and class_name(root) != model_class:  # FSDP2's ``FSDP<name>`` is still <name>
        return False
    if module_count is not None and sum(1 for _ in root.named_modules()) != module_count:
        return False
    if param_count is None:
        return True
    seen: set[int] = set()
    total = 0
    for module in root.modules():
        for p in module.parameters(recurse=False):
            if storage_key(p) not in seen:
                seen.add(storage_key(p))
                total += p.numel()
    return total == param_count


def optimizers_of(model: nn.Module) -> list[torch.optim.Optimizer]:
    """The live optimizers that step any of ``model``'s parameters.

    Wrappers (accelerate's ``AcceleratedOptimizer``, an ``Optimizer`` holding the real one as
    ``.optimizer``) are left out: patching the inner optimizer covers both.
    """
    ids = {id(p) for p in model.parameters()}
    found = [
        o
        for o in gc.get_objects()
        if issubclass(type(o), torch.optim.Optimizer) and any(id(p) in ids for p in optimizer_params(o))
    ]
    return [o for o in found if not isinstance(getattr(o, "optimizer", None), torch.optim.Optimizer)]
