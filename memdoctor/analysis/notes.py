"""The reasons a trace gives for what it did not measure."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def collector_note(notes: Iterable[Any] | None, name: str) -> str | None:
    """Why collector ``name`` measured nothing: the reason of the first ``"NAME: reason"`` entry of a
    trace's ``not_measured`` notes (``memdoctor.capture.collectors.make_collectors`` writes them), or
    None. Also the ``collector_note`` filter of the report's templates."""
    prefix = f"{name}:"
    for note in notes or ():
        text = str(note)
        if text.startswith(prefix):
            return text[len(prefix) :].strip()
    return None
