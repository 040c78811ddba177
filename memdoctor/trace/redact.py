"""Secrets never reach a trace: the one place that finds and redacts them.

A trace is a file people attach to bug reports, and the summary, the report and the terminal lines are
all made from it, so what is kept out of the trace is kept out of every output. ``TraceWriter`` passes
every record but the bulky numeric ones (steps, model tables) through ``redact_record`` before writing
it: the header's command line (``redact_argv``), event and end messages, exception tracebacks,
collector notes. What is redacted, everywhere, as ``<redacted>``:

- the value of a flag whose name holds ``token``, ``pass``, ``secret``, ``key``, ``auth``, ``cred``,
  ``bearer`` or ``pat`` (``pat`` as a word of its own: not ``path``), as ``--x Y``, ``--x=Y`` and
  ``X=Y``, and quoted (``'api_key': 'Y'``) in a message;
- the user information of a URL (``https://user:password@host``);
- values shaped like well-known tokens: Hugging Face ``hf_...``, GitHub ``ghp_...``/``github_pat_...``,
  AWS access key ids ``AKIA...``, OpenAI ``sk-...``, ``Bearer ...``, and 40 hex digits after a W&B
  (``wandb``) name;
- the value of every environment variable whose name looks secret (the same words), wherever it
  appears: a token the script read from ``HF_TOKEN`` and put in its own exception message is caught
  even though it has no known shape.

Names that only look secret (``--max-tokens``, ``--tokenizer``, ``--author``, ``--num-passes``) keep
their values; a value that begins with ``-`` is taken for the next flag, not for a secret.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "<redacted>"
SECRET_WORDS = ("token", "pass", "secret", "key", "auth", "cred", "bearer")
# Words of a name that hold a secret word but name no secret (compared whole, lowercased).
HARMLESS_WORDS = frozenset(
    (
        "tokenizer",
        "tokenizers",
        "tokenize",
        "tokenized",
        "tokens",
        "passes",
        "bypass",
        "author",
        "authors",
        "keyword",
        "keywords",
        "keyframe",
        "keyframes",
    )
)
MIN_ENV_SECRET = 6  # shorter environment values ("1", "false") are not searched for in text

_WORD_SPLIT = re.compile(r"[^a-z0-9]+")
_TOKEN_SHAPES = re.compile(
    r"\bhf_[A-Za-z0-9]{20,}"
    r"|\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{30,}"
    r"|\bgithub_pat_[A-Za-z0-9_]{20,}"
    r"|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"
    r"|\bsk-(?:proj-|ant-|svcacct-)?[A-Za-z0-9_-]{20,}"
)
_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{6,}")
_WANDB_KEY = re.compile(r"(?i)(wandb[\w.-]*(?:\s+[\w-]+)?(?:\s*[=:]\s*|\s+)['\"]?)[0-9a-f]{40}\b")
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@?#]+@")
_FLAG_VALUE = re.compile(r"(?<![\w-])(--?[A-Za-z][\w.-]*)(=|\s+)(?!-)(['\"]?)([^\s'\";,]+)")
_NAME_VALUE = re.compile(r"\b([A-Za-z_][\w.-]*)=(['\"]?)([^\s'\",;&]+)")
_QUOTED_PAIR = re.compile(r"(['\"])([\w.-]+)\1(\s*:\s*)(['\"])([^'\"]*)\4")


def is_secret_name(name: str) -> bool:
    """Whether a flag or variable named ``name`` holds a secret (``--hf-token``, ``DB_PASSWORD``,
    ``apiKey``, ``GITHUB_PAT``), and not one that only looks so (``--max-tokens``, ``PATH``)."""
    for word in _WORD_SPLIT.split(name.lower()):
        if word in ("pat", "pats"):
            return True
        if word not in HARMLESS_WORDS and any(s in word for s in SECRET_WORDS):
            return True
    return False


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of the environment's secret-looking variables, longest first (so that a value
    containing another is replaced whole)."""
    env = os.environ if environ is None else environ
    values = {v for k, v in env.items() if is_secret_name(k) and len(v) >= MIN_ENV_SECRET}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every secret this module knows replaced by ``<redacted>``; ``secrets`` are
    values to remove wherever they appear (``secret_values()``)."""
    for value in secrets:
        if value in text:
            text = text.replace(value, REDACTED)
    text = _URL_USERINFO.sub(rf"\g<1>{REDACTED}@", text)
    text = _TOKEN_SHAPES.sub(REDACTED, text)
    text = _BEARER.sub(rf"\g<1>{REDACTED}", text)
    text = _WANDB_KEY.sub(rf"\g<1>{REDACTED}", text)
    text = _FLAG_VALUE.sub(_flag_value, text)
    text = _NAME_VALUE.sub(_name_value, text)
    return _QUOTED_PAIR.sub(_quoted_pair, text)


def _flag_value(m: re.Match[str]) -> str:
    if not is_secret_name(m.group(1)) or m.group(4) == REDACTED:
        return m.group(0)
    return f"{m.group(1)}{m.group(2)}{m.group(3)}{REDACTED}"


def _name_value(m: re.Match[str]) -> str:
    if not is_secret_name(m.group(1)) or m.group(3) == REDACTED:
        return m.group(0)
    return f"{m.group(1)}={m.group(2)}{REDACTED}"


def _quoted_pair(m: re.Match[str]) -> str:
    if not is_secret_name(m.group(2)) or m.group(5) == REDACTED:
        return m.group(0)
    return f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{m.group(4)}{REDACTED}{m.group(4)}"


def redact_argv(args: list[str], secrets: Iterable[str] | None = None) -> list[str]:
    """A command line with secrets redacted: the value after or in a secret-named flag (``--x Y``,
    ``--x=Y``, ``X=Y``), a W&B key after a ``wandb`` flag, and every secret ``redact_text`` finds."""
    found = secret_values() if secrets is None else list(secrets)
    out: list[str] = []
    after: str | None = None  # the flag whose value comes next
    for arg in args:
        if after is not None and not arg.startswith("-"):
            secret = is_secret_name(after) or ("wandb" in after.lower() and _is_hex40(arg))
            after = None
            if secret:
                out.append(REDACTED)
                continue
        after = None
        name, eq, value = arg.partition("=")
        if (eq and is_secret_name(name.lstrip("-"))) or (eq and "wandb" in name.lower() and _is_hex40(value)):
            out.append(f"{name}={REDACTED}")
        else:
            if arg.startswith("-") and not eq:
                after = arg
            out.append(redact_text(arg, found))
    return out


def _is_hex40(value: str) -> bool:
    return len(value) == 40 and all(c in "0123456789abcdefABCDEF" for c in value)


# Record types passed as they are: they hold figures and module names only, and are the bulk of a trace.
_FIGURE_RECORDS = frozenset(("step", "model"))


def redact_record(record: dict[str, Any], secrets: Iterable[str] | None = None) -> dict[str, Any]:
    """``record`` with its text redacted (a new dict; the record passed in is not changed); step and
    model records pass as they are."""
    if record.get("type") in _FIGURE_RECORDS:
        return record
    found = secret_values() if secrets is None else list(secrets)
    out = _redact_value(record, found)
    command = out.get("command") if record.get("type") == "header" else None
    if isinstance(command, dict) and isinstance(command.get("argv"), list):
        command["argv"] = redact_argv([str(a) for a in command["argv"]], found)
    return out


def _redact_value(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, str):
        return redact_text(value, secrets)
    if isinstance(value, dict):
        return {k: _redact_value(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact_value(v, secrets) for v in value]
    return value
