"""What a batch looks like: the shapes of its tensors and, for token batches, each sequence's real length.

Used by the data collector on every batch a DataLoader hands the training loop (on the host, where
batches are built) and, for scripts without a DataLoader, on the inputs of the model's forward (where the
tensors may already be on the GPU). The work per batch is bounded: at most ``MAX_TENSORS`` tensors and
``MAX_DEPTH`` levels of nesting are looked at, and one row sum gives the lengths. A row sum on the GPU is
only launched here; ``BatchTraits.to_field`` reads it, once per step, after the step's GPU work is done.

A token batch is recognised by name first (``input_ids``, ``attention_mask``, as Hugging Face tokenizers
and collators produce, also inside tuples and dataclasses). An unnamed tuple such as ``(ids, mask,
labels)`` is recognised on the host only, by value: a second integer matrix of the ids' shape that holds
only 0 and 1, with a 1 in the first or last column of every row (a padding mask, right- or left-padded;
this rules out all-zero or sentence-pair ``token_type_ids``). Without a mask, real lengths come from
``input_ids != pad_token_id`` when the model's config names a pad token.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import torch

MAX_TENSORS = 32
MAX_DEPTH = 3
MAX_ITEMS = 64  # children looked at per container
MAX_NODES = 512  # objects visited per batch (a batch of raw token lists is mostly ints)
MAX_KEY = 64
MAX_LENGTHS = 512  # lengths kept per batch; longer batches keep an evenly spaced sample
IDS_NAMES = frozenset({"input_ids"})
MASK_NAMES = frozenset({"attention_mask"})
BARE = "batch"  # the path of a batch that is a single tensor

Named = list[tuple[str, torch.Tensor, bool]]  # (path, tensor, reached through names only)


@dataclasses.dataclass
class BatchTraits:
    """One batch: shapes by path (``input_ids``, ``0``, ``0.pixel_values``), and token figures."""

    shapes: dict[str, list[int]]
    elements: int
    tokens: int | None = None  # ids (or mask) elements: batch x padded length
    lengths: Any = None  # list[int], a device tensor until resolved, or None
    lengths_from: str | None = None
    truncated: bool = False  # a limit (MAX_TENSORS, MAX_NODES) cut the walk: shapes lists the first ones
    fetched_step: int | None = None
    batch_size: int | None = None  # measured: the size the tensors share along their batch dimension
    batch_dim: int | None = None  # that dimension, where every tensor agrees on it (1: sequence-first)

    def real_lengths(self) -> list[int] | None:
        """The lengths as ints (reads a device tensor back: call it from ``step_field`` only)."""
        if self.lengths is None or isinstance(self.lengths, list):
            return self.lengths
        self.lengths = [int(v) for v in self.lengths.tolist()]
        return self.lengths

    def to_field(self, step: int) -> dict[str, Any]:
        """The batch's entry in ``step.collectors.data.batches``."""
        out: dict[str, Any] = {"shapes": self.shapes, "elements": self.elements}
        if self.truncated:
            out["shapes_truncated"] = True
        if self.fetched_step is not None and self.fetched_step != step:
            out["fetched_step"] = self.fetched_step
        if self.batch_size is not None:
            out["batch_size"] = self.batch_size
            out["batch_dim"] = self.batch_dim
        if self.tokens is None:
            return out
        out["tokens"] = self.tokens
        lengths = self.real_lengths()
        if lengths is None:
            return out
        real = sum(lengths)
        out["real_tokens"] = real
        out["padding_fraction"] = round(1.0 - real / self.tokens, 6) if self.tokens else None
        out["lengths_from"] = self.lengths_from
        if len(lengths) > MAX_LENGTHS:
            stride = len(lengths) / MAX_LENGTHS
            lengths = [lengths[int(i * stride)] for i in range(MAX_LENGTHS)]
            out["lengths_sampled"] = True
        out["lengths"] = lengths
        return out


def batch_traits(batch: Any, pad_token_id: int | None = None) -> BatchTraits:
    """Shapes and token figures of ``batch`` (a tensor, or dicts/tuples/lists/dataclasses of them)."""
    return _traits(named_tensors(batch), pad_token_id)


def _traits(collected: tuple[Named, bool], pad_token_id: int | None) -> BatchTraits:
    found, truncated = collected
    shapes: dict[str, list[int]] = {}
    elements = 0
    for path, t, _ in found:
        shapes[path] = list(t.shape)
        elements += t.numel()
    traits = BatchTraits(shapes=shapes, elements=elements, truncated=truncated)
    _token_figures(traits, found, pad_token_id)
    return traits


def call_traits(args: tuple[Any, ...], kwargs: dict[str, Any], pad_token_id: int | None) -> BatchTraits:
    """Traits of a forward call's inputs: positional arguments by index, keyword arguments by name."""
    roots = [(str(i), a, False) for i, a in enumerate(args)] + [(str(k), v, True) for k, v in kwargs.items()]
    return _traits(_collect(roots), pad_token_id)


def named_tensors(batch: Any) -> tuple[Named, bool]:
    """The tensors in ``batch`` with their paths, depth-first, at most ``MAX_TENSORS``; and whether
    some were left out."""
    if isinstance(batch, torch.Tensor):
        return _collect([(BARE, batch, False)])
    return _collect(_children(batch))


def _collect(roots: list[tuple[str, Any, bool]]) -> tuple[Named, bool]:
    out: Named = []
    budget = [MAX_NODES]
    for key, obj, named in roots:
        if _walk(obj, key, named, 1, out, budget):
            return out, True
    return out, False


def _walk(obj: Any, path: str, named: bool, depth: int, out: Named, budget: list[int]) -> bool:
    """Append the tensors under ``obj``; True when a limit (tensors, objects visited) cut the walk short."""
    budget[0] -= 1
    if budget[0] < 0:
        return True
    if isinstance(obj, torch.Tensor):
        if len(out) >= MAX_TENSORS:
            return True
        if _usable(obj):
            out.append((path, obj, named))
        return False
    if depth >= MAX_DEPTH:
        return False
    kids = _children(obj)
    return any(_walk(c, f"{path}.{k}", named and n, depth + 1, out, budget) for k, c, n in kids)


def _children(obj: Any) -> list[tuple[str, Any, bool]]:
    """``(key, child, key is a name)`` of a container, at most ``MAX_ITEMS``; nothing for anything else
    (strings, numbers, arbitrary objects)."""
    if isinstance(obj, Mapping):  # dict, BatchEncoding, ModelOutput
        pairs: Any = ((k, v, True) for k, v in obj.items())
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        pairs = ((k, v, True) for k, v in zip(obj._fields, obj, strict=False))
    elif isinstance(obj, (tuple, list)):
        if obj and isinstance(obj[0], (int, float, str, bytes)):
            return []  # a list of numbers or strings (raw token ids, texts): no tensors inside
        pairs = ((i, v, False) for i, v in enumerate(obj))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        pairs = ((f.name, getattr(obj, f.name, None), True) for f in dataclasses.fields(obj))
    else:
        return []
    return [(str(k)[:MAX_KEY], v, n) for k, v, n in itertools.islice(pairs, MAX_ITEMS)]


def _usable(t: torch.Tensor) -> bool:
    """Whether a tensor has a plain shape (nested and meta tensors are skipped)."""
    try:
        return not t.is_nested and t.device.type != "meta"
    except (RuntimeError, AttributeError):
        return False


# ----------------------------------------------------------------------------------------- tokens


def _token_figures(traits: BatchTraits, found: Named, pad_token_id: int | None) -> None:
    ids = _by_name(found, IDS_NAMES)
    mask = _by_name(found, MASK_NAMES)
    if ids is None and mask is None:
        ids, mask = _unnamed_pair(found, pad_token_id)
    if ids is not None and mask is not None and ids[1].shape != mask[1].shape:
        mask = None  # not a per-token mask (e.g. a 4-D attention bias)
    matrix = ids or mask
    if matrix is None:
        return
    traits.tokens = matrix[1].numel()
    try:
        if mask is not None:
            m = mask[1]
            lengths, source = (m.ne(0) if m.is_floating_point() else m).sum(dim=1), mask[0]
        elif pad_token_id is not None and ids is not None:
            lengths, source = ids[1].ne(pad_token_id).sum(dim=1), f"{ids[0]} != {pad_token_id}"
        else:
            return
    except (RuntimeError, TypeError):
        return
    traits.lengths = [int(v) for v in lengths.tolist()] if lengths.device.type == "cpu" else lengths
    traits.lengths_from = source


def _by_name(found: Named, names: frozenset[str]) -> tuple[str, torch.Tensor] | None:
    for path, t, named in found:
        if named and path.rsplit(".", 1)[-1] in names and t.dim() == 2:
            return path, t
    return None


def _unnamed_pair(
    found: Named, pad_token_id: int | None
) -> tuple[tuple[str, torch.Tensor] | None, tuple[str, torch.Tensor] | None]:
    """``(ids, mask)`` among the integer matrices not reached through names: the first is the ids; a
    mask is recognised by its values, so on the host only."""
    mats = [(p, t) for p, t, named in found if not named and t.dim() == 2 and _integer(t)]
    candidates = [m for m in mats if m[1].dtype != torch.bool]
    if not candidates:
        return None, None
    ids = candidates[0]
    for other in mats:
        same = other is not ids and other[1].shape == ids[1].shape
        if same and other[1].device.type == "cpu" and _looks_like_mask(other[1]):
            return ids, other
    return (ids, None) if pad_token_id is not None else (None, None)


def _integer(t: torch.Tensor) -> bool:
    return t.dtype == torch.bool or not (t.is_floating_point() or t.is_complex())


def _looks_like_mask(t: torch.Tensor) -> bool:
    """0/1 values, every row with a 1 in its first or last column (right or left padding). Host
    tensors only (reading values back from a GPU would synchronise)."""
    if t.numel() == 0:
        return False
    if t.dtype != torch.bool:
        lo, hi = torch.aminmax(t)
        if int(lo) < 0 or int(hi) > 1:
            return False
    return bool((t[:, 0] | t[:, -1]).all())
