"""Collectors: the instruments beyond the memory ledger (histograms, data, transfers, FLOPs, ...).

A collector is a small object the ``ProfileSession`` calls at fixed points. Every method is optional
(the base class does nothing), so a collector implements only what it needs:

* ``start(session)`` / ``stop()``: install and remove whatever it patches or hooks. ``stop`` must be safe
  to call twice and must leave nothing behind (the test suite checks for leaked hooks and threads).
* ``on_step_start(step, detailed)``: a new optimizer step begins (``detailed``: it records the
  per-module ledger; timing steps run with the optimizer hooks only and get no module calls).
* ``on_forward_pre`` / ``on_forward_post``: every module call of a detailed step (``timed`` is False for
  modules deeper than the timing depth). Only collectors with ``wants_modules = True`` get them; they
  run on the hot path, so keep them to a few attribute reads and no host synchronisation.
* ``on_backward(event, key, depth, grad)``: a timed module's backward starts (``bwd_pre``, ``grad`` is
  the gradient of its output) or ends (``bwd_post``, the gradient of its first input).
* ``on_optimizer(step)``: the step's first optimizer pre-hook (gradients are complete);
  ``on_optimizer_end(step)``: after every optimizer step's post-hook.
* ``on_model(model, root)``: a trained model was discovered (at its first optimizer step, or at a
  fault): ``model`` is its index in the trace, ``root`` the ``nn.Module``; ``session.models[model]``
  has its module list in trace order.
* ``step_field(step)``: JSON-able data for the step's record (``step.collectors[name]``), or None.
  Called when the step's record is built, after the step's GPU work has finished, so this is the
  one place a collector may read device values back; it may be called twice for the same step (a
  provisional and a final record) and must then return the same data.
* ``module_columns(step)``: extra per-module numeric columns (``{model: {column: [value per module]}}``)
  merged into ``step.modules``.

Collector-wide facts (the device's PCIe link, a measured bandwidth) go out once through
``session.emit(name, data)`` as a ``collector`` record. The collectors are an explicit list of
imported classes (``collector_classes``): a missing memdoctor module is an ImportError. A missing
optional dependency (nvtx, an NVIDIA driver) is the collector's own business: its constructor raises
``CollectorUnavailable``, which disables that one collector, says why in the trace's ``not_measured``,
and leaves the others working.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from memdoctor.capture.session import ProfileSession

# What ``--collect`` accepts: each collector class's ``name``, in the order ``collector_classes`` lists
# them (the order they are started and called). Plain strings, so the launching process checks
# ``--collect`` without importing torch.
NAMES: tuple[str, ...] = ("device", "nvtx", "data", "transfers", "histograms", "flops", "precision")
ALL = "all"
NONE = "none"


class Collector:
    """Base class: every hook is a no-op. Subclasses set ``name`` (the key in the trace)."""

    name: str = ""
    wants_modules: bool = False

    def start(self, session: ProfileSession) -> None:
        """Install patches or hooks; ``session`` answers where the script is (``current_*``)."""

    def stop(self) -> None:
        """Remove everything ``start`` installed. Safe to call twice."""

    def on_step_start(self, step: int, detailed: bool) -> None:
        """A new optimizer step begins."""

    def on_forward_pre(self, key: int, module: nn.Module, depth: int, timed: bool) -> None:
        """A module's forward starts (detailed steps only; ``key`` is ``id(module)``)."""

    def on_forward_post(self, key: int, module: nn.Module, output: Any, depth: int, timed: bool) -> None:
        """A module's forward returned ``output``."""

    def on_backward(self, event: str, key: int, depth: int, grad: Any) -> None:
        """A timed module's backward starts (``bwd_pre``) or ends (``bwd_post``)."""

    def on_optimizer(self, step: int) -> None:
        """The step's first optimizer step is about to run: its gradients are complete."""

    def on_optimizer_end(self, step: int) -> None:
        """An optimizer step returned (a step may run several optimizers)."""

    def on_model(self, model: int, root: nn.Module) -> None:
        """A trained model was discovered; its modules are ``session.models[model].modules``."""

    def step_field(self, step: int) -> Any:
        """The step record's ``collectors[name]`` (JSON-able), or None for nothing measured."""
        return None

    def module_columns(self, step: int) -> dict[int, dict[str, list[Any]]]:
        """Extra numeric per-module columns for the step: ``{model: {column: [one per module]}}``."""
        return {}


def parse_names(text: str | None) -> list[str]:
    """``--collect`` text -> collector names: ``all`` (default), ``none``, or a comma list.

    Raises ValueError with a one-line message for an unknown name."""
    text = (text or ALL).strip().lower()
    if text == ALL:
        return list(NAMES)
    if text == NONE:
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        known = ", ".join(NAMES)
        raise ValueError(f"unknown collector {unknown[0]!r}: choose from {known}, or all / none")
    return [n for n in NAMES if n in names]  # registry order, each once


def collector_classes() -> dict[str, type[Collector]]:
    """Every collector class by its ``name``, in ``NAMES`` order.

    Imported here rather than at the top: each collector module imports this one (for ``Collector``),
    and ``parse_names`` runs in the launching process, which never imports torch."""
    from memdoctor.capture.dataloader import DataCollector
    from memdoctor.capture.devicefacts import DeviceFactsCollector
    from memdoctor.capture.flops import FlopCollector
    from memdoctor.capture.histograms import HistogramCollector
    from memdoctor.capture.nvtxranges import NvtxCollector
    from memdoctor.capture.precision import PrecisionCollector
    from memdoctor.capture.transfers import TransferCollector

    classes: list[type[Collector]] = [
        DeviceFactsCollector,
        NvtxCollector,
        DataCollector,
        TransferCollector,
        HistogramCollector,
        FlopCollector,
        PrecisionCollector,
    ]
    return {cls.name: cls for cls in classes}


def make_collectors(names: list[str], **options: Any) -> tuple[list[Collector], list[str]]:
    """Instantiate the named collectors; return them and a ``not_measured`` note for each that cannot
    run here (it says it cannot: ``CollectorUnavailable``)."""
    classes = collector_classes()
    out: list[Collector] = []
    notes: list[str] = []
    for name in names:
        try:
            out.append(classes[name](**options))
        except CollectorUnavailable as exc:
            notes.append(f"{name}: {exc}")
        except Exception as exc:  # memdoctor's own failure: that collector is off, the script still runs
            notes.append(f"{name}: the collector failed to start: {type(exc).__name__}: {exc}"[:400])
    return out, notes


class CollectorUnavailable(Exception):
    """Raised by a collector's constructor when it cannot measure anything here (the message says
    why, e.g. ``no NVIDIA driver``); it ends up in the trace's ``not_measured``."""
