"""Secrets never reach the trace, and so no output made from it (issue 19, point 5): each form of a
planted secret, then the whole path from a writer to the summary, the report and memdoctor.yaml."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from memdoctor.report import write_report
from memdoctor.trace import TraceWriter, event_record, load_trace, make_end, make_header
from memdoctor.trace.redact import (
    REDACTED,
    is_secret_name,
    redact_argv,
    redact_record,
    redact_text,
    secret_values,
)
from tests.tracebuilder import GiB, TraceBuilder, bert_like

HF = "hf_" + "PlantedHuggingFaceToken1234567"
GH = "ghp_" + "PlantedGitHubToken0123456789abcdefghij"
GH_PAT = "github_pat_" + "11PlantedFineGrainedToken_abc"
AWS = "AKIA" + "PLANTEDAWSKEY123"
OPENAI = "sk-proj-" + "PlantedOpenAIKey-abcdefghijk"
WANDB = "0123456789abcdef0123456789abcdef01234567"
ENV_SECRET = "PlantedEnvValue-9f8e7d"


def test_secret_flags_are_redacted_in_both_spellings() -> None:
    argv = ["--lr", "3e-5", "--hf-token", "hf_abc", "--api-key=sk-123", "--password", "pw", "--epochs", "2"]
    assert redact_argv(argv, []) == [
        "--lr",
        "3e-5",
        "--hf-token",
        REDACTED,
        "--api-key=" + REDACTED,
        "--password",
        REDACTED,
        "--epochs",
        "2",
    ]


@pytest.mark.parametrize(
    "flag",
    ["--db-pass", "--auth", "--credentials", "--pat", "--bearer", "--client-secret", "--ssh-key", "--gh_pat"],
)
def test_every_secret_word_redacts_its_value(flag: str) -> None:
    assert redact_argv([flag, "planted1", f"{flag}=planted2"], []) == [flag, REDACTED, f"{flag}={REDACTED}"]


def test_environment_style_assignments_are_redacted() -> None:
    assert redact_argv(["HF_TOKEN=hf_abc", "WANDB_API_KEY=x"], []) == [
        f"HF_TOKEN={REDACTED}",
        f"WANDB_API_KEY={REDACTED}",
    ]


def test_plain_arguments_and_names_that_only_look_secret_are_kept() -> None:
    argv = ["train.py", "--batch-size", "32", "data/tokens.bin", "--max-tokens", "512", "--tokenizer", "gpt2"]
    argv += ["--data-path", "/d", "--patience", "3", "--author", "me", "--num-passes", "2"]
    assert redact_argv(argv, []) == argv


def test_a_flag_without_a_value_does_not_swallow_the_next_flag() -> None:
    assert redact_argv(["--no-auth", "--lr", "0.1"], []) == ["--no-auth", "--lr", "0.1"]


def test_url_user_info_and_token_shapes_are_redacted_anywhere() -> None:
    argv = ["--data", "https://bob:hunter2@example.com/x", HF, f"--model={GH}", GH_PAT, AWS, OPENAI]
    out = redact_argv(argv, [])
    assert out == [
        "--data",
        f"https://{REDACTED}@example.com/x",
        REDACTED,
        f"--model={REDACTED}",
        *[REDACTED] * 3,
    ]


def test_a_wandb_key_after_a_wandb_flag_is_redacted() -> None:
    assert redact_argv(["--wandb", WANDB, "--wandb-id=" + WANDB, "--seed", WANDB[:8]], []) == [
        "--wandb",
        REDACTED,
        f"--wandb-id={REDACTED}",
        "--seed",
        WANDB[:8],
    ]
    assert WANDB not in redact_text(f"wandb login {WANDB}")


def test_secret_names() -> None:
    for name in ("HF_TOKEN", "WANDB_API_KEY", "apiKey", "DB_PASSWORD", "GITHUB_PAT", "AWS_SECRET_ACCESS_KEY"):
        assert is_secret_name(name), name
    for name in ("PATH", "TOKENIZERS_PARALLELISM", "max_tokens", "patience", "CUDA_VISIBLE_DEVICES"):
        assert not is_secret_name(name), name


def test_the_environments_secret_values_are_scrubbed_from_text() -> None:
    env = {
        "MY_SERVICE_TOKEN": ENV_SECRET,
        "TOKENIZERS_PARALLELISM": "false",
        "PATH": "/usr/bin",
        "X_KEY": "1",
    }
    assert secret_values(env) == [ENV_SECRET]
    text = f"RuntimeError: login refused for {ENV_SECRET} (retry)"
    assert redact_text(text, secret_values(env)) == f"RuntimeError: login refused for {REDACTED} (retry)"


def test_messages_keep_their_words() -> None:
    for text in ("KeyError: 'weight'", "expected a non-key argument", "--lr 0.1 is too high", "tokens=512"):
        assert redact_text(text, []) == text


def test_secrets_in_messages_in_each_form() -> None:
    text = (
        f"failed: --db-pass hunter2; url https://u:p@h.io?api_key=zz9; Authorization: Bearer abc.def.ghi; "
        f"{{'password': 'pw1'}}; token={HF}"
    )
    out = redact_text(text, [])
    for secret in ("hunter2", "u:p", "zz9", "abc.def.ghi", "pw1", HF):
        assert secret not in out, secret
    assert out.startswith("failed: --db-pass <redacted>; url https://<redacted>@h.io")


def test_step_and_model_records_pass_untouched() -> None:
    step = {"type": "step", "step": 0, "note": HF}
    assert redact_record(step, []) is step


def _planted_trace(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace written through ``TraceWriter`` with secrets planted in each place a trace records text."""
    monkeypatch.setenv("MY_SERVICE_TOKEN", ENV_SECRET)
    b = TraceBuilder(kind="cuda", budget_bytes=4 * GiB)
    b.add_model(bert_like(layers=2, seq=64))
    b.add_steps(warmup=1, profiled=2)
    b.header["command"] = {
        "argv": [
            "--db-pass",
            "hunter2",
            "--auth=planted-auth",
            "--pat",
            GH,
            "--data",
            "s3://k:planted-s3@b/x",
            HF,
        ],
        "script": "train.py",
        "module": None,
        "cwd": "/work",
    }
    trace = b.end("completed").build()
    writer = TraceWriter(path)
    for rec in trace.records()[:-1]:
        writer.write(rec)
    message = f"RuntimeError: could not log in with {ENV_SECRET} or {OPENAI}"
    writer.write(event_record("note", message, None, traceback=[f'  token = "{AWS}"', f"wandb {WANDB}"]))
    writer.write(
        {"type": "end", **make_end(status="completed", message=message, steps_recorded=2, duration_s=1)}
    )
    writer.close()


PLANTED = ("hunter2", "planted-auth", GH, "planted-s3", HF, ENV_SECRET, OPENAI, AWS, WANDB)


def test_no_planted_secret_reaches_any_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "trace.jsonl.gz"
    _planted_trace(path, monkeypatch)
    trace = load_trace(path)
    out = tmp_path / "out"
    out.mkdir()
    written = write_report(trace, out)
    assert {"summary", "report"} <= set(written)
    texts = {"trace": gzip.decompress(path.read_bytes()).decode()}
    texts.update({name: p.read_text() for name, p in written.items()})
    for name, text in texts.items():
        for secret in PLANTED:
            assert secret not in text, f"a planted secret ({secret[:12]}...) reached {name}"
    assert REDACTED in texts["trace"] and "--db-pass" in texts["trace"]


def test_a_header_made_by_make_header_is_redacted_when_written(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    writer = TraceWriter(path)
    writer.write(make_header(command={"argv": ["--token", "planted-tok"], "script": "t.py"}))
    writer.close()
    assert b"planted-tok" not in gzip.decompress(path.read_bytes())
