"""The distributed engines a script runs its model in, as the ledger counts them.

* DDP (``torch.nn.parallel.DistributedDataParallel``): the reducer allocates flat gradient buckets when
  it wraps the model, one slot per parameter it reduces, so the buckets hold as many bytes as those
  parameters do (category ``gradient_buckets``). With ``gradient_as_bucket_view=True`` the gradients
  *are* views into the buckets: their bytes are counted once, as gradients (each parameter its own
  slot), and ``gradient_buckets`` keeps only the slots no gradient fills, 0 once every gradient
  exists: what the option saves shows as exactly that.
* FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state are DTensor
  shards, counted at their local size (``discovery.local_tensor``); the buffers FSDP2 gathers into and
  reduces from are ``sharding_buffers``, charged to the module whose parameters they hold
  (``memdoctor.capture.shardbuffers``).

In one process nothing is found: no category, no record, and the cost is an ``isinstance`` per new
top-level module. The engines found are described once in an ``engines`` collector record.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memdoctor.capture.discovery import own_nbytes, storage_nbytes
from memdoctor.capture.shardbuffers import ShardBuffers, fsdp_groups

BUCKETS = "gradient_buckets"
SHARDING = "sharding_buffers"
SHARDING_COLUMN = "sharding_buffer_bytes"  # the per-module column of FSDP2 traces
RECORD = "engines"

# Models an engine wraps from outside the script's call path: ``memdoctor run``'s parallel lever routes
# the script's ``model(...)`` through a DDP wrapper the script never calls, so the session sees the
# model, not the wrapper, as the top-level module; the lever names the wrapper here (``wrapped_by``).
_WRAPPERS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def wrapped_by(model: nn.Module, engine: nn.Module) -> Callable[[], None]:
    """Say that ``engine`` (a DDP wrapper) runs ``model``'s forward, though the script calls ``model``:
    the ledger then counts the engine's buckets when it sees ``model``. Returns the undo."""
    _WRAPPERS[model] = engine

    def undo() -> None:
        if _WRAPPERS.get(model) is engine:
            del _WRAPPERS[model]

    return undo


class Engines:
    """What the engines hold now, as the ledger's samples copy it: ``buckets_live`` (DDP's bucket bytes
    no gradient counts), ``sharding_live`` (FSDP2's gathered and reduce buffers) and ``gathered``
    (storage address -> group of the unsharded parameters, not activations when autograd saves them)."""

    def __init__(
        self,
        on_device: Callable[[torch.Tensor], bool],
        index: dict[int, tuple[int, int]],
        emit: Callable[[str, dict[str, Any]], None],
    ) -> None:
        self.on_device = on_device
        self.index = index  # id(module) -> (model, module index): the session's, shared
        self.emit = emit
        self.ddps: list[tuple[Any, int]] = []  # (the DDP module, its buckets' bytes)
        self.bucket_bytes = 0  # every DDP's buckets
        self.bucket_params: dict[int, int] = {}  # id(parameter) -> its slot's bytes, where grads are views
        self.bucket_grads = 0  # bytes of the bucket-view gradients that exist now (the ledger keeps it)
        self.shards = ShardBuffers(self._locate, on_device)
        self._fsdp_roots: set[int] = set()
        self._reducer: dict[int, list[dict[str, float]]] = {}  # id(ddp) -> DDP's own backward timings

    @property
    def buckets_live(self) -> int:
        return max(0, self.bucket_bytes - self.bucket_grads)

    @property
    def sharding_live(self) -> int:
        return self.shards.live

    @property
    def gathered(self) -> dict[int, int]:
        return self.shards.ptrs

    def categories(self) -> tuple[str, ...]:
        """The ledger categories this run's engines add (none in one plain process)."""
        return ((BUCKETS,) if self.ddps else ()) + ((SHARDING,) if self.shards.groups else ())

    # ------------------------------------------------------------------------------ finding them
    def see(self, module: nn.Module) -> None:
        """A top-level module called, or a model described: is it, or does it hold, an engine? The
        ``engines`` record is written again each time (the model indices are known once described)."""
        module = _WRAPPERS.get(module, module)
        if isinstance(module, nn.parallel.DistributedDataParallel):
            if all(d is not module for d, _ in self.ddps):
                self.ddps.append((module, self._buckets(module)))
            module = module.module
        if id(module) not in self._fsdp_roots:
            self._fsdp_roots.add(id(module))
            self.shards.add(fsdp_groups(module))
        if self.ddps or self.shards.groups:
            self.emit(RECORD, self.facts())

    def poll_ddp(self) -> None:
        """Read DDP's own timing of its last sampled backward (its logger times the reducer's bucket
        all-reduces, which no Python wrapper sees), once per new sample; the ``engines`` record is
        written again with it. DDP samples its first 10 iterations, then one in 100 (its default),
        and logs an iteration's figures as the next forward starts. Private API
        (``_get_ddp_logging_data``), read behind a check: without it, nothing is added."""
        changed = False
        for ddp, _ in self.ddps:
            seen = self._reducer.setdefault(id(ddp), [])
            timing = _reducer_timing(ddp)
            if timing is not None and (not seen or seen[-1]["start_ns"] != timing["start_ns"]):
                seen.append(timing)
                changed = True
        if changed:
            self.emit(RECORD, self.facts())

    def _buckets(self, ddp: nn.parallel.DistributedDataParallel) -> int:
        """Bytes of the reducer's buckets: one slot per parameter it reduces (trainable, dense, not
        ignored; ``_build_params_for_reducer`` names them ``module_name.param_name``), on the device."""
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        view = bool(getattr(ddp, "gradient_as_bucket_view", False))
        seen: set[int] = set()
        total = 0
        for module_name, mod in ddp.module.named_modules():
            sparse = bool(getattr(mod, "sparse", False)) and isinstance(mod, (nn.Embedding, nn.EmbeddingBag))
            for name, p in mod.named_parameters(recurse=False):
                if id(p) in seen or not p.requires_grad or sparse or f"{module_name}.{name}" in ignored:
                    continue
                seen.add(id(p))
                if not self.on_device(p):
                    continue
                n = own_nbytes(p)
                total += n
                if view:
                    self.bucket_params[id(p)] = n
        self.bucket_bytes += total
        return total

    def _locate(self, group: Any) -> tuple[int, int] | None:
        modules = getattr(group, "modules", ())
        return self.index.get(id(modules[0])) if modules else None

    # ------------------------------------------------------------------------------ the record
    def facts(self) -> dict[str, Any]:
        """The ``engines`` collector record: each DDP and each ``fully_shard`` module found."""
        out: dict[str, Any] = {}
        if self.ddps:
            out["ddp"] = [self._ddp_facts(d, n) for d, n in self.ddps]
        if self.shards.groups:
            out["fsdp"] = [self._group_facts(g) for g in self.shards.groups.values()]
            out["sharding_buffers_measured"] = self.shards.off is None
            if self.shards.off:
                out["not_measured"] = [self.shards.off]
        return out

    def _ddp_facts(self, ddp: Any, nbytes: int) -> dict[str, Any]:
        loc = self.index.get(id(ddp.module))
        return {
            "model": loc[0] if loc else None,
            "gradient_as_bucket_view": bool(getattr(ddp, "gradient_as_bucket_view", False)),
            "bucket_bytes": nbytes,
            "bucket_cap_bytes": _int_or_none(getattr(ddp, "bucket_bytes_cap", None)),
            "find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False)),
            "static_graph": bool(getattr(ddp, "static_graph", False)),
            # The reducer's all-reduces run in C++, not through torch.distributed's Python functions:
            # they are not in the steps' ``collectives``; DDP's own logger times them.
            "bucket_all_reduce_measured": False,
            "reducer_timings": [
                {k: v for k, v in t.items() if k != "start_ns"} for t in self._reducer.get(id(ddp), [])
            ],
        }

    def _group_facts(self, group: Any) -> dict[str, Any]:
        loc = self._locate(group)
        params = [fp.sharded_param for fp in getattr(group, "fsdp_params", ())]
        mesh = getattr(group, "mesh_info", None)
        return {
            "model": loc[0] if loc else None,
            "module": loc[1] if loc else None,
            "parameters": len(params),
            "sharded_bytes": sum(storage_nbytes(p) for p in params),
            "unsharded_bytes": sum(p.numel() * p.element_size() for p in params),
            "shard_world_size": _int_or_none(getattr(mesh, "shard_mesh_size", None)),
            "reshard_after_forward": _reshard(group),
        }


def _reducer_timing(ddp: Any) -> dict[str, float] | None:
    """DDP's logger's figures for its last sampled backward, in ms (None where it has none)."""
    read = getattr(ddp, "_get_ddp_logging_data", None)
    try:
        data = read() if read is not None else {}
    except Exception:
        return None
    start, comm = data.get("backward_comm_time_start"), data.get("backward_comm_time")
    if not isinstance(start, int) or not start or not isinstance(comm, int):
        return None
    ms = {k: data.get(f"backward_{k}_time") for k in ("comm", "compute", "compute_comm_overlap")}
    out: dict[str, float] = {"start_ns": float(start)}
    out.update({f"{k}_ms": round(v / 1e6, 4) for k, v in ms.items() if isinstance(v, int)})
    return out


def _reshard(group: Any) -> bool | int | None:
    """FSDP2's ``reshard_after_forward`` as the group resolved it (private; None where unknown)."""
    try:
        value = group._reshard_after_forward
    except Exception:
        return None
    if isinstance(value, bool):
        return value
    return _int_or_none(value)


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
