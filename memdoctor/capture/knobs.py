"""The script's own batch-size and accumulation knobs: ``argparse`` options, or config variables that a
configurator sets from ``--name=value`` in argv.

``ArgparseWatch`` records the options an ``argparse`` parser knows and the values it parsed.

nanoGPT's shape has no argparse: ``train.py`` sets module-level globals (``batch_size = 12``,
``gradient_accumulation_steps = 40``) and then runs ``exec(open('configurator.py').read())``, which
reads ``--name=value`` entries of ``sys.argv`` and overrides the matching globals. Passing
``--batch_size=3 --gradient_accumulation_steps=160`` is what an expert would type; memdoctor may propose
it only where it is known to work. So nothing is guessed from names alone: ``ConfiguratorWatch`` sees
each code object the script ``exec``s at its module level that reads ``argv`` (through the ``exec``
audit event, which observes without changing anything: no patch of ``builtins.exec``), with a copy of
the script's plain globals as they were before it ran. ``trial_knobs`` then runs that code again on
copies of those globals, once with the script's own argv and once with ``--name=value`` overrides
appended, its output discarded, and keeps a knob only where the override came back as the global's
new value.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import sys
import types
from collections.abc import Callable
from typing import Any

from memdoctor.patching import Undo, wrap_attr

BATCH_KNOB = re.compile(r"^(?:train_|per_device_train_|micro_)?batch_?size$")
ACCUMULATION_KNOB = re.compile(
    r"^(?:gradient_accumulation_steps|grad_accum(?:ulation)?(?:_steps)?|accumulation_steps|accum(?:_steps)?)$"
)


@dataclasses.dataclass
class Knobs:
    """The script's batch-size and accumulation options (as typed: ``--batch-size``) and their values;
    ``style`` says how ``memdoctor run`` passes them (``memdoctor.levers.scriptargs``)."""

    batch_option: str | None = None
    batch_value: int | None = None
    accumulation_option: str | None = None
    accumulation_value: int | None = None
    style: str = "argparse"  # or "argv": config variables set by --name=value (``trial_knobs``)

    def as_field(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def knobs_of(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> Knobs:
    """The batch-size and accumulation options of ``parser`` with the values parsed into ``namespace``
    (an int option only: a value memdoctor run can set by passing the option again)."""
    knobs = Knobs()
    for action in parser._actions:  # argparse has no public list of a parser's options
        longs = [s for s in action.option_strings if s.startswith("--")]
        value = getattr(namespace, action.dest, None)
        if not longs or not isinstance(value, int) or isinstance(value, bool):
            continue
        name = action.dest.lower().replace("-", "_")
        if knobs.batch_option is None and BATCH_KNOB.match(name):
            knobs.batch_option, knobs.batch_value = longs[0], value
        elif knobs.accumulation_option is None and ACCUMULATION_KNOB.match(name):
            knobs.accumulation_option, knobs.accumulation_value = longs[0], value
    return knobs


class ArgparseWatch:
    """Records the knobs of every ``ArgumentParser.parse_known_args`` call (``parse_args`` goes through
    it) while installed; ``on_knobs`` is called with each parse that found a batch-size option."""

    def __init__(self, on_knobs: Callable[[Knobs], None]) -> None:
        self._on_knobs = on_knobs

    def install(self) -> Undo:
        watch = self

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def parse_known_args(parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
                result = original(parser, *args, **kwargs)
                watch._seen(parser, result)
                return result

            return parse_known_args

        return wrap_attr(argparse.ArgumentParser, "parse_known_args", make)

    def _seen(self, parser: argparse.ArgumentParser, result: Any) -> None:
        try:
            knobs = knobs_of(parser, result[0])
        except Exception:  # never into the script's argument parsing
            return
        if knobs.batch_option is not None:
            self._on_knobs(knobs)


# ----------------------------------------------------------------------------------------- configurators

# What a trial copies of the script's globals: plain values (the configurator compares types) and
# modules (one that uses the script's ``sys`` or ``os`` without importing it); never tensors or models.
_PLAIN = (int, float, str, bool, type(None), types.ModuleType)


@dataclasses.dataclass(frozen=True)
class Configurator:
    """One module-level ``exec`` of code that reads ``argv``: the code, the script's plain globals and
    its argv at that moment."""

    code: types.CodeType
    globals: dict[str, Any]
    argv: list[str]


def reads_argv(code: types.CodeType) -> bool:
    """Whether ``code`` (or code nested in it) names ``argv``."""
    if "argv" in code.co_names:
        return True
    return any(isinstance(c, types.CodeType) and reads_argv(c) for c in code.co_consts)


# One audit hook for the process (audit hooks cannot be removed): it calls the watches started now.
_LISTENERS: list[Callable[[types.CodeType, types.FrameType], None]] = []
_HOOKED = False
_IN_TRIAL = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "exec" or not _LISTENERS or _IN_TRIAL:
        return
    code = args[0] if args else None
    if not isinstance(code, types.CodeType):
        return
    try:
        frame = sys._getframe(1)  # the frame that called exec (exec itself is C: no frame of its own)
    except ValueError:
        return
    for listener in list(_LISTENERS):
        listener(code, frame)


class ConfiguratorWatch:
    """Collects the ``Configurator``s of the script while started (``start`` returns the stop)."""

    def __init__(self) -> None:
        self.found: list[Configurator] = []

    def start(self) -> Callable[[], None]:
        global _HOOKED
        if not _HOOKED:
            sys.addaudithook(_audit)
            _HOOKED = True
        _LISTENERS.append(self._seen)
        return lambda: _LISTENERS.remove(self._seen) if self._seen in _LISTENERS else None

    def _seen(self, code: types.CodeType, frame: types.FrameType) -> None:
        try:
            module_level = frame.f_code.co_name == "<module>" and frame.f_globals is frame.f_locals
            if not module_level or not reads_argv(code) or len(self.found) >= 4:
                return
            found = frame.f_globals.items()
            plain = {k: v for k, v in found if isinstance(v, _PLAIN) and not k.startswith("__")}
            if any(BATCH_KNOB.match(k) and _count(v) for k, v in plain.items()):
                self.found.append(Configurator(code, plain, list(sys.argv)))
        except Exception:  # never into the script's exec
            return


def trial_knobs(found: Configurator) -> Knobs | None:
    """The knobs ``found`` really sets from ``--name=value`` (module docstring); None when the batch
    size cannot be set that way."""
    base = _trial(found, [])
    if base is None:
        return None
    names = _knob_names(base)
    if names[0] is None:
        return None
    overrides = {n: base[n] + 1 for n in names if n is not None}
    after = _trial(found, [f"--{n}={v}" for n, v in overrides.items()])
    if after is None:
        return None
    took = {n for n, v in overrides.items() if after.get(n) == v and type(after.get(n)) is int}
    batch, accumulation = (n if n in took else None for n in names)
    if batch is None:
        return None
    return Knobs(
        batch_option=f"--{batch}",
        batch_value=base[batch],
        accumulation_option=f"--{accumulation}" if accumulation else None,
        accumulation_value=base[accumulation] if accumulation else None,
        style="argv",
    )


def _knob_names(values: dict[str, Any]) -> tuple[str | None, str | None]:
    batch = next((k for k, v in values.items() if BATCH_KNOB.match(k) and _count(v)), None)
    accumulation = next((k for k, v in values.items() if ACCUMULATION_KNOB.match(k) and _count(v)), None)
    return batch, accumulation


def _count(value: Any) -> bool:
    return type(value) is int and value > 0


def _trial(found: Configurator, extra: list[str]) -> dict[str, Any] | None:
    """The globals after running ``found.code`` on a copy of its globals, with ``extra`` appended to its
    argv; None when it raised or exited (its assertions refused the values)."""
    global _IN_TRIAL
    scratch: dict[str, Any] = {**found.globals, "__builtins__": __builtins__, "__name__": "__main__"}
    argv, _IN_TRIAL = sys.argv, True
    sys.argv = [*found.argv, *extra]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            exec(found.code, scratch)
    except (Exception, SystemExit):  # a configurator that refuses (assert, sys.exit): not a knob
        return None
    finally:
        sys.argv, _IN_TRIAL = argv, False
    return scratch
