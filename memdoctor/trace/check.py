"""Deep checks of a loaded trace, so that analysis and reports can trust what they read.

``memdoctor.trace`` parses records and checks their shape; this module checks every field a reader
uses — types, ranges, column lengths, and references between records (a step's module columns must
match its model's module table; a peak module must exist). A trace that fails is refused with the
first problem found: a damaged or crafted trace never reaches the report code. Keys a newer minor
version adds are not checked here and are ignored by the readers that do not know them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

Check = Callable[[Any], bool]
MAX_TEXT = 64 * 1024


# The checks read values a JSON decoder made: exact types (``type(v) is int`` is no bool), and object
# keys that are strings. They run on every value of every step record (100,000 steps: millions of calls).
def _int(v: Any) -> bool:
    return type(v) is int and v >= 0


def _num(v: Any) -> bool:
    t = type(v)
    return (t is int or (t is float and math.isfinite(v))) and v >= 0


def _str(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_TEXT


def _opt(check: Check) -> Check:
    fast = _OPTIONAL.get(check)
    return fast if fast is not None else lambda v: v is None or check(v)


def _list_of(check: Check) -> Check:
    column = _COLUMNS.get(check)
    if column is not None:
        return lambda v: type(v) is list and column(v)
    return lambda v: type(v) is list and all(map(check, v))


def _dict_of(check: Check) -> Check:
    column = _COLUMNS.get(check)
    if column is not None:
        return lambda v: type(v) is dict and column(list(v.values()))
    return lambda v: type(v) is dict and all(map(check, v.values()))


def _timestamp(v: Any) -> bool:
    """Seconds since 1970, before the year 10000 (what a date can show)."""
    return _num(v) and v < _YEAR_10000


_YEAR_10000 = 253402300800


def _signed_int(v: Any) -> bool:
    return type(v) is int


# The optional checks, as one call each rather than two (``_opt`` of a check not listed wraps it).
def _opt_int(v: Any) -> bool:
    return v is None or (type(v) is int and v >= 0)


def _opt_num(v: Any) -> bool:
    return v is None or _num(v)


def _opt_str(v: Any) -> bool:
    return v is None or (isinstance(v, str) and len(v) <= MAX_TEXT)


def _opt_signed_int(v: Any) -> bool:
    return v is None or type(v) is int


_OPTIONAL: dict[Check, Check] = {_int: _opt_int, _num: _opt_num, _str: _opt_str, _signed_int: _opt_signed_int}

# The same checks over a whole list of values at once: its types as a set, its minimum, sum or longest,
# all in C. They say what the check of each value would say; a timeline column of a long step, a step's
# phases, a ledger's categories are each one call, not one per value (a trace holds tens of millions).
_NONE = type(None)
_INTS, _INTS_NONE, _NUMBERS = frozenset((int,)), frozenset((int, _NONE)), frozenset((int, float))


def _all_num(vals: list[Any]) -> bool:
    # >= 0 and finite: a NaN or Inf makes the sum NaN or Inf (every value is >= 0 by then)
    return set(map(type, vals)) <= _NUMBERS and (not vals or (min(vals) >= 0 and math.isfinite(sum(vals))))


def _all_opt_int(vals: list[Any]) -> bool:
    types = set(map(type, vals))
    if not types <= _INTS_NONE:
        return False
    ints = [v for v in vals if v is not None] if _NONE in types else vals
    return not ints or min(ints) >= 0


def _all_str(vals: list[Any]) -> bool:
    return set(map(type, vals)) <= {str} and (not vals or max(map(len, vals)) <= MAX_TEXT)


_COLUMNS: dict[Check, Callable[[list[Any]], bool]] = {
    _num: _all_num,
    _str: _all_str,
    _signed_int: lambda vals: set(map(type, vals)) <= _INTS,
    _opt_int: _all_opt_int,
    _opt_signed_int: lambda vals: set(map(type, vals)) <= _INTS_NONE,
}


HEADER = {
    "command": _dict_of(lambda v: True),
    "settings": lambda v: (
        isinstance(v, dict)
        and all(_opt(_int)(v.get(k)) for k in ("warmup", "steps", "budget_bytes"))
        and _opt(_str)(v.get("gpu"))
    ),
    "host": _dict_of(_opt(_str)),
    "device": lambda v: (
        isinstance(v, dict)
        and _opt(_str)(v.get("kind"))
        and _opt(_str)(v.get("name"))
        and _opt(_int)(v.get("total_memory_bytes"))
        and _opt(_int)(v.get("memory_cap_bytes"))
        and _opt(lambda c: isinstance(c, list) and len(c) == 2 and all(_int(x) for x in c))(
            v.get("capability")
        )
        and _opt(lambda b: isinstance(b, bool))(v.get("bf16_supported"))
        and _opt(_str)(v.get("torch_cuda"))
        and _opt(_int)(v.get("index"))
    ),
    "not_measured": _list_of(_str),
    "memdoctor_version": _str,
    "created_unix": _opt(_timestamp),
    "environment": _dict_of(_str),
    "applied_config": lambda v: v is None or isinstance(v, dict),
}
EVENT = {
    "kind": _str,
    "message": _str,
    "exception_type": _opt(_str),
    "traceback": _opt(lambda v: _list_of(_str)(v) or _str(v)),
    "step": _opt(_int),
    "phase": _opt(_str),
    "model": _opt(_int),
    "module": _opt(_int),
    "module_name": _opt(_str),
    "exit_code": _opt(_signed_int),
    "t_unix": _opt(_timestamp),
}
END = {
    "status": _str,
    "exit_code": _opt(_signed_int),
    "signal": _opt(_str),
    "message": _str,
    "steps_recorded": _opt(_int),
    "duration_s": _opt(_num),
    "memdoctor_exit_code": _opt(_signed_int),
}
MEMORY = {
    "peak_bytes": _opt(_int),
    "peak_source": _opt(_str),
    "peak_t_ms": _opt(_num),
    "peak_phase": _opt(_str),
    "peak_model": _opt(_int),
    "peak_module": _opt(_int),
    "categories_at_peak": _opt(_dict_of(_opt(_signed_int))),
    "accounted_bytes": _opt(_int),
    "allocator": _opt(_dict_of(_opt(_signed_int))),
    "peak_ledger": _opt(
        lambda v: (
            isinstance(v, dict)
            and _dict_of(_signed_int)(v.get("categories"))
            and _list_of(lambda p: isinstance(p, list) and len(p) == 2 and _str(p[0]) and _int(p[1]))(
                v.get("temporaries_by_site", [])
            )
            and all(_opt(_int)(v.get(k)) for k in ("peak_allocated", "baseline", "entries"))
        )
    ),
    "outside_modules": _opt(
        _list_of(
            lambda r: (
                isinstance(r, dict)
                and r.get("holder") in ("root", "loop")
                and _opt(_int)(r.get("model"))
                and _str(r.get("site"))
                and _int(r.get("bytes"))
            )
        )
    ),
}
TIMELINE_TYPES: dict[str, Check] = {
    "t_ms": _num,
    "event": _str,
    "phase": _str,
    "depth": _signed_int,
    "model": _opt(_int),
    "module": _opt(_int),
}


def _fields(record: dict[str, Any], spec: dict[str, Check], what: str) -> None:
    for key, check in spec.items():
        if key in record and not check(record[key]):
            raise ValueError(f"{what}.{key} has an invalid value")


def check_header(header: dict[str, Any]) -> None:
    _fields(header, HEADER, "header")


def check_event(event: dict[str, Any]) -> None:
    _fields(event, EVENT, "event")


def check_end(end: dict[str, Any]) -> None:
    _fields(end, END, "end")


_PHASES = _dict_of(_num)


def check_step(step: Any) -> None:
    """The fields of one step record that readers use (a ``memdoctor.trace.StepRecord``)."""
    _fields(step.memory, MEMORY, "step.memory")
    if not _PHASES(step.phases_ms):
        raise ValueError("step.phases_ms must map phases to milliseconds")
    _check_timeline(step.timeline)


# TIMELINE_TYPES as column checks (``_COLUMNS``); a figure column not named there: whole numbers or None.
_TIMELINE_COLUMNS = {key: _COLUMNS[check] for key, check in TIMELINE_TYPES.items()}
_FIGURE_COLUMN = _COLUMNS[_opt_signed_int]


def _check_timeline(tl: dict[str, Any]) -> None:
    lengths = {len(col) for col in tl.values() if col is not None}
    if len(lengths) > 1:
        raise ValueError("step.timeline columns differ in length")
    for key, col in tl.items():
        if col is None:
            continue
        if type(col) is not list or not _TIMELINE_COLUMNS.get(key, _FIGURE_COLUMN)(col):
            raise ValueError(f"step.timeline.{key} holds an invalid value")


def check_references(trace: Any) -> None:
    """References between records: module columns, peak and timeline modules, events' modules."""
    sizes = {m.index: len(m.names) for m in trace.models}
    if len(sizes) != len(trace.models):
        raise ValueError("two model records share an index")
    for m in trace.models:
        # named_modules() order: the root first, every module after its parent
        if m.parents and (m.parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(m.parents) if i)):
            raise ValueError(f"model {m.index}'s module tree is not in named_modules() order")
    for step in trace.steps:
        for m, cols in step.modules.items():
            if m not in sizes or not set(map(len, cols.values())) <= {sizes[m]}:
                raise ValueError(f"step {step.step}: module columns do not match model {m}'s module table")
        mem = step.memory
        _check_ref(sizes, mem.get("peak_model"), mem.get("peak_module"), f"step {step.step}'s peak")
        # each (model, module) pair once: a timeline names a few modules thousands of times
        tl = step.timeline
        for model, module in set(zip(tl.get("model") or [], tl.get("module") or [], strict=False)):
            _check_ref(sizes, model, module, f"step {step.step}'s timeline")
    for ev in trace.events:
        _check_ref(sizes, ev.get("model"), ev.get("module"), "an event")


def _check_ref(sizes: dict[int, int], model: Any, module: Any, what: str) -> None:
    if model is None and module is None:
        return
    if model is None or module is None or model not in sizes or not 0 <= module < sizes[model]:
        raise ValueError(f"{what} names a module that is not in the trace")
