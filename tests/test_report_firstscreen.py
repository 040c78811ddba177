"""The report's first screen (memdoctor.report.firstscreen) and its page structure, on built traces:
the verdict's tone, the biggest layers with repeated blocks grouped, the command that works from any
folder, the module table's top rows, and messages cut at a word rather than mid-word."""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest
from tracebuilder import GiB, completed_trace, oom_trace

from memdoctor.report import build_summary, render_report
from memdoctor.report.firstscreen import command, eaters, verdict
from memdoctor.report.render import layer_table, own_top, whole_words
from memdoctor.units import MESSAGE_CHARS, clip


def _plan(**fields: Any) -> dict[str, Any]:
    return {"fits": True, "fits_as_is": False, "verified_fits": None, "budget_bytes": 8 * GiB, **fields}


@pytest.mark.parametrize(
    ("plan", "fault", "tone", "as_is", "with_plan"),
    [
        (None, None, "info", None, None),
        (_plan(fits_as_is=True), None, "ok", "fits", None),
        (_plan(), {"kind": "oom"}, "ok", "does not fit", "fits"),
        (_plan(verified_fits=False), {"kind": "oom"}, "bad", "does not fit", "does not fit"),
        (_plan(fits=False), None, "bad", "does not fit", "does not fit"),
        (_plan(fits_as_is=True), {"kind": "oom"}, "ok", "does not fit", "fits"),  # died of something
    ],
)
def test_the_verdict_is_green_only_when_it_fits(
    plan: dict[str, Any] | None,
    fault: dict[str, Any] | None,
    tone: str,
    as_is: str | None,
    with_plan: str | None,
) -> None:
    v = verdict(completed_trace(), {"plan": plan, "fault": fault})
    assert (v["tone"], v["as_is"], v["plan"], v["measured"]) == (tone, as_is, with_plan, None)


def test_repeated_blocks_holding_the_same_bytes_are_one_row() -> None:
    trace = completed_trace(layers=12)
    rows = eaters(trace)
    layer_rows = [r for r in rows if r["name"].startswith("bert.encoder.layer.")]
    assert len(layer_rows) == 1, rows
    (row,) = layer_rows
    assert row["name"] == "bert.encoder.layer.0 … 11" and row["count"] == 12
    assert row["bytes"] == 12 * row["each"]
    assert [r["bytes"] for r in rows] == sorted((r["bytes"] for r in rows), reverse=True)


def test_the_modules_top_table_counts_each_byte_once() -> None:
    trace = completed_trace()
    rows = layer_table(trace, trace.steps[-1])
    top = own_top(rows, limit=len(rows))
    every = sum(
        (r["param_bytes"] or 0)
        + (r["grad_bytes"] or 0)
        + (r["optimizer_state_bytes"] or 0)
        + (r["activation_self_bytes"] or 0)
        for r in rows
    )
    assert sum(r["own_bytes"] for r in top) == every  # exclusive figures: the sum is the whole
    assert len(own_top(rows)) == 15
    assert own_top(rows)[0]["own_bytes"] == max(r["own_bytes"] for r in top)


def test_the_command_works_from_any_folder() -> None:
    trace = oom_trace()
    summary = build_summary(trace)
    assert summary["plan"] and not summary["plan"]["fits_as_is"]
    text = command(trace, summary, "out/memdoctor.yaml")["text"]
    cd, _, run = text.partition(" && ")
    assert shlex.split(cd) == ["cd", "/home/user/project"]
    words = shlex.split(run)
    assert words[:3] == ["memdoctor", "run", "--config"]
    assert words[3].startswith("/") and words[3].endswith("/out/memdoctor.yaml")
    assert words[4] == "/home/user/project/train.py"
    assert words[5] == "--"


def test_no_plan_no_command_and_fits_as_is_runs_the_script() -> None:
    trace = completed_trace()
    assert command(trace, {"plan": None}, "memdoctor.yaml")["text"] is None
    fits = command(trace, {"plan": _plan(fits_as_is=True), "fault": None}, "memdoctor.yaml")
    assert fits == {
        "text": "cd /home/user/project && python /home/user/project/train.py train.py --epochs 1",
        "applies": False,
    }


def test_a_message_cut_at_the_limit_ends_at_a_sentence_not_mid_word() -> None:
    oom = "OutOfMemoryError: " + "CUDA out of memory. Tried to allocate 384.00 MiB. " * 20
    old_cut = oom[:MESSAGE_CHARS]  # how memdoctor used to cut it: "... Tried to allo"
    shown = whole_words(old_cut)
    assert shown.endswith(". …") and len(shown) < MESSAGE_CHARS
    assert whole_words("short message") == "short message"
    clipped = clip(oom, MESSAGE_CHARS)
    assert len(clipped) <= MESSAGE_CHARS and clipped.endswith("…")
    assert clipped[:-1] == oom[: len(clipped) - 1] and oom[len(clipped) - 1] == " "  # cut at a word


@pytest.fixture(scope="module")
def oom_html() -> str:
    return render_report(oom_trace())


def test_the_page_has_a_table_of_contents_that_reaches_every_section(oom_html: str) -> None:
    html = oom_html
    toc = html[html.index('<nav id="toc"') : html.index("</nav>")]
    targets = re.findall(r'href="#([^"]+)"', toc)
    h2_ids = re.findall(r'<h2[^>]*\bid="([^"]+)"', html)
    assert set(targets) <= set(h2_ids), set(targets) - set(h2_ids)
    assert set(h2_ids) <= set(targets)  # and every section is in it
    # verdict -> what ate it -> plan -> charts -> diagnostics
    order = [h2_ids.index(i) for i in ("fault", "peak", "plan", "verify", "layer-chart", "layers", "steps")]
    assert order == sorted(order)


def test_the_failing_module_has_one_name(oom_html: str) -> None:
    """The headline, the fault box, the module stack's last entry and the peak's sentence name the
    module the run died in, the same way."""
    html = oom_html
    stack = html[html.index('<ol class="stack">') : html.index("</ol>")]
    assert re.findall(r"<li>([^<]+)</li>", stack)[-1] == "bert.encoder.layer.11"
    assert "in <code>bert.encoder.layer.11</code>, where it died" in html
    named = set(re.findall(r"<code>(bert\.encoder\.layer\.11[^<]*)</code>", html))
    assert named == {"bert.encoder.layer.11"}, named


def test_the_glossary_explains_the_terms(oom_html: str) -> None:
    html = oom_html
    glossary = html[html.index('<h2 id="glossary"') :]
    for term in ("nine-grid", "allocated vs reserved", "checkpointing", "expandable segments", "roofline"):
        assert term in glossary, term
    for key in re.findall(r'href="#g-([a-z_]+)"', html):
        assert f'id="g-{key}"' in glossary


@pytest.mark.parametrize("kind", ["oom", "cpu"])
def test_no_table_is_left_empty(kind: str, oom_html: str) -> None:
    """A table with no rows is omitted (or replaced by one line saying none), not drawn as a header."""
    html = oom_html if kind == "oom" else render_report(completed_trace(kind="cpu", budget_bytes=None))
    empty = [
        attrs
        for attrs, body in re.findall(r"<table([^>]*)>(.*?)</table>", html, re.S)
        if len(re.findall(r"<tr", body)) <= 1
    ]
    assert empty == []
