"""``torch.compile`` under memdoctor: keep out of compiled code, and say what the compiler did.

memdoctor's module hooks (the module stack, the data collector's forward hooks) are Python bookkeeping.
Dynamo inlines a compiled module's hooks into what it traces, so a hook that appends to a list, writes
a trace line or reads a tensor's values would either break the graph (dynamo then runs the whole frame
eagerly: the issue-19 attack measured an 18x slower step) or, worse, run once at trace time only. Each
such hook therefore starts with ``compiling()`` (``torch.compiler.is_compiling``, which dynamo folds to
a constant): inside a compiled region the hook is traced away to nothing, no break and no cost, and the
compiled region counts as one call of the module that called it (saved tensors are still seen: the
compiled forward saves them through autograd like any other).

``CompileWatch`` records what dynamo compiled while the session ran: the graphs it made and the graph
breaks it met (the script's own, or torch's), from dynamo's counters. Those counters are private
(``torch._dynamo.utils.counters``), so they are read only when dynamo is already imported and have the
expected shape; otherwise nothing is recorded. dynamo is never imported here: that takes seconds.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

# torch >= 2.3 has torch.compiler.is_compiling (public); older torch had no dynamo-aware check here.
compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)

# The hooks ``outside_compiled`` wraps, as dynamo's graph-break message names them: breaks at them are
# memdoctor's own (``memdoctor_breaks``).
MEMDOCTOR_HOOKS = ("OptimizerSteps.pre", "OptimizerSteps.post")
MAX_REASONS = 5  # distinct graph-break reasons kept, the most frequent first
MAX_REASON_CHARS = 200  # of each reason: its first line


def outside_compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly even when called from compiled code (``torch.compiler.disable``, torch >= 2.1).

    For hooks that must run to find steps at all, the optimizer-step hooks: a script that compiles its
    ``optimizer.step()`` calls them from compiled code. Tracing them would break the graph at their
    first trace write anyway (and run their bookkeeping at trace time only); disabled, dynamo breaks
    the graph once at the call, by design, and the break is counted as memdoctor's
    (``MEMDOCTOR_HOOKS``)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


# What a caller that restores the thread's dispatch keys on return uses: dynamo's wrapper of every
# torch.compile'd call (``_ForceDispatchKeyGuard``) and its frame compiler (``_PreserveDispatchKeyGuard``).
_KEY_GUARDS = frozenset({"_ForceDispatchKeyGuard", "_PreserveDispatchKeyGuard"})


def in_compiled_call() -> bool:
    """Whether the code running now was called, at any depth, from a ``torch.compile``'d function or
    module (an eager hook such as ``outside_compiled``'s, or code between two graphs).

    Why it matters: such a call saves the thread's dispatch keys on entry and forces them back on
    return. A ``TorchDispatchMode`` entered or left inside it (the FLOP counter's) leaves the keys and
    the mode stack out of step: a mode popped there has its Python dispatch key switched back on when
    the compiled call returns, with no mode left to take it, and the script's next op without a tensor
    argument (``optimizer.zero_grad()``'s ``record_function``) fails an internal assert. dynamo has no
    public way to ask, so the Python stack is read: a frame whose code uses one of those guards is a
    caller that will restore the keys (a false positive only delays the FLOP counter, never breaks)."""
    frame = sys._getframe(1)
    while frame is not None:
        if not _KEY_GUARDS.isdisjoint(frame.f_code.co_names):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


# The warning ``OptimizedModule.__call__`` gives on every call while any global module hook exists.
GLOBAL_HOOKS_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def hush_global_hooks_warning() -> Callable[[], None]:
    """Ignore torch's global-hooks warning for a ``torch.compile(module)`` while memdoctor's own global
    module hooks are installed; returns the undo, to call as they are removed.

    Why: the warning says the hooks fire an extra time for the compiled wrapper. For memdoctor's hooks
    that is known and handled (``compiled_inner``: the wrapper's call stands for its module), and the
    warning is only noise in the script's output, repeated at each call site. Only that one message,
    and only where the script had no global module hook of its own when memdoctor added its hooks
    (call this before registering them): the script's own hooks keep their warning."""
    has_hooks = getattr(torch.nn.modules.module, "_has_any_global_hook", None)
    if has_hooks is None or has_hooks():
        return lambda: None
    warnings.filterwarnings("ignore", message=GLOBAL_HOOKS_WARNING, category=UserWarning)
    entry = warnings.filters[0]

    def undo() -> None:
        with contextlib.suppress(ValueError):
            cast(list[Any], warnings.filters).remove(entry)  # a list at run time; typeshed: Sequence
            mutated = getattr(warnings, "_filters_mutated", None)  # resets the once-per-place caches
            if mutated is not None:
                mutated()

    return undo


def eager_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` kept out of dynamo (``torch.compiler.disable``) where dynamo is already loaded, else
    ``fn`` itself: for hooks that autograd calls (gradient, saved-tensor hooks).

    Why: a compiled function that calls ``loss.backward()`` runs that backward eagerly with dynamo's
    frame callback still on, so every hook autograd calls there is a new frame dynamo tries to compile;
    memdoctor's fail (they read storage pointers), run eagerly from then on, and each attempt counted
    as a graph break among the script's. Disabled, dynamo leaves them alone. Only where dynamo is
    loaded: loading it for an eager script takes seconds, and the wrapper costs a few microseconds
    a call."""
    if "torch._dynamo" not in sys.modules:
        return fn
    return outside_compiled(fn)


def compiled_inner(module: Any) -> Any:
    """The module a ``torch.compile(module)`` wrapper (``OptimizedModule``) compiles, else ``module``.
    The wrapper's call is the root call memdoctor's hooks see outside the compiled code; it stands for
    its module, so what the compiled forward saves is that model's, not the training loop's."""
    if type(module).__name__ != "OptimizedModule":
        return module
    inner = getattr(module, "_modules", {}).get("_orig_mod")
    return inner if inner is not None else module


def dynamo_counters() -> Mapping[str, Any] | None:
    """dynamo's event counters when dynamo is loaded (``torch._dynamo.utils.counters``, private: a
    mapping of counter groups), else None."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    return counters if isinstance(counters, Mapping) else None


def _group(counters: Mapping[str, Any], name: str) -> dict[str, int]:
    group = counters.get(name)
    if not isinstance(group, Mapping):
        return {}
    return {str(k): v for k, v in group.items() if isinstance(v, int)}


def read_counts() -> dict[str, Any]:
    """Graphs compiled, frames dynamo saw and compiled, graph breaks by reason: totals since start-up."""
    counters = dynamo_counters()
    if counters is None:
        return {"graphs": 0, "frames": 0, "frames_ok": 0, "breaks": {}}
    frames = _group(counters, "frames")
    return {
        "graphs": _group(counters, "stats").get("unique_graphs", 0),
        "frames": frames.get("total", 0),
        "frames_ok": frames.get("ok", 0),
        "breaks": _group(counters, "graph_break"),
    }


def _first_line(reason: str) -> str:
    line = reason.strip().splitlines()[0] if reason.strip() else "unknown"
    return line[:MAX_REASON_CHARS]


class CompileWatch:
    """What dynamo did since the session started; ``update`` emits the ``compile`` collector record
    when that changed (after each step record, so a run that dies keeps what was known)."""

    def __init__(self) -> None:
        self.base = read_counts()
        self.last: dict[str, Any] | None = None

    def compiled_any(self) -> bool:
        """Whether dynamo has looked at any frame since the session started."""
        return read_counts()["frames"] > self.base["frames"]

    def field(self) -> dict[str, Any] | None:
        """The ``compile`` record's data, or None while dynamo compiled nothing in this session."""
        now = read_counts()
        graphs = max(0, now["graphs"] - self.base["graphs"])
        frames = max(0, now["frames"] - self.base["frames"])
        frames_ok = max(0, now["frames_ok"] - self.base["frames_ok"])
        breaks: dict[str, int] = {}
        ours = 0
        for reason, n in now["breaks"].items():
            delta = n - self.base["breaks"].get(reason, 0)
            if delta > 0:
                key = _first_line(reason)
                breaks[key] = breaks.get(key, 0) + delta
                ours += delta if any(h in reason for h in MEMDOCTOR_HOOKS) else 0
        if not graphs and not frames and not breaks:
            return None
        top = sorted(breaks.items(), key=lambda kv: -kv[1])[:MAX_REASONS]
        return {
            "graphs": graphs,
            "frames": frames,
            "frames_compiled": frames_ok,
            "graph_breaks": sum(breaks.values()),
            "memdoctor_breaks": ours,
            "break_reasons": [{"reason": r, "count": n} for r, n in top],
        }

    def update(self, emit: Callable[[str, dict[str, Any]], None]) -> None:
        """Emit the ``compile`` record if it changed since the last one. Never raises: a torch whose
        counters look different leaves the record out."""
        try:
            data = self.field()
        except Exception:  # private counters of another torch: record nothing
            return
        if data is not None and data != self.last:
            self.last = data
            emit("compile", data)
