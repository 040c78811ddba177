"""The forward half of the session: the module call stack, kept by global module forward hooks.

A part of ``ProfileSession`` (it reads the session's step in progress and adds samples to it), kept in
its own module because it is the hot path and reads best on its own.

``pre`` and ``post`` run for every module call of a detailed step (the hot path): each pushes or pops a
``Frame``, and a timed module also gets a sample and a tensor hook on its first input and its output
that mark the start and end of its backward. Modules deeper than ``time_depth`` keep the stack (for
the saved-tensor attribution) but get no timing sample: a CUDA event costs ~14 us of host time.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memdoctor.capture.compiled import compiled_inner, compiling
from memdoctor.capture.sessionhooks import (
    NO_PTRS,
    Frame,
    TensorHook,
    first_grad_tensor,
    in_backward,
    input_ptrs,
    pick_depth,
)

if TYPE_CHECKING:
    from memdoctor.capture.session import ProfileSession


class ForwardStack:
    """The module stack of the forward in progress, and where an exception last escaped a forward."""

    def __init__(self, session: ProfileSession, time_depth: int | None, timed_calls_budget: int) -> None:
        self.session = session
        self.frames: list[Frame] = []
        self.fault_at: int | None = None  # id() of the innermost module an exception escaped
        # None picks the depth after the first step, so that at most timed_calls_budget module calls a
        # forward are timed.
        self.time_depth = time_depth
        self.auto_depth = time_depth is None
        self.timed_calls_budget = timed_calls_budget
        self.calls_at_depth: dict[int, int] = {}
        # Calls of a torch.compile'd root's own module that ran eagerly (dynamo fell back) inside its
        # wrapper's frame, which stands for it (``compiled_inner``): skipped, not counted twice.
        self.swallowed = 0
        # id(module) -> its torch.compile wrapper, seen calling it at the top level: the wrapper's own
        # hooks run in eager code, the module's inside the compiled code (``compiled_wrapper``).
        self.wrappers: dict[int, weakref.ref[nn.Module]] = {}

    def compiled_wrapper(self, module: nn.Module) -> nn.Module | None:
        """The ``torch.compile(module)`` wrapper seen calling ``module``, if any."""
        ref = self.wrappers.get(id(module))
        wrapper = ref() if ref is not None else None
        return wrapper if wrapper is not None and compiled_inner(wrapper) is module else None

    def first_step_done(self, forwards: int) -> None:
        """Pick the timing depth from the first step's module calls (when it was left to us), per
        forward: a step may run several (micro-batches, LBFGS's closure calls)."""
        if self.auto_depth:
            per_forward = {d: -(-n // max(1, forwards)) for d, n in self.calls_at_depth.items()}
            self.time_depth = pick_depth(per_forward, self.timed_calls_budget)

    def pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        # Hot path: runs for every module call. Deep (untimed) modules only keep the stack for the
        # saved-tensor attribution. Inside torch.compile'd code dynamo folds compiling() to True and
        # traces nothing of this (memdoctor.capture.compiled): the region is its caller's one call.
        if compiling():
            return
        s, stack = self.session, self.frames
        calls = s._calls
        depth = len(stack)
        if depth == 1 and stack[0].key == id(module):
            self.swallowed += 1  # the compiled root's own call, run eagerly: its wrapper's frame has it
            return
        if depth == 0:
            inner = compiled_inner(module)
            if inner is not module and id(inner) not in self.wrappers:
                self.wrappers[id(inner)] = weakref.ref(module)
            module = inner
            if not torch.is_grad_enabled():
                stack.append(Frame(id(module), -1, 0, NO_PTRS, active=False))
                return
            if in_backward():
                # Activation checkpointing recomputing a forward inside backward: not a new
                # micro-batch, and its time is the backward's. (Non-reentrant checkpointing stops the
                # recomputation early by raising; the always_call post hook unwinds these frames.)
                stack.append(Frame(id(module), -1, 0, NO_PTRS, active=False, recompute=True))
                if calls.modules:  # collectors see recomputations (NVTX, FLOPs do)
                    calls.forward_pre(module, depth, False)
                return
            s._root_call(module)
        elif not stack[-1].active:
            recompute = stack[-1].recompute
            stack.append(Frame(id(module), -1, 0, NO_PTRS, active=False, recompute=recompute))
            if recompute and calls.modules:
                calls.forward_pre(module, depth, False)
            return
        if self.auto_depth and s._step_index == 0:
            self.calls_at_depth[depth] = self.calls_at_depth.get(depth, 0) + 1
        if self.time_depth is not None and depth > self.time_depth:
            stack.append(Frame(id(module), -1, s._data.saved_total, NO_PTRS))
            if calls.modules:
                calls.forward_pre(module, depth, False)
            return
        if calls.modules:
            calls.forward_pre(module, depth, True)
        stack.append(Frame(id(module), len(s._data.samples), s._data.saved_total, input_ptrs(args)))
        first = first_grad_tensor(args)
        if first is not None:
            first.register_hook(TensorHook(s, "bwd_post", id(module), depth))
        s._sample("fwd_pre", id(module), depth)

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if compiling():  # as in pre: no bookkeeping traced into compiled code
            return
        stack = self.frames
        key = id(module)
        if self.swallowed and stack and stack[-1].key == key:
            self.swallowed -= 1
            return
        if len(stack) == 1 and stack[0].key != key:
            key = id(compiled_inner(module))  # torch.compile's wrapper: its frame is its module's
        if output is None:
            exc = sys.exc_info()[0]
            if exc is not None:  # the forward raised: torch calls always_call hooks with None
                self._unwound(module, key, exc)
                return
        s = self.session
        calls = s._calls
        frame = stack.pop() if stack and stack[-1].key == key else self._pop_frame(key)
        if frame is None or not frame.active:
            if frame is not None and frame.recompute and calls.modules:
                calls.forward_post(module, output, len(stack), False)
            return
        data = s._data
        incl = data.saved_total - frame.saved_at_pre
        acc = data.micro.get(key)
        if acc is None:
            acc = data.micro[key] = [0, 0, 0]
        acc[0] += incl
        acc[2] += 1
        if calls.modules:
            calls.forward_post(module, output, len(stack), frame.sample >= 0)
        if frame.sample < 0:
            acc[1] = None  # not measured for untimed modules: their inputs were not recorded
            return
        if acc[1] is not None:
            acc[1] += incl - frame.input_saved
        out = first_grad_tensor(output)
        if out is not None:
            out.register_hook(TensorHook(s, "bwd_pre", key, len(stack)))
        i = s._sample("fwd_post", key, len(stack))
        data.fwd_pairs.append((key, frame.sample, i))
        if not stack and s._writer.pending:
            # The forward's kernels are queued: building the last step's record now overlaps them.
            s._emit_ready(wait=False)

    def _unwound(self, module: nn.Module, key: int, exc: type[BaseException]) -> None:
        """An exception escaped ``module``'s forward: pop its frame, and remember the innermost such
        module as where the script was (not for checkpointing's own early stop of a recomputation)."""
        if self.fault_at is None and "StopRecomputation" not in exc.__name__:
            self.fault_at = key
        frame = self._pop_frame(key)
        calls = self.session._calls
        if frame is not None and (frame.active or frame.recompute) and calls.modules:
            calls.forward_post(module, None, len(self.frames), False)

    def _pop_frame(self, key: int) -> Frame | None:
        # An exception inside a child skips its post hook: unwind to the frame of this module.
        while self.frames:
            frame = self.frames.pop()
            if frame.key == key:
                return frame
        return None
