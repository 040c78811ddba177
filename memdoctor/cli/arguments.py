"""What every command's parsing shares: the ``Command`` record, the parser class, the split of a
script's arguments from memdoctor's own, and the value types of the options."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memdoctor.errors import UsageError
from memdoctor.trace import TRACE_FILENAME

PROG = "memdoctor"
ORDER_HINT = (
    "memdoctor's own options go before the script, or between the script and --; the script's arguments "
    "follow the script, or the -- when there is one"
)


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, how to add its options and what it does."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    passes_args_through: bool = False  # everything after its target goes to the user's script


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose "unrecognized arguments" says where memdoctor's options go: a
    misplaced option is the usual cause."""

    def error(self, message: str) -> Any:
        if message.startswith("unrecognized arguments"):
            message = f"{message}\n({ORDER_HINT})"
        super().error(message)


# ------------------------------------------------------------------------------- the script's arguments


@dataclass(frozen=True)
class ScriptSplit:
    own: list[str]  # memdoctor's options (with -m MODULE)
    script: str | None
    script_args: list[str]
    separated: bool  # a -- separated memdoctor's options from the script's arguments


def split_script_args(parser: argparse.ArgumentParser, tokens: list[str]) -> ScriptSplit:
    """Split ``profile``'s tokens into memdoctor's options, the script (or ``-m MODULE``) and its arguments.

    The first positional token is the script. memdoctor's options come before it, or between it and a
    ``--``; the script's arguments are everything after that ``--``, or, when no ``--`` follows the
    script, everything after the script. A ``--`` before the script ends memdoctor's options: the next
    token is the script and the rest is passed as is. ``-m MODULE`` stands where the script would.
    """
    own: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":
            rest = tokens[i + 1 :]
            return ScriptSplit(own, (rest[0] if rest else None), rest[1:], separated=True)
        if tok == "-m" or (tok.startswith("-m") and not tok.startswith("--")):
            n = 2 if tok == "-m" else 1
            return _after_target([*own, *tokens[i : i + n]], None, tokens[i + n :])
        if not tok.startswith("-") or tok == "-":
            return _after_target(own, tok, tokens[i + 1 :])
        own.append(tok)
        if _takes_value(parser, tok) and i + 1 < len(tokens):
            own.append(tokens[i + 1])
            i += 1
        i += 1
    return ScriptSplit(own, None, [], separated=False)


def _after_target(own: list[str], script: str | None, rest: list[str]) -> ScriptSplit:
    if "--" not in rest:
        return ScriptSplit(own, script, rest, separated=False)
    j = rest.index("--")
    return ScriptSplit([*own, *rest[:j]], script, rest[j + 1 :], separated=True)


def _takes_value(parser: argparse.ArgumentParser, tok: str) -> bool:
    action = parser._option_string_actions.get(tok)  # argparse keeps no public lookup
    return action is not None and action.nargs != 0


# ----------------------------------------------------------------------------------------- value types


def arg_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """Turn a converter that raises ``UsageError``/``ValueError`` into an argparse type (exit 2)."""

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except (UsageError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = convert.__name__
    return parse


def count(minimum: int) -> Callable[[str], int]:
    """A whole number of at least ``minimum`` (steps, rounds)."""

    def count(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise ValueError(f"must be at least {minimum}, got {value}")
        return value

    return count


def seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"must be a positive number of seconds, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def trace_file(path: Path) -> Path:
    """The TRACE that ``report`` and ``plan`` take: a trace file, or the folder holding one."""
    if path.is_dir() and (path / TRACE_FILENAME).is_file():
        return path / TRACE_FILENAME
    return path


# ------------------------------------------------------------------------------- multi-process jobs


def add_launch_options(p: argparse.ArgumentParser) -> None:
    """``--nproc-per-node N`` and the rendezvous options, passed to ``torch.distributed.run``."""
    group = p.add_argument_group("multi-process jobs (torch.distributed.run; docs/distributed.md)")
    group.add_argument(
        "--nproc-per-node",
        metavar="N",
        help="start N processes on this node through torch.distributed.run, each a rank with torchrun's "
        "RANK, LOCAL_RANK and WORLD_SIZE (a script written for torchrun runs unedited); each rank is run "
        "as one process would be",
    )
    group.add_argument("--nnodes", metavar="N|MIN:MAX", help="nodes in the job (default: 1)")
    group.add_argument("--node-rank", metavar="K", help="this node's rank, with --nnodes (static rendezvous)")
    group.add_argument("--master-addr", metavar="HOST", help="the rendezvous host (rank 0's node)")
    group.add_argument("--master-port", metavar="PORT", help="the rendezvous port on --master-addr")


_LAUNCH_OPTIONS = ("nnodes", "node_rank", "master_addr", "master_port")


def rank_job(ns: argparse.Namespace) -> Any:
    """The job the options ask for (``memdoctor.launch.ranks.RankJob``), or None for one process;
    a usage error (one line, exit 2) for a value torchrun would refuse."""
    given = [name for name in _LAUNCH_OPTIONS if getattr(ns, name, None) is not None]
    if ns.nproc_per_node is None:
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UsageError(f"{flag} is for a multi-process job: give --nproc-per-node N too")
        return None
    from memdoctor.launch.ranks import RankJob

    return RankJob(
        nproc_per_node=_whole(ns.nproc_per_node, "--nproc-per-node", 1),
        nnodes=_nodes(ns.nnodes),
        node_rank=None if ns.node_rank is None else _whole(ns.node_rank, "--node-rank", 0),
        master_addr=_host(ns.master_addr),
        master_port=None if ns.master_port is None else _port(ns.master_port),
    )


def _whole(text: str, flag: str, minimum: int) -> int:
    if not text.strip().isdigit() or int(text) < minimum:
        raise UsageError(f"{flag} takes a whole number of at least {minimum}, not {text!r}")
    return int(text)


def _nodes(text: str | None) -> str:
    if text is None:
        return "1"
    low, sep, high = text.partition(":")
    parts = [low, high] if sep else [low]
    if not all(p.isdigit() and int(p) >= 1 for p in parts) or (sep and int(low) > int(high)):
        raise UsageError(f"--nnodes takes N or MIN:MAX (whole numbers of at least 1), not {text!r}")
    return text


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise UsageError(f"--master-port takes a port number from 1 to 65535, not {text!r}")
    return int(text)


def _host(text: str | None) -> str | None:
    if text is not None and (not text.strip() or any(c.isspace() for c in text)):
        raise UsageError(f"--master-addr takes a host name or address, not {text!r}")
    return text


def add_gpus(p: argparse.ArgumentParser) -> None:
    """``plan``'s ``--gpus N``: the cards (one process each) the plan spreads the step over."""
    p.add_argument(
        "--gpus",
        type=arg_type(count(1)),
        metavar="N",
        help="plan for N cards of the budget each (DDP, FSDP2, FSDP2 with CPU offload; the batch split "
        "over them): per-card peak and step time, and how many cards are needed when N are not; "
        "default: the ranks of the traced job, else 1",
    )
