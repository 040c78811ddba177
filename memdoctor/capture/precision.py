"""The script's own precision, measured: the autocast state in force during each module's forward, the
dtypes of the module outputs and of the parameters, and the TF32 switches.

Why: the planner's what-if for autocast (``memdoctor.plan.memory``) halves the activations that
autocast would store in 16 bits. A script that already runs its own ``torch.autocast(bf16)`` stores
them in 16 bits already; assuming fp32 there predicted a minimal GPT trainer's plan at 7.19 GiB that
ran out of memory. So the plan starts from what this collector saw the script do.

On the hot path (every module call of a detailed step) it reads the autocast switch of the profiled
device type (one C call) and, for a module's first call in the step, the width in bits of the autocast
dtype and of its output's first floating tensor (the per-module columns ``autocast_bits`` and
``output_bits``: trace columns are numbers); for leaf modules it adds that tensor's bytes to its dtype's
total (``numel * element_size``: no kernel, no host synchronisation). Parameters and TF32 switches are
read once per step, off the hot path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from memdoctor.capture.collectors import Collector
from memdoctor.capture.histsample import first_float
from memdoctor.capture.sessionhooks import in_backward

if TYPE_CHECKING:
    from torch import nn

    from memdoctor.capture.session import ProfileSession

NAME = "precision"
OFF = 0  # the ``autocast_bits`` column of a module whose forward ran without autocast


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def autocast_readers(device_type: str) -> tuple[Callable[[], bool], Callable[[], torch.dtype]]:
    """(is autocast on, its dtype) for ``device_type``, through the API the installed torch has:
    ``torch.is_autocast_enabled(device_type)`` / ``torch.get_autocast_dtype(device_type)`` (torch >= 2.4),
    else the older per-device functions (``is_autocast_enabled()`` is CUDA's there)."""
    try:
        torch.is_autocast_enabled(device_type)
        torch.get_autocast_dtype(device_type)
        return (
            lambda: torch.is_autocast_enabled(device_type),
            lambda: torch.get_autocast_dtype(device_type),
        )
    except (TypeError, AttributeError, RuntimeError):
        pass
    if device_type == "cpu":
        return torch.is_autocast_cpu_enabled, torch.get_autocast_cpu_dtype
    return torch.is_autocast_enabled, torch.get_autocast_gpu_dtype


_READERS: dict[str, tuple[Callable[[], bool], Callable[[], torch.dtype]]] = {}


def _readers(device_type: str) -> tuple[Callable[[], bool], Callable[[], torch.dtype]]:
    """``autocast_readers``, once per device type. A dict, not ``functools.cache``: the module hooks
    that ask run inside a compiled model's forward, where dynamo warns that it traces through the
    cache's wrapper (the warning reached the terminal of a ``torch.compile`` script under ``run``)."""
    found = _READERS.get(device_type)
    if found is None:
        found = _READERS[device_type] = autocast_readers(device_type)
    return found


def autocast_now(device_type: str) -> torch.dtype | None:
    """The dtype of the autocast in force for ``device_type`` now; None where it is off."""
    enabled, dtype = _readers(device_type)
    return dtype() if enabled() else None


def tf32_settings() -> dict[str, Any]:
    """The TF32 switches in force: ``torch.backends.cuda.matmul.allow_tf32``,
    ``torch.backends.cudnn.allow_tf32`` and ``torch.get_float32_matmul_precision()`` (null where this
    torch lacks one; a deprecation warning of a newer torch is not the script's business)."""
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key, read in (
            ("matmul", lambda: bool(torch.backends.cuda.matmul.allow_tf32)),
            ("cudnn", lambda: bool(torch.backends.cudnn.allow_tf32)),
            ("float32_matmul_precision", lambda: str(torch.get_float32_matmul_precision())),
        ):
            try:
                out[key] = read()
            except Exception:  # an older or newer torch without this switch
                out[key] = None
    return out


def parameter_bytes(roots: list[nn.Module]) -> dict[str, int]:
    """Bytes of the models' floating parameters by dtype, each parameter once."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for root in roots:
        for p in root.parameters():
            if id(p) in seen or not p.is_floating_point():
                continue
            seen.add(id(p))
            name = dtype_name(p.dtype)
            out[name] = out.get(name, 0) + p.numel() * p.element_size()
    return out


class StepPrecision:
    """What one detailed step's module calls showed (kept until its record is built, which may be after
    the next step began: a step ends at the next step's first forward)."""

    def __init__(self, tf32: dict[str, Any]) -> None:
        self.tf32 = tf32
        self.forwards = 0
        self.auto: dict[str, int] = {}  # autocast dtype -> module forwards under it
        self.first: dict[int, int] = {}  # id(module) -> autocast dtype's bits (or OFF) at its first call
        self.out: dict[int, int] = {}  # id(module) -> bits of its first call's output dtype
        self.bytes: dict[str, int] = {}  # leaf modules' output bytes by dtype


KEEP_STEPS = 4  # steps whose figures stay for their (provisional and final) records


class PrecisionCollector(Collector):
    """Autocast in force per module forward, output and parameter dtypes, TF32 (see the module doc)."""

    name = NAME
    wants_modules = True

    def __init__(self, **_: Any) -> None:
        self._session: ProfileSession | None = None
        self._enabled: Callable[[], bool] = lambda: False
        self._dtype: Callable[[], torch.dtype] = lambda: torch.float32
        self._device_type = "cpu"
        self._roots: list[nn.Module] = []
        self._now: StepPrecision | None = None  # the detailed step in progress
        self._steps: dict[int, StepPrecision] = {}
        self._fields: dict[int, dict[str, Any]] = {}
        self._leaf: dict[int, bool] = {}  # id(module) -> it has no children (its outputs are counted)

    def start(self, session: ProfileSession) -> None:
        self._session = session
        self._device_type = "cuda" if session.device.kind == "cuda" else "cpu"
        self._enabled, self._dtype = autocast_readers(self._device_type)

    def on_step_start(self, step: int, detailed: bool) -> None:
        self._now = StepPrecision(tf32_settings()) if detailed else None
        if self._now is not None:
            self._steps[step] = self._now
        for old in [k for k in self._steps if k <= step - KEEP_STEPS]:
            self._steps.pop(old, None)
            self._fields.pop(old, None)

    def on_model(self, model: int, root: nn.Module) -> None:
        self._roots.append(root)

    # ---------------------------------------------------------------------------------- hot path
    def on_forward_pre(self, key: int, module: nn.Module, depth: int, timed: bool) -> None:
        now = self._now
        if now is None or in_backward():  # a checkpoint's recomputation: counted at its forward
            return
        now.forwards += 1
        if not self._enabled():
            now.first.setdefault(key, OFF)
            return
        dtype = self._dtype()
        name = dtype_name(dtype)
        now.auto[name] = now.auto.get(name, 0) + 1
        if key not in now.first:
            now.first[key] = dtype.itemsize * 8

    def on_forward_post(self, key: int, module: nn.Module, output: Any, depth: int, timed: bool) -> None:
        now = self._now
        if now is None or output is None:
            return
        leaf = self._leaf.get(key)
        if leaf is None:
            leaf = self._leaf[key] = next(iter(module.children()), None) is None
        if (key in now.out and not leaf) or in_backward():
            return
        # the common case first: a module returning one floating tensor
        t = output if isinstance(output, torch.Tensor) and output.is_floating_point() else first_float(output)
        if t is None:
            return
        size = t.element_size()
        now.out.setdefault(key, size * 8)
        if leaf:
            name = dtype_name(t.dtype)
            now.bytes[name] = now.bytes.get(name, 0) + t.numel() * size

    # ---------------------------------------------------------------------------------- records
    def step_field(self, step: int) -> Any:
        if step in self._fields:
            return self._fields[step]
        data = self._steps.get(step)
        if data is None or not data.forwards:
            return None
        self._fields[step] = {
            "device_type": self._device_type,
            "forwards": data.forwards,
            "autocast_forwards": dict(sorted(data.auto.items())),
            "output_bytes": dict(sorted(data.bytes.items())),
            "parameter_bytes": dict(sorted(parameter_bytes(self._roots).items())),
            "tf32": data.tf32,
        }
        return self._fields[step]

    def module_columns(self, step: int) -> dict[int, dict[str, list[Any]]]:
        session, data = self._session, self._steps.get(step)
        if session is None or data is None or not data.first:
            return {}
        out: dict[int, dict[str, list[Any]]] = {}
        for key, state in data.first.items():
            loc = session.locate(key)
            if loc is None:
                continue
            model, index = loc
            if model not in out:
                n = session.module_count(model)
                out[model] = {"autocast_bits": [None] * n, "output_bits": [None] * n}
            cols = out[model]
            if index < len(cols["autocast_bits"]):
                cols["autocast_bits"][index] = state
                cols["output_bits"][index] = data.out.get(key)
        return out
