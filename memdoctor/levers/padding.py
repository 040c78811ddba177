"""``padding: trim``: cut each batch a DataLoader yields to its longest attention-masked sequence.

Done where the batch is built, on the host (the DataLoader iterator's ``__next__``, as the data
collector times it: torch has no public hook there), so finding the length costs no GPU sync and the
loop's iterations are unchanged. Only trailing columns where every row's ``attention_mask`` is 0 are
dropped, from every tensor of the batch shaped (batch, length): with the mask, attention gives those
positions weight 0, and right padding leaves every real token's position unchanged, so the model's
outputs for the real tokens are those of the padded batch (up to float summation order). A label
tensor is trimmed only when its dropped columns are all -100 (ignored by the loss); otherwise that
batch is left as it is. Left padding is never trimmed (positions would shift).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, MutableMapping
from typing import Any

import torch

from memdoctor.patching import Undo, set_attr

IGNORE_INDEX = -100  # the label value torch's and HF's losses ignore


class PaddingTrim:
    def __init__(self, active: Callable[[], bool] = lambda: True) -> None:
        self._active = active
        self.batches = 0  # batches with an attention mask
        self.trimmed = 0
        self.columns_before = 0
        self.columns_after = 0
        self.kept_for_labels = 0

    def install(self) -> Undo | None:
        """Patch the loader iterator; None when this torch lacks it (the caller names the part)."""
        from torch.utils.data import dataloader

        cls = getattr(dataloader, "_BaseDataLoaderIter", None)
        original = getattr(cls, "__next__", None)
        if cls is None or original is None:
            return None
        trim = self

        def __next__(it: Any) -> Any:
            batch = original(it)
            return trim.trim(batch) if trim._active() else batch

        return set_attr(cls, "__next__", __next__)

    def trim(self, batch: Any) -> Any:
        if not isinstance(batch, MutableMapping):
            return batch
        mask = batch.get("attention_mask")
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.device.type != "cpu":
            return batch
        self.batches += 1
        rows, length = mask.shape
        real = mask.any(dim=0).nonzero()
        keep = max(1, int(real[-1]) + 1) if real.numel() else 1
        self.columns_before += length
        if keep >= length:
            self.columns_after += length
            return batch
        shaped = {
            k: v
            for k, v in batch.items()
            if isinstance(v, torch.Tensor) and tuple(v.shape[:2]) == (rows, length)
        }
        if any("label" in str(k) and bool((v[:, keep:] != IGNORE_INDEX).any()) for k, v in shaped.items()):
            self.kept_for_labels += 1
            self.columns_after += length
            return batch
        out = copy.copy(batch)
        for k, v in shaped.items():
            out[k] = v[:, :keep]
        self.trimmed += 1
        self.columns_after += keep
        return out

    def summary(self) -> str:
        if not self.batches:
            return (
                "padding: trim: NOT applied: the script's DataLoaders yielded no mapping batch with a "
                "2-D attention_mask on the CPU"
            )
        cut = 1 - self.columns_after / max(1, self.columns_before)
        text = (
            f"padding: trim: {self.trimmed} of {self.batches} batches trimmed, "
            f"{cut:.0%} of their columns dropped"
        )
        if self.kept_for_labels:
            text += f"; {self.kept_for_labels} left whole (labels in the padding were not -100)"
        return text
