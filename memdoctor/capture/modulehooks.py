"""The hooks only the steps with the per-module ledger run: the global module forward hooks (the
``ForwardStack``), the saved-tensors hook (the ``Ledger``'s activations) and a gradient hook on every
parameter. Installed and removed between steps only, never inside a forward.

Timing steps run without them, so their step times are the script's own: even the gradient hooks are
~200 Python calls a backward on BERT-base; a timing step counts its gradients once, at the optimizer
step, instead.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from memdoctor.capture.compiled import eager_hook, hush_global_hooks_warning
from memdoctor.capture.discovery import DiscoveredModel
from memdoctor.capture.sessionhooks import GradHook, unpack

if TYPE_CHECKING:
    from memdoctor.capture.session import ProfileSession


class ModuleHooks:
    """The handles of one session's per-module hooks (``on`` while installed)."""

    def __init__(self, session: ProfileSession) -> None:
        self.session = session
        self.module_handles: list[Any] = []
        self.param_handles: list[Any] = []
        self.saved_ctx: Any = None
        self.unhush: Callable[[], None] = lambda: None
        self.for_dynamo = False  # the hooks in were made with dynamo loaded (see rearm)

    def set(self, on: bool, running: bool) -> None:
        """Install (``on``) or remove the module, saved-tensor and gradient hooks. The gradient hooks of
        the models found so far go in only while the session runs."""
        s = self.session
        if on and not self.param_handles and running:
            for model in s.models:
                self.watch_grads(model)
        elif not on and self.param_handles:
            for handle in self.param_handles:
                handle.remove()
            self.param_handles = []
        if on and not self.module_handles:
            mod = torch.nn.modules.module
            # always_call (torch >= 2.0): the post hook also runs when the forward raises, so the
            # module stack unwinds with the exception (a script that catches it, or non-reentrant
            # activation checkpointing, which stops its recomputation by raising, would otherwise
            # leave frames behind and every later forward would look nested).
            self.unhush = hush_global_hooks_warning()  # before ours are in: are there others?
            self.for_dynamo = "torch._dynamo" in sys.modules  # (eager_hook)
            self.module_handles = [
                mod.register_module_forward_pre_hook(s._forward.pre),
                mod.register_module_forward_hook(s._forward.post, always_call=True),
            ]
            self.saved_ctx = torch.autograd.graph.saved_tensors_hooks(
                eager_hook(s._ledger.pack), eager_hook(unpack)
            )
            self.saved_ctx.__enter__()
        elif not on and self.module_handles:
            for handle in self.module_handles:
                handle.remove()
            self.module_handles = []
            self.unhush()
            if self.saved_ctx is not None:
                self.saved_ctx.__exit__(None, None, None)
                self.saved_ctx = None

    def rearm(self) -> None:
        """Install the hooks again once dynamo is loaded, if it was not when they went in (a script
        that calls ``torch.compile`` after the session started): the hooks autograd calls are then
        kept out of dynamo (``eager_hook``). Between steps only, as ``set``."""
        if self.for_dynamo or not self.module_handles or "torch._dynamo" not in sys.modules:
            return
        self.set(False, True)
        self.set(True, True)

    def watch_grads(self, model: DiscoveredModel) -> None:
        """A gradient hook on each of ``model``'s parameters that train (once each)."""
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            return  # torch < 2.1: gradients are measured at the optimizer step only
        seen: set[int] = set()
        hook = eager_hook(GradHook(self.session))
        for mod in model.modules:
            for p in mod.parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self.param_handles.append(p.register_post_accumulate_grad_hook(hook))
