"""``data_loader``: the config's DataLoader arguments, given to every DataLoader the script builds.

A built DataLoader cannot be changed (its iterator reads the arguments once), so ``DataLoader.__init__``
is wrapped before the script runs and the config's values replace the script's (subclasses, such as
accelerate's ``DataLoaderShard``, call it too). ``prefetch_factor`` and ``persistent_workers`` only
exist with worker processes: with ``num_workers`` 0 they are left out (and said so).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from memdoctor.config import DataLoaderSettings
from memdoctor.patching import Undo, set_attr

_WORKER_ONLY = ("prefetch_factor", "persistent_workers")


def overrides(settings: DataLoaderSettings) -> dict[str, Any]:
    return {k: v for k, v in vars(settings).items() if v is not None}


class LoaderSettings:
    def __init__(self, settings: DataLoaderSettings, active: Callable[[], bool] = lambda: True) -> None:
        self.values = overrides(settings)
        self._active = active
        self.loaders = 0
        self.dropped: set[str] = set()

    def install(self) -> Undo:
        original = DataLoader.__init__
        signature = inspect.signature(original)
        patch = self

        def __init__(loader: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
            if patch._active():
                bound = signature.bind(loader, *args, **kwargs)
                patch._apply(bound.arguments)
                args, kwargs = tuple(bound.args[1:]), dict(bound.kwargs)
            original(loader, *args, **kwargs)

        return set_attr(DataLoader, "__init__", __init__)

    def _apply(self, arguments: dict[str, Any]) -> None:
        arguments.update(self.values)
        if not arguments.get("num_workers"):
            for name in _WORKER_ONLY:
                if name in self.values:
                    arguments.pop(name, None)
                    self.dropped.add(name)
        self.loaders += 1

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.values.items())
        return f"data loader: {shown} for every DataLoader the script builds"

    def summary(self) -> str:
        if not self.loaders:
            return "data_loader: NOT applied: the script built no DataLoader"
        text = f"data_loader: applied to {self.loaders} DataLoader(s)"
        if self.dropped:
            text += f"; {', '.join(sorted(self.dropped))} left out where num_workers is 0"
        return text
