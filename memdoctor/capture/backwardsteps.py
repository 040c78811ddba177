"""The session's step boundaries in a script without ``torch.optim``: found from its backward passes
and its parameter updates.

pytorch/examples' word_language_model and regression train by hand: ``model.zero_grad()``, a forward,
``loss.backward()``, then ``p.data.add_(p.grad, alpha=-lr)`` for every parameter. No optimizer hook
ever fires, so ``OptimizerSteps`` sees no step. Here a training step ends at the first training forward
(a top-level call with gradients enabled, outside any backward) that follows a backward, where the
parameters were updated or their gradients reset since the forward before it. Without such a sign the
forward is a further micro-batch of the same step (gradient accumulation by hand).

The signs, cheapest first:

* a parameter's version counter moved: an in-place update under ``torch.no_grad()``
  (``p -= lr * p.grad``);
* every gradient is ``None``: ``zero_grad()`` (set to None, its default) ran;
* the first element of one of a few parameters changed: writes through ``p.data`` bump no version
  counter (``.data`` is a tensor with a counter of its own: that is what sets it apart from
  ``.detach()``), so the values are compared, one element each (one wait for the device a step).

Once an optimizer has stepped, its hooks find the steps and this part stands aside. A part of
``ProfileSession`` (it reads the session's step in progress and closes it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from memdoctor.capture.session import ProfileSession

# Parameters whose first element is compared (the largest ones: a hand-written update touches all).
MARKED_PARAMETERS = 8


class BackwardSteps:
    """Whether the session's steps are found from backward passes (``active``), and the parameters'
    state at the last training forward, to tell an update from gradient accumulation."""

    def __init__(self, session: ProfileSession) -> None:
        self.session = session
        self.active = False  # a step was closed here: the script has no optimizer
        self.versions: dict[int, int] = {}
        self.marks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._params: list[torch.Tensor] = []
        self._params_of: int = -1  # how many roots the parameter list was made from
        self._largest: list[torch.Tensor] = []

    def ends_step(self) -> bool:
        """At a training forward: whether the step in progress ended before it (no optimizer has
        stepped, a backward ran since the step's last forward, and the parameters changed since)."""
        s = self.session
        data = s._data
        if s._found.known_opts or not data.forwards or not data.bwd_since_fwd:
            return False
        return self._updated()

    def in_step(self) -> bool:
        """Whether the step in progress is one found from backward passes that ran its backward (the
        script ended after its update: ``finish`` closes it)."""
        data = self.session._data
        return not self.session._found.known_opts and bool(data.forwards) and data.bwd_since_fwd

    def note_forward(self) -> None:
        """A training forward starts a micro-batch: remember the parameters' state, to compare at the
        next one. Nothing once an optimizer has stepped (its hooks find the steps)."""
        if self.session._found.known_opts:
            self.versions, self.marks = {}, []
            return
        params = self.params()
        # ``_version`` is the autograd version counter every in-place op bumps (public in effect:
        # torch's own checks on saved tensors read it); reading it costs no device work.
        self.versions = {id(p): p._version for p in params}
        self.marks = [(p, mark) for p in self._largest if (mark := _first_element(p)) is not None]

    def params(self) -> list[torch.Tensor]:
        """The parameters that take gradients, of every top-level module called with gradients on."""
        roots = self.session._found.roots
        if self._params_of != len(roots):
            seen: set[int] = set()
            self._params = []
            for root in roots:
                for p in root.parameters():
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        self._params.append(p)
            self._params_of = len(roots)
            self._largest = sorted(self._params, key=lambda p: -p.numel())[:MARKED_PARAMETERS]
        return self._params

    def _grad_bytes(self) -> dict[tuple[int, int], int]:
        """The step's gradients per module: those still allocated, and those reset to None since the
        backward (``zero_grad()`` before the forward that ends the step) as the gradient hooks saw
        them. An optimizer's pre-hook measures them before any reset; here the reset came first."""
        ledger = self.session._ledger
        out = ledger.grads_by_module()
        seen = dict(ledger.data.grad_ptrs)
        for p, loc in ledger.flat_params:
            at = ledger.grad_at.get(id(p))
            if p.grad is None and at is not None and at[0] not in seen:
                seen[at[0]] = at[1]
                out[loc] = out.get(loc, 0) + at[1]
        ledger.data.grad_ptrs = seen
        return out

    def _updated(self) -> bool:
        params = self.params()
        if any(p._version != self.versions.get(id(p), p._version) for p in params):
            return True
        if params and all(p.grad is None for p in params):
            return True
        return any(_changed(p, mark) for p, mark in self.marks)

    def close(self) -> None:
        """End the step in progress here (the first time: the script has no optimizer; describe the
        models that took gradients, say how steps are found, and record every step in full, since
        the module hooks are what see its forwards)."""
        s = self.session
        if not self.active:
            self.active = True
            s._found.add_trained(self.params())
            s.emit("steps", {"found_by": "backward"})
            s._schedule.detail_all()
        if s.detailed(s._step_index):
            s._data.grad_bytes = self._grad_bytes()
        s._calls.each("on_optimizer", s._step_index)
        s._calls.each("on_optimizer_end", s._step_index)
        s._sample("step_end", None, 0)
        s._finalize_step()


def _first_element(p: torch.Tensor) -> torch.Tensor | None:
    """A copy of ``p``'s first element (None where there is none to copy: empty, meta, sparse)."""
    try:
        return p.detach().reshape(-1)[:1].clone() if p.numel() and not p.is_meta else None
    except RuntimeError:
        return None


def _changed(p: torch.Tensor, mark: torch.Tensor) -> bool:
    """Whether ``p``'s first element differs from ``mark``. A parameter whose data moved to another
    device since (memdoctor's parameter offload swaps ``p.data`` in and out) was not updated."""
    if p.device != mark.device or p.is_meta:
        return False
    try:
        return not torch.equal(mark, p.detach().reshape(-1)[:1])
    except RuntimeError:
        return False
