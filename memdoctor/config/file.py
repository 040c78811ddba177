"""``memdoctor.yaml``: the plan as a versioned, schema-checked file a person can read and edit.

Why a file of its own: a plan is only useful when it can be applied (``memdoctor.apply``) or exported
(``memdoctor.config.export``) without re-running the planner, and reviewed in a pull request. The file
is data only: it is parsed with ``yaml.safe_load`` after a token scan that refuses every YAML tag
(``!!python/object`` and friends, but also ``!!str``: a config never needs one) and every alias (no
"billion laughs" expansion), so loading it can never construct an object or run code. Every field is
checked; the first problem is reported as one line (``ConfigError``, exit code 2 on the command line).

Field by field: ``docs/config.md``.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from memdoctor.errors import ConfigError
from memdoctor.plan.config import OPTIMIZERS, PADDING_POLICIES, PARALLEL, PRECISIONS
from memdoctor.units import first_names

CONFIG_VERSION = 1
CONFIG_FILENAME = "memdoctor.yaml"
MAX_CONFIG_BYTES = 1 << 20  # a real config is a few KiB; refuse anything that could exhaust memory

ATTENTION = ("eager", "sdpa", "flash_attention_2")
# Where micro-batching splits the batch (docs/config.md): inside the model's forward (which returns the
# loss), at the DataLoader (the loop computes the loss), or through the script's own batch-size and
# accumulation arguments (``script_args``).
ACCUMULATION_SPLITS = ("forward", "loader", "arguments")


@dataclass(frozen=True)
class GradScalerSettings:
    """``torch.amp.GradScaler`` settings, used with fp16 only (bf16 and fp32 need no loss scaling)."""

    init_scale: float = 65536.0
    growth_interval: int = 2000


@dataclass(frozen=True)
class DataLoaderSettings:
    """``torch.utils.data.DataLoader`` arguments; ``None`` keeps the script's own value."""

    num_workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    prefetch_factor: int | None = None


@dataclass(frozen=True)
class Provenance:
    """Where the plan came from, so a stale config (another model, another trace) can be recognised."""

    trace: str | None = None
    model_class: str | None = None
    module_count: int | None = None
    param_count: int | None = None  # with model_class and module_count: which of several models
    budget_bytes: int | None = None
    fits: bool | None = None
    predicted_peak_bytes: int | None = None
    predicted_step_time_ratio: float | None = None
    # ``memdoctor profile --verify``: true when a verified run of this config fitted the budget, false
    # when no verified round fitted (this config is then not known to fit: the file's header says so,
    # and ``memdoctor run`` too); null when the plan was not verified. ``verify_note`` says what was
    # measured and, when nothing fitted, what to try.
    verified: bool | None = None
    verify_note: str | None = None


@dataclass(frozen=True)
class PlanConfig:
    """One plan. The defaults are the profiled run unchanged (``PlanConfig()`` changes nothing)."""

    checkpoint: tuple[str, ...] = ()
    precision: str = "fp32"
    grad_scaler: GradScalerSettings | None = None
    micro_batch: int | None = None
    accumulation_steps: int = 1
    accumulation_split: str | None = None  # one of ACCUMULATION_SPLITS; None: "forward"
    script_args: tuple[str, ...] = ()  # with "arguments": the options memdoctor run adds to the script's
    optimizer: str = "as-is"
    padding: str = "as-is"
    pad_to_multiple_of: int | None = None  # with padding "trim": round each batch's length up to this
    offload_parameters: tuple[str, ...] = ()  # modules whose parameters live on the CPU
    attention: str | None = None
    allocator: str | None = None  # PYTORCH_CUDA_ALLOC_CONF
    full_offload: bool = False  # parameters, gradients, optimizer state on the CPU (FSDP2 CPUOffloadPolicy)
    gpus: int = 1  # processes, one GPU each: memdoctor run --nproc-per-node
    parallel: str | None = None  # one of PARALLEL (ddp, fsdp2, fsdp2-no-reshard); None: one process
    shard_modules: tuple[str, ...] = ()  # with fsdp2: modules given their own fully_shard before the root
    data_loader: DataLoaderSettings = field(default_factory=DataLoaderSettings)
    provenance: Provenance = field(default_factory=Provenance)

    def as_dict(self) -> dict[str, Any]:
        """The YAML document's content, keys in the documented order."""
        d = dataclasses.asdict(self)
        d["checkpoint"] = list(self.checkpoint)
        d["offload_parameters"] = list(self.offload_parameters)
        d["script_args"] = list(self.script_args)
        d["shard_modules"] = list(self.shard_modules)
        return {"memdoctor_config": CONFIG_VERSION, **d}


# ----------------------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike[str]) -> PlanConfig:
    """Read and validate ``path``; ``ConfigError`` (one line, naming the file) on any problem."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{p}: {size} bytes is too large for a memdoctor config")
        text = p.read_text(encoding="utf-8")
    except ConfigError:
        raise
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a text file (not UTF-8)") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    return parse_config(text, source=str(p))


def parse_config(text: str, source: str = "config") -> PlanConfig:
    """Validate a config from its text (see the module docstring for what is refused and why)."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: too large for a memdoctor config")
    doc = _safe_yaml(text, source)
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: a memdoctor config is a mapping (key: value), not {_kind(doc)}")
    return config_from_mapping(doc, source)


def _safe_yaml(text: str, source: str) -> Any:
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if isinstance(token, yaml.TagToken):
                raise ConfigError(f"{source}: line {token.start_mark.line + 1}: YAML tags are not allowed")
            if isinstance(token, (yaml.AliasToken, yaml.AnchorToken)):
                raise ConfigError(
                    f"{source}: line {token.start_mark.line + 1}: YAML anchors and aliases are not allowed"
                )
        return yaml.safe_load(text)
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{source}: {where}not valid YAML: {problem}") from None
    except (RecursionError, ValueError, OverflowError, MemoryError) as exc:
        # PyYAML's resolver can raise ValueError/OverflowError on odd scalars; deep nesting recursion
        raise ConfigError(f"{source}: not valid YAML: {type(exc).__name__}") from None


_TOP = (
    "memdoctor_config",
    "checkpoint",
    "precision",
    "grad_scaler",
    "micro_batch",
    "accumulation_steps",
    "accumulation_split",
    "script_args",
    "optimizer",
    "padding",
    "pad_to_multiple_of",
    "offload_parameters",
    "attention",
    "allocator",
    "full_offload",
    "gpus",
    "parallel",
    "shard_modules",
    "data_loader",
    "provenance",
)


def config_from_mapping(doc: dict[Any, Any], src: str) -> PlanConfig:
    """A config from a mapping already parsed (the plan a child process receives as JSON), held to
    the same checks as a file's text; ``src`` names it in the messages."""
    _known_keys(doc, _TOP, src)
    if "memdoctor_config" not in doc:
        raise ConfigError(f"{src}: not a memdoctor config: the key memdoctor_config (the version) is missing")
    version = _int(doc["memdoctor_config"], "memdoctor_config", src, minimum=1)
    if version > CONFIG_VERSION:
        raise ConfigError(
            f"{src}: config version {version} is newer than this memdoctor reads ({CONFIG_VERSION}); "
            "upgrade memdoctor"
        )
    checkpoint = _names(doc.get("checkpoint"), "checkpoint", src)
    precision = _choice(doc.get("precision", "fp32"), "precision", PRECISIONS, src)
    scaler = _scaler(doc.get("grad_scaler"), src)
    if scaler is not None and precision != "fp16":
        raise ConfigError(f"{src}: grad_scaler is for precision fp16 only (precision is {precision})")
    if precision == "fp16" and scaler is None:
        scaler = GradScalerSettings()
    micro = doc.get("micro_batch")
    multiple = doc.get("pad_to_multiple_of")
    full = _full_offload(doc, src)
    return PlanConfig(
        checkpoint=tuple(checkpoint),
        precision=precision,
        grad_scaler=scaler,
        micro_batch=None if micro is None else _int(micro, "micro_batch", src, minimum=1),
        accumulation_steps=_int(doc.get("accumulation_steps", 1), "accumulation_steps", src, minimum=1),
        accumulation_split=_opt_choice(
            doc.get("accumulation_split"), "accumulation_split", ACCUMULATION_SPLITS, src
        ),
        script_args=_strings(doc.get("script_args"), "script_args", src),
        optimizer=_choice(doc.get("optimizer", "as-is"), "optimizer", OPTIMIZERS, src),
        padding=_choice(doc.get("padding", "as-is"), "padding", PADDING_POLICIES, src),
        pad_to_multiple_of=None if multiple is None else _int(multiple, "pad_to_multiple_of", src, minimum=1),
        offload_parameters=_names(doc.get("offload_parameters"), "offload_parameters", src),
        attention=_opt_choice(doc.get("attention"), "attention", ATTENTION, src),
        allocator=_opt_str(doc.get("allocator"), "allocator", src),
        full_offload=full,
        **_parallel(doc, src),
        data_loader=_data_loader(doc.get("data_loader"), src),
        provenance=_provenance(doc.get("provenance"), src),
    )


def _full_offload(doc: dict[Any, Any], src: str) -> bool:
    """``full_offload``: true or false; it already holds the optimizer state and every parameter on the
    CPU, so it is refused beside ``optimizer: offload`` or ``offload_parameters`` (two engines would
    move the same tensors)."""
    value = doc.get("full_offload", False)
    if not isinstance(value, bool):
        raise ConfigError(f"{src}: full_offload must be true or false, not {_short(value)}")
    if value and doc.get("optimizer", "as-is") != "as-is":
        raise ConfigError(f"{src}: full_offload already offloads the optimizer state: remove optimizer")
    if value and doc.get("offload_parameters"):
        raise ConfigError(f"{src}: full_offload already offloads every parameter: remove offload_parameters")
    return value


def _parallel(doc: dict[Any, Any], src: str) -> dict[str, Any]:
    """``gpus``, ``parallel`` and ``shard_modules``: an engine needs more than one GPU, blocks to shard
    need FSDP2, and full offload over several GPUs is FSDP2's (DDP cannot hold state on the host)."""
    gpus = _int(doc.get("gpus", 1), "gpus", src, minimum=1)
    parallel = _opt_choice(doc.get("parallel"), "parallel", PARALLEL, src)
    shard = _names(doc.get("shard_modules"), "shard_modules", src)
    if parallel is not None and gpus < 2:
        raise ConfigError(f"{src}: parallel {parallel} needs gpus of 2 or more (gpus is {gpus})")
    if gpus > 1 and parallel is None:
        raise ConfigError(f"{src}: gpus {gpus} needs parallel: one of {', '.join(PARALLEL)}")
    if shard and parallel not in ("fsdp2", "fsdp2-no-reshard"):
        raise ConfigError(f"{src}: shard_modules is for parallel fsdp2 or fsdp2-no-reshard only")
    if parallel == "ddp" and doc.get("full_offload"):
        raise ConfigError(f"{src}: full_offload over several GPUs needs parallel fsdp2, not ddp")
    return {"gpus": gpus, "parallel": parallel, "shard_modules": tuple(shard)}


def _names(value: Any, name: str, src: str) -> tuple[str, ...]:
    """A list of distinct module names (empty when absent)."""
    names = value or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{src}: {name} must be a list of module names (strings)")
    if len(set(names)) != len(names):
        raise ConfigError(f"{src}: {name} names a module twice")
    return tuple(names)


def _strings(value: Any, name: str, src: str) -> tuple[str, ...]:
    """A list of strings (empty when absent)."""
    items = value or []
    if not isinstance(items, list) or not all(isinstance(n, str) for n in items):
        raise ConfigError(f"{src}: {name} must be a list of strings")
    return tuple(items)


def _scaler(value: Any, src: str) -> GradScalerSettings | None:
    if value is None:
        return None
    m = _mapping(value, "grad_scaler", ("init_scale", "growth_interval"), src)
    scale = m.get("init_scale", 65536.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ConfigError(f"{src}: grad_scaler.init_scale must be a positive number")
    interval = _int(m.get("growth_interval", 2000), "grad_scaler.growth_interval", src, minimum=1)
    return GradScalerSettings(float(scale), interval)


def _data_loader(value: Any, src: str) -> DataLoaderSettings:
    if value is None:
        return DataLoaderSettings()
    names = tuple(f.name for f in dataclasses.fields(DataLoaderSettings))
    m = _mapping(value, "data_loader", names, src)
    out: dict[str, Any] = {}
    for key in ("num_workers", "prefetch_factor"):
        if m.get(key) is not None:
            out[key] = _int(m[key], f"data_loader.{key}", src, minimum=0 if key == "num_workers" else 1)
    for key in ("pin_memory", "persistent_workers"):
        if m.get(key) is not None:
            if not isinstance(m[key], bool):
                raise ConfigError(f"{src}: data_loader.{key} must be true or false")
            out[key] = m[key]
    return DataLoaderSettings(**out)


_MAX_RATIO = 1e6  # a predicted slow-down past this is a typo (and 400 digits would overflow a float)


def _provenance(value: Any, src: str) -> Provenance:
    if value is None:
        return Provenance()
    names = tuple(f.name for f in dataclasses.fields(Provenance))
    m = _mapping(value, "provenance", names, src)
    fits, verified = (_opt_bool(m.get(k), f"provenance.{k}", src) for k in ("fits", "verified"))
    ratio = m.get("predicted_step_time_ratio")
    if ratio is not None and (
        isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= _MAX_RATIO
    ):
        raise ConfigError(
            f"{src}: provenance.predicted_step_time_ratio must be a number from 0 to {_MAX_RATIO:g}"
        )
    ints = {
        k: None if m.get(k) is None else _int(m[k], f"provenance.{k}", src, minimum=0)
        for k in ("module_count", "param_count", "budget_bytes", "predicted_peak_bytes")
    }
    return Provenance(
        trace=_opt_str(m.get("trace"), "provenance.trace", src),
        model_class=_opt_str(m.get("model_class"), "provenance.model_class", src),
        predicted_step_time_ratio=None if ratio is None else float(ratio),
        verify_note=_opt_str(m.get("verify_note"), "provenance.verify_note", src),
        fits=fits,
        verified=verified,
        **ints,
    )


def _known_keys(m: dict[Any, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in m:
        if not isinstance(key, str) or key not in allowed:
            raise ConfigError(f"{where}: unknown key {str(key)[:80]!r} (known: {', '.join(allowed)})")


def _mapping(value: Any, name: str, allowed: tuple[str, ...], src: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{src}: {name} must be a mapping, not {_kind(value)}")
    _known_keys(value, allowed, f"{src}: {name}")
    return value


def _int(value: Any, name: str, src: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or value > 2**62:
        raise ConfigError(f"{src}: {name} must be a whole number >= {minimum}, not {_short(value)}")
    return value


def _choice(value: Any, name: str, allowed: tuple[str, ...], src: str) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{src}: {name} must be one of {', '.join(allowed)}, not {_short(value)}")
    return value


def _opt_choice(value: Any, name: str, allowed: tuple[str, ...], src: str) -> str | None:
    return None if value is None else _choice(value, name, allowed, src)


def _opt_bool(value: Any, name: str, src: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{src}: {name} must be true or false")
    return value


def _opt_str(value: Any, name: str, src: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{src}: {name} must be a string, not {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "empty"}.get(
        type(value), f"a {type(value).__name__}"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ----------------------------------------------------------------------------------------- checks


def check_modules(config: PlanConfig, names: list[str] | set[str], model_class: str | None = None) -> None:
    """``ConfigError`` when the config names a module the model lacks (a stale config, another model)."""
    known = set(names)
    missing = [n for n in (*config.checkpoint, *config.offload_parameters) if n not in known]
    if missing:
        other = config.provenance.model_class
        hint = f" (the config was made for {other})" if other and model_class and other != model_class else ""
        shown = first_names([repr(n) for n in missing], 3)
        raise ConfigError(f"config names modules this model lacks: {shown}{hint}")


# ----------------------------------------------------------------------------------------- writing


HEADER = """\
# memdoctor.yaml: the plan memdoctor made for this training run (field by field: docs/config.md).
# Apply it in code with memdoctor.apply(memdoctor.load_config("memdoctor.yaml"), model, optimizer),
# or export it: memdoctor.config.export (HF TrainingArguments, Lightning Trainer, accelerate).
# Every number here is a prediction from the profiled run, not a measurement.
"""


def dump_config(config: PlanConfig) -> str:
    """The YAML text of ``config`` (round-trips through ``parse_config``), under a header that says
    first, plainly, when ``profile --verify`` measured no config that fits (``provenance.verified``)."""
    body = yaml.safe_dump(config.as_dict(), sort_keys=False, default_flow_style=False, allow_unicode=False)
    return _verify_lines(config.provenance, first=True) + HEADER + _verify_lines(config.provenance) + body


def _verify_lines(p: Provenance, *, first: bool = False) -> str:
    """The header's verify verdict as comment lines: a config no verified round fitted says so before
    anything else (``first``); one a round measured says so after the header's standard lines."""
    if p.verified is None or (p.verified is False) != first:
        return ""
    default = "NOT verified to fit: memdoctor profile --verify measured no config that fits"
    note = p.verify_note or (
        default if p.verified is False else "measured to fit by memdoctor profile --verify"
    )
    lines = textwrap.wrap(note, 98, break_long_words=False, break_on_hyphens=False)
    if p.verified is False:
        lines = ["NOT PLANNED TO FIT: read this before applying it.", *lines, ""]
    return "".join(f"# {line}".rstrip() + "\n" for line in lines)
