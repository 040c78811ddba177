"""Micro-batching through the script's own arguments (``accumulation_split: arguments``).

A script that draws its batches without a DataLoader (a nanoGPT-style ``get_batch()``) gives memdoctor
nothing to split; but when it exposes a batch-size and a gradient-accumulation knob, smaller batches and
more accumulation steps with the same effective batch is what an expert would type:
``train.py --batch_size 3 --gradient_accumulation_steps 4`` instead of ``--batch_size 12``. The config
carries those options (``script_args``), in one of two forms, as the profile found the knobs
(``memdoctor.capture.knobs``):

- ``--option value`` pairs, for ``argparse`` options: ``memdoctor run`` (and ``profile --config``) adds
  them to the arguments of every parser that knows both options and parses the command line, after
  the user's own (argparse keeps the last value given), so the script parses them as if typed, and a
  second parser of the script that does not know them is left alone;
- ``--name=value`` entries, for config variables set by a configurator that reads ``sys.argv`` (nanoGPT's
  ``configurator.py``, which has no parser to hook): they are appended to the script's command line
  itself (``argv_args``, by the launcher), and whether they took is read back from the script's
  globals when its model is found (``check``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from memdoctor.patching import Undo, wrap_attr


def is_argv_form(args: Sequence[str]) -> bool:
    """Whether ``args`` are all ``--name=value`` entries (the configurator form)."""
    return bool(args) and all(a.startswith("--") and "=" in a for a in args)


class ScriptArguments:
    """Adds ``args`` to the script's command line, as its knobs are read (module docstring);
    ``applied`` counts the parses that got them, or is 1 once the script's globals hold the values
    (zero at the end: the run says it did not apply)."""

    def __init__(self, args: Sequence[str]) -> None:
        self.args = list(args)
        self.argv_form = is_argv_form(self.args)
        self.options = [a.split("=", 1)[0] if self.argv_form else a for a in self.args if a.startswith("-")]
        self.applied = 0
        self.unequal: list[str] = []  # with the argv form: the globals that did not take the values

    def install(self) -> Undo:
        if self.argv_form:
            return lambda: None  # the launcher appends them (argv_args): sys.argv is set after install
        lever = self

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def parse_known_args(
                parser: argparse.ArgumentParser, args: Any = None, *rest: Any, **kw: Any
            ) -> Any:
                if args is None and lever.knows(parser):
                    args = [*sys.argv[1:], *lever.args]
                    lever.applied += 1
                return original(parser, args, *rest, **kw)

            return parse_known_args

        return wrap_attr(argparse.ArgumentParser, "parse_known_args", make)

    def argv_args(self) -> list[str]:
        """What the launcher appends to the script's ``sys.argv`` (the argv form only)."""
        return list(self.args) if self.argv_form else []

    def check(self, script_globals: dict[str, Any]) -> None:
        """With the argv form: whether the script's globals now hold the values passed (a configurator
        read them); called when the model is found, after the script configured itself."""
        if not self.argv_form or self.applied:
            return
        self.unequal = []
        for arg in self.args:
            name, value = arg[2:].split("=", 1)
            if str(script_globals.get(name)) != value:
                self.unequal.append(f"{name} is {script_globals.get(name)!r}, not {value}")
        self.applied = 0 if self.unequal else 1

    def knows(self, parser: argparse.ArgumentParser) -> bool:
        known = parser._option_string_actions  # argparse has no public map of a parser's options
        return bool(self.options) and all(o in known for o in self.options)

    def not_applied(self) -> str:
        """The end-of-run note when the arguments never took."""
        if not self.argv_form:
            return "no argparse parser of the script knows " + " ".join(self.options)
        if self.unequal:
            return "the script's globals did not take the values passed: " + "; ".join(self.unequal)
        return "the script built no model after its configurator ran, so the values were never read back"

    def describe(self) -> str:
        where = "appended to its command line" if self.argv_form else "added to its command line"
        return (
            f"micro-batching through the script's own arguments: {' '.join(self.args)} ({where}; the "
            "effective batch and its optimizer steps are unchanged)"
        )
