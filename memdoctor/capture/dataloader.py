"""The data collector: how long the training loop waits for each batch, and what the batches hold.

Wait. torch has no public hook on DataLoader iteration, so every batch fetch is timed by wrapping the
private ``torch.utils.data.dataloader._BaseDataLoaderIter.__next__``, the one method that single- and
multi-process loader iterators share (a feature check: on a torch without it, the wait is "not
measured" and the rest works). ``stop()`` puts the original back exactly. The wait is the host's wall
time inside ``__next__``: the time the training loop could not run. On CUDA a fetch may hide behind GPU
work still queued, which is no starvation, so each fetch is also bracketed by two device markers: the
device time between them (``device_wait_ms``) is the part of the wait the GPU sat idle. Each fetch is
an NVTX range ``dataloader`` (domain ``memdoctor``) when the ``nvtx`` package is importable.

Traits. Every fetched batch is measured on the host, where it was built (``batchtraits``): shapes, and
for token batches the real length of each sequence. Scripts that build batches without a DataLoader get
the same figures from the inputs of each trained model's forward (a ``register_forward_pre_hook`` with
kwargs on each discovered root), where the tensors may be on the GPU: the row sums are launched there
and read in ``step_field``.

Attribution. A fetch's wait belongs to the step the loop is in (``session.current_step()``), which is
the step the wait delays. A batch's traits belong to the step that trains on it, and that is not always
the step that fetched it: ``accelerate`` (so also the Hugging Face ``Trainer``) and Lightning fetch one
batch ahead, to know whether the current one is the last. The collector measures this look-ahead once,
at the first optimizer step: the batches fetched by then, less the micro-batches the step ran. After
that, each fetch hands the traits of the batch fetched ``lookahead`` fetches earlier to the current step,
and the end of an epoch hands over the rest.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from memdoctor import patching
from memdoctor.capture.batchtraits import BatchTraits, batch_traits, call_traits
from memdoctor.capture.collectors import Collector
from memdoctor.capture.compiled import compiled_inner, compiling
from memdoctor.capture.loopshape import LoopFacts, batch_dim, batch_size_of
from memdoctor.device import Device

if TYPE_CHECKING:
    from torch import nn

    from memdoctor.capture.session import ProfileSession

MAX_BATCHES = 16  # batch entries kept per step (more are counted in batches_total)
MAX_OPEN_STEPS = 64  # steps whose figures wait for their record; older ones are dropped
_NOTHING = object()


@dataclasses.dataclass(slots=True)
class _StepFigures:
    """What one step's fetches and batches measured, until its record is built."""

    wait_s: float = 0.0
    max_wait_s: float = 0.0
    fetches: int = 0
    markers: list[Any] = dataclasses.field(default_factory=list)
    batches: list[BatchTraits] = dataclasses.field(default_factory=list)
    batches_total: int = 0
    source: str | None = None
    epoch_ends: int = 0
    bg_fetches: int = 0
    bg_wait_s: float = 0.0


class DataCollector(Collector):
    """Data-loader wait per step and the traits of the batches each step trained on."""

    name = "data"

    def __init__(self, device: Device | None = None, **_: Any) -> None:
        self.device = device or Device()
        self._device_markers = self.device.kind != "cpu"  # on a CPU the wall clock is the device
        self._session: ProfileSession | None = None
        self._thread: int | None = None
        self._active = False
        self._patched: patching.Undo | None = None
        self._why_not: str | None = None
        self._failure: str | None = None
        self._steps: dict[int, _StepFigures] = {}
        self._fields: dict[int, Any] = {}
        self._pending: collections.deque[BatchTraits] = collections.deque()
        self._lookahead: int | None = None
        self._loader_tensors = False  # a fetched batch held tensors: the forward fallback stays off
        self._pad_id: int | None = None
        self._hooks: list[Any] = []
        self._in_wrapper = False  # inside a compiled model's call (``_wrapper_pre``)
        self._nvtx = _nvtx_range()
        self._loop = LoopFacts(self._emit_facts)

    # ------------------------------------------------------------------------------ lifecycle
    def start(self, session: ProfileSession) -> None:
        self._session = session
        self._thread = threading.get_ident()
        self._active = True
        self._patch()
        self._loop.start()
        self._emit_facts()

    def stop(self) -> None:
        self._active = False
        self._loop.stop()
        if self._patched is not None:
            self._patched()  # restores only if still ours; else someone wrapped ours: it passes through
            self._patched = None
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _patch(self) -> None:
        cls = getattr(torch.utils.data.dataloader, "_BaseDataLoaderIter", None)
        original = cls.__dict__.get("__next__") if isinstance(cls, type) else None
        if cls is None or not callable(original):
            self._why_not = (
                "this torch has no DataLoader iterator method to time (_BaseDataLoaderIter.__next__)"
            )
            return
        self._patched = patching.set_attr(cls, "__next__", _fetch_wrapper(self, original))

    def _emit_facts(self) -> None:
        if self._session is None:
            return
        self._session.emit(
            self.name,
            {
                "wait_measured": self._patched is not None,
                "why_not": self._why_not,
                "device_wait": self._device_markers,
                "lookahead": self._lookahead,
                "pad_token_id": self._pad_id,
                "nvtx": self._nvtx is not None,
                "failure": self._failure,
                "loop": self._loop.as_field(),
            },
        )

    def _fail(self, exc: BaseException) -> None:
        """A measurement failed inside the script's own call: stop measuring, keep the script running."""
        self._active = False
        self._failure = f"{type(exc).__name__}: {exc}"[:300]
        self._emit_facts()

    # ------------------------------------------------------------------------------ fetches
    def fetch(self, original: Callable[[Any], Any], it: Any) -> Any:
        """Run one ``__next__`` of a DataLoader iterator, timed (the wrapper calls this)."""
        if threading.get_ident() != self._thread:  # another thread's prefetching: the loop did not wait
            t0 = time.perf_counter()
            got = False
            try:
                fetched = original(it)
                got = True
                return fetched
            finally:
                self._safely(self._background, time.perf_counter() - t0, got)
        session = self._session
        step = session.current_step() if session is not None else 0
        m0 = self._edge(0)
        batch: Any = _NOTHING
        end = False
        t0 = time.perf_counter()
        try:
            batch = original(it)
            return batch
        except StopIteration:
            end = True
            raise
        finally:
            wait = time.perf_counter() - t0
            m1 = self._edge(1)
            self._safely(self._record, step, wait, (m0, m1), batch, end, it)

    def _edge(self, which: int) -> Any:
        """Open (0) or close (1) a fetch: the NVTX range, and a device marker (None on a CPU)."""
        try:
            if self._nvtx is not None:
                self._nvtx[which]()
            return self.device.marker() if self._device_markers else None
        except Exception as exc:  # a device error here must not reach the script's loop
            self._device_markers = False
            self._nvtx = None
            self._fail(exc)
            return None

    def _safely(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # never into the script's loop
            self._fail(exc)

    def _record(
        self, step: int, wait: float, markers: tuple[Any, Any], batch: Any, end: bool, it: Any = None
    ) -> None:
        fig = self._figures(step)
        fig.wait_s += wait
        fig.max_wait_s = max(fig.max_wait_s, wait)
        if markers[0] is not None and markers[1] is not None:
            fig.markers += markers
        if batch is not _NOTHING:
            fig.fetches += 1
            traits = batch_traits(batch, self._pad_id)
            traits.fetched_step = step
            _batch_axis(traits, batch, _loader_batch_size(it))
            self._loader_tensors = self._loader_tensors or bool(traits.shapes)
            if traits.shapes and torch.is_grad_enabled():
                self._loop.loader_batch()
            self._pending.append(traits)
            self._hand_over(step, self._lookahead)
        if end:
            fig.epoch_ends += 1
            self._hand_over(step, 0)

    def _background(self, wait: float, got: bool) -> None:
        fig = self._figures(self._session.current_step() if self._session is not None else 0)
        fig.bg_fetches += got
        fig.bg_wait_s += wait

    def _hand_over(self, step: int, keep: int | None) -> None:
        """Give the step the fetched batches beyond the ``keep`` newest (the look-ahead)."""
        if keep is None:  # look-ahead not known yet (before the first optimizer step)
            return
        while len(self._pending) > keep:
            self._take(step, self._pending.popleft(), "dataloader")

    def _take(self, step: int, traits: BatchTraits, source: str) -> None:
        fig = self._figures(step)
        fig.batches_total += 1
        fig.source = source
        if len(fig.batches) < MAX_BATCHES:
            fig.batches.append(traits)

    def _figures(self, step: int) -> _StepFigures:
        fig = self._steps.get(step)
        if fig is None:
            if len(self._steps) >= MAX_OPEN_STEPS:
                del self._steps[min(self._steps)]
            fig = self._steps[step] = _StepFigures()
        return fig

    # ------------------------------------------------------------------------------ session hooks
    def on_optimizer(self, step: int) -> None:
        self._loop.stepped()
        if self._lookahead is not None or not self._active:
            return
        consumed = self._session.micro_batches() if self._session is not None else 0
        fetched = len(self._pending)
        self._lookahead = max(0, fetched - consumed) if consumed and fetched else 0
        self._hand_over(step, self._lookahead)
        self._emit_facts()

    def on_model(self, model: int, root: nn.Module) -> None:
        if self._pad_id is None:
            self._pad_id = _pad_token_id(root)
            if self._pad_id is not None:
                self._emit_facts()
        if hasattr(root, "register_forward_pre_hook"):
            self._hooks.append(root.register_forward_pre_hook(self._forward_pre, with_kwargs=True))
            self._hooks.append(root.register_forward_hook(self._forward_post, with_kwargs=True))
        wrapper = self._session.compiled_wrapper(root) if self._session is not None else None
        if wrapper is not None:
            # torch.compile(model): the model's own hooks are traced away inside the compiled forward;
            # the wrapper's run in eager code around it, where reading the batch breaks no graph.
            self._hooks.append(wrapper.register_forward_pre_hook(self._wrapper_pre, with_kwargs=True))
            self._hooks.append(
                wrapper.register_forward_hook(self._wrapper_post, with_kwargs=True, always_call=True)
            )

    def _wrapper_pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> None:
        """A compiled model's call, in eager code: its batch. The model's own hooks, should dynamo run
        its forward eagerly after all, stay quiet until the wrapper's call returns (one batch, once)."""
        self._forward_pre(module, args, kwargs)
        self._in_wrapper = True

    def _wrapper_post(self, module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        self._in_wrapper = False
        if out is not None:  # None: the forward raised (an always_call hook)
            self._forward_post(compiled_inner(module), args, kwargs, out)

    def _forward_post(self, module: nn.Module, args: Any, *rest: Any) -> None:
        """Where the trained model's loss is and what its output holds, from its first training forward
        (``LoopFacts``). Not inside torch.compile'd code (``memdoctor.capture.compiled``): it writes a
        trace record. ``rest``: the kwargs and the output (torch calls a hook removed during the same
        call, by the session stopping, with the output alone)."""
        if self._active and not compiling() and not self._in_wrapper:
            kwargs = rest[0] if len(rest) == 2 else {}
            self._safely(self._loop.forward_output, module, rest[-1], (args, kwargs))

    def _forward_pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> None:
        """Fallback for scripts without a DataLoader: the traits of what the model is called with.
        Launches at most one row sum on the device; nothing is read back here. (``kwargs`` defaults:
        torch calls a hook removed during the same call, by the session stopping, without them.)"""
        if (
            self._loader_tensors
            or not self._active
            or not torch.is_grad_enabled()
            or compiling()
            or self._in_wrapper
        ):
            return  # compiling: dynamo would trace (and break on) reading the batch's values
        try:
            traits = call_traits(args, kwargs or {}, self._pad_id)
            _batch_axis(traits, (args, kwargs or {}), None)
            if traits.shapes and self._session is not None:
                self._take(self._session.current_step(), traits, "forward")
        except Exception as exc:
            self._fail(exc)

    # ------------------------------------------------------------------------------ records
    def step_field(self, step: int) -> Any:
        if self._lookahead is None and self._pending:
            # No optimizer step yet, so no look-ahead known: the script failed in its first step (an
            # OOM at step 0 is the common case). Every batch fetched so far is that step's.
            self._hand_over(step, 0)
        if step not in self._fields:
            fig = self._steps.pop(step, None)
            if fig is None and self._patched is None:
                self._fields[step] = None
            else:
                self._fields[step] = self._field(step, fig or _StepFigures())
            while len(self._fields) > 8:
                del self._fields[min(self._fields)]
        return self._fields[step]

    def _field(self, step: int, fig: _StepFigures) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self._patched is not None or fig.fetches:
            out.update(wait_ms=_ms(fig.wait_s), fetches=fig.fetches, max_wait_ms=_ms(fig.max_wait_s))
        if fig.markers:
            out["device_wait_ms"] = self._device_wait(fig.markers)
        if fig.batches_total:
            out["source"] = fig.source
            out["batches"] = [b.to_field(step) for b in fig.batches]
            if fig.batches_total > len(fig.batches):
                out["batches_total"] = fig.batches_total
        if fig.epoch_ends:
            out["epoch_ends"] = fig.epoch_ends
        if fig.bg_fetches:
            out.update(background_fetches=fig.bg_fetches, background_wait_ms=_ms(fig.bg_wait_s))
        return out

    def _device_wait(self, markers: list[Any]) -> float:
        """Device time between each fetch's two markers, summed: the part of the wait the device was
        idle (resolving waits for the markers: step_field runs after the step's GPU work)."""
        times = self.device.resolve_ms(markers)
        self.device.release_markers(markers)
        return round(sum(max(0.0, times[i + 1] - times[i]) for i in range(0, len(times) - 1, 2)), 4)


def _fetch_wrapper(collector: DataCollector, original: Any) -> Any:
    @functools.wraps(original)
    def __next__(it: Any) -> Any:
        if not collector._active:
            return original(it)
        return collector.fetch(original, it)

    return __next__


def _loader_batch_size(it: Any) -> int | None:
    """The batch size a DataLoader iterator collates (its batch sampler's; torch names it only on the
    private ``_index_sampler``), None when not batching or not known."""
    size = getattr(getattr(it, "_index_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _batch_axis(traits: BatchTraits, batch: Any, expected: int | None) -> None:
    """The batch's size and batch dimension, measured (``memdoctor.capture.loopshape``)."""
    traits.batch_size = batch_size_of(batch, expected)
    traits.batch_dim = batch_dim(batch, traits.batch_size)


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 4)


def _pad_token_id(root: nn.Module) -> int | None:
    """The pad token id from a Hugging Face style ``config`` on the model (or a submodule near the top)."""
    for module in itertools.islice(root.modules(), 64):
        pad = getattr(getattr(module, "config", None), "pad_token_id", None)
        if isinstance(pad, int) and not isinstance(pad, bool):
            return pad
    return None


def _nvtx_range() -> tuple[Callable[[], Any], Callable[[], Any]] | None:
    """``(push, pop)`` of an NVTX range "dataloader" in domain "memdoctor", or None without ``nvtx``.
    The domain's pre-built attributes make a push/pop pair cost ~0.15 us (no Nsight attached)."""
    try:
        import nvtx

        domain = nvtx.get_domain("memdoctor")
        attributes = domain.get_event_attributes(message="dataloader")
    except Exception:  # not installed, or an nvtx without domains: skip silently
        return None
    return functools.partial(domain.push_range, attributes), domain.pop_range
