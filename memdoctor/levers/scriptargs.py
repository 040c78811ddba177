"""Micro-batching through the script's own arguments (``accumulation_split: arguments``).

A script that draws its batches without a DataLoader (a nanoGPT-style ``get_batch()``) gives memdoctor
nothing to split; but when it exposes a batch-size and a gradient-accumulation argument, smaller
batches and more accumulation steps with the same effective batch is what an expert would type:
``train.py --batch_size 3 --gradient_accumulation_steps 4`` instead of ``--batch_size 12``. The config
carries those options (``script_args``); ``memdoctor run`` (and ``profile --config``) adds them to the
arguments of every ``argparse`` parser that knows both options and parses the command line, after the
user's own (argparse keeps the last value given), so the script parses them as if typed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from memdoctor.patching import Undo, wrap_attr


class ScriptArguments:
    """Adds ``args`` (``--option value`` pairs) to each parse of the command line by a parser that knows
    every option; ``applied`` counts those parses (zero at the end: the run says it did not apply)."""

    def __init__(self, args: Sequence[str]) -> None:
        self.args = list(args)
        self.options = [a for a in self.args if a.startswith("-")]
        self.applied = 0

    def install(self) -> Undo:
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

    def knows(self, parser: argparse.ArgumentParser) -> bool:
        known = parser._option_string_actions  # argparse has no public map of a parser's options
        return bool(self.options) and all(o in known for o in self.options)

    def describe(self) -> str:
        return (
            f"micro-batching through the script's own arguments: {' '.join(self.args)} (added to its "
            "command line; the effective batch and its optimizer steps are unchanged)"
        )
