"""Build valid memdoctor traces in memory, for tests of everything that reads a trace.

A ``TraceBuilder`` takes models as module lists ``(name, type, param_bytes, activation_self_bytes)``
(parents are derived from the dotted names; the root is ``""``) and simulates plausible steps: a forward
pass that saves each module's activations, a backward pass that frees them and creates gradients, and an
AdamW step that holds two states per parameter. Every figure it writes is consistent with the others
(timeline, per-module columns, the step's peak), so analysis tests can check sums exactly.

    b = TraceBuilder(kind="cuda", budget_bytes=8 * GiB)
    b.add_model(bert_like())
    b.add_steps(warmup=1, profiled=3)
    b.end("completed")
    trace = b.build()          # or b.save(tmp_path / "trace.jsonl.gz")
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memdoctor.trace import ModelInfo, StepRecord, Trace, TraceWriter, load_trace, make_header, save_trace

KiB, MiB, GiB = 1024, 1024**2, 1024**3
Module = tuple[str, str, int, int]  # name, class name, own param bytes, own activation bytes
_PHASE_MS = {"forward": 1.0, "backward": 2.0, "optimizer": 4.0}
_ALLOC_COLS = ("allocated", "reserved", "max_allocated")


def bert_like(layers: int = 12, batch: int = 8, seq: int = 512, hidden: int = 768) -> list[Module]:
    """A BertForSequenceClassification-shaped module table with realistic fp32 byte counts."""
    h, tok = hidden, batch * seq
    act = tok * h * 4
    mods: list[Module] = [
        ("", "BertForSequenceClassification", 0, 64),
        ("bert", "BertModel", 0, 0),
        ("bert.embeddings", "BertEmbeddings", 0, 0),
        ("bert.embeddings.word_embeddings", "Embedding", 30522 * h * 4, tok * 8),
        ("bert.embeddings.position_embeddings", "Embedding", 512 * h * 4, tok * 8),
        ("bert.embeddings.token_type_embeddings", "Embedding", 2 * h * 4, tok * 8),
        ("bert.embeddings.LayerNorm", "LayerNorm", 2 * h * 4, act),
        ("bert.embeddings.dropout", "Dropout", 0, act // 4),
        ("bert.encoder", "BertEncoder", 0, 0),
        ("bert.encoder.layer", "ModuleList", 0, 0),
    ]
    for i in range(layers):
        mods += _bert_layer(f"bert.encoder.layer.{i}", batch, seq, h)
    mods += [
        ("bert.pooler", "BertPooler", 0, 0),
        ("bert.pooler.dense", "Linear", (h * h + h) * 4, batch * h * 4),
        ("bert.pooler.activation", "Tanh", 0, batch * h * 4),
        ("dropout", "Dropout", 0, batch * h),
        ("classifier", "Linear", (h * 2 + 2) * 4, batch * h * 4),
    ]
    return mods


def _bert_layer(p: str, batch: int, seq: int, h: int) -> list[Module]:
    act, heads = batch * seq * h * 4, 12
    scores = batch * heads * seq * seq
    lin = (h * h + h) * 4
    return [
        (p, "BertLayer", 0, 0),
        (f"{p}.attention", "BertAttention", 0, 0),
        (f"{p}.attention.self", "BertSelfAttention", 0, scores * 4 * 2),
        (f"{p}.attention.self.query", "Linear", lin, act),
        (f"{p}.attention.self.key", "Linear", lin, 0),
        (f"{p}.attention.self.value", "Linear", lin, 0),
        (f"{p}.attention.self.dropout", "Dropout", 0, scores),
        (f"{p}.attention.output", "BertSelfOutput", 0, 0),
        (f"{p}.attention.output.dense", "Linear", lin, act),
        (f"{p}.attention.output.dropout", "Dropout", 0, act // 4),
        (f"{p}.attention.output.LayerNorm", "LayerNorm", 2 * h * 4, act),
        (f"{p}.intermediate", "BertIntermediate", 0, 0),
        (f"{p}.intermediate.dense", "Linear", (h * 4 * h + 4 * h) * 4, act),
        (f"{p}.intermediate.intermediate_act_fn", "GELUActivation", 0, act * 4),
        (f"{p}.output", "BertOutput", 0, 0),
        (f"{p}.output.dense", "Linear", (4 * h * h + h) * 4, act * 4),
        (f"{p}.output.dropout", "Dropout", 0, act // 4),
        (f"{p}.output.LayerNorm", "LayerNorm", 2 * h * 4, act),
    ]


def tiny_mlp(width: int = 64, depth: int = 3) -> list[Module]:
    """A small ``nn.Sequential`` of Linear/ReLU pairs (a few KiB)."""
    mods: list[Module] = [("", "Sequential", 0, 0)]
    for i in range(depth):
        mods.append((str(2 * i), "Linear", (width * width + width) * 4, 32 * width * 4))
        mods.append((str(2 * i + 1), "ReLU", 0, 32 * width * 4))
    return mods


def model_info(index: int, modules: Sequence[Module], cls: str | None = None) -> ModelInfo:
    """A ``ModelInfo`` from a module list; parents are found by the dotted names."""
    names = [m[0] for m in modules]
    pos = {n: i for i, n in enumerate(names)}
    parents = [-1 if not n else pos[n.rpartition(".")[0]] for n in names]
    params = [m[2] for m in modules]
    return ModelInfo(
        index=index,
        cls=cls or modules[0][1],
        names=names,
        types=[m[1] for m in modules],
        parents=parents,
        param_bytes=params,
        param_counts=[b // 4 for b in params],
        trainable_param_bytes=list(params),
        optimizers=[{"class": "AdamW", "param_count": sum(params) // 4, "param_groups": 1}],
    )


@dataclass
class _Model:
    info: ModelInfo
    act_self: list[int]
    kids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kids = [[] for _ in self.info.names]
        for i, p in enumerate(self.info.parents):
            if p >= 0:
                self.kids[p].append(i)


class _StepSim:
    """Walks forward, backward and the optimizer over every model, recording a timeline sample per event."""

    def __init__(self, models: list[_Model], *, first: bool, scale: float, other: int, cuda: bool) -> None:
        self.models, self.scale, self.other, self.cuda = models, scale, other, cuda
        total_params = sum(sum(m.info.param_bytes) for m in models)
        self.mem = {"parameters": total_params, "gradients": 0, "activations": 0}
        self.mem["optimizer_state"] = 0 if first else 2 * total_params
        self.t, self.phase = 0.0, "other"
        self.samples: list[dict[str, Any]] = []
        self.times: dict[tuple[int, int, str], float] = {}
        self.stop: tuple[str, int, int] | None = None
        self.first = first
        self.fwd_done: set[tuple[int, int]] = set()
        self.bwd_done: set[tuple[int, int]] = set()
        self.stepped = False
        self.sample("step_start", None, None)

    def act(self, m: _Model, i: int) -> int:
        return int(m.act_self[i] * self.scale)

    def sample(self, event: str, model: int | None, module: int | None) -> None:
        self.t += _PHASE_MS.get(self.phase, 0.5)
        accounted = sum(self.mem.values())
        extra = self.other if self.cuda and self.phase in ("forward", "backward") else 0
        self.samples.append(
            {"t_ms": self.t, "event": event, "phase": self.phase, "model": model, "module": module}
            | dict(self.mem)
            | {"allocated": accounted + extra, "total": accounted + extra}
        )
        if self.stop == (event, model, module):
            raise _Died

    def forward(self, mi: int, m: _Model, i: int) -> None:
        start = self.t
        self.sample("fwd_pre", mi, i)
        for k in m.kids[i]:
            self.forward(mi, m, k)
        self.mem["activations"] += self.act(m, i)
        self.fwd_done.add((mi, i))
        self.sample("fwd_post", mi, i)
        self.times[(mi, i, "forward")] = self.t - start

    def backward(self, mi: int, m: _Model, i: int) -> None:
        start = self.t
        self.sample("bwd_pre", mi, i)
        self.mem["activations"] -= self.act(m, i)
        self.mem["gradients"] += m.info.param_bytes[i]
        self.bwd_done.add((mi, i))
        for k in reversed(m.kids[i]):
            self.backward(mi, m, k)
        self.sample("bwd_post", mi, i)
        self.times[(mi, i, "backward")] = self.t - start

    def run(self) -> bool:
        """Simulate the whole step; ``False`` when it stopped at ``self.stop`` (the run died there)."""
        try:
            for phase, walk in (("forward", self.forward), ("backward", self.backward)):
                self.phase = phase
                for m in self.models:
                    walk(m.info.index, m, 0)
            self.phase = "optimizer"
            self.sample("opt_pre", None, None)
            self.mem["optimizer_state"] = 2 * self.mem["parameters"]
            self.stepped = True
            self.sample("opt_post", None, None)
        except _Died:
            return False
        return True


class _Died(Exception):
    pass


class TraceBuilder:
    """Accumulates header, models, steps, events and the end record of one trace."""

    def __init__(
        self,
        *,
        kind: str = "cuda",
        device_name: str | None = None,
        total_memory_bytes: int | None = 8 * GiB,
        budget_bytes: int | None = None,
        memory_cap_bytes: int | None = None,
        not_measured: list[str] | None = None,
        argv: list[str] | None = None,
    ) -> None:
        cuda = kind == "cuda"
        self.cuda = cuda
        self.header = make_header(
            memdoctor_version="0.1.0",
            created_unix=1_700_000_000.0,
            command={
                "argv": argv or ["train.py", "--epochs", "1"],
                "script": "train.py",
                "module": None,
                "cwd": "/home/user/project",
            },
            settings={"warmup": 1, "steps": 3, "budget_bytes": budget_bytes},
            host={"python": "3.11.7", "torch": "2.4.0", "platform": "Linux-6.5-x86_64"},
            device={
                "kind": kind,
                "name": device_name or ("NVIDIA GeForce RTX 2070" if cuda else "cpu"),
                "total_memory_bytes": total_memory_bytes if cuda else None,
                "capability": [7, 5] if cuda else None,
                "memory_cap_bytes": memory_cap_bytes,
            },
            not_measured=not_measured if not_measured is not None else self._default_not_measured(),
        )
        self.header.pop("type")
        self.models: list[_Model] = []
        self.steps: list[StepRecord] = []
        self.events: list[dict[str, Any]] = []
        self.end_record: dict[str, Any] | None = None

    def _default_not_measured(self) -> list[str]:
        return [] if self.cuda else ["allocator figures: no CUDA device"]

    def add_model(self, modules: Sequence[Module], cls: str | None = None) -> int:
        index = len(self.models)
        self.models.append(_Model(model_info(index, modules, cls), [m[3] for m in modules]))
        return index

    def add_steps(self, warmup: int = 1, profiled: int = 3, **kw: Any) -> TraceBuilder:
        for i in range(warmup + profiled):
            self.add_step(warmup=i < warmup, scale=1.0 + 0.01 * i, **kw)
        return self

    def add_step(
        self,
        *,
        warmup: bool = False,
        scale: float = 1.0,
        other_bytes: int = 64 * MiB,
        die_at: tuple[str, str] | None = None,
        stride: int = 1,
    ) -> StepRecord:
        """Simulate one step; ``die_at=("backward", "bert.encoder.layer.11")`` cuts it short there."""
        sim = _StepSim(self.models, first=not self.steps, scale=scale, other=other_bytes, cuda=self.cuda)
        sim.stop = self._stop_point(die_at)
        complete = sim.run()
        samples = sim.samples[::stride] if stride > 1 else sim.samples
        step = StepRecord(
            step=len(self.steps),
            warmup=warmup,
            complete=complete,
            duration_ms=sim.t if complete else None,
            phases_ms=self._phases(sim.samples),
            micro_batches=1,
            memory=self._memory(sim.samples),
            modules=self._modules(sim),
            timeline=self._timeline(samples),
            timeline_stride=stride,
        )
        self.steps.append(step)
        return step

    def _stop_point(self, die_at: tuple[str, str] | None) -> tuple[str, int, int] | None:
        if die_at is None:
            return None
        phase, name = die_at
        event = {"forward": "fwd_pre", "backward": "bwd_pre"}[phase]
        return event, 0, self.models[0].info.names.index(name)

    def _phases(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        out = dict.fromkeys(("forward", "backward", "optimizer", "other"), 0.0)
        for prev, cur in itertools.pairwise(samples):
            out[cur["phase"]] += cur["t_ms"] - prev["t_ms"]
        return out

    def _memory(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        i = max(range(len(samples)), key=lambda k: samples[k]["total"])
        s = samples[i]
        cats = {c: s[c] for c in ("parameters", "gradients", "optimizer_state", "activations")}
        accounted = sum(cats.values())
        allocs = [x["allocated"] for x in samples]
        return {
            "peak_bytes": s["total"] if self.cuda else accounted,
            "peak_source": "allocator" if self.cuda else "accounting",
            "peak_t_ms": s["t_ms"],
            "peak_phase": s["phase"],
            "peak_model": s["model"],
            "peak_module": s["module"],
            "categories_at_peak": {**cats, "other": s["total"] - accounted if self.cuda else None},
            "accounted_bytes": accounted,
            "allocator": self._allocator(allocs) if self.cuda else None,
        }

    def _allocator(self, allocs: list[int]) -> dict[str, int]:
        return {
            "allocated_start": allocs[0],
            "allocated_end": allocs[-1],
            "max_allocated": max(allocs),
            "max_reserved": int(max(allocs) * 1.1),
            "reserved_end": int(max(allocs) * 1.1),
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def _modules(self, sim: _StepSim) -> dict[int, dict[str, list[Any]]]:
        out: dict[int, dict[str, list[Any]]] = {}
        for m in self.models:
            mi = m.info.index
            own = [sim.act(m, i) if (mi, i) in sim.fwd_done else 0 for i in range(len(m.act_self))]
            incl = _subtree(m, own)
            params = m.info.param_bytes
            has_state = sim.stepped or not sim.first
            out[m.info.index] = {
                "activation_bytes": incl,
                "activation_self_bytes": own,
                "checkpoint_free_bytes": [int(a * 0.9) for a in incl],
                "grad_bytes": [p if (mi, i) in sim.bwd_done else 0 for i, p in enumerate(params)],
                "optimizer_state_bytes": [2 * p if has_state else 0 for p in params],
                "forward_ms": [sim.times.get((mi, i, "forward"), 0.0) for i in range(len(own))],
                "backward_ms": [sim.times.get((mi, i, "backward"), 0.0) for i in range(len(own))],
                "calls": [1] * len(own),
            }
        return out

    def _timeline(self, samples: list[dict[str, Any]]) -> dict[str, list[Any] | None]:
        cols = ("t_ms", "event", "phase", "model", "module", "parameters", "gradients")
        tl: dict[str, list[Any] | None] = {c: [s[c] for s in samples] for c in (*cols, "optimizer_state")}
        tl["activations"] = [s["activations"] for s in samples]
        if not self.cuda:
            return tl | dict.fromkeys(_ALLOC_COLS)
        allocated = [s["allocated"] for s in samples]
        tl["allocated"] = allocated
        tl["max_allocated"] = _running_max(allocated)
        tl["reserved"] = [int(x * 1.1) for x in _running_max(allocated)]
        return tl

    def add_event(self, kind: str, message: str, **fields: Any) -> dict[str, Any]:
        event = {
            "kind": kind,
            "message": message,
            "exception_type": None,
            "traceback": [],
            "step": None,
            "phase": None,
            "model": None,
            "module": None,
            "module_name": None,
            "exit_code": None,
            "t_unix": 1_700_000_100.0,
        } | fields
        self.events.append(event)
        return event

    def end(self, status: str = "completed", message: str = "", **fields: Any) -> TraceBuilder:
        complete = sum(1 for s in self.steps if s.complete)
        self.end_record = {
            "status": status,
            "exit_code": 0,
            "signal": None,
            "message": message or f"profiled {complete} steps",
            "steps_recorded": complete,
            "duration_s": 12.5,
            "memdoctor_exit_code": 0,
        } | fields
        return self

    def build(self) -> Trace:
        return Trace(
            header=dict(self.header),
            models=[m.info for m in self.models],
            steps=list(self.steps),
            events=list(self.events),
            end=self.end_record,
        )

    def save(self, path: str | Path) -> Path:
        return save_trace(self.build(), path)

    def roundtrip(self, tmp_dir: Path) -> Trace:
        """Save and load again: the trace exactly as a reader sees it."""
        return load_trace(self.save(Path(tmp_dir) / "trace.jsonl.gz"))


def _subtree(m: _Model, own: list[int]) -> list[int]:
    out = list(own)
    for i in range(len(out) - 1, 0, -1):
        out[m.info.parents[i]] += out[i]
    return out


def _running_max(values: list[int]) -> list[int]:
    out, best = [], 0
    for v in values:
        best = max(best, v)
        out.append(best)
    return out


# ----------------------------------------------------------------------------------------- ready-made traces


def completed_trace(kind: str = "cuda", budget_bytes: int | None = 8 * GiB, layers: int = 12) -> Trace:
    """A BERT-like run that profiled 1 warm-up and 3 steps and completed."""
    b = TraceBuilder(kind=kind, budget_bytes=budget_bytes)
    b.add_model(bert_like(layers=layers))
    b.add_steps(warmup=1, profiled=3)
    return b.end("completed").build()


def oom_trace(layers: int = 12) -> Trace:
    """A run that died of CUDA OOM at step 0 in the backward of the last encoder layer."""
    b = TraceBuilder(kind="cuda", budget_bytes=4 * GiB)
    b.add_model(bert_like(layers=layers))
    last = f"bert.encoder.layer.{layers - 1}"
    b.add_step(warmup=True, die_at=("backward", last))
    b.add_event(
        "oom",
        "CUDA out of memory. Tried to allocate 96.00 MiB (GPU 0; 7.79 GiB total capacity)",
        exception_type="torch.OutOfMemoryError",
        traceback=['  File "train.py", line 42, in <module>', "    loss.backward()"],
        step=0,
        phase="backward",
        model=0,
        module=b.models[0].info.names.index(last),
        module_name=last,
    )
    return b.end("oom", "CUDA out of memory during step 0", exit_code=1, memdoctor_exit_code=1).build()


def trace_from_records(path: Path, records: list[dict[str, Any]], **header: Any) -> Trace:
    """A trace file of records a ``ProfileSession`` sent to its sink (a CPU header first, ``header``
    keys added to it, an ``end`` record last), loaded back as any reader would."""
    writer = TraceWriter(path)
    writer.write({**make_header(), **TraceBuilder(kind="cpu").header, **header})
    for rec in records:
        writer.write(rec)
    writer.write({"type": "end", "status": "completed", "message": "", "exit_code": 0})
    writer.close()
    return load_trace(path)
