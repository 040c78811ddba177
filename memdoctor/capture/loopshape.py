"""What a training loop looks like, for the planner to know which micro-batch split can apply.

Facts measured while the script runs: where the loss is (``find_loss`` on the trained model's
forward output: in it, or computed outside by the loop), the batch dimension of a batch (``batch_dims``:
the dimension of each tensor whose size is the batch's, not assumed to be 0: a sequence-first RNN batch
is ``[seq, batch, ...]``), and the script's own batch-size and gradient-accumulation knobs
(``memdoctor.capture.knobs``: the options an ``argparse`` parser knows and the values it parsed, or
config variables a configurator verifiably sets from ``--name=value``), and whether accelerate
accumulates gradients by itself (``accelerate_accumulation``: the DataLoader split cannot combine with
it). The levers use the same functions when they split, so what the plan was made from is what
``memdoctor run`` does.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from memdoctor.capture.knobs import ArgparseWatch, ConfiguratorWatch, Knobs, trial_knobs
from memdoctor.patching import Undo

# Where a loss sits in a forward's output: () the output itself, ("key", k) a mapping's key,
# ("index", i) a tuple's element, ("attr", name) an attribute (a dataclass field, HF's ModelOutput).
LossPath = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class LossAt:
    """The loss found in a forward's output (``loss`` None: none, or ``ambiguous`` names why)."""

    loss: torch.Tensor | None
    path: LossPath = ()
    ambiguous: str | None = None

    def where(self) -> str:
        """The path as text for the trace: ``output``, ``["loss"]``, ``[1]``, ``.loss``."""
        if not self.path:
            return "output"
        kind, key = self.path
        return {"key": f"[{key!r}]", "index": f"[{key}]", "attr": f".{key}"}[kind]


def is_loss(value: Any) -> bool:
    """A loss is a floating scalar tensor that autograd can backpropagate."""
    return (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and value.requires_grad
        and value.is_floating_point()
    )


def find_loss(out: Any) -> LossAt:
    """The loss in a forward's output: a scalar requiring grad, as the output, under the name ``loss``
    (key or attribute), else the one such scalar among a tuple's, mapping's or dataclass's members.
    Two or more unnamed scalars are ambiguous: the split would not know which one the script
    backpropagates, so it says so rather than guess."""
    if isinstance(out, torch.Tensor):
        return LossAt(out if is_loss(out) else None)
    named = _named_loss(out)
    if named is not None:
        return named
    members = _members(out)
    found = [(path, v) for path, v in members if is_loss(v)]
    if len(found) == 1:
        return LossAt(found[0][1], found[0][0])
    if len(found) > 1:
        places = ", ".join(LossAt(None, p).where() for p, _ in found)
        return LossAt(None, (), f"the forward returns {len(found)} scalar tensors requiring grad ({places})")
    return LossAt(None)


def _named_loss(out: Any) -> LossAt | None:
    if isinstance(out, Mapping):
        value = out.get("loss")
        return LossAt(value, ("key", "loss")) if is_loss(value) else None
    if isinstance(out, tuple) and hasattr(out, "_fields") and "loss" in out._fields:
        i = out._fields.index("loss")
        return LossAt(out[i], ("index", i)) if is_loss(out[i]) else None
    value = getattr(out, "loss", None) if not isinstance(out, (list, tuple)) else None
    return LossAt(value, ("attr", "loss")) if is_loss(value) else None


def _members(out: Any) -> list[tuple[LossPath, Any]]:
    if isinstance(out, Mapping):
        return [(("key", k), v) for k, v in out.items()]
    if isinstance(out, (list, tuple)):
        return [(("index", i), v) for i, v in enumerate(out)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [(("attr", f.name), getattr(out, f.name, None)) for f in dataclasses.fields(out)]
    return []


def output_fact(out: Any, inputs: Any) -> dict[str, Any]:
    """The trace's record of what a forward's output holds besides its loss: ``{"bytes": ..., "batch":
    ...}``. A split inside the forward (``memdoctor.levers.microbatch``) keeps the earlier micro-batches'
    outputs while the last one runs, so they do not shrink with the micro-batch as the rest does (a
    minimal GPT's logits on the H200: 0.63 GB more at 4 micro-batches); the planner needs their size.
    ``bytes``: the storages of every tensor of the output but the loss, each once; ``batch``: the size
    of the output's batch dimension (the call's batch size where every such tensor has it, else the
    size their first dimension shares: a split forward that returned only its last micro-batch's
    outputs), None where none is found. Shapes and sizes only: no device work."""
    loss = find_loss(out).loss
    seen: set[tuple[int, int]] = set()
    total = 0
    shaped: list[torch.Tensor] = []
    for t in _output_tensors(out):
        if t is loss:
            continue
        key = _storage(t)
        if key not in seen:
            seen.add(key)
            total += key[1]
        if t.dim() > 0:
            shaped.append(t)
    batch = batch_size_of(shaped, batch_size_of(inputs)) if shaped else None
    return {"bytes": total, "batch": batch}


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage behind ``t``; a tensor without one (sparse) counts its elements."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(t), t.numel() * t.element_size()


def _output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a forward's output, as the forward split keeps them (``levers.outputs.detached``:
    mappings and HF ``ModelOutput``, lists, tuples, dataclass fields)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _output_tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _output_tensors(v)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in _output_tensors(getattr(out, f.name, None))]
    return []


def loss_fact(out: Any) -> dict[str, Any]:
    """The trace's record of where a forward's loss is: ``{"in_forward": bool, "at": ..., "why": ...}``."""
    found = find_loss(out)
    if found.loss is not None:
        return {"in_forward": True, "at": found.where(), "why": None}
    why = found.ambiguous or "the forward returns no scalar tensor requiring grad (the loop computes it)"
    return {"in_forward": False, "at": None, "why": why}


# ----------------------------------------------------------------------------------------- batch dim


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """The tensors of a batch (tensor, mapping, list, tuple; strings and numbers hold none), depth-first."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in tensors_of(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in tensors_of(v)]
    return []


def batch_size_of(batch: Any, expected: int | None = None) -> int | None:
    """The batch's size: ``expected`` when every tensor has a dimension of it; else the size every
    tensor's dim 0 shares; else the one size every tensor has in some dimension; else ``expected``
    when some tensor has it (the split then names the tensor without it). None when none is."""
    shaped = [t for t in tensors_of(batch) if t.dim() > 0]
    if not shaped:
        return None
    if expected is not None and all(expected in t.shape for t in shaped):
        return expected
    firsts = {t.shape[0] for t in shaped}
    if len(firsts) == 1:
        return firsts.pop()
    common = set(shaped[0].shape).intersection(*(set(t.shape) for t in shaped[1:]))
    if len(common) == 1:
        return common.pop()
    return expected if expected is not None and any(expected in t.shape for t in shaped) else None


def batch_dims(batch: Any, size: int) -> list[int | None]:
    """For each tensor of ``batch`` (``tensors_of`` order), the dimension of size ``size``: dim 0 where
    it is (batch-first, as a DataLoader collates), else the first that is (sequence-first: ``[seq,
    batch, ...]``, hidden states ``[layers, batch, hidden]``); None for a tensor without one."""
    out: list[int | None] = []
    for t in tensors_of(batch):
        dims = [d for d in range(t.dim()) if t.shape[d] == size]
        out.append(None if not dims else dims[0])
    return out


def batch_layout(
    batch: Any, expected: int | None, known: list[int | None] | None
) -> tuple[int | None, list[int | None]]:
    """The batch's size and each tensor's batch dimension. ``known``: the dimensions found on an
    earlier, full batch of the same structure, reused where they still agree on one size (an epoch's
    short last batch whose sequence length happens to equal the full batch size stays split along
    its batch dimension, not its sequence)."""
    tensors = tensors_of(batch)
    if known is not None and len(known) == len(tensors):
        fits = all(d is None or d < t.dim() for t, d in zip(tensors, known, strict=True))
        sizes = {t.shape[d] for t, d in zip(tensors, known, strict=True) if fits and d is not None}
        if fits and len(sizes) == 1:
            return sizes.pop(), known
    size = batch_size_of(batch, expected)
    return size, batch_dims(batch, size) if size is not None else []


def batch_dim(batch: Any, expected: int | None = None) -> int | None:
    """The batch dimension the batch's tensors agree on (the trace's ``batch_dim``); None when they
    disagree (a mix of batch-first and sequence-first tensors) or no batch size is found."""
    size = batch_size_of(batch, expected)
    if size is None:
        return None
    dims = {d for d in batch_dims(batch, size) if d is not None}
    return dims.pop() if len(dims) == 1 else None


def accelerate_accumulation() -> int:
    """The gradient accumulation steps of the script's ``accelerate.Accelerator`` (1 without one):
    accelerate syncs and steps every n-th ``accumulate()`` call, so under a split it would step on
    micro-batches. Read from its shared ``GradientState`` only where the script already set one up."""
    state = sys.modules.get("accelerate.state")
    cls = getattr(state, "GradientState", None)
    if cls is None or not getattr(cls, "_shared_state", None):
        return 1
    try:
        steps = cls().num_steps
    except Exception:  # another accelerate: not ours to fail on
        return 1
    return steps if isinstance(steps, int) and steps > 0 else 1


# ----------------------------------------------------------------------------------------- the record


class LoopFacts:
    """The ``loop`` entry of the data collector's facts (docs/trace-format.md): where the loss is, whether
    training batches come from a DataLoader, whether a ``torch.optim`` optimizer steps (a step that can
    be deferred), and the script's batch-size and accumulation arguments. ``changed`` is called when a
    fact is first known (the collector emits its facts again)."""

    def __init__(self, changed: Callable[[], None]) -> None:
        self._changed = changed
        self.loss: dict[str, Any] | None = None
        self.outputs: dict[str, Any] | None = None
        self.loader = False
        self.torch_optim = False
        self.knobs: dict[str, Any] | None = None
        self.accelerate_accumulation = 1
        self._undo: list[Undo] = []
        self._configurators = ConfiguratorWatch()
        self._tried = False

    def as_field(self) -> dict[str, Any]:
        return {
            "loss": self.loss,
            "outputs": self.outputs,
            "loader": self.loader,
            "torch_optim": self.torch_optim,
            "knobs": self.knobs,
            "accelerate_accumulation": self.accelerate_accumulation,
        }

    def start(self) -> None:
        self._undo = [ArgparseWatch(self._knobs).install(), self._configurators.start()]

    def stop(self) -> None:
        while self._undo:
            self._undo.pop()()
        if self._configured():  # a run that died in its first forward: its re-profile may use them
            self._changed()

    def forward_output(self, module: torch.nn.Module, out: Any, inputs: Any = None) -> None:
        """The trained root's first training forward (called with ``inputs``, its args and kwargs):
        where its loss is (``loss_fact``) and what else its output holds (``output_fact``)."""
        if self.loss is None and module.training and torch.is_grad_enabled():
            self.loss = loss_fact(out)
            self.outputs = output_fact(out, inputs)
            self._configured()
            self._changed()

    def loader_batch(self) -> None:
        if not self.loader:
            self.loader = True
            self._changed()

    def stepped(self) -> None:
        """A ``torch.optim`` optimizer stepped (the collector's ``on_optimizer``)."""
        if not self.torch_optim:
            self.torch_optim = True
            self.accelerate_accumulation = accelerate_accumulation()
            self._configured()
            self._changed()

    def _knobs(self, knobs: Knobs) -> None:
        if self.knobs is None:
            self.knobs = knobs.as_field()
            self._changed()

    def _configured(self) -> bool:
        """By its first training forward or optimizer step the script has configured itself: the knobs
        its configurators verifiably set (``trial_knobs``) where no argparse parse gave both a batch
        and an accumulation option. Tried once; True when it found them."""
        if self._tried or (self.knobs is not None and self.knobs.get("accumulation_option")):
            return False
        self._tried = True
        for found in self._configurators.found:
            knobs = trial_knobs(found)
            if knobs is not None and (self.knobs is None or knobs.accumulation_option):
                self.knobs = knobs.as_field()
                return True
        return False
