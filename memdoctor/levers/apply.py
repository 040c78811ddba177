"""``memdoctor.apply(config, model, optimizer=None, loader=None)``: the plan, applied in code.

For people who write their own loop::

    cfg = memdoctor.load_config("memdoctor-report/memdoctor.yaml")
    applied = memdoctor.apply(cfg, model, optimizer, loader)
    for batch in loader:
        for micro, weight in applied.micro_batches(batch):   # accumulation (one pair when k = 1)
            with applied.autocast():                          # bf16/fp16 autocast (no-op for fp32)
                loss = model(**micro).loss * weight           # weight = this micro-batch's share
            applied.backward(loss)                            # through the GradScaler for fp16
        applied.step()                                        # optimizer step (+ scaler update), zero_grad
    applied.remove()                                          # the model is as it was

What is applied: activation checkpointing of exactly the chosen modules (their ``forward`` wrapped with
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, reversible with ``remove()``), autocast in
the chosen dtype with a ``torch.amp.GradScaler`` for fp16, accumulation through ``micro_batches``, and
offload of the chosen modules' parameters and of the optimizer's state to the host
(``memdoctor.levers.offload``; the optimizer must be passed for the latter), and full offload (FSDP2
with CPU offload, ``memdoctor.levers.offload_full``: pass the optimizer before its first step, or build
it after ``apply`` from ``model.parameters()``; ``remove()`` cannot unshard the model), and ``parallel``
in each rank of the user's own job (``memdoctor.levers.parallel.apply_parallel``: DDP or FSDP2 wraps the
model in place; a loader passed must already use a ``DistributedSampler``).
What it cannot apply faithfully (an optimizer swap, padding trimming, an attention
implementation, data-loader settings on a loader that already exists, an allocator setting after CUDA
started) raises ``ConfigError`` naming the part: a plan part is never silently dropped.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from memdoctor.capture.loopshape import batch_dims, batch_size_of, tensors_of
from memdoctor.config import PlanConfig, check_modules
from memdoctor.errors import ConfigError
from memdoctor.levers.modnames import recorded_names, submodule
from memdoctor.patching import wrap_forward

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Applied:
    """The applied plan: autocast, micro-batches, backward/step helpers, and ``remove()``."""

    def __init__(self, config: PlanConfig, model: torch.nn.Module, optimizer: Any, loader: Any) -> None:
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.device_type = _device_type(model)
        self.scaler: torch.amp.GradScaler | None = None
        if config.precision == "fp16" and config.grad_scaler is not None:
            self.scaler = torch.amp.GradScaler(
                self.device_type,
                init_scale=config.grad_scaler.init_scale,
                growth_interval=config.grad_scaler.growth_interval,
            )
        self._undo: list[Callable[[], None]] = []

    def __iter__(self) -> Iterator[Any]:
        """``model, optimizer, loader = memdoctor.apply(...)`` (the same objects, changed in place)."""
        return iter((self.model, self.optimizer, self.loader))

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast in the plan's dtype around forward + loss; a no-op context for fp32."""
        dtype = _DTYPES.get(self.config.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    def micro_batches(self, batch: Any) -> Iterator[tuple[Any, float]]:
        """Split ``batch`` along dim 0 into ``accumulation_steps`` parts; yield ``(part, weight)``.

        ``weight`` is the part's share of the batch (size / batch size): multiplying a mean-reduced loss
        by it makes the summed gradients equal the full batch's, also when the split is uneven.
        """
        yield from split_batch(batch, self.config.accumulation_steps)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the GradScaler under fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self) -> None:
        """One optimizer step over the accumulated gradients (unscaled first under fp16), then zero_grad."""
        if self.optimizer is None:
            raise ConfigError("memdoctor.apply was given no optimizer: call your optimizer's step yourself")
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def remove(self) -> None:
        """Undo the checkpointing wrappers and the offload: the model and optimizer are as they were."""
        while self._undo:
            self._undo.pop()()

    def _checkpoint(self, module: torch.nn.Module) -> None:
        self._undo.append(checkpoint_module(module))


SeeSaved = Callable[[torch.Tensor], None]


def checkpoint_module(module: torch.nn.Module, see_saved: SeeSaved | None = None) -> Callable[[], None]:
    """Recompute ``module``'s forward in backward (non-reentrant ``torch.utils.checkpoint``); return the
    undo. The wrapper is an instance attribute (``memdoctor.patching.wrap_forward``); under
    ``torch.no_grad()`` the module runs unwrapped (nothing is saved to recompute).

    ``see_saved`` (the checkpoint-all re-profile, ``memdoctor.launch.reprofile``): called with every
    tensor the forward would have saved for backward had it not been checkpointed (``SeeThrough``)."""

    def checkpointed(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return inner(*args, **kwargs)
        if see_saved is not None and can_see_through():
            see = see_saved
            return torch_checkpoint(
                inner,
                *args,
                use_reentrant=False,
                context_fn=lambda: (SeeThrough(see), contextlib.nullcontext()),
                **kwargs,
            )
        return torch_checkpoint(inner, *args, use_reentrant=False, **kwargs)

    return wrap_forward(module, checkpointed)


# The saved-tensors hooks in force (pack, unpack), innermost first: a private binding of torch's, read
# behind a feature check (torch's own AOT autograd reads it the same way). torch has no public way to
# chain saved-tensors hooks: the innermost one alone is called.
_TOP_HOOKS = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)


def can_see_through() -> bool:
    """Whether this torch lets ``SeeThrough`` find the checkpoint's own hooks."""
    return _TOP_HOOKS is not None


class SeeThrough(torch.autograd.graph.saved_tensors_hooks):
    """Inside a checkpointed forward (``torch.utils.checkpoint``'s ``context_fn``, entered just after
    the checkpoint's own saved-tensors hooks): shows ``see`` each tensor the forward saves, then hands
    it to the checkpoint's hook, which keeps no reference to it (the tensor is freed as it would be
    under checkpointing; only its recomputation in backward brings it back). Why: a profiler's own
    saved-tensors hook (memdoctor's ledger) is not called under a checkpoint, so a checkpointed
    module's activations are never measured; with this, its forward is measured as if it were not
    checkpointed, while the run holds only what checkpointing holds."""

    def __init__(self, see: SeeSaved) -> None:
        # Closures over a cell rather than bound methods: the graph keeps the unpack hook, which
        # reaches the checkpoint's frame and its saved inputs; a cycle through ``self`` would keep those
        # alive until the garbage collector ran, not until the graph is freed.
        inner: list[tuple[Callable[[Any], Any], Callable[[Any], Any]]] = []
        self._inner = inner

        def pack(tensor: torch.Tensor) -> Any:
            see(tensor)
            return inner[0][0](tensor)

        def unpack(packed: Any) -> Any:
            return inner[0][1](packed)

        super().__init__(pack, unpack)

    def __enter__(self) -> None:
        self._inner[:] = [_top_hooks()]  # the checkpoint's, entered just before this
        super().__enter__()


def _top_hooks() -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    assert _TOP_HOOKS is not None
    try:
        found = _TOP_HOOKS(True)  # ignore_is_tracing
    except TypeError:  # a torch whose binding takes no argument
        found = _TOP_HOOKS()
    if found is None:
        raise RuntimeError("memdoctor: no checkpoint saved-tensors hook to see through")
    return found[0], found[1]


def no_kv_cache(root: torch.nn.Module) -> Callable[[], None] | None:
    """With modules checkpointed, switch a Hugging Face model's KV cache off (``config.use_cache``), as
    HF's own gradient checkpointing does in training: a recomputed attention block appends its keys and
    values to the cache a second time (on the H200, 2 GiB of a 0.95B decoder's 10.15 GiB peak was
    ``DynamicCache.update``), and a training step never reads it. Returns the undo; None when the model
    has no such switch or it is already off (a ``use_cache=True`` the script passes itself still wins)."""
    config = getattr(root, "config", None)
    if config is None or getattr(config, "use_cache", None) is not True:
        return None
    config.use_cache = False

    def undo() -> None:
        config.use_cache = True

    return undo


def apply(config: PlanConfig, model: torch.nn.Module, optimizer: Any = None, loader: Any = None) -> Applied:
    """Apply ``config`` to ``model`` (see the module docstring); ``ConfigError`` names what cannot apply."""
    check_modules(config, recorded_names(model), type(model).__name__)
    refused = not_applicable(config, loader)
    if refused:
        raise ConfigError("memdoctor.apply cannot apply: " + "; ".join(refused))
    if config.optimizer == "offload" and optimizer is None:
        raise ConfigError(
            "memdoctor.apply cannot apply: optimizer: offload: memdoctor.apply was given no optimizer "
            "(pass it: memdoctor.apply(config, model, optimizer))"
        )
    _allocator(config)
    applied = Applied(config, model, optimizer, loader)
    try:
        if config.parallel is not None:
            _parallel(applied)
        else:
            _full_offload(applied)
        _offload(applied)
    except ValueError as exc:
        applied.remove()
        raise ConfigError(f"memdoctor.apply cannot apply: {exc}") from None
    for name in config.checkpoint:
        applied._checkpoint(submodule(model, name))
    if config.checkpoint:
        undo = no_kv_cache(model)
        if undo is not None:
            applied._undo.append(undo)
    return applied


def _offload(applied: Applied) -> None:
    """The plan's offload (``memdoctor.levers.offload.install_offload``; ValueError names a part that
    cannot apply)."""
    from memdoctor.levers.offload import install_offload

    config, optimizer = applied.config, applied.optimizer
    optimizers = [optimizer] if config.optimizer == "offload" and optimizer is not None else []
    install_offload(applied.model, config.offload_parameters, optimizers, applied._undo)


def _full_offload(applied: Applied) -> None:
    """``full_offload``: the model sharded by FSDP2 with CPU offload (``memdoctor.levers.offload_full``),
    the optimizer, if given, made to hold the sharded parameters. FSDP2 cannot be undone: ``remove()``
    leaves the model sharded, and its one-process group lives until the interpreter exits."""
    if not applied.config.full_offload:
        return
    from memdoctor.levers.offload_full import FullOffload

    def fail(message: str) -> None:
        raise ValueError(message)

    FullOffload(lambda root: True, lambda line: None, fail).wrap_built(applied.model, applied.optimizer)


def _parallel(applied: Applied) -> None:
    """``parallel``: the model wrapped by DDP or FSDP2 in this rank of the user's job
    (``memdoctor.levers.parallel.apply_parallel``; ValueError names what cannot apply)."""
    from memdoctor.levers.parallel import apply_parallel

    a = applied
    a._undo.extend(apply_parallel(a.config, a.model, a.optimizer, a.loader))


def not_applicable(config: PlanConfig, loader: Any = None) -> list[str]:
    """The plan's parts ``apply`` would refuse, one sentence each naming the part and the way out."""
    out = []
    if config.optimizer == "8bit":
        out.append("optimizer: 8bit (build bitsandbytes.optim.AdamW8bit yourself with the same settings)")
    if config.padding != "as-is":
        out.append(f"padding: {config.padding} (trim padding in your collate function; see docs/config.md)")
    if config.attention is not None:
        out.append(
            f"attention: {config.attention} "
            f"(pass attn_implementation={config.attention!r} to from_pretrained)"
        )
    dl = config.data_loader
    if loader is not None and any(v is not None for v in vars(dl).values()):
        out.append("data_loader: a DataLoader cannot be changed once built (build it with these settings)")
    return out


def _allocator(config: PlanConfig) -> None:
    """PYTORCH_CUDA_ALLOC_CONF is read when CUDA starts: set it before, refuse after (unless equal)."""
    if config.allocator is None or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == config.allocator:
        return
    if torch.cuda.is_initialized():
        raise ConfigError(
            "memdoctor.apply cannot apply: allocator: CUDA has already started; set "
            f"PYTORCH_CUDA_ALLOC_CONF={config.allocator} in the environment before running the script"
        )
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = config.allocator


def split_batch(
    batch: Any, parts: int, size: int | None = None, dims: list[int | None] | None = None
) -> Iterator[tuple[Any, float]]:
    """``(part, weight)`` for ``parts`` slices of ``batch`` along its batch dimension (tensors,
    mappings, sequences).

    The batch dimension is measured, not assumed to be 0 (``memdoctor.capture.loopshape``): each tensor
    is sliced along its dimension of the batch's size (``size`` when given: the planned batch; else
    the size the tensors share), dim 0 where that is it, else the first that is (a sequence-first
    ``[seq, batch]`` tensor along dim 1). A batch with a tensor that has no such dimension (a flattened
    ``[seq * batch]`` target), or that holds no tensor, cannot be split faithfully: ``ConfigError``.
    Non-tensor leaves (strings, numbers) and 0-d tensors are passed to every part unchanged. ``dims``
    (with ``size``): each tensor's batch dimension, already measured (``loopshape.batch_layout``).
    """
    if parts <= 1:
        yield batch, 1.0
        return
    total = batch_size_of(batch, size)
    if total is None:
        shapes = sorted({tuple(t.shape) for t in tensors_of(batch) if t.dim() > 0})
        raise ConfigError(
            "accumulation_steps: cannot split this batch: "
            + ("it holds no tensor" if not shapes else f"its tensors share no batch size ({shapes[:4]})")
        )
    shaped = tensors_of(batch)
    if dims is None or len(dims) != len(shaped):
        dims = batch_dims(batch, total)
    lost = [tuple(t.shape) for t, d in zip(shaped, dims, strict=True) if d is None and t.dim() > 0]
    if lost:
        raise ConfigError(
            f"accumulation_steps: cannot split this batch of {total}: a tensor of shape {list(lost[0])} "
            "has no dimension of the batch size"
        )
    if total < parts:
        raise ConfigError(
            f"accumulation_steps: a batch of {total} cannot be split into {parts} micro-batches"
        )
    bounds = [i * total // parts for i in range(parts + 1)]
    for lo, hi in itertools.pairwise(bounds):
        yield _slice(batch, iter(dims), lo, hi), (hi - lo) / total


def _slice(batch: Any, dims: Iterator[int | None], lo: int, hi: int) -> Any:
    """``batch`` with each tensor sliced [lo:hi] along its dimension from ``dims`` (``tensors_of``
    order, so the same walk)."""
    if isinstance(batch, torch.Tensor):
        d = next(dims)
        return batch if d is None else batch.narrow(d, lo, hi - lo)
    if isinstance(batch, Mapping):
        return type(batch)({k: _slice(v, dims, lo, hi) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_slice(v, dims, lo, hi) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, dims, lo, hi) for v in batch)
    return batch


def _device_type(model: torch.nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"
