"""Finding the model(s) a script trains, without the user telling us.

A trained model is a root ``nn.Module`` (not a child of another module) that owns parameters some
optimizer steps. We learn the optimizers from the global optimizer-step hooks; the roots are found once,
at the first optimizer step, by scanning the live modules (``gc``), because nothing in PyTorch links a
parameter back to the module that owns it. A script without an optimizer (parameters updated by hand)
trains the top-level modules it calls with gradients on: they are described at its first step's end
(``memdoctor.capture.backwardsteps``). Well-known wrappers (DDP, ``torch.compile``) are unwrapped so
names read as the user wrote them (``bert.encoder.layer.3``).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memdoctor.trace import ModelInfo
from memdoctor.units import fit_name


@dataclass
class DiscoveredModel:
    info: ModelInfo
    modules: list[nn.Module]  # aligned with info.names
    param_owner: dict[int, int] = field(default_factory=dict)  # id(param) -> module index


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def live_optimizers(param_ids: set[int]) -> list[torch.optim.Optimizer]:
    """The live ``torch.optim`` optimizers (``gc``) that hold any of ``param_ids``; a wrapper whose
    ``optimizer`` is another of them (accelerate's ``AcceleratedOptimizer``) gives way to it."""
    # type() rather than isinstance(), as in find_trained_roots.
    optimizers = [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)]
    found = [o for o in optimizers if _holds(o, param_ids)]
    ids = {id(o) for o in found}
    return [o for o in found if id(getattr(o, "optimizer", None)) not in ids]


def _holds(opt: torch.optim.Optimizer, param_ids: set[int]) -> bool:
    try:
        return any(id(p) in param_ids for p in optimizer_params(opt))
    except Exception:  # a half-built or exotic optimizer: not ours to describe
        return False


def find_trained_roots(param_ids: set[int]) -> list[nn.Module]:
    """Root modules owning any of ``param_ids``, biggest share first."""
    # type() rather than isinstance(): some objects' __class__ is a deprecation-warning property.
    modules = [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]
    child_ids = {id(c) for m in modules for c in m.children()}
    roots = [_unwrap(m) for m in modules if id(m) not in child_ids]
    return _drop_covered(_by_share(roots, param_ids), param_ids)


def _by_share(roots: list[nn.Module], param_ids: set[int]) -> list[nn.Module]:
    """``roots`` that own any of ``param_ids``, each once, most owned first (a stable sort: ties keep
    the order given)."""
    scored = []
    seen: set[int] = set()
    for root in roots:
        if id(root) in seen:
            continue
        seen.add(id(root))
        owned = sum(1 for p in root.parameters() if id(p) in param_ids)
        if owned:
            scored.append((owned, root))
    scored.sort(key=lambda pair: -pair[0])
    return [r for _, r in scored]


def _drop_covered(roots: list[nn.Module], param_ids: set[int]) -> list[nn.Module]:
    """Keep roots until every optimised parameter has an owner (a wrapper and its model overlap)."""
    kept: list[nn.Module] = []
    covered: set[int] = set()
    for root in roots:
        ids = {id(p) for p in root.parameters() if id(p) in param_ids}
        if ids - covered:
            kept.append(root)
            covered |= ids
    return kept


def _unwrap(module: nn.Module) -> nn.Module:
    for attr in ("_orig_mod", "module"):  # torch.compile's OptimizedModule; DDP / DataParallel
        inner = getattr(module, attr, None)
        if isinstance(inner, nn.Module) and type(module).__name__ in (
            "OptimizedModule",
            "DistributedDataParallel",
            "DataParallel",
        ):
            return _unwrap(inner)
    return module


def describe_model(index: int, root: nn.Module, optimizers: list[torch.optim.Optimizer]) -> DiscoveredModel:
    """The module table of one model: names, types, parents, parameter bytes (shared storages once)."""
    names: list[str] = []
    mods: list[nn.Module] = []
    pos: dict[int, int] = {}
    parents: list[int] = []
    for name, mod in root.named_modules(remove_duplicate=True):
        pos[id(mod)] = len(mods)
        names.append(fit_name(name))  # as the reader accepts it, and as memdoctor run looks it up
        mods.append(mod)
    parents = [-1] * len(mods)
    for i, mod in enumerate(mods):
        for child in mod.children():
            j = pos.get(id(child))
            if j is not None and parents[j] == -1 and j != 0:
                parents[j] = i
    seen: set[int] = set()
    owner: dict[int, int] = {}
    pbytes, pcount, tbytes = [0] * len(mods), [0] * len(mods), [0] * len(mods)
    for i, mod in enumerate(mods):
        for p in mod.parameters(recurse=False):
            key = storage_key(p)
            owner.setdefault(id(p), i)
            if key in seen:
                continue
            seen.add(key)
            nbytes = p.numel() * p.element_size()
            pbytes[i] += nbytes
            pcount[i] += p.numel()
            if p.requires_grad:
                tbytes[i] += nbytes
    info = ModelInfo(
        index=index,
        cls=fit_name(type(root).__name__),
        names=names,
        types=[fit_name(type(m).__name__) for m in mods],
        parents=parents,
        param_bytes=pbytes,
        param_counts=pcount,
        trainable_param_bytes=tbytes,
        optimizers=[_describe_optimizer(o, owner) for o in optimizers],
    )
    return DiscoveredModel(info=info, modules=mods, param_owner=owner)


def _describe_optimizer(opt: torch.optim.Optimizer, owner: dict[int, int]) -> dict[str, Any]:
    params = optimizer_params(opt)
    return {
        "class": type(opt).__name__,
        "param_count": sum(p.numel() for p in params),
        "param_tensors": len(params),
        "param_groups": len(opt.param_groups),
        "params_in_model": sum(1 for p in params if id(p) in owner),
    }


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of ``t``: a ``DTensor``'s local shard (``to_local()``: FSDP2's sharded
    parameters, their gradients and the optimizer state made from them), any other tensor itself.

    A DTensor is a wrapper without storage of its own, so its bytes are its shard's. No DTensor can
    exist before ``torch.distributed.tensor`` is imported, so a one-process script pays one dict read."""
    mod = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(mod, "DTensor", None) if mod is not None else None
    if dtensor is not None and isinstance(t, dtensor):
        with torch.no_grad():  # without grad mode, to_local() is the shard itself: no autograd node
            return t.to_local()
    return t


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (a DTensor's: its local shard's): views and aliases share it,
    so it is counted once."""
    try:
        return local_tensor(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        return id(t)


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's storage (a DTensor's: its local shard's, padding included)."""
    t = local_tensor(t)
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, AttributeError):
        return t.numel() * t.element_size()


def own_nbytes(t: torch.Tensor) -> int:
    """Bytes of the elements of ``t`` itself (a DTensor's: its local shard's), not of the storage it
    views: a gradient that is one slot of a flat buffer (DDP's bucket, FSDP2's reduce-scatter output)."""
    t = local_tensor(t)
    return t.numel() * t.element_size()


class TrainedModels:
    """The models the session found (``models``), where each module sits in them (``index``: id(module)
    -> (model, module index)), the optimizers seen and the top-level modules called so far.

    ``on_model`` is told of each model as it is added, so the session can watch its gradients and the
    collectors learn its modules."""

    def __init__(self, on_model: Callable[[DiscoveredModel], None]) -> None:
        self.on_model = on_model
        self.models: list[DiscoveredModel] = []
        self.index: dict[int, tuple[int, int]] = {}
        self.known_opts: set[int] = set()
        self.optimizers: list[torch.optim.Optimizer] = []
        self.roots_seen: set[int] = set()
        self.roots: list[nn.Module] = []

    def saw_root(self, module: nn.Module) -> bool:
        """Note a top-level module call; whether it is the first call of that module."""
        if id(module) in self.roots_seen:
            return False
        self.roots_seen.add(id(module))
        self.roots.append(module)
        return True

    def started(self) -> bool:
        """Whether a step began: a forward ran or an optimizer stepped."""
        return bool(self.roots_seen or self.known_opts)

    def add_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer stepped for the first time: describe the models whose parameters it steps."""
        self.known_opts.add(id(opt))
        self.optimizers.append(opt)
        params = {id(p) for p in optimizer_params(opt)}
        owned = {pid for m in self.models for pid in m.param_owner}
        if params <= owned:
            return
        for root in find_trained_roots(params - owned):
            if any(m.modules[0] is root for m in self.models):
                continue
            self._add(describe_model(len(self.models), root, self.optimizers))

    def add_trained(self, params: list[torch.Tensor]) -> None:
        """A script without an optimizer ended its first step: describe the top-level modules seen
        that own ``params`` (those that take gradients), largest share first, as its models."""
        ids = {id(p) for p in params}
        for root in _drop_covered(_by_share([_unwrap(r) for r in self.roots], ids), ids):
            if not any(m.modules[0] is root for m in self.models):
                self._add(describe_model(len(self.models), root, self.optimizers))

    def add_seen(self) -> None:
        """Describe the top-level modules seen so far as models (for a fault before any optimizer step),
        with the optimizers alive that hold their parameters (none has stepped yet): what their state
        will hold is then known too (a re-profile at a smaller micro-batch cannot fit an AdamW state
        beyond the budget, ``memdoctor.plan.reprofiled``)."""
        if self.models:
            return
        found = self.optimizers or live_optimizers({id(p) for r in self.roots for p in r.parameters()})
        for root in self.roots:
            self._add(describe_model(len(self.models), root, found))

    def _add(self, model: DiscoveredModel) -> None:
        self.models.append(model)
        for i, mod in enumerate(model.modules):
            self.index.setdefault(id(mod), (model.info.index, i))
        self.on_model(model)
