"""Every module of every model, and the layers a chart shows.

Conventions for per-module figures (as in the trace): parameters, gradients and optimizer state are
*exclusive* (what the module owns directly); activations and forward/backward times are *inclusive*
of submodules. Where a table needs inclusive parameter figures it sums the subtree itself.
"""

from __future__ import annotations

from typing import Any

from memdoctor.analysis.numbers import opt_float, opt_int
from memdoctor.trace import ModelInfo, StepRecord, Trace

ACCOUNTED = ("parameters", "gradients", "optimizer_state", "activations")
# What a rank's engine holds beyond those (docs/trace-format.md): DDP's gradient buckets, FSDP2's
# gathered and reduce buffers; present only in traces of a run that had that engine.
ENGINE_CATEGORIES = ("gradient_buckets", "sharding_buffers")
# Trace columns that hold a module's exclusive figure for each accounted category.
_OWN_COLUMNS = {"gradients": "grad_bytes", "optimizer_state": "optimizer_state_bytes"}
MODULE_COLUMNS = (
    *("activation_bytes", "activation_self_bytes", "checkpoint_free_bytes", "grad_bytes"),
    *("optimizer_state_bytes", "forward_ms", "backward_ms", "calls", "grad_norm", "grad_nonfinite"),
)
DOMINANT_SHARE = 0.8
TOP_LAYERS = 24
OWN_BAR_SHARE = 0.01


def model_by_index(trace: Trace, index: Any) -> ModelInfo | None:
    return next((m for m in trace.models if m.index == index), None)


def module_label(trace: Trace, model: Any, module: Any) -> str | None:
    """A module's display name; ``model{i}:`` is prefixed only when the trace has several models."""
    info = model_by_index(trace, model if model is not None else 0)
    if info is None or not isinstance(module, int) or not 0 <= module < len(info.names):
        return None
    return model_prefix(trace, info) + info.display_name(module)


def model_prefix(trace: Trace, info: ModelInfo) -> str:
    return f"model{info.index}:" if len(trace.models) > 1 else ""


def depths(info: ModelInfo) -> list[int]:
    """Depth of every module (the root is 0); parents come before children in ``named_modules()`` order."""
    out: list[int] = []
    for parent in info.parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


def children(info: ModelInfo) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in info.names]
    for i, parent in enumerate(info.parents):
        if parent >= 0:
            kids[parent].append(i)
    return kids


def module_columns(info: ModelInfo, step: StepRecord | None) -> dict[str, list[Any]]:
    """The step's per-module columns for this model, padded with ``None`` where missing or short."""
    n = len(info.names)
    cols = (step.modules.get(info.index) if step else None) or {}
    return {k: (list(cols[k]) + [None] * n)[:n] if k in cols else [None] * n for k in MODULE_COLUMNS}


def subtree_sums(info: ModelInfo, values: list[Any]) -> list[int]:
    """Inclusive totals of an exclusive per-module column (children follow their parent in order)."""
    out = [int(v or 0) for v in values]
    for i in range(len(out) - 1, 0, -1):
        if info.parents[i] >= 0:
            out[info.parents[i]] += out[i]
    return out


def layer_table(trace: Trace, step: StepRecord | None) -> list[dict[str, Any]]:
    """Every module of every model, in model order, with own and inclusive figures for ``step``."""
    rows: list[dict[str, Any]] = []
    for info in trace.models:
        rows += model_rows(trace, info, step)
    return rows


def model_rows(trace: Trace, info: ModelInfo, step: StepRecord | None) -> list[dict[str, Any]]:
    cols = module_columns(info, step)
    own = {"parameters": info.param_bytes, **{c: cols[k] for c, k in _OWN_COLUMNS.items()}}
    incl = {c: subtree_sums(info, v) for c, v in own.items()}
    level = depths(info)
    return [
        {
            "model": info.index,
            "index": i,
            "name": model_prefix(trace, info) + info.display_name(i),
            "type": info.types[i],
            "depth": level[i],
            "param_bytes": info.param_bytes[i],
            "grad_bytes": opt_int(cols["grad_bytes"][i]),
            "optimizer_state_bytes": opt_int(cols["optimizer_state_bytes"][i]),
            "activation_bytes": opt_int(cols["activation_bytes"][i]),
            "activation_self_bytes": opt_int(cols["activation_self_bytes"][i]),
            "checkpoint_free_bytes": opt_int(cols["checkpoint_free_bytes"][i]),
            "forward_ms": opt_float(cols["forward_ms"][i]),
            "backward_ms": opt_float(cols["backward_ms"][i]),
            "calls": opt_int(cols["calls"][i]),
            "grad_norm": opt_float(cols["grad_norm"][i]),
            "inclusive": {c: incl[c][i] for c in incl},
        }
        for i in range(len(info.names))
    ]


_SUMMARY_LAYER_KEYS = (
    *("name", "type", "model", "depth", "param_bytes", "grad_bytes", "optimizer_state_bytes"),
    *("activation_bytes", "checkpoint_free_bytes", "forward_ms", "backward_ms", "grad_norm"),
)


def summary_layers(trace: Trace, step: StepRecord | None) -> list[dict[str, Any]]:
    return [{k: row[k] for k in _SUMMARY_LAYER_KEYS} for row in layer_table(trace, step)]


def top_layers(trace: Trace, step: StepRecord | None, limit: int = TOP_LAYERS) -> list[dict[str, Any]]:
    """The layers a bar chart shows, in model order: ``{name, parameters, gradients, ...}`` bytes each.

    Per model: walk down from the root while one child holds more than 80% of its parent's bytes (a
    wrapper such as ``BertForSequenceClassification.bert``), take that module's children and the
    siblings passed on the way, and open any of them that is (or wraps) a stack of repeated blocks
    (``encoder.layer.0..11``). Modules passed on the way down that own bytes themselves (parameters,
    or activations of their own ops) show as ``name (own)`` when that is at least 1% of the model.
    The biggest ``limit - 1`` bars are kept when there are more; the rest become one ``other`` bar.
    """
    bars: list[dict[str, Any]] = []
    for info in trace.models:
        rows = model_rows(trace, info, step)
        floor = OWN_BAR_SHARE * _totals(rows)[0]
        picked = [_bar(rows[i], own) for i, own in top_modules(info, rows)]
        bars += [b for b in picked if b["total"] > (floor if b["own"] else 0)]
    return _group_rest(bars, limit)


def top_layer_modules(trace: Trace, step: StepRecord | None) -> list[tuple[ModelInfo, int]]:
    """The layers of ``top_layers`` that cover a whole subtree (not the "(own)" bars), as ``(model,
    module index)`` in model order, none grouped: the rows of the layer x time heatmap."""
    out: list[tuple[ModelInfo, int]] = []
    for info in trace.models:
        rows = model_rows(trace, info, step)
        out += [(info, i) for i, own in top_modules(info, rows) if not own]
    return out


def _totals(rows: list[dict[str, Any]]) -> list[int]:
    return [sum(r["inclusive"].values()) + (r["activation_bytes"] or 0) for r in rows]


def top_modules(info: ModelInfo, rows: list[dict[str, Any]]) -> list[tuple[int, bool]]:
    """``(module index, own_only)`` pairs covering the model, in model order."""
    kids, totals = children(info), _totals(rows)
    picked: list[tuple[int, bool]] = []
    node = 0
    while (nxt := _dominant_child(node, kids, totals)) is not None:
        picked += [(node, True)] + [(k, False) for k in kids[node] if k != nxt]
        node = nxt
    picked += [(node, True)] if kids[node] else [(node, False)]
    for k in kids[node]:
        picked += _open_blocks(k, kids, totals, info.types)
    return sorted(picked)


def _dominant_child(node: int, kids: list[list[int]], totals: list[int]) -> int | None:
    big = max(kids[node], key=lambda k: totals[k], default=None)
    if big is None or totals[node] <= 0 or totals[big] <= DOMINANT_SHARE * totals[node]:
        return None
    return big


def _open_blocks(
    node: int, kids: list[list[int]], totals: list[int], types: list[str]
) -> list[tuple[int, bool]]:
    """The repeated blocks under ``node`` (through single dominant wrappers), or ``node`` itself."""
    path, cur = [node], node
    while not _is_block_stack(cur, kids, types) and (nxt := _dominant_child(cur, kids, totals)) is not None:
        path.append(nxt)
        cur = nxt
    if not _is_block_stack(cur, kids, types):
        return [(node, False)]
    return [(p, True) for p in path] + [(k, False) for k in kids[cur]]


def _is_block_stack(node: int, kids: list[list[int]], types: list[str]) -> bool:
    """Most children are composite modules of one class: ``layer.0``, ``layer.1``, ... (not leaf layers)."""
    blocks = [k for k in kids[node] if kids[k]]
    if len(blocks) < 2:
        return False
    common = max(sum(types[k] == types[j] for j in blocks) for k in blocks)
    return common >= 2 and common * 2 > len(kids[node])


def _bar(row: dict[str, Any], own_only: bool) -> dict[str, Any]:
    if own_only:
        values = {
            "parameters": row["param_bytes"],
            "gradients": row["grad_bytes"] or 0,
            "optimizer_state": row["optimizer_state_bytes"] or 0,
            "activations": row["activation_self_bytes"] or 0,
        }
    else:
        values = {**row["inclusive"], "activations": row["activation_bytes"] or 0}
    name = row["name"] + (" (own)" if own_only else "")
    total = sum(values.values())
    ran = bool(row["calls"])  # False: never called in the step (the run died first, or unused)
    return {
        "name": name,
        "type": row["type"],
        "own": own_only,
        "layers": 1,
        **values,
        "total": total,
        "ran": ran,
    }


def _group_rest(bars: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    if len(bars) <= limit:
        return bars
    keep = set(sorted(range(len(bars)), key=lambda i: -bars[i]["total"])[: limit - 1])
    rest = [b for i, b in enumerate(bars) if i not in keep]
    other: dict[str, Any] = {"name": f"other ({len(rest)} layers)", "type": "", "own": False}
    other["layers"] = len(rest)
    other["ran"] = any(b["ran"] for b in rest)
    for key in (*ACCOUNTED, "total"):
        other[key] = sum(b[key] for b in rest)
    return [b for i, b in enumerate(bars) if i in keep] + [other]


def repeated_blocks(info: ModelInfo) -> list[list[int]]:
    """Stacks of three or more sibling modules of one class that hold parameters (``encoder.layer.0..11``,
    the ``Linear`` layers of an MLP), in model order; a stack inside a block of another is left out."""
    kids, params = children(info), subtree_sums(info, info.param_bytes)
    groups: list[list[int]] = []
    covered: set[int] = set()
    for node in range(len(info.names)):
        if node in covered:
            covered.update(kids[node])
            continue
        by_type: dict[str, list[int]] = {}
        for k in kids[node]:
            if params[k] > 0:
                by_type.setdefault(info.types[k], []).append(k)
        for group in (g for g in by_type.values() if len(g) >= 3):
            groups.append(group)
            covered.update(group)
    return groups


LOOP_HOLDER = "training loop (outside the model)"


def outside_holders(trace: Trace, step: StepRecord | None) -> list[dict[str, Any]]:
    """What code outside every child module holds in ``step``, one row per holder and line, largest
    first: a model's own forward code (``holder`` ``root``, named ``<class> (own code)``: a GPT's fp32
    logits and its loss) and the loop's (``loop``: a loss computed from the model's output). No module's
    row holds these bytes (a root's own code only in its ``activation_self_bytes``), so a table of
    layers alone never shows them. ``activation_bytes``: saved for backward there (the tensor
    accounting, on any device); ``temporary_bytes``: the peak ledger's temporaries allocated at the same
    line (CUDA's allocator history only, else 0)."""
    if step is None:
        return []
    temps = _temporaries_by_line(step)
    rows = []
    for r in step.memory.get("outside_modules") or []:
        root = r.get("holder") == "root"
        info = model_by_index(trace, r.get("model")) if root else None
        label = model_prefix(trace, info) + info.cls if info is not None else None
        site = str(r.get("site"))
        rows.append(
            {
                "holder": "root" if root else "loop",
                "name": f"{label} (own code)" if label else LOOP_HOLDER,
                "model": r.get("model") if root else None,
                "site": site,
                "activation_bytes": int(r.get("bytes") or 0),
                "temporary_bytes": temps.get(site, 0),
            }
        )
    return sorted(rows, key=lambda r: -(r["activation_bytes"] + r["temporary_bytes"]))


def _temporaries_by_line(step: StepRecord) -> dict[str, int]:
    """The step's peak-ledger temporaries by the line outside PyTorch that led to them (the part of a
    ``temporaries_by_site`` entry after ``<-``, or the whole site where the allocating line is the
    script's own): the form ``outside_modules`` names its sites in."""
    led = step.memory.get("peak_ledger") or {}
    out: dict[str, int] = {}
    for pair in led.get("temporaries_by_site") or []:
        if isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[1], (int, float)):
            line = str(pair[0]).rsplit(" <- ", 1)[-1]
            out[line] = out.get(line, 0) + int(pair[1])
    return out
