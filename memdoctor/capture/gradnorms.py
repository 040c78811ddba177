"""Gradient L2 norms: launched on the device at the optimizer step, read to the host once per step.

``collect`` runs inside the optimizer pre-hook of a detailed step: it launches the norm kernels for
every parameter's gradient and keeps the result as device tensors (one per device, so one on a single
GPU). Nothing is read to the host there, so the script keeps running ahead of the GPU as it does
without memdoctor. ``build_step`` reads the norms (``GradNorms.host``) once the step's GPU work has
completed, and ``step_figures`` turns them into the trace's per-module ``grad_norm`` and
``grad_nonfinite`` columns and the step's ``grad_norm`` field.

A module's norm is its own parameters' (exclusive, like the other per-module gradient figures):
sqrt(sum of its parameters' squared norms). A parameter shared by several modules (tied weights) is
counted once, at the first module in order, and so once in the global norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Loc = tuple[int, int]  # (model index, module index)


@dataclass
class GradNorms:
    """The step's gradient norms, still on the device: ``locs[i]`` owns the i-th norm."""

    locs: list[Loc]
    param_ids: list[int]
    tensors: list[torch.Tensor]  # float32, one per device, in the order of ``locs``
    _host: list[float] | None = field(default=None, repr=False)

    def host(self) -> list[float]:
        """The norms as floats. This waits for the device: call it only from ``build_step``."""
        if self._host is None:
            self._host = [x for t in self.tensors for x in t.tolist()]
        return self._host


def collect(flat_params: Sequence[tuple[torch.Tensor, Loc]]) -> GradNorms | None:
    """Launch the norms of every dense gradient; ``None`` when no parameter has one."""
    groups = _grads_by_device(flat_params)
    if not groups:
        return None
    locs: list[Loc] = []
    ids: list[int] = []
    tensors = []
    with torch.no_grad():
        for entries in groups.values():
            tensors.append(device_norms([g for g, _, _ in entries]))
            locs += [loc for _, loc, _ in entries]
            ids += [pid for _, _, pid in entries]
    return GradNorms(locs, ids, tensors)


def _grads_by_device(
    flat_params: Sequence[tuple[torch.Tensor, Loc]],
) -> dict[torch.device, list[tuple[torch.Tensor, Loc, int]]]:
    """(gradient, owner, parameter id) per device; each parameter once, sparse gradients left out."""
    groups: dict[torch.device, list[tuple[torch.Tensor, Loc, int]]] = {}
    seen: set[int] = set()
    for p, loc in flat_params:
        g = p.grad
        if g is None or id(p) in seen or g.layout != torch.strided:
            continue
        seen.add(id(p))
        groups.setdefault(g.device, []).append((g, loc, id(p)))
    return groups


def device_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each tensor (all on one device) as one float32 tensor there, without a host sync."""
    # torch._foreach_norm computes all the norms in a few fused kernels instead of one launch per
    # gradient (hundreds for a transformer, which a launch-bound step would feel); it is a private
    # API, so it is used behind a feature check, and a torch without it (or without its dtype
    # argument) gets the per-tensor loop. At least float32 so that an fp16 gradient's norm cannot
    # overflow; float64 where a gradient is float64 (torch refuses a narrowing dtype), then float32.
    wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    foreach = getattr(torch, "_foreach_norm", None)
    if foreach is not None:
        try:
            return torch.stack(list(foreach(grads, 2, dtype=wide))).float()
        except (TypeError, NotImplementedError):
            pass
    return torch.stack([torch.linalg.vector_norm(g, dtype=wide) for g in grads]).float()


# ----------------------------------------------------------------------------------------- per module


def step_figures(
    norms: GradNorms, order: dict[int, int], sizes: dict[int, int]
) -> tuple[dict[int, dict[str, list[Any]]], dict[str, Any]]:
    """Per-model columns ``grad_norm`` (null: no gradient, or non-finite) and ``grad_nonfinite`` (0, or
    the module's 1-based rank among the non-finite ones), and the step's ``grad_norm`` field.

    ``order`` maps a parameter's id to when its gradient was first accumulated in the backward pass;
    the non-finite modules are ranked in that order (see ``nonfinite_order``)."""
    own, total = module_norms(norms.locs, norms.host())
    bad = nonfinite_order(own, _backward_rank(norms, order))
    cols: dict[int, dict[str, list[Any]]] = {
        m: {"grad_norm": [None] * n, "grad_nonfinite": [0] * n} for m, n in sizes.items()
    }
    for (m, i), value in own.items():
        if m in cols and math.isfinite(value):
            cols[m]["grad_norm"][i] = _sig(value)
    for rank, (m, i) in enumerate(bad, 1):
        if m in cols:
            cols[m]["grad_nonfinite"][i] = rank
    field_: dict[str, Any] = {
        "global": _sig(total) if math.isfinite(total) else None,
        "nonfinite_modules": [[m, i] for m, i in bad],
        "first_nonfinite": list(bad[0]) if bad else None,
    }
    return cols, field_


def module_norms(locs: list[Loc], values: list[float]) -> tuple[dict[Loc, float], float]:
    """Each module's norm, sqrt(sum of its parameters' squared norms), and the global norm."""
    squares: dict[Loc, float] = {}
    for loc, v in zip(locs, values, strict=True):
        squares[loc] = squares.get(loc, 0.0) + v * v
    return {loc: math.sqrt(s) for loc, s in squares.items()}, math.sqrt(sum(squares.values()))


def _backward_rank(norms: GradNorms, order: dict[int, int]) -> dict[Loc, int]:
    """Per module, when the first of its parameters' gradients was accumulated."""
    rank: dict[Loc, int] = {}
    for loc, pid in zip(norms.locs, norms.param_ids, strict=True):
        if pid in order:
            rank[loc] = min(rank.get(loc, order[pid]), order[pid])
    return rank


def nonfinite_order(own: dict[Loc, float], rank: dict[Loc, int]) -> list[Loc]:
    """Modules with a NaN or infinite norm, in backward order. Where that is unknown (the first step,
    before the gradient hooks exist), in reverse model order, the order backward usually runs in: a
    NaN flows from where it appears to the modules before it, so the first one listed is its source."""
    bad = [loc for loc, v in own.items() if not math.isfinite(v)]
    return sorted(bad, key=lambda loc: (rank.get(loc, math.inf), -loc[0], -loc[1]))


def _sig(value: float) -> float:
    """Six significant digits: enough for a norm, and a short, deterministic trace."""
    return float(f"{value:.6g}")
