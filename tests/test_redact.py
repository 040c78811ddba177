"""Secrets on the command line never reach the trace."""

from __future__ import annotations

from memdoctor.trace.redact import redact_argv


def test_secret_flags_are_redacted_in_both_spellings() -> None:
    argv = ["--lr", "3e-5", "--hf-token", "hf_abc", "--api-key=sk-123", "--password", "pw", "--epochs", "2"]
    assert redact_argv(argv) == [
        "--lr",
        "3e-5",
        "--hf-token",
        "<redacted>",
        "--api-key=<redacted>",
        "--password",
        "<redacted>",
        "--epochs",
        "2",
    ]


def test_environment_style_assignments_are_redacted() -> None:
    assert redact_argv(["HF_TOKEN=hf_abc", "WANDB_API_KEY=x"]) == [
        "HF_TOKEN=<redacted>",
        "WANDB_API_KEY=<redacted>",
    ]


def test_plain_arguments_are_kept() -> None:
    argv = ["train.py", "--batch-size", "32", "data/tokens.bin"]
    assert redact_argv(argv) == argv
