"""The Lightning ``Trainer`` adapter of ``memdoctor run`` (``lightning`` and ``pytorch_lightning``).

``Trainer.__init__`` gets the plan's ``accumulate_grad_batches`` and ``precision``; the data connector's
``_prepare_dataloader`` rebuilds the training DataLoader around ``MicroBatchSampler``, so n micro-batches
make exactly one of the script's batches (or the accumulation is refused by name).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from memdoctor.config.export import lightning_trainer_kwargs
from memdoctor.levers.frameworks_state import FrameworkState, framework_splits, micro_batch_note

_FULL_PRECISION = (None, 32, "32", "32-true")


def patch_trainer(state: FrameworkState, module: ModuleType) -> None:
    """Lightning's ``Trainer.__init__`` takes the plan's kwargs and remembers what to split by."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(trainer: Any, *a: Any, **kw: Any) -> None:
            kw, armed = state.guard("Lightning Trainer", trainer_kwargs, state, kw) or (kw, None)
            original(trainer, *a, **kw)
            if armed is not None:  # (the script's accumulate_grad_batches, n) for the loader hook
                trainer.__dict__["_memdoctor_accumulation"] = armed

        return __init__

    state.wrap(module.Trainer, "__init__", make)


def patch_data_connector(state: FrameworkState, module: ModuleType) -> None:
    """The training DataLoader is rebuilt into micro-batches when Lightning prepares it."""
    connector = getattr(module, "_DataConnector", None)
    if connector is None or not hasattr(connector, "_prepare_dataloader"):
        return  # another Lightning: _lightning_accumulation refuses accumulation by name
    state.loader_hook = True

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _prepare_dataloader(conn: Any, dataloader: Any, shuffle: bool, mode: Any) -> Any:
            prepared = original(conn, dataloader, shuffle, mode)
            if getattr(mode, "value", mode) != "train":
                return prepared
            rebatched = state.guard("Lightning DataLoader", _lightning_rebatch, state, conn.trainer, prepared)
            return prepared if rebatched is None else rebatched

        return _prepare_dataloader

    state.wrap(connector, "_prepare_dataloader", make)


def trainer_kwargs(
    state: FrameworkState, kwargs: dict[str, Any]
) -> tuple[dict[str, Any], tuple[int, int] | None]:
    """The user's ``Trainer`` kwargs with the plan's accumulation and precision (+ what to split by)."""
    config, out, armed = state.config, dict(kwargs), None
    if framework_splits(config):
        armed = _lightning_accumulation(state, out)
    if config.precision != "fp32":
        wanted = lightning_trainer_kwargs(config)["precision"]
        own = out.get("precision")
        note = (
            ""
            if own in _FULL_PRECISION or own == wanted
            else f" (the script set {own!r}; the plan's is used)"
        )
        out["precision"] = wanted
        state.say(f"Lightning: precision={wanted!r}{note}")
        state.handled.add("precision")
    return out, armed


def _lightning_accumulation(state: FrameworkState, kwargs: dict[str, Any]) -> tuple[int, int] | None:
    """Multiply ``accumulate_grad_batches`` by n, or refuse by name; the part is Lightning's either way."""
    n, own = state.config.accumulation_steps, int(kwargs.get("accumulate_grad_batches", 1))
    state.handled.add("accumulation")
    if not state.loader_hook:
        state.say("Lightning: accumulation refused: this Lightning has no DataLoader hook memdoctor knows")
        return None
    callbacks = kwargs.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks]
    if any(type(c).__name__ == "GradientAccumulationScheduler" for c in callbacks):
        state.say("Lightning: accumulation refused: the script schedules accumulation itself")
        return None
    kwargs["accumulate_grad_batches"] = own * n
    state.say(
        f"Lightning: accumulate_grad_batches={own * n} (was {own}); each training batch is split into {n} "
        "micro-batches when the training DataLoader is built"
    )
    return own, n


def _lightning_rebatch(state: FrameworkState, trainer: Any, loader: Any) -> Any:
    """The training loader with each batch split into n micro-batches, or refused (accumulation undone)."""
    armed = trainer.__dict__.get("_memdoctor_accumulation")
    if armed is None or trainer.accumulate_grad_batches != armed[0] * armed[1]:
        return loader  # no plan for this Trainer, or the accumulation was already refused
    own, n = armed
    why, rebuilt = _cannot_rebatch(loader, n), None
    if why is None:
        try:
            rebuilt = _rebuild(loader, MicroBatchSampler(loader.batch_sampler, n))
        except Exception as exc:  # an argument this torch's DataLoader does not take back
            why = f"the training DataLoader could not be rebuilt ({type(exc).__name__}: {exc})"
    if rebuilt is None:  # the script's batches with the script's accumulation: its effective batch
        trainer.accumulate_grad_batches = own
        state.say(f"Lightning: accumulation refused: {why}; accumulate_grad_batches is back to {own}")
        return loader
    state.say(
        f"Lightning: training DataLoader batch size {loader.batch_size} -> {n} micro-batches of "
        f"{loader.batch_size // n}{micro_batch_note(state.config, loader.batch_size)}"
    )
    return rebuilt


def _cannot_rebatch(loader: Any, n: int) -> str | None:
    from torch.utils.data import BatchSampler, DataLoader

    if type(loader) is not DataLoader:
        return (
            f"the training loader is a {type(loader).__name__}, not a plain DataLoader memdoctor can rebuild"
        )
    if type(loader.batch_sampler) is not BatchSampler:
        return "the training DataLoader has its own batch sampler (or no batching) memdoctor cannot split"
    size = loader.batch_sampler.batch_size
    if size % n:
        return f"its batch size {size} is not divisible by the plan's accumulation_steps={n}"
    return None


def _rebuild(loader: Any, batch_sampler: Any) -> Any:
    """The same DataLoader (dataset, workers, collate, pinning, ...) with another batch sampler."""
    from torch.utils.data import DataLoader

    skip = {"self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"}
    params = inspect.signature(DataLoader.__init__).parameters
    kwargs = {p: getattr(loader, p) for p in params if p not in skip and hasattr(loader, p)}
    return DataLoader(loader.dataset, batch_sampler=batch_sampler, **kwargs)


class MicroBatchSampler:
    """Each batch of ``batches`` (a ``BatchSampler``) as ``n`` consecutive near-equal micro-batches.

    The samples and their order are the script's own; ``n`` micro-batches make one of its batches, so
    ``accumulate_grad_batches × n`` steps the optimizer on exactly the script's batches (a last, partial
    batch smaller than ``n`` samples gives fewer micro-batches; Lightning steps at the epoch's end).
    """

    def __init__(self, batches: Any, n: int) -> None:
        self.batches = batches
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches:
            indices = list(batch)
            size, extra = divmod(len(indices), self.n)
            start = 0
            for i in range(min(self.n, len(indices))):
                stop = start + size + (1 if i < extra else 0)
                yield indices[start:stop]
                start = stop

    def __len__(self) -> int:
        batches = self.batches
        full, rest = divmod(len(batches.sampler), batches.batch_size)
        return full * self.n + (0 if batches.drop_last or not rest else min(self.n, rest))
