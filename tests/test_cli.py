"""The command line, in-process through ``main(argv)`` (the supervisor faked) and as a subprocess."""

from __future__ import annotations

import dataclasses
import gzip
import importlib
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from memdoctor import __version__, exitcodes
from memdoctor.cli import main, parse_args
from memdoctor.errors import TraceError
from memdoctor.outputs import LOCK_NAME, FolderClaim, FolderHeld
from memdoctor.trace import TraceWriter, make_header

REPO = Path(__file__).resolve().parent.parent

SUMMARY = {
    "format_version": 1,
    "status": "completed",
    "device": {"name": "cpu", "kind": "cpu", "total_memory_bytes": None, "memory_cap_bytes": None},
    "steps_profiled": 3,
    "peak_memory_bytes": 3 * 2**20,
    "categories": {"parameters": 2**20, "gradients": 2**20, "optimizer_state": 2**19, "activations": 2**19},
    "layers": [
        {"name": "", "type": "Net", "param_bytes": 2**20, "activation_bytes": 2**19},
        {"name": "encoder.0", "type": "Linear", "param_bytes": 4096, "activation_bytes": 2**18},
        {"name": "encoder.1", "type": "Linear", "param_bytes": 4096, "activation_bytes": 2**17},
        {"name": "head[bold]", "type": "Linear", "param_bytes": 4096, "activation_bytes": 2**10},
    ],
}


@dataclasses.dataclass
class FakeRequest:
    script: str | None
    module: str | None
    args: list[str]
    out_dir: Path
    warmup: int
    steps: int
    budget_bytes: int | None
    timeout_s: float | None


@dataclasses.dataclass
class FakeResult:
    exit_code: int
    status: str
    message: str
    trace_path: Path | None = None
    report_path: Path | None = None
    summary_path: Path | None = None
    summary: dict[str, Any] | None = None


class FakeSupervisor:
    """Stands in for ``memdoctor.launch.supervisor.run_profile``: records the request, writes 3 files."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.exit_code = exitcodes.OK
        self.raises: BaseException | None = None

    def __call__(self, request: Any) -> FakeResult:
        self.requests.append(request)
        if self.raises is not None:
            raise self.raises
        paths = [request.out_dir / name for name in ("trace.jsonl.gz", "report.html", "summary.json")]
        for path in paths:
            path.write_text("fake")
        status = "completed" if self.exit_code == exitcodes.OK else "exception"
        return FakeResult(self.exit_code, status, "3 steps profiled", *paths, summary=SUMMARY)

    @property
    def request(self) -> Any:
        assert len(self.requests) == 1
        return self.requests[0]


@pytest.fixture
def supervisor(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeSupervisor:
    """A fake ``run_profile`` (the real ``ProfileRequest`` when the supervisor module exists); cwd = tmp."""
    fake = FakeSupervisor()
    try:
        module = importlib.import_module("memdoctor.launch.supervisor")
    except ImportError:
        module = types.ModuleType("memdoctor.launch.supervisor")
        module.ProfileRequest = FakeRequest  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "memdoctor.launch.supervisor", module)
    monkeypatch.setattr(module, "run_profile", fake, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('training')\n")
    return fake


def stderr_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


# ----------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("argv", "script", "script_args"),
    [
        (["train.py", "--lr", "3e-5"], "train.py", ["--lr", "3e-5"]),
        (["train.py", "--", "--lr", "3e-5"], "train.py", ["--lr", "3e-5"]),
        (["--steps", "3", "-o", "out", "train.py", "--steps", "9"], "train.py", ["--steps", "9"]),
        (["--steps=3", "--force", "train.py", "-o", "x", "--force"], "train.py", ["-o", "x", "--force"]),
        (["--steps", "3", "--", "train.py", "--lr", "1"], "train.py", ["--lr", "1"]),
        (["train.py", "--help"], "train.py", ["--help"]),
        (["train.py", "--", "--", "x"], "train.py", ["--", "x"]),
        (["train.py", "--steps", "3", "--", "--lr", "1"], "train.py", ["--lr", "1"]),
        (["--force", "train.py", "-o", "out", "--", "--", "x"], "train.py", ["--", "x"]),
        (["train.py"], "train.py", []),
    ],
)
def test_script_args_split(argv: list[str], script: str, script_args: list[str]) -> None:
    ns = parse_args(["profile", *argv])
    assert (ns.script, ns.script_args, ns.module) == (script, script_args, None)


def test_own_flags_before_the_script_are_parsed() -> None:
    ns = parse_args(["profile", "--steps", "3", "--warmup", "0", "--budget", "8GiB", "--timeout", "60",
                     "-o", "out", "--force", "train.py", "--steps", "9"])  # fmt: skip
    assert (ns.steps, ns.warmup, ns.budget, ns.timeout, ns.output, ns.force) == (
        3, 0, 8 * 2**30, 60.0, Path("out"), True
    )  # fmt: skip
    assert ns.script_args == ["--steps", "9"]


def test_own_flags_between_script_and_separator_are_parsed() -> None:
    ns = parse_args(["profile", "train.py", "--steps", "2", "--budget", "1GiB", "--", "--batch-size", "32"])
    assert (ns.script, ns.steps, ns.budget, ns.script_args) == ("train.py", 2, 2**30, ["--batch-size", "32"])


@pytest.mark.parametrize(
    ("argv", "module", "script_args"),
    [
        (["-m", "pkg.train", "--lr", "1"], "pkg.train", ["--lr", "1"]),
        (["--steps", "2", "-mpkg.train", "--", "--lr", "1"], "pkg.train", ["--lr", "1"]),
        (["-m", "pkg.train", "other.py"], "pkg.train", ["other.py"]),
        (["-m", "pkg.train", "--steps", "2", "--", "x"], "pkg.train", ["x"]),
    ],
)
def test_module_split(argv: list[str], module: str, script_args: list[str]) -> None:
    ns = parse_args(["profile", *argv])
    assert (ns.module, ns.script, ns.script_args) == (module, None, script_args)


def test_profile_builds_the_request(supervisor: FakeSupervisor, tmp_path: Path) -> None:
    code = main(["profile", "--steps", "3", "--warmup", "0", "--budget", "1GiB", "--timeout", "9",
                 "train.py", "--batch-size", "32"])  # fmt: skip
    assert code == exitcodes.OK
    req = supervisor.request
    assert (req.script, req.module, req.args) == ("train.py", None, ["--batch-size", "32"])
    assert (req.steps, req.warmup, req.budget_bytes, req.timeout_s) == (3, 0, 2**30, 9.0)
    assert Path(req.out_dir) == tmp_path / "memdoctor-report"


def test_profile_module_request(supervisor: FakeSupervisor) -> None:
    assert main(["profile", "-m", "pkg.train", "--epochs", "1"]) == exitcodes.OK
    assert (supervisor.request.script, supervisor.request.module) == (None, "pkg.train")
    assert supervisor.request.args == ["--epochs", "1"]


def test_profile_prints_summary_and_written_files(
    supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", "train.py"]) == exitcodes.OK
    out = capsys.readouterr().out
    assert "steps profiled" in out and "3.00 MiB" in out and "encoder.0" in out
    assert "head[bold]" in out  # user-derived names are printed literally, not as rich markup
    written = [line for line in out.splitlines() if line.startswith("Wrote ")]
    assert [Path(line.split(" ", 1)[1]).name for line in written] == [
        "trace.jsonl.gz", "report.html", "summary.json"
    ]  # fmt: skip


@pytest.mark.parametrize("code", [exitcodes.SCRIPT_FAILED, exitcodes.NO_STEPS, exitcodes.OUT_OF_MEMORY])
def test_profile_returns_the_supervisors_exit_code(supervisor: FakeSupervisor, code: int) -> None:
    supervisor.exit_code = code
    assert main(["profile", "train.py"]) == code


# ----------------------------------------------------------------------------------------- usage errors


def test_missing_script_is_one_line(supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "nope.py", "--lr", "1"]) == exitcodes.USAGE_ERROR
    assert stderr_lines(capsys) == ["memdoctor: error: nope.py: no such file"]
    assert supervisor.requests == []


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\x7fELF\x02\x01\x01\x00\x00", "compiled program"),
        (b"\x00\x01\x02binary", "binary file"),
        (b"#!/bin/bash\necho hi\n", "not Python"),
    ],
)
def test_non_python_script_is_refused(
    supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str], content: bytes, expected: str
) -> None:
    Path("train.bin").write_bytes(content)
    assert main(["profile", "train.bin"]) == exitcodes.USAGE_ERROR
    lines = stderr_lines(capsys)
    assert len(lines) == 1 and expected in lines[0]


def test_folder_as_script_is_refused(supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str]) -> None:
    Path("pkg").mkdir()
    assert main(["profile", "pkg"]) == exitcodes.USAGE_ERROR
    assert "is a folder" in stderr_lines(capsys)[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["--budget", "lots", "train.py"],
        ["--budget", "0", "train.py"],
        ["--steps", "0", "train.py"],
        ["--steps", "two", "train.py"],
        ["--warmup", "-1", "train.py"],
        ["--timeout", "-5", "train.py"],
        ["--lr", "3e-5", "train.py"],
        [],
        ["-m", "not a module"],
    ],
)
def test_bad_arguments_exit_2(
    supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert main(["profile", *argv]) == exitcodes.USAGE_ERROR
    assert "Traceback" not in capsys.readouterr().err
    assert supervisor.requests == []


def test_unknown_flag_before_script_explains_the_order(
    supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", "--lr", "1", "train.py"]) == exitcodes.USAGE_ERROR
    assert "before the script" in capsys.readouterr().err


def test_memdoctor_option_given_to_the_script_is_pointed_out(
    supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", "train.py", "--steps", "3"]) == exitcodes.OK
    assert supervisor.request.args == ["--steps", "3"] and supervisor.request.steps == 5
    assert "note: --steps after the script goes to the script" in capsys.readouterr().err


def test_no_command_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == exitcodes.USAGE_ERROR
    assert main(["--help"]) == exitcodes.OK
    assert main(["profile", "--help"]) == exitcodes.OK
    out = capsys.readouterr().out
    assert "exit codes:" in out and "124" in out and "130" in out


# ----------------------------------------------------------------------------------------- output folders


def test_default_output_picks_a_fresh_folder(
    supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["profile", "train.py"]) == exitcodes.OK
    assert main(["profile", "train.py"]) == exitcodes.OK
    assert [Path(r.out_dir) for r in supervisor.requests] == [
        tmp_path / "memdoctor-report", tmp_path / "memdoctor-report-1"
    ]  # fmt: skip
    assert "writing to memdoctor-report-1 instead" in capsys.readouterr().err
    assert (tmp_path / "memdoctor-report" / "report.html").read_text() == "fake"


def test_default_output_skips_a_users_folder(supervisor: FakeSupervisor, tmp_path: Path) -> None:
    (tmp_path / "memdoctor-report").mkdir()
    (tmp_path / "memdoctor-report" / "notes.txt").write_text("mine")
    (tmp_path / "memdoctor-report-1").write_text("a file, not a folder")
    assert main(["profile", "train.py"]) == exitcodes.OK
    assert Path(supervisor.request.out_dir) == tmp_path / "memdoctor-report-2"
    assert (tmp_path / "memdoctor-report" / "notes.txt").read_text() == "mine"


def test_explicit_non_empty_output_is_refused_without_force(
    supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["profile", "-o", str(out), "train.py"]) == exitcodes.USAGE_ERROR
    lines = stderr_lines(capsys)
    assert len(lines) == 1 and "--force" in lines[0] and str(out) in lines[0]
    assert supervisor.requests == []

    assert main(["profile", "-o", str(out), "--force", "train.py"]) == exitcodes.OK
    assert Path(supervisor.request.out_dir) == out
    assert (out / "keep.txt").read_text() == "mine"


def test_explicit_empty_or_new_output_is_used(supervisor: FakeSupervisor, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["profile", "-o", "empty", "train.py"]) == exitcodes.OK
    assert main(["profile", "-o", "new/nested", "train.py"]) == exitcodes.OK
    assert [Path(r.out_dir) for r in supervisor.requests] == [Path("empty"), Path("new/nested")]
    assert (tmp_path / "new" / "nested" / "report.html").exists()


def test_unwritable_output_names_the_path(
    supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str]
) -> None:
    Path("afile").write_text("x")
    assert main(["profile", "-o", "afile", "train.py"]) == exitcodes.USAGE_ERROR
    assert "afile" in stderr_lines(capsys)[0]
    assert main(["profile", "-o", "afile/sub", "train.py"]) == exitcodes.USAGE_ERROR
    lines = stderr_lines(capsys)
    assert len(lines) == 1 and "afile/sub" in lines[0] and "cannot" in lines[0]


# ----------------------------------------------------------------------------------------- errors at the edge


def test_internal_error_is_reported_as_a_bug(
    supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MEMDOCTOR_DEBUG", raising=False)
    supervisor.raises = RuntimeError("boom\nsecond line")
    assert main(["profile", "train.py"]) == exitcodes.INTERNAL_ERROR
    err = capsys.readouterr().err
    assert "memdoctor: internal error: RuntimeError: boom second line" in err
    assert "this is a bug in memdoctor; please report it with the trace" in err
    assert "Traceback" not in err

    assert main(["--debug", "profile", "train.py"]) == exitcodes.INTERNAL_ERROR
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("MEMDOCTOR_DEBUG", "1")
    assert main(["profile", "train.py"]) == exitcodes.INTERNAL_ERROR
    assert "Traceback" in capsys.readouterr().err


def test_a_bug_in_the_terminal_table_keeps_the_exit_code(
    supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(SUMMARY, "steps_profiled", None)
    monkeypatch.setitem(SUMMARY, "peak_memory_bytes", "not a number")
    supervisor.exit_code = exitcodes.OUT_OF_MEMORY
    assert main(["profile", "train.py"]) == exitcodes.OUT_OF_MEMORY
    captured = capsys.readouterr()
    assert "internal error printing the summary" in captured.err and "Wrote " in captured.out


def test_memdoctor_error_carries_its_exit_code(
    supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str]
) -> None:
    supervisor.raises = TraceError("t.jsonl.gz: corrupt")
    assert main(["profile", "train.py"]) == exitcodes.TRACE_ERROR
    assert stderr_lines(capsys)[-1] == "memdoctor: error: t.jsonl.gz: corrupt"


def test_ctrl_c_exits_130(supervisor: FakeSupervisor, capsys: pytest.CaptureFixture[str]) -> None:
    supervisor.raises = KeyboardInterrupt()
    assert main(["profile", "train.py"]) == exitcodes.INTERRUPTED
    assert stderr_lines(capsys)[-1] == "memdoctor: interrupted"


# ----------------------------------------------------------------------------------------- report


def _write_trace(path: Path, **header: Any) -> Path:
    writer = TraceWriter(path, fsync=False)
    writer.write({**make_header(), **header})
    writer.write({"type": "end", "status": "completed", "message": "test trace"})
    writer.close()
    return path


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: None, "no such trace file"),
        (lambda p: p.write_bytes(b"not gzip at all"), "not a gzip file"),
        (lambda p: p.write_bytes(gzip.compress(b'{"type": "header"')[:-6]), "truncated"),
        (lambda p: _write_trace(p, format_version=99), "newer"),
    ],
    ids=["missing", "corrupt", "truncated", "future-version"],
)
def test_report_on_a_bad_trace_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Any, expected: str
) -> None:
    trace = tmp_path / "trace.jsonl.gz"
    make(trace)
    assert main(["report", str(trace)]) == exitcodes.TRACE_ERROR
    lines = stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("memdoctor: error: ") and expected in lines[0]
    assert not (tmp_path / "report.html").exists()


@pytest.fixture
def fake_report(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Fake ``write_report`` and ``build_summary`` (the report layer has its own tests); records out dirs."""
    out_dirs: list[Path] = []

    def write_report(trace: Any, out_dir: Path, summary: Any = None) -> dict[str, Path]:
        out_dirs.append(Path(out_dir))
        written = {name: Path(out_dir) / name for name in ("report.html", "summary.json")}
        for path in written.values():
            path.write_text("rendered")
        return written

    for name, attr, fn in [
        ("memdoctor.report", "write_report", write_report),
        ("memdoctor.report", "build_summary", lambda trace: SUMMARY),
    ]:
        try:
            module = importlib.import_module(name)
        except ImportError:
            module = types.ModuleType(name)
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(module, attr, fn, raising=False)
    return out_dirs


def test_report_refuses_a_folder_a_running_profile_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_report: list[Path]
) -> None:
    # A profile writing into its folder holds it (outputs.FolderClaim); a re-render there would race it.
    trace = _write_trace(tmp_path / "trace.jsonl.gz")
    other = tmp_path / "other"
    other.mkdir()
    for folder, args in [(tmp_path, []), (other, ["-o", str(other), "--force"])]:
        with FolderClaim(folder):  # this process stands in for the running profile
            assert main(["report", str(trace), *args]) == exitcodes.USAGE_ERROR
            lines = stderr_lines(capsys)
            assert len(lines) == 1 and f"{folder}: in use by memdoctor profile (pid {os.getpid()}" in lines[0]
    assert fake_report == []  # nothing was written
    assert main(["report", str(trace), "-o", str(other), "--force"]) == exitcodes.OK  # free again
    assert fake_report == [other]


def test_report_holds_its_folder_while_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_report: list[Path]
) -> None:
    trace = _write_trace(tmp_path / "trace.jsonl.gz")
    holders: list[Any] = []

    def write_report(trace: Any, out_dir: Path, summary: Any = None) -> dict[str, Path]:
        with pytest.raises(FolderHeld) as held:  # a profile starting now would be refused
            FolderClaim(Path(out_dir))
        holders.append(held.value.holder)
        return {}

    monkeypatch.setattr(importlib.import_module("memdoctor.report"), "write_report", write_report)
    for args in [[], ["-o", str(tmp_path / "out")], []]:  # beside the trace, -o, a rerender-N folder
        assert main(["report", str(trace), *args]) == exitcodes.OK
        (tmp_path / "report.html").write_text("a report: the next run takes rerender-1")
    assert [h["command"] for h in holders] == ["report"] * 3
    assert [h["pid"] for h in holders] == [os.getpid()] * 3
    for folder in (tmp_path, tmp_path / "out", tmp_path / "rerender-1"):
        assert not (folder / LOCK_NAME).exists()  # released once written


def test_report_writes_beside_the_trace_then_into_rerender(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_report: list[Path]
) -> None:
    trace = _write_trace(tmp_path / "trace.jsonl.gz")
    assert main(["report", str(trace)]) == exitcodes.OK
    assert main(["report", str(tmp_path)]) == exitcodes.OK  # the folder holding trace.jsonl.gz
    assert main(["report", str(trace), "--force"]) == exitcodes.OK
    assert fake_report == [tmp_path, tmp_path / "rerender-1", tmp_path]
    out = capsys.readouterr().out
    assert f"Wrote {tmp_path / 'rerender-1' / 'report.html'}" in out


def test_report_explicit_output_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_report: list[Path]
) -> None:
    trace = _write_trace(tmp_path / "t.jsonl.gz")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["report", str(trace), "-o", str(out)]) == exitcodes.USAGE_ERROR
    assert "--force" in stderr_lines(capsys)[0]
    assert main(["report", str(trace), "-o", str(out), "--force"]) == exitcodes.OK
    assert (out / "keep.txt").read_text() == "mine" and (out / "report.html").exists()


def test_report_renders_a_recorded_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real report layer on a BERT-shaped trace; the terminal names the blocks, not the wrappers."""
    from tracebuilder import GiB, TraceBuilder, bert_like

    builder = TraceBuilder(kind="cuda", budget_bytes=8 * GiB)
    builder.add_model(bert_like(layers=4))
    builder.add_steps(warmup=1, profiled=2)
    builder.end("completed")
    trace = builder.save(tmp_path / "trace.jsonl.gz")
    assert main(["report", str(trace)]) == exitcodes.OK
    assert (tmp_path / "report.html").stat().st_size > 0
    out = capsys.readouterr().out
    assert "biggest memory holders" in out and "bert.encoder.layer.0" in out
    table = out.split("biggest memory holders", 1)[1]
    assert "BertModel" not in table and "BertForSequenceClassification" not in table
    assert f"Wrote {tmp_path / 'report.html'}" in out and f"Wrote {tmp_path / 'summary.json'}" in out


# ----------------------------------------------------------------------------------------- end to end

TINY_LOOP = """
import sys
import torch

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
fail_at = int(sys.argv[1]) if len(sys.argv) > 1 else -1
for step in range(6):
    if step == fail_at:
        raise RuntimeError(f"failing at step {step} as asked")
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
@pytest.mark.parametrize(("script_args", "code"), [([], exitcodes.OK), (["1"], exitcodes.SCRIPT_FAILED)])
def test_profile_end_to_end(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    script_args: list[str],
    code: int,
) -> None:
    """The real supervisor and child on a tiny CPU loop: files written, exit code mapped, one line."""
    monkeypatch.chdir(tmp_path)
    Path("loop.py").write_text(TINY_LOOP)
    assert main(["profile", "--warmup", "0", "--steps", "2", "loop.py", *script_args]) == code
    out = capsys.readouterr().out
    for name in ("trace.jsonl.gz", "report.html", "summary.json"):
        assert (tmp_path / "memdoctor-report" / name).stat().st_size > 0
        assert f"Wrote {tmp_path / 'memdoctor-report' / name}" in out
    assert ("completed" if code == exitcodes.OK else "exception") in out


# ----------------------------------------------------------------------------------------- docs and smoke


def test_readme_documents_every_summary_key() -> None:
    from tracebuilder import TraceBuilder, tiny_mlp

    from memdoctor.report import build_summary

    builder = TraceBuilder(kind="cpu")
    builder.add_model(tiny_mlp())
    builder.add_steps(warmup=0, profiled=1)
    builder.end("completed")
    summary = build_summary(builder.build())
    readme = (REPO / "docs" / "summary-json.md").read_text()
    keys = [*summary, *summary["device"], *summary["categories"], *summary["layers"][0]]
    missing = sorted({k for k in keys if f"`{k}`" not in readme})
    assert not missing, f"summary.json keys missing from docs/summary-json.md: {missing}"


def test_readme_documents_every_exit_code() -> None:
    readme = (REPO / "README.md").read_text()
    for code, _ in exitcodes.TABLE:
        assert f"| {code} |" in readme, f"exit code {code} is missing from the README's table"


@pytest.mark.slow  # a child process
def test_python_dash_m_version() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "memdoctor", "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"memdoctor {__version__}"


@pytest.mark.slow  # a child process
def test_console_script_help() -> None:
    script = Path(sys.executable).parent / "memdoctor"
    assert script.exists(), f"console script missing at {script}; is memdoctor installed (pip install -e .)?"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "profile" in proc.stdout and "report" in proc.stdout


def test_a_closed_output_pipe_is_not_an_internal_error(capsys: pytest.CaptureFixture[str]) -> None:
    """``memdoctor plan TRACE --json | head``: the reader went away; memdoctor says nothing, exits 0."""
    import argparse

    from memdoctor.cli import _run_guarded

    def closed(ns: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    assert _run_guarded(argparse.Namespace(command_run=closed)) == 0
    assert "internal error" not in capsys.readouterr().err
