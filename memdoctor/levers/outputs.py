"""A split forward's outputs joined back into one, for the script that reads them.

The in-forward split (``memdoctor.levers.microbatch``) returns what the unsplit forward would have: the
last micro-batch's output with its loss (found by ``memdoctor.capture.loopshape.find_loss``, wherever
it is: the output itself, a tuple's element, a mapping's key, a dataclass field or HF ``ModelOutput``
attribute) replaced by the whole batch's, and every batch-shaped tensor prefixed by the earlier
micro-batches' (detached: only the loss carries gradients back). Tensors are joined along the batch
dimension the inputs were split on; one whose shape differs elsewhere keeps the last micro-batch's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from memdoctor.capture.loopshape import LossPath


def detached(out: Any) -> Any:
    """``out`` without autograd history, as plain containers (a dataclass as a dict of its fields)."""
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, Mapping):
        return {k: detached(v) for k, v in out.items()}
    if isinstance(out, (list, tuple)):
        return [detached(v) for v in out]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return {f.name: detached(getattr(out, f.name, None)) for f in dataclasses.fields(out)}
    return None


def nbytes(out: Any) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, Mapping):
        return sum(nbytes(v) for v in out.values())
    if isinstance(out, (list, tuple)):
        return sum(nbytes(v) for v in out)
    return 0


def merge_outputs(out: Any, earlier: list[Any], loss: torch.Tensor, path: LossPath, dim: int = 0) -> Any:
    """``out`` with its loss (at ``path``) replaced by ``loss`` and its other batch-shaped tensors
    prefixed by ``earlier``'s (``detached`` outputs), joined along ``dim``."""
    if not path:
        return loss
    _, key = path
    if isinstance(out, Mapping):
        for k in list(out.keys()):
            out[k] = loss if k == key else _cat([_get(e, k) for e in earlier], out[k], dim)  # type: ignore[index]
        return out
    if isinstance(out, (list, tuple)):
        values = [
            loss if i == key else _cat([_get(e, i) for e in earlier], v, dim) for i, v in enumerate(out)
        ]
        return type(out)(*values) if hasattr(out, "_fields") else type(out)(values)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        changes = {
            f.name: loss
            if f.name == key
            else _cat([_get(e, f.name) for e in earlier], getattr(out, f.name, None), dim)
            for f in dataclasses.fields(out)
            if f.init
        }
        return dataclasses.replace(out, **changes)
    setattr(out, key, loss)  # an object with a .loss attribute
    return out


def _get(earlier: Any, key: Any) -> Any:
    if isinstance(earlier, Mapping):
        return earlier.get(key)
    if isinstance(earlier, list) and isinstance(key, int) and key < len(earlier):
        return earlier[key]
    return None


def _cat(earlier: list[Any], last: Any, dim: int) -> Any:
    if not earlier:
        return last
    if isinstance(last, torch.Tensor) and all(isinstance(t, torch.Tensor) for t in earlier):
        return _cat_tensors(earlier, last, dim)
    if isinstance(last, (list, tuple)) and all(isinstance(e, list) and len(e) == len(last) for e in earlier):
        joined = [_cat([e[i] for e in earlier], v, dim) for i, v in enumerate(last)]
        return type(last)(*joined) if hasattr(last, "_fields") else type(last)(joined)
    return last


def _cat_tensors(earlier: list[torch.Tensor], last: torch.Tensor, dim: int) -> torch.Tensor:
    """Joined along ``dim`` where every piece has it and agrees elsewhere; else the last piece (a
    tensor that is not batch-shaped, such as a per-model statistic)."""
    if last.dim() <= dim:
        return last
    rest = [*last.shape[:dim], *last.shape[dim + 1 :]]
    if all(t.dim() == last.dim() and [*t.shape[:dim], *t.shape[dim + 1 :]] == rest for t in earlier):
        return torch.cat([*earlier, last], dim=dim)
    return last
