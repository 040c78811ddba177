"""``memdoctor check`` (a CI memory guard) and ``memdoctor diff`` (two runs side by side)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tracebuilder import GiB, TraceBuilder, bert_like

from memdoctor import exitcodes
from memdoctor.cli import main
from memdoctor.compare import Run, changed_layers, check_run, diff_runs
from memdoctor.errors import UsageError
from memdoctor.report import build_summary
from memdoctor.report.diff import render_diff_html
from memdoctor.trace import load_trace


def _trace(tmp_path: Path, name: str, batch: int = 8, layers: int = 2, prefix: str = "") -> Path:
    builder = TraceBuilder(kind="cuda", budget_bytes=8 * GiB)
    mods = bert_like(layers=layers, batch=batch, seq=512)
    builder.add_model([(prefix + m[0] if m[0] else m[0], *m[1:]) for m in mods])
    builder.add_steps(warmup=1, profiled=2)
    builder.end("completed")
    (tmp_path / name).mkdir()
    return builder.save(tmp_path / name / "trace.jsonl.gz")


def _peak(path: Path) -> int:
    return int(build_summary(load_trace(path))["peak_memory_bytes"])


# ----------------------------------------------------------------------------------------- check


def test_check_exits_zero_within_and_seven_over_the_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _trace(tmp_path, "a")
    peak = _peak(path)
    assert main(["check", str(path), "--max-peak", str(peak)]) == exitcodes.OK  # equal is within
    assert "within the budget" in capsys.readouterr().out
    assert main(["check", str(path), "--max-peak", str(peak - 1024)]) == exitcodes.LIMIT_EXCEEDED
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "exceeds the budget" in out[0] and "(1,024 bytes, " in out[0]


def test_check_reads_a_report_folder_with_only_a_summary(tmp_path: Path) -> None:
    folder = tmp_path / "report"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"peak_memory_bytes": 3 * GiB}))
    assert main(["check", str(folder), "--max-peak", "2GiB"]) == exitcodes.LIMIT_EXCEEDED
    assert main(["check", str(folder), "--max-peak", "3GiB"]) == exitcodes.OK


def test_check_step_time_ratio_against_a_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small, big = _trace(tmp_path, "small", batch=2), _trace(tmp_path, "big", batch=8)
    base = ["--max-peak", "100GiB", "--baseline", str(small)]
    t = build_summary(load_trace(big))["step_time_ms"] / build_summary(load_trace(small))["step_time_ms"]
    assert main(["check", str(big), *base, "--max-step-time-ratio", str(t * 1.01)]) == exitcodes.OK
    capsys.readouterr()
    assert (
        main(["check", str(big), *base, "--max-step-time-ratio", str(t * 0.99)]) == exitcodes.LIMIT_EXCEEDED
    )
    assert "over the limit" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ([], exitcodes.USAGE_ERROR, "give a limit"),
        (["--max-peak", "lots"], exitcodes.USAGE_ERROR, "cannot read 'lots' as a size"),
        (["--max-step-time-ratio", "1.1"], exitcodes.USAGE_ERROR, "needs --baseline"),
        (["--max-step-time-ratio", "-1", "--baseline", "x"], exitcodes.USAGE_ERROR, "max-step-time-ratio"),
    ],
)
def test_check_bad_arguments_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], code: int, message: str
) -> None:
    path = _trace(tmp_path, "a")
    assert main(["check", str(path), *args]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_check_unreadable_trace_is_a_trace_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "trace.jsonl.gz"
    bad.write_bytes(b"not gzip")
    assert main(["check", str(bad), "--max-peak", "1GiB"]) == exitcodes.TRACE_ERROR
    assert main(["check", str(tmp_path / "missing"), "--max-peak", "1GiB"]) == exitcodes.TRACE_ERROR
    assert len(capsys.readouterr().err.strip().splitlines()) == 2


def test_check_without_a_peak_figure_says_so() -> None:
    with pytest.raises(UsageError, match="no peak memory"):
        check_run(Run(Path("x"), {"peak_memory_bytes": None}), 1, None)


# ----------------------------------------------------------------------------------------- diff


def test_changed_layers_ranks_by_change_and_keeps_one_sided_modules() -> None:
    a = [
        {"name": "(M)", "depth": 0, "activation_bytes": 100, "param_bytes": 0},
        {"name": "x", "depth": 1, "activation_bytes": 10, "param_bytes": 5},
        {"name": "y", "depth": 1, "activation_bytes": 10, "param_bytes": 5},
        {"name": "gone", "depth": 1, "activation_bytes": 3, "param_bytes": 0},
    ]
    b = [
        {"name": "(M)", "depth": 0, "activation_bytes": 900, "param_bytes": 0},
        {"name": "x", "depth": 1, "activation_bytes": 10, "param_bytes": 5},
        {"name": "y", "depth": 1, "activation_bytes": 50, "param_bytes": 1},
        {"name": "new", "depth": 1, "activation_bytes": 7, "param_bytes": 0},
    ]
    rows = changed_layers(a, b, top=10)
    assert [r["name"] for r in rows] == ["y", "new", "gone"]  # unchanged x and the root are left out
    assert rows[0]["change"] == 44
    assert rows[1]["activation_a"] is None and rows[2]["activation_b"] is None


def test_diff_terminal_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _trace(tmp_path, "a", batch=2), _trace(tmp_path, "b", batch=32)
    out_dir = tmp_path / "cmp"
    assert main(["diff", str(a), str(b.parent), "-o", str(out_dir)]) == exitcodes.OK
    out = capsys.readouterr().out
    assert "peak memory" in out and "activations" in out and "bert.encoder.layer.0" in out
    assert f"Wrote {out_dir / 'diff.html'}" in out
    html = (out_dir / "diff.html").read_text()
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    for section in ('id="overview"', 'id="categories"', 'id="layers"'):
        assert section in html
    peak_line = next(line for line in out.splitlines() if "peak memory" in line)
    assert peak_line.rstrip().endswith("x)") and "+" in peak_line  # b is the bigger batch: a growth


def test_diff_escapes_module_names() -> None:
    layer = {"name": "<script>alert(1)</script>", "depth": 1, "activation_bytes": 1, "param_bytes": 0}
    a = Run(Path("<b>a"), {"peak_memory_bytes": 1, "layers": []})
    b = Run(Path("b"), {"peak_memory_bytes": 2, "layers": [layer]})
    html = render_diff_html(diff_runs(a, b))
    assert "<script>" not in html and "&lt;script&gt;alert(1)" in html and "&lt;b&gt;a" in html


def test_diff_unwritable_output_is_an_output_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _trace(tmp_path, "a")
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["diff", str(a), str(a), "-o", str(blocker / "sub")]) == exitcodes.USAGE_ERROR
    assert "cannot write diff.html" in capsys.readouterr().err
