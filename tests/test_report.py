"""The report layer: self-contained, escaped HTML; summary.json written atomically; deterministic plots."""

from __future__ import annotations

import base64
import json
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import matplotlib
import pytest
from tracebuilder import GiB, TraceBuilder, bert_like, completed_trace, oom_trace

from memdoctor.errors import OutputError
from memdoctor.report import build_summary, render, render_report, summary_json, write_report
from memdoctor.report.render import environment, template_dir
from memdoctor.trace import Trace

EVIL_MODULE = "<script>alert(1)</script>"
EVIL_CLASS = "<b>"
DATA_RE = re.compile(r'<script type="application/json" id="memdoctor-data">(.*?)</script>', re.S)


class Tags(HTMLParser):
    """Collects start tags with their attributes, and the text of the ``h1``."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.h1, self._in_h1 = "", False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_h1 = self._in_h1 or tag == "h1"

    def handle_endtag(self, tag: str) -> None:
        self._in_h1 = self._in_h1 and tag != "h1"

    def handle_data(self, data: str) -> None:
        if self._in_h1:
            self.h1 += data

    def ids(self) -> set[str]:
        return {a["id"] for _, a in self.tags if a.get("id")}


@pytest.fixture(scope="module")
def bert() -> Trace:
    return completed_trace(layers=2)


@pytest.fixture(scope="module")
def html(bert: Trace) -> str:
    return render_report(bert)


def embedded(html: str) -> dict:
    match = DATA_RE.search(html)
    assert match is not None
    return json.loads(match.group(1))


def evil_trace(module: str = EVIL_MODULE, cls: str = EVIL_CLASS) -> Trace:
    mods = bert_like(1)
    mods[3] = (f"bert.embeddings.{module}", cls, mods[3][2], mods[3][3])
    b = TraceBuilder(argv=["train.py", "--tag", "</script><img src=x onerror=alert(2)>"])
    b.add_model(mods)
    b.add_step(die_at=("forward", f"bert.embeddings.{module}"))
    b.add_event(
        "oom",
        f"died in {module}",
        module_name=f"bert.embeddings.{module}",
        model=0,
        module=3,
        step=0,
        phase="forward",
        traceback=[f"  File {module}"],
    )
    return b.end("oom", f"<i>{module}</i>", exit_code=1).build()


def test_embedded_json_equals_the_summary(bert: Trace, html: str) -> None:
    assert embedded(html) == build_summary(bert)


def test_csp_and_no_external_resources(html: str) -> None:
    tags = Tags(html).tags
    csp = [a for t, a in tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert csp == [
        {
            "http-equiv": "Content-Security-Policy",
            "content": "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; "
            "form-action 'none'",
        }
    ]
    for _, attrs in tags:
        for key in ("src", "href"):
            assert not (attrs.get(key) or "").startswith(("http:", "https:", "//"))
    imgs = [a["src"] for t, a in tags if t == "img"]
    # layer bars, timeline, layer x time heatmap, nine-grid
    assert len(imgs) == 4 and all(src.startswith("data:image/svg+xml;base64,") for src in imgs)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "<link" not in html


def test_user_strings_are_escaped() -> None:
    trace = evil_trace()
    html = render_report(trace)
    assert EVIL_MODULE not in html and "<img src=x" not in html and "<i>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;b&gt;" in html
    plain = render_report(evil_trace("plain_name", "PlainClass"))
    assert html.count("<b>") == plain.count("<b>")  # only the template's own <b> tags
    assert html.count("<script") == plain.count("<script") == 1


def test_the_embedded_summary_keeps_the_rows_the_table_shows_and_counts_the_rest(
    bert: Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary = build_summary(bert)
    n = len(summary["steps"])
    assert n >= 4 and len(summary["grad_norm"]) <= 2
    monkeypatch.setattr(render, "STEP_ROWS", 2)
    data = embedded(render_report(bert, summary))
    assert data["steps"] == [summary["steps"][0], summary["steps"][-1]]
    assert data["grad_norm"] == summary["grad_norm"]  # within the cap: whole
    assert data["rows_left_out"] == {"steps": n - 2}
    assert {k: v for k, v in data.items() if k not in ("steps", "rows_left_out")} == {
        k: v for k, v in summary.items() if k != "steps"
    }


def test_embedded_json_cannot_close_its_script_element() -> None:
    trace = evil_trace()
    html = render_report(trace)
    raw = DATA_RE.search(html).group(1)
    assert "<" not in raw and ">" not in raw
    assert json.loads(raw) == build_summary(trace)


def test_svg_plots_carry_no_markup_from_names() -> None:
    html = render_report(evil_trace())
    for _, attrs in Tags(html).tags:
        src = attrs.get("src") or ""
        if src.startswith("data:image/svg+xml;base64,"):
            svg = base64.b64decode(src.split(",", 1)[1]).decode()
            assert "<script" not in svg


def test_cpu_report_says_the_allocator_was_not_measured() -> None:
    trace = completed_trace(kind="cpu", budget_bytes=None, layers=1)
    html = render_report(trace)
    data = embedded(html)
    assert data["device"]["kind"] == "cpu" and data["categories"]["other"] is None
    assert any("allocator" in note for note in data["not_measured"])
    assert "not-measured" in Tags(html).ids()
    assert "allocator figures: no CUDA device" in html


def test_faulted_report_names_the_fault() -> None:
    trace = oom_trace(layers=2)
    html = render_report(trace)
    data = embedded(html)
    assert data["fault"]["kind"] == "oom"
    assert data["live_at_fault"]["module_stack"][-1] == "bert.encoder.layer.1"
    h1 = " ".join(Tags(html).h1.split())
    assert h1 == data["headline"]
    assert "CUDA out of memory" in h1 and "bert.encoder.layer.1" in h1
    assert {"fault", "live-categories"} <= Tags(html).ids()


def test_report_without_steps_renders() -> None:
    b = TraceBuilder()
    b.add_model(bert_like(1))
    html = render_report(b.end("no_steps", "no optimizer step").build())
    assert embedded(html)["peak_memory_bytes"] is None
    assert not [a for t, a in Tags(html).tags if t == "img"]  # no step: no chart that would show zeros


def test_rendering_is_deterministic(bert: Trace, html: str) -> None:
    assert render_report(bert) == html


def test_rendering_leaves_matplotlib_state_alone(bert: Trace) -> None:
    had_pyplot = "matplotlib.pyplot" in sys.modules
    render_report(bert)
    assert had_pyplot or "matplotlib.pyplot" not in sys.modules
    # Reading rcParams["backend"] may import pyplot to resolve it, so this comes after that check.
    before = {k: v for k, v in matplotlib.rcParams.items() if k != "backend"}
    render_report(bert)
    assert {k: v for k, v in matplotlib.rcParams.items() if k != "backend"} == before


def test_environment_is_cached_and_autoescapes() -> None:
    env = environment()
    assert env is environment()
    assert env.autoescape is True
    assert (template_dir() / "report.html.j2").is_file()


def test_write_report_writes_both_files_atomically(tmp_path: Path, bert: Trace) -> None:
    (tmp_path / "report.html").write_text("old")
    paths = write_report(bert, tmp_path)
    assert build_summary(bert)["plan"] is not None  # so the plan is written as memdoctor.yaml too
    assert paths == {
        "report": tmp_path / "report.html",
        "summary": tmp_path / "summary.json",
        "config": tmp_path / "memdoctor.yaml",
    }
    text = paths["summary"].read_text()
    assert text == summary_json(build_summary(bert))
    assert json.loads(text) == build_summary(bert)
    # two-space indent, sorted keys; each per-step row on a line of its own
    data = json.loads(text)
    assert text.startswith('{\n  "accounted_fraction": ') and '\n  "categories": {\n    "' in text
    rows = [json.dumps(r, sort_keys=True, separators=(", ", ": ")) for r in data["steps"]]
    table = ",\n    ".join(rows)
    assert f'\n  "steps": [\n    {table}\n  ],\n' in text and len(rows) > 1
    assert embedded(paths["report"].read_text()) == json.loads(text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memdoctor.yaml", "report.html", "summary.json"]


def test_write_report_to_a_missing_folder_is_an_output_error(tmp_path: Path, bert: Trace) -> None:
    with pytest.raises(OutputError, match="missing"):
        write_report(bert, tmp_path / "missing")


def test_report_from_a_saved_trace(tmp_path: Path) -> None:
    b = TraceBuilder(budget_bytes=6 * GiB)
    b.add_model(bert_like(1))
    b.add_steps(warmup=1, profiled=1)
    b.end("completed")
    saved, built = b.roundtrip(tmp_path), b.build()
    built.path = saved.path  # the card table's commands name the trace's file
    assert render_report(saved) == render_report(built)
