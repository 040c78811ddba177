"""The report's visuals: plan alternatives, findings ranked by saving, the nine-grid chart and the
layer x time memory heatmap, on hand-built workloads, synthetic traces and the recorded GPU traces."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from memdoctor.analysis.heatmap import COLUMNS, MAX_ROWS, heatmap, why_not
from memdoctor.analysis.layers import layer_table
from memdoctor.analysis.steps import peak_step, timeline_series
from memdoctor.plan.alternatives import ALTERNATIVES, alternatives
from memdoctor.plan.planner import make_plan
from memdoctor.plan.target import Target
from memdoctor.report import build_summary, plots, plots_heatmap, plots_plan
from memdoctor.report.render import report_context
from memdoctor.report.sections import plan as plan_section
from memdoctor.trace import Trace, load_trace
from tests.test_plan import hand_workload
from tests.tracebuilder import TraceBuilder, completed_trace, tiny_mlp

DATA = Path(__file__).parent / "data"
BERT32 = DATA / "gpu-bert-base-b32-s512-fp32.jsonl.gz"
BERT_OOM = DATA / "gpu-bert-base-b32-s512-8gib-oom.jsonl.gz"


@pytest.fixture(scope="module")
def bert32() -> tuple[Trace, dict[str, Any]]:
    trace = load_trace(BERT32)
    return trace, build_summary(trace)


def _svg(uri: str) -> str:
    header, _, payload = uri.partition(",")
    assert header == "data:image/svg+xml;base64"
    return base64.b64decode(payload).decode("utf-8")


# ----------------------------------------------------------------------------------------- alternatives


@pytest.mark.parametrize("budget", [2000, 900, 700])
def test_alternatives_are_what_their_names_say(budget: int) -> None:
    w, target = hand_workload(), Target(budget, margin=0.0)
    plan = make_plan(w, target)
    alt = alternatives(w, target, plan)
    assert tuple(alt) == ALTERNATIVES
    chosen, fastest, least, same = (alt[k] for k in ALTERNATIVES)
    assert chosen is not None and fastest is not None and least is not None and same is not None
    assert plan.chosen is not None and chosen["config"] == plan.chosen.config.as_dict()
    assert all(a["fits"] for a in (chosen, fastest, same))
    # least memory is no bigger than any other alternative
    assert all(least["predicted_reserved_bytes"] <= a["predicted_reserved_bytes"] for a in alt.values() if a)
    assert same["config"]["precision"] == "fp32" and same["config"]["optimizer"] != "8bit"


def test_fastest_may_change_precision_where_the_plan_does_not() -> None:
    w, target = hand_workload(), Target(2000, margin=0.0)
    alt = alternatives(w, target, make_plan(w, target))
    assert alt["chosen"] is not None and alt["chosen"]["levers"] == []  # fits as it is
    fastest = alt["fastest"]
    assert fastest is not None and fastest["config"]["precision"] == "bf16"
    assert fastest["predicted_step_time_ratio"] < 1.0 == alt["chosen"]["predicted_step_time_ratio"]


def test_alternatives_when_nothing_fits() -> None:
    w, target = hand_workload(), Target(300, margin=0.0)
    plan = make_plan(w, target)
    alt = alternatives(w, target, plan)
    assert not plan.fits and alt["chosen"] is None and alt["fastest"] is None
    for key in ("least_memory", "numerics_preserving"):
        a = alt[key]
        assert a is not None and a["fits"] is False
    least = alt["least_memory"]
    assert least is not None and least["predicted_reserved_bytes"] <= plan.closest.reserved_bytes


def test_summary_plan_has_alternatives_and_the_report_ranks_findings(
    bert32: tuple[Trace, dict[str, Any]],
) -> None:
    trace, summary = bert32
    alt = summary["plan"]["alternatives"]
    assert set(alt) == set(ALTERNATIVES)
    assert alt["chosen"]["levers"] == summary["plan"]["levers"]
    assert alt["fastest"]["predicted_step_time_ratio"] <= alt["chosen"]["predicted_step_time_ratio"]
    ctx = plan_section.report_section(trace, summary)
    assert ctx is not None
    savings = [f["saving_bytes"] or 0 for f in ctx["findings"]]
    assert savings == sorted(savings, reverse=True) and len(savings) >= 2
    assert sorted(f["rule"] for f in ctx["findings"]) == sorted(f["rule"] for f in summary["findings"])


def test_ranked_keeps_rule_order_for_ties_and_puts_unknown_savings_last() -> None:
    findings = [
        {"rule": "a", "saving_bytes": None},
        {"rule": "b", "saving_bytes": 5},
        {"rule": "c", "saving_bytes": 9},
        {"rule": "d", "saving_bytes": 5},
    ]
    assert [f["rule"] for f in plan_section.by_saving(findings)] == ["c", "b", "d", "a"]


# ----------------------------------------------------------------------------------------- nine-grid


def test_ninegrid_rows_carry_figures_and_thresholds(bert32: tuple[Trace, dict[str, Any]]) -> None:
    _, summary = bert32
    rows = {r["axis"]: r for r in plan_section.ninegrid_rows(summary["ninegrid"])}
    compute = rows["compute intensity"]
    assert compute["level"] == "high" and "75.9 FLOP/byte" in compute["figure"]
    assert "3.49" in compute["thresholds"] and "14" in compute["thresholds"]  # quarter ridge, ridge
    assert rows["parameter scale"]["figure"].endswith("1.2%")
    assert "37.7% padding" in rows["data traits"]["figure"]


def test_ninegrid_rows_say_what_was_not_measured() -> None:
    grid = {"compute": {"level": None, "figures": None, "evidence": "no flops"}, "parameter_scale": None}
    rows = plan_section.ninegrid_rows(grid)
    assert [r["level"] for r in rows] == [None, None, None]
    assert [r["figure"] for r in rows] == [None, None, None]
    assert rows[0]["evidence"] == "no flops" and all(r["thresholds"] for r in rows)


def _grid(compute: str | None, state: str | None, data: str | None) -> dict[str, Any]:
    return {
        "compute": {"level": compute, "figures": {"arithmetic_intensity": 50.0, "ridge_point": 10.0}},
        "parameter_scale": {
            "level": state,
            "figures": {"model_state_bytes": 2**30, "budget_bytes": 2**33, "share": 0.125},
        },
        "data": {"level": data, "figures": {"padding_fraction": 0.4, "class": "padded"}},
    }


def test_ninegrid_chart_highlights_one_cell_or_hatches_the_unknown() -> None:
    known = _svg(plots_plan.ninegrid(_grid("high", "low", "high")))
    # the highlight colour fills the workload's cell and its data-traits segment; nothing is hatched
    assert known.count(f"fill: {plots_plan.HIT}") == 2
    assert "<pattern" not in known
    unknown = _svg(plots_plan.ninegrid(_grid(None, "low", None)))
    assert f"fill: {plots_plan.HIT}" not in unknown
    # compute unmeasured: the whole "low" row (3 cells) is hatched, and so is the 3-segment data strip
    assert unknown.count("fill: url(#h") == 6 and f'fill="{plots_plan.UNKNOWN}"' in unknown


# ----------------------------------------------------------------------------------------- heatmap


def _by_name(trace: Trace, step: Any) -> dict[str, int]:
    return {r["name"]: r["activation_bytes"] or 0 for r in layer_table(trace, step)}


def test_heatmap_rows_hold_what_each_layer_saved_and_free_it_in_backward() -> None:
    trace = completed_trace(layers=4)
    step = peak_step(trace)
    hm = heatmap(trace, step)
    assert hm is not None and step is not None
    saved = _by_name(trace, step)
    assert hm["rows"][:2] == ["bert.embeddings", "bert.encoder.layer.0"]
    assert all(len(v) == COLUMNS for v in hm["values"])
    for name, values in zip(hm["rows"], hm["values"], strict=True):
        if name in saved:  # the most a layer holds is what it saved (the builder frees it in backward)
            assert max(values) == saved[name], name
        assert values[-1] == 0, f"{name} still holds activations after the optimizer step"
    layer0 = hm["values"][1]
    assert layer0[0] == 0 and max(layer0) > 0  # lights up in the forward, not before
    # at every moment, the rows add up to no more than the step's largest activation total
    totals = [sum(col) for col in zip(*hm["values"], strict=True)]
    assert max(totals) <= max(int(v or 0) for v in step.timeline["activations"] or [])
    # earlier layers save first and free last: layer 0 holds memory longer than layer 3
    held = {n: sum(1 for v in vals if v) for n, vals in zip(hm["rows"], hm["values"], strict=True)}
    assert held["bert.encoder.layer.0"] > held["bert.encoder.layer.3"]


def test_heatmap_merges_consecutive_layers_beyond_max_rows() -> None:
    b = TraceBuilder(kind="cpu", budget_bytes=None)
    b.add_model(tiny_mlp(depth=60))  # 120 top-level layers
    b.add_steps(warmup=0, profiled=1)
    trace = b.end("completed").build()
    step = peak_step(trace)
    hm = heatmap(trace, step)
    assert hm is not None and hm["layers"] == 120
    assert hm["per_row"] == 3 and len(hm["rows"]) == 40 <= MAX_ROWS
    assert hm["rows"][0] == "0 … 2"
    saved = _by_name(trace, step)
    # a merged row holds at least as much as its largest member
    assert max(hm["values"][0]) >= max(saved[n] for n in ("0", "1", "2")) > 0


def test_heatmap_is_not_drawn_when_no_layer_was_timed() -> None:
    trace = completed_trace(layers=2)
    step = peak_step(trace)
    assert step is not None
    tl = step.timeline
    tl["module"] = [0 if m is not None else None for m in tl["module"] or []]  # only the root sampled
    assert heatmap(trace, step) is None
    assert "timing depth" in why_not(trace, step)
    assert why_not(trace, None) == "no step was recorded"


def test_heatmap_of_a_100_layer_model_stays_small() -> None:
    trace = completed_trace(layers=100)  # 1,815 modules, every one sampled in the timeline
    hm = heatmap(trace, peak_step(trace))
    assert hm is not None and hm["layers"] == 104 and len(hm["rows"]) <= MAX_ROWS
    assert hm["per_row"] == 3  # merged rows name their span briefly
    assert hm["rows"][:2] == ["bert.embeddings … encoder.layer.1", "bert.encoder.layer.2 … 4"]
    chart = plots_heatmap.layer_heatmap(hm)
    assert chart is not None and "<svg" in _svg(chart)[:2000]
    assert len(chart) < 200_000  # the grid is one raster at its own size (240 x rows pixels)


def test_report_draws_the_heatmap(tmp_path: Path) -> None:
    trace = completed_trace(layers=2)
    ctx = report_context(trace, build_summary(trace))
    assert ctx["heatmap"]["layers"] == 6 and ctx["heatmap_missing"] is None
    assert "<svg" in _svg(ctx["heatmap_chart"])[:2000]


# ----------------------------------------------------------------------------------------- timeline


def test_a_long_timeline_is_thinned_keeping_its_envelope_and_peak() -> None:
    trace = completed_trace(layers=100)
    step = peak_step(trace)
    assert step is not None
    series = timeline_series(step)
    thin = plots.thin_series(series, limit=500)
    n = len(series["t_ms"])
    assert thin["thinned"] == -(-n // 500) > 1 and len(thin["t_ms"]) <= 502
    total = [sum(v) for v in zip(*series["categories"].values(), strict=True)]
    kept = [sum(v) for v in zip(*thin["categories"].values(), strict=True)]
    assert max(kept) == max(total)  # the peak sample survives
    assert thin["t_ms"][0] == series["t_ms"][0] and thin["t_ms"][-1] == series["t_ms"][-1]
    assert all(len(v) == len(thin["t_ms"]) for v in thin["allocator"].values())
    assert plots.thin_series(series, limit=n)["thinned"] == 1  # short enough: untouched


# ----------------------------------------------------------------------------------------- README


def test_readme_links_every_sample_report() -> None:
    repo = Path(__file__).resolve().parent.parent
    readme = (repo / "README.md").read_text(encoding="utf-8")
    folders = sorted(p.name for p in (repo / "sample_reports").iterdir() if p.is_dir())
    assert folders, "no sample reports"
    for name in folders:
        assert f"](sample_reports/{name}/report.html)" in readme, f"README does not link {name}"
        assert (repo / "sample_reports" / name / "report.html").is_file()
    # every sample report comes from a committed trace (benchmarks/make_sample_reports.py): a GPU trace,
    # or a recorded multi-rank folder (its merged report, each rank's in rank-K/)
    traces = sorted(
        p.name.removeprefix("gpu-").removesuffix(".jsonl.gz") for p in DATA.glob("gpu-*.jsonl.gz")
    )
    ranks = [n for n in folders if (repo / "sample_reports" / n / "rank-0").is_dir()]
    assert [n for n in folders if n not in ranks] == traces
    assert ranks and all((DATA / f"cpu-{n}" / "ranks.json").is_file() for n in ranks)


def test_the_top_of_the_page_names_the_plan_and_the_command_that_applies_it(tmp_path: Path) -> None:
    """Under the verdict, the one command that applies the plan: a cd into the folder the profile ran
    in, then the config's and the script's absolute paths, so it works pasted into any shell."""
    import shlex

    from memdoctor.report import write_report
    from memdoctor.trace import load_trace

    trace = load_trace(Path(__file__).parent / "data" / "gpu-bert-base-b32-s512-8gib-oom.jsonl.gz")
    (tmp_path / "out").mkdir()
    html = (write_report(trace, tmp_path / "out")["report"]).read_text()
    top = html[html.index('id="verdict"') : html.index('id="toc"')]
    assert "With the plan: predicted to fit" in top and "7.08 GiB" in top
    start = top.index('id="apply-command">') + len('id="apply-command">')
    command = top[start : top.index("</pre>", start)]
    cd, _, run = command.partition(" &amp;&amp; ")
    assert shlex.split(cd) == ["cd", trace.header["command"]["cwd"]]
    words = shlex.split(run)
    assert words[:4] == ["memdoctor", "run", "--config", str(tmp_path / "out" / "memdoctor.yaml")]
    assert words[4] == "/work/main/benchmarks/workloads/bert_story.py"  # the profile's folder + script
    assert words[5:] == ["--", "--steps", "20", "--attn", "eager"]
    assert 'id="plan-status"' in top and "Predicted only, not measured" in top
