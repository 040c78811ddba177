"""Micro-batching for loops that compute the loss themselves: split at the DataLoader, defer the step.

When the model's forward returns no loss (the loop computes it from the logits, as a torchvision
classification loop does), the in-forward split (``memdoctor.levers.microbatch``) cannot weigh the
micro-batches. So the split moves to where the batch comes from: each batch a training DataLoader
yields (``_BaseDataLoaderIter.__next__``, as the data collector and padding trim patch it: torch has no
public hook there) is split into k micro-batches along its measured batch dimension
(``memdoctor.levers.apply.split_batch``), and the loop gets them one by one, so the script's step body
runs k times per batch. Then:

- each user backward of a scalar loss is multiplied by its micro-batch's share of the batch (size /
  batch size; exact for an uneven split too), so the summed gradients are the whole batch's for a loss
  that is a mean over the batch's samples (a sum-reduced loss would come out that share too small);
- ``optimizer.step`` (each optimizer's own, as an instance method, outermost: an LR scheduler rebinds
  it, memdoctor's optimizer offload wraps it),
  LR-scheduler ``step``, GradScaler ``step``/``unscale_``/``update`` and gradient clipping run only for a
  batch's last micro-batch (clipping earlier ones would clip a partial gradient: there the norm is
  computed and returned, nothing is clipped); earlier calls are no-ops;
- ``zero_grad`` (an optimizer's or a module's) clears only when no gradient of the current batch is in
  ``.grad`` yet (called first in the body) or after the batch's real step (called last): it never
  clears what the batch's earlier micro-batches accumulated.

The script's optimizer-step count and LR schedule stay the script's. What changes for the loop: it
iterates k times per batch (``enumerate`` counts micro-batches; ``len(loader)`` still counts batches),
and a loss it logs is a micro-batch's. Batches fetched in evaluation (``torch.no_grad()`` or the model
in ``eval()``) are not split. Needs ``torch.optim`` (a script that updates parameters by hand cannot be
deferred: the run stops, naming it).

Look-ahead. ``accelerate`` prepares loaders that fetch one batch ahead (to know whether the current one
is the last), so the loop trains on micro-batch j while micro-batch j+1 is being fetched: the state of
the micro-batch fetched is not the state of the one trained on. So each fetched micro-batch's state
waits in a queue, and the loop enters it ``lookahead`` fetches later (at the end of an epoch, when the
fetch that finds no more batches leaves one to train on). The look-ahead is measured, as the profiler
measures it: the micro-batches fetched by the first training forward, less the one it runs on. One
batch ahead at most: a deeper look-ahead stops the run, naming it, as does accelerate's own gradient
accumulation (it would count micro-batches as its own and step on them).
"""

from __future__ import annotations

import collections
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memdoctor.capture.loopshape import accelerate_accumulation, batch_layout
from memdoctor.errors import ConfigError
from memdoctor.levers.apply import split_batch
from memdoctor.levers.backward import BackwardPatch
from memdoctor.patching import Undo, set_attr, wrap_attr

State = tuple[int, int, float]  # a micro-batch: its index, the batch's count of them, its share


class LoopSplit:
    """Split each training DataLoader batch into ``parts`` and defer the step (module docstring)."""

    def __init__(
        self,
        parts: int,
        backward: BackwardPatch,
        fail: Callable[[str], None],
        training: Callable[[], bool] = lambda: True,
        expected_batch: int | None = None,
    ) -> None:
        self.parts = parts
        self.backward = backward
        self._fail = fail
        self._training = training
        self._expected = expected_batch
        self._queues: weakref.WeakKeyDictionary[Any, collections.deque[Any]] = weakref.WeakKeyDictionary()
        self._undo: list[Undo] = []
        self._part: int | None = None  # the micro-batch the loop is on (None: no training batch)
        self._count = 1
        self._weight = 1.0
        self._touched: set[int] = set()  # optimizers with gradients of the current batch in .grad
        self._stepped: set[int] = set()  # optimizers that took the current batch's real step
        self._backwards = 0  # user backwards in the current batch
        self._ever_stepped = False
        self._built: list[weakref.ref[torch.optim.Optimizer]] = []  # optimizers not yet deferred
        self._wrapped: set[int] = set()
        self._layout: list[int | None] | None = None  # each tensor's batch dimension, from the first batch
        # per iterator: the states of micro-batches fetched and not yet trained on; the last fetched from
        self._pending: weakref.WeakKeyDictionary[Any, collections.deque[State]] = weakref.WeakKeyDictionary()
        self._last: weakref.ref[Any] | None = None
        self.lookahead: int | None = None  # measured at the first training forward
        self._first_forward: Any = None  # the hook that measures it
        self.batches = 0

    # ------------------------------------------------------------------------------ state
    def mid_batch(self) -> bool:
        """Whether the loop is on a micro-batch before its batch's last: steps are deferred."""
        return self._part is not None and self._part < self._count - 1

    def _enter(self, part: int, count: int, weight: float) -> None:
        if part == 0:
            self._wrap_built()
            self._check_stepped()
            self._touched.clear()
            self._stepped.clear()
            self._backwards = 0
            self.batches += 1
        self._part, self._count, self._weight = part, count, weight

    def _fetched(self, it: Any, state: State) -> None:
        """A micro-batch was fetched from ``it``: the loop trains on the one fetched ``lookahead``
        fetches ago from the same iterator."""
        pending = self._pending.setdefault(it, collections.deque())
        pending.append(state)
        self._last = weakref.ref(it)
        while self.lookahead is not None and len(pending) > self.lookahead:
            self._enter(*pending.popleft())

    def _ended(self, it: Any) -> None:
        """The loader found no more batches: with look-ahead, the loop still trains on the last one."""
        pending = self._pending.get(it)
        if pending and self.lookahead:
            self._enter(*pending.popleft())
        else:
            self._part = None  # the epoch is over: steps after the loop are the script's own

    def _forward(self, module: nn.Module, _args: Any) -> None:
        """The first training forward after a fetch measures the look-ahead (module docstring), on the
        iterator fetched from last (a batch peeked at with ``next(iter(loader))`` is another's)."""
        it = self._last() if self._last is not None else None
        pending = self._pending.get(it) if it is not None else None
        if not (pending and module.training and torch.is_grad_enabled()):
            return
        self._first_forward.remove()
        self.lookahead = len(pending) - 1
        if self.lookahead > 1:
            self._fail(
                f"accumulation_steps: the script's DataLoader is read {self.lookahead} batches ahead; "
                "memdoctor run splits batches read at most one ahead; remove accumulation_steps"
            )
        steps = accelerate_accumulation()
        if steps > 1:
            self._fail(
                f"accumulation_steps: the script accumulates gradients through accelerate "
                f"(gradient_accumulation_steps={steps}), which would count memdoctor's micro-batches as "
                "its own and step k times as often; remove accumulation_steps from the config"
            )
        self._enter(*pending.popleft())

    def _check_stepped(self) -> None:
        """A whole batch backpropagated with no optimizer step called: parameters updated by hand."""
        if self._part is not None and self._count > 1 and self._backwards and not self._ever_stepped:
            self._fail(
                "accumulation_steps: the script updates its parameters without a torch.optim optimizer "
                "step, which memdoctor run cannot defer to the batch's last micro-batch; remove "
                "accumulation_steps from the config"
            )

    def share(self, loss: torch.Tensor) -> torch.Tensor:
        """The user's loss weighted by its micro-batch's share (``BackwardPatch.share``)."""
        if self._part is None:
            return loss
        self._backwards += 1
        return loss * self._weight if self._count > 1 else loss

    # ------------------------------------------------------------------------------ install
    def install(self) -> Undo:
        from torch.utils.data import dataloader

        cls = getattr(dataloader, "_BaseDataLoaderIter", None)
        if cls is None or not callable(cls.__dict__.get("__next__")):
            raise ConfigError("accumulation_steps: this torch has no DataLoader iterator to split batches in")
        self._undo += [
            wrap_attr(cls, "__next__", self._next),
            wrap_attr(torch.optim.Optimizer, "__init__", self._optimizer_init),
            wrap_attr(nn.Module, "zero_grad", self._module_zero_grad),
            wrap_attr(torch.amp.GradScaler, "step", self._deferred_or(None)),
            wrap_attr(torch.amp.GradScaler, "update", self._deferred_or(None)),
            wrap_attr(torch.amp.GradScaler, "unscale_", self._deferred_or(None)),
            wrap_attr(nn.utils, "clip_grad_value_", self._deferred_or(None)),
            wrap_attr(nn.utils, "clip_grad_norm_", self._clip_norm),
        ]
        for sched in _scheduler_classes():
            self._undo.append(wrap_attr(sched, "step", self._deferred_or(None)))
        self._first_forward = nn.modules.module.register_module_forward_pre_hook(self._forward)
        self._undo.append(self._first_forward.remove)
        self.backward.share = self.share
        return self.remove

    def remove(self) -> None:
        if self.backward.share == self.share:
            self.backward.share = None
        while self._undo:
            self._undo.pop()()

    # ------------------------------------------------------------------------------ the loader
    def _next(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        split = self

        def __next__(it: Any) -> Any:
            queue = split._queues.get(it)
            if queue:
                part, count, weight, micro = queue.popleft()
                split._fetched(it, (part, count, weight))
                return micro
            try:
                batch = original(it)
            except StopIteration:
                split._ended(it)
                raise
            if not (torch.is_grad_enabled() and split._training()):
                return batch  # evaluation: not split
            parts = split._split(batch)
            split._queues[it] = collections.deque(
                (i, len(parts), w, micro) for i, (micro, w) in enumerate(parts) if i
            )
            split._fetched(it, (0, len(parts), parts[0][1]))
            return parts[0][0]

        return __next__

    def _split(self, batch: Any) -> list[tuple[Any, float]]:
        size, dims = batch_layout(batch, self._expected, self._layout)
        if size is not None and size < self.parts:
            return [(batch, 1.0)]  # an epoch's short last batch: smaller than one split needs
        if self._layout is None and size is not None:
            self._layout = dims  # the first batch is a full one: later batches keep its layout
        try:
            return list(split_batch(batch, self.parts, size, dims))
        except ConfigError as exc:
            self._fail(f"{exc} (memdoctor run splits each DataLoader batch)")
            return [(batch, 1.0)]

    # ------------------------------------------------------------------------------ deferral
    def _optimizer_init(self, original: Callable[..., None]) -> Callable[..., None]:
        split = self

        def __init__(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            original(opt, *args, **kwargs)
            split._built.append(weakref.ref(opt))

        return __init__

    def _wrap_built(self) -> None:
        """Defer the steps of the optimizers built so far, at a training batch's first micro-batch: by
        then every wrapper of their ``step`` is in place (an LR scheduler's, memdoctor's optimizer
        offload, installed when the model is found), and the deferral is outermost, so none of them runs
        before the batch's last micro-batch."""
        built, self._built = self._built, []
        for ref in built:
            opt = ref()
            if opt is not None and id(opt) not in self._wrapped:
                self._wrapped.add(id(opt))
                self._watch(opt)

    def _watch(self, opt: torch.optim.Optimizer) -> None:
        """Defer ``opt``'s step and zero_grad (bound methods: an LR scheduler rebinds ``step``'s
        ``__func__``), and note when its parameters receive gradients."""
        key = id(opt)
        step, zero = opt.step, opt.zero_grad

        def deferred_step(_opt: Any, *args: Any, **kwargs: Any) -> Any:
            if self.mid_batch():
                return None
            self._ever_stepped = True
            self._stepped.add(key)
            return step(*args, **kwargs)

        def deferred_zero(_opt: Any, *args: Any, **kwargs: Any) -> None:
            if self._part is None or key not in self._touched or key in self._stepped:
                zero(*args, **kwargs)

        if getattr(step, "_wrapped_by_lr_sched", False):  # the scheduler checks its wrapper is still there
            deferred_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        self._undo.append(set_attr(opt, "step", types.MethodType(deferred_step, opt)))
        self._undo.append(set_attr(opt, "zero_grad", types.MethodType(deferred_zero, opt)))

        def touched(_p: torch.Tensor) -> None:
            self._touched.add(key)

        for group in opt.param_groups:
            for p in group["params"]:
                if isinstance(p, torch.Tensor) and p.requires_grad:
                    self._undo.append(p.register_post_accumulate_grad_hook(touched).remove)

    def _module_zero_grad(self, original: Callable[..., None]) -> Callable[..., None]:
        split = self

        def zero_grad(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            if split._part is None or not (split._touched - split._stepped):
                original(module, *args, **kwargs)

        return zero_grad

    def _deferred_or(self, value: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A wrapper maker: the original, except before a batch's last micro-batch (then ``value``)."""

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def deferred(*args: Any, **kwargs: Any) -> Any:
                return value if self.mid_batch() else original(*args, **kwargs)

            return deferred

        return make

    def _clip_norm(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
            if self.mid_batch():  # the norm of a partial gradient, returned; nothing clipped
                return original(parameters, float("inf"), *args, **kwargs)
            return original(parameters, max_norm, *args, **kwargs)

        return clip_grad_norm_


def _scheduler_classes() -> list[type]:
    """The LR schedulers whose class defines its own ``step`` (the base and those overriding it)."""
    from torch.optim import lr_scheduler

    bases = tuple(
        c for c in (getattr(lr_scheduler, "LRScheduler", None), lr_scheduler.ReduceLROnPlateau) if c
    )
    return [
        c
        for c in vars(lr_scheduler).values()
        if isinstance(c, type) and issubclass(c, bases) and "step" in c.__dict__
    ]
