"""``install(config)``: put every part of a plan in place in this process, before the script runs.

At once: the allocator setting, the framework path (``memdoctor.levers.frameworks``),
the DataLoader settings and padding trim, and a watch for the model. When the script builds the
model's optimizer (``memdoctor.levers.targets``), before its first training step, the config is
checked against the model (a stale config stops the run), then offload (``memdoctor.levers.offload``),
checkpointing, autocast, loss scaling and micro-batching are installed on it, each printed as one line.
A part that cannot be applied stops
the run with one line naming it (``fail``), before any optimizer step: a plan part is never silently
dropped.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from memdoctor.config import PlanConfig, check_modules
from memdoctor.config.file import config_from_mapping
from memdoctor.errors import ConfigError
from memdoctor.levers import SEEN_THROUGH, FrameworkPatch
from memdoctor.levers.apply import SeeSaved, _allocator, can_see_through, checkpoint_module, no_kv_cache
from memdoctor.levers.autocast import LossScaling, autocast_forward
from memdoctor.levers.backward import BackwardPatch
from memdoctor.levers.beforeoptimizer import BeforeOptimizer
from memdoctor.levers.firststep import forward_called, offloaded_only
from memdoctor.levers.frameworks import patch_frameworks
from memdoctor.levers.loader import LoaderSettings
from memdoctor.levers.loopsplit import LoopSplit
from memdoctor.levers.microbatch import MicroBatching
from memdoctor.levers.modnames import class_name, recorded_names, submodule
from memdoctor.levers.offload import install_offload
from memdoctor.levers.offload_full import FullOffload, model_for
from memdoctor.levers.padding import PaddingTrim
from memdoctor.levers.parallel import start_parallel
from memdoctor.levers.parallel_data import DataSharding
from memdoctor.levers.scriptargs import ScriptArguments
from memdoctor.levers.targets import ModelWatch, describes, optimizers_of
from memdoctor.patching import Undo
from memdoctor.units import first_names

Say = Callable[[str], None]
_SHOWN_NAMES = 6


def say_stderr(line: str) -> None:
    """One write per line: the ranks of a job share one stderr, and a line written in parts interleaves."""
    sys.stderr.write(f"memdoctor: {line}\n")
    sys.stderr.flush()


def raise_config_error(message: str) -> None:
    raise ConfigError(message)


@dataclass
class Installation:
    """The installed plan: what was applied (``lines``), the model once found, and ``remove()``."""

    config: PlanConfig
    say: Say
    fail: Callable[[str], None]
    see_saved: SeeSaved | None = None  # the checkpoint-all re-profile (``checkpoint_module``)
    lines: list[str] = field(default_factory=list)
    model: nn.Module | None = None
    framework: FrameworkPatch = field(default_factory=FrameworkPatch)
    backward: BackwardPatch = field(default_factory=BackwardPatch)
    _undo: list[Undo] = field(default_factory=list)
    _loader: LoaderSettings | None = None
    _padding: PaddingTrim | None = None
    _split: LoopSplit | ScriptArguments | None = None  # micro-batching outside the forward
    _first: nn.Module | None = None  # a root passed over for another model class
    _full: BeforeOptimizer | None = None  # full_offload's or parallel's engine, wrapping at the optimizer
    _sharding: DataSharding | None = None  # parallel's DataLoaders
    _near: nn.Module | None = None  # a root with the planned modules, but not the model described
    _watch: ModelWatch | None = None
    _scaling: LossScaling | None = None  # fp16's loss scaling, for the end-of-run line

    def applied(self, line: str) -> None:
        self.lines.append(line)
        self.say(line)

    def ours(self, part: str) -> bool:
        """Whether memdoctor applies ``part`` here (not the framework path)."""
        return part not in self.framework.handled

    def remove(self) -> None:
        """Undo every patch, last first: the process is as it was before ``install``."""
        while self._undo:
            self._undo.pop()()

    def finish(self) -> list[str]:
        """End-of-run notes: parts applied to what the script did, or that it never gave a chance."""
        notes = []
        if self.model is None and self._needs_model():
            notes.append(
                "NOT applied: the script built no optimizer of a model, nor called a model the config "
                "describes, so checkpoint, precision, accumulation and offload had nothing to apply to"
            )
        if self._loader is not None:
            notes.append(self._loader.summary())
        if self._padding is not None:
            notes.append(self._padding.summary())
        if self._sharding is not None:
            notes.append(self._sharding.summary())
        scaled = self._scaling.summary() if self._scaling is not None else None
        if scaled:
            notes.append(scaled)
        split = self._split
        if isinstance(split, ScriptArguments) and not split.applied:
            notes.append("NOT applied: accumulation_steps: " + split.not_applied())
        if isinstance(split, LoopSplit) and not split.batches:
            notes.append(
                "NOT applied: accumulation_steps: the script trained on no DataLoader batch to split"
            )
        for note in notes:
            self.say(note)
        return notes

    def _needs_model(self) -> bool:
        c = self.config
        offload = bool(c.offload_parameters) or c.optimizer == "offload" or c.full_offload
        offload = offload or c.parallel is not None
        in_forward = c.accumulation_steps > 1 and c.accumulation_split in (None, "forward")
        return bool(c.checkpoint) or c.precision != "fp32" or in_forward or offload

    # ------------------------------------------------------------------ when the model is found

    def accept(self, root: nn.Module) -> bool:
        """Is ``root`` the model the config was made for? A stale config stops the run here.

        The planned modules must be there, and the model must be the one the provenance describes
        (``describes``): a script's other model may have modules of the same names (dcgan's
        generator and discriminator). A root with the modules that is not the one described is taken
        only if no better one is built before the first optimizer step (``missing``)."""
        cls = class_name(root)
        names = set(recorded_names(root))
        p = self.config.provenance
        if all(n in names for n in (*self.config.checkpoint, *self.config.offload_parameters)):
            if describes(root, p.model_class, p.module_count, p.param_count):
                return True
            self._near = self._near or root
            return False
        if p.model_class and p.model_class != cls:
            self._first = self._first or root
            return False  # perhaps another model of the script (a critic); keep looking until a step
        self._stale(root)
        return False

    def matches(self, root: nn.Module) -> bool:
        """Whether ``root`` has the planned modules and is the model the provenance describes (for a
        model met at its first forward, in a script that builds no optimizer: never stops the run)."""
        names = set(recorded_names(root))
        p = self.config.provenance
        wanted = (*self.config.checkpoint, *self.config.offload_parameters)
        return all(n in names for n in wanted) and describes(
            root, p.model_class, p.module_count, p.param_count
        )

    def missing(self) -> None:
        """An optimizer steps and no model matched the config exactly: apply it to the root that has
        its modules (a model changed since the plan: ``on_model`` says so), else stop, naming what the
        config lacks."""
        if self._near is not None:
            self.on_model(self._near)
        elif self._first is not None:
            self._stale(self._first)

    def _stale(self, root: nn.Module) -> None:
        try:
            check_modules(self.config, recorded_names(root), type(root).__name__)
        except ConfigError as exc:
            self.fail(str(exc))

    def argv_args(self) -> list[str]:
        """What the launcher appends to the script's command line (``ScriptArguments.argv_args``)."""
        return self._split.argv_args() if isinstance(self._split, ScriptArguments) else []

    def on_model(self, root: nn.Module) -> None:
        self.model = root
        if isinstance(self._split, ScriptArguments):
            self._split.check(vars(sys.modules["__main__"]))
        cls = class_name(root)
        other = self.config.provenance.model_class
        if other and other != cls:
            self.say(f"note: the config was made for {other}; this script's model is {cls}")
        self._refuse(root)
        if self._full is not None and self._full.model is not root:
            self.fail(self._full.not_wrapped(root))
        self._offload(root)  # before the GradScaler's step wrapper: that one must be outermost
        c = self.config
        if c.checkpoint and self.ours("checkpoint"):
            for name in c.checkpoint:
                self._undo.append(checkpoint_module(submodule(root, name), self.see_saved))
            shown = first_names(c.checkpoint, _SHOWN_NAMES, " ")
            seen = f"; {SEEN_THROUGH}" if self.see_saved is not None and can_see_through() else ""
            self.applied(f"checkpointing {len(c.checkpoint)} modules of {cls}: {shown}{seen}")
            undo = no_kv_cache(root)
            if undo is not None:
                self._undo.append(undo)
                self.applied(
                    f"{cls}.config.use_cache = False while checkpointing, as HF's gradient checkpointing "
                    "does (recomputed attention would fill the KV cache twice; training never reads it)"
                )
        precision = c.precision != "fp32" and self.ours("precision")
        scaling = self._precision(root) if precision else None
        accumulation = c.accumulation_steps > 1 and self.ours("accumulation") and self._split is None
        if accumulation:
            self._micro_batching(root, scaling)
        if precision or accumulation:
            self._undo.append(
                forward_called(self.fail, root, "precision" if precision else "accumulation_steps")
            )
            if self._watch is not None and self._watch.found_at_forward:
                self.say(
                    f"note: {cls} was found at its first forward (the script builds no optimizer): "
                    f"what wraps {cls}.forward applies from its second forward on"
                )

    def _refuse(self, root: nn.Module) -> None:
        c = self.config
        if c.optimizer == "8bit" and self.ours("optimizer"):
            self.fail(
                "optimizer: 8bit: memdoctor run cannot swap the script's optimizer (it is built by the "
                "script); build it with bitsandbytes.optim.AdamW8bit, or remove optimizer from the config"
            )
        if c.attention is not None and self.ours("attention"):
            setter = getattr(root, "set_attn_implementation", None)
            try:
                if setter is None:
                    raise TypeError(f"{type(root).__name__} has no set_attn_implementation")
                setter(c.attention)
            except Exception as exc:
                self.fail(f"attention: {c.attention}: cannot set it on this model: {exc}")
            self.applied(f"attention implementation {c.attention} (set_attn_implementation)")

    def _start_full_offload(self) -> None:
        """Before the model watch: FSDP2 shards the model before its optimizer takes the parameters
        (``memdoctor.levers.offload_full``), so its ``Optimizer.__init__`` wrapper runs inside the watch's."""
        self._full = FullOffload(model_for(self.config.checkpoint), self.applied, self.fail)
        try:
            self._undo.append(self._full.install())
        except ValueError as exc:
            self.fail(str(exc))

    def _offload(self, root: nn.Module) -> None:
        """Parameter offload first (the optimizer's state does not exist yet: it is being built), then
        the optimizer-state offload of each optimizer of the model (memdoctor.levers.offload)."""
        c = self.config
        cls = type(root).__name__
        optimizers = optimizers_of(root)
        state = c.optimizer == "offload" and self.ours("optimizer")
        stepped = optimizers if state else []
        try:
            params, offloads = install_offload(root, c.offload_parameters, stepped, self._undo)
        except ValueError as exc:
            self.fail(str(exc))
            return
        if params is not None:
            resident = list(params.params.values())
            tied = params.tied()
            shown = first_names(c.offload_parameters, _SHOWN_NAMES, " ")
            notes = [f"tied {' '.join(tied)} offloaded with them"] if tied else []
            self.applied(
                f"offload: the parameters of {len(c.offload_parameters)} module(s) of {cls} on the host "
                f"({shown}; {len(resident)} tensors, {_mib(resident)} MiB), copied in while they run"
                + "".join(f"; {n}" for n in [*notes, *params.notes])
            )
        for offload in offloads:
            self.applied(
                f"offload: {type(offload.optimizer).__name__}'s state on the host; its step runs there on "
                "host copies of the parameters and gradients, the updated parameters copied back"
                + "".join(f"; {n}" for n in offload.notes)
            )
        if state:
            self._undo.append(offloaded_only(self.fail, root, optimizers))

    def _precision(self, root: nn.Module) -> LossScaling | None:
        c = self.config
        if c.precision != "fp16" or c.grad_scaler is None:
            self._undo.append(autocast_forward(root, c.precision, self.say))
            self.applied(f"autocast {c.precision} around {type(root).__name__}.forward")
            return None
        scaling = self._scaling = LossScaling(c.grad_scaler, root, self.fail)
        self._undo.append(autocast_forward(root, c.precision, self.say, scaling.stand_down))
        self._undo.append(scaling.install())
        scaling.attach()
        self.backward.scale = scaling.scale
        self.applied(
            f"autocast fp16 with loss scaling around {type(root).__name__}.forward (torch.amp.GradScaler, "
            f"init_scale={c.grad_scaler.init_scale:g}, growth_interval={c.grad_scaler.growth_interval}; "
            "driven from loss.backward() and optimizer.step())"
        )
        return scaling

    def _micro_batching(self, root: nn.Module, scaling: LossScaling | None) -> None:
        c = self.config
        micro = MicroBatching(
            c.accumulation_steps,
            self.backward,
            self.fail,
            self.say,
            scale=None if scaling is None else scaling.scale,
            current_scale=None if scaling is None else scaling.current_scale,
            expected_micro=c.micro_batch,
        )
        self._undo.append(micro.install(root))
        size = f" of {c.micro_batch} samples" if c.micro_batch else ""
        self.applied(
            f"micro-batching: each batch split into {c.accumulation_steps} micro-batches{size} inside "
            f"{type(root).__name__}.forward, gradients accumulated; the script's optimizer steps and "
            "LR schedule are unchanged"
        )


def _mib(params: list[nn.Parameter]) -> str:
    return f"{sum(p.numel() * p.element_size() for p in params) / 2**20:.1f}"


def install(
    config: PlanConfig | Mapping[str, Any],
    *,
    say: Say = say_stderr,
    fail: Callable[[str], None] = raise_config_error,
    see_saved: SeeSaved | None = None,
) -> Installation:
    """Install ``config`` (a ``PlanConfig``, or its mapping as in ``memdoctor.yaml``) in this process.

    ``say`` prints each applied part; ``fail`` reports a part that cannot be applied (default: raise
    ``ConfigError``; ``memdoctor run`` prints the line and exits 2). Call ``remove()`` to undo.
    ``see_saved``: what checkpointed modules save is shown to it (a profiled run's ledger, for the
    checkpoint-all re-profile: ``memdoctor.levers.apply.SeeThrough``).
    """
    if not isinstance(config, PlanConfig):
        config = config_from_mapping(dict(config), "config")  # the loader's own checks, on a mapping
    inst = Installation(config, say, fail, see_saved)
    try:
        _install_now(inst)
    except BaseException:
        inst.remove()
        raise
    return inst


def _install_now(inst: Installation) -> None:
    c = inst.config
    if c.allocator is not None:
        _allocator(c)
        inst.applied(f"allocator PYTORCH_CUDA_ALLOC_CONF={c.allocator}")
    inst.framework = _frameworks(c)
    inst._undo.append(inst.framework.undo)
    for line in inst.framework.lines:
        inst.applied(line)
    if any(v is not None for v in vars(c.data_loader).values()):
        inst._loader = LoaderSettings(c.data_loader, active=lambda: inst.ours("data_loader"))
        inst._undo.append(inst._loader.install())
        inst.applied(inst._loader.describe())
    if c.padding == "trim":
        inst._padding = PaddingTrim(active=lambda: inst.ours("padding"))
        undo = inst._padding.install()
        if undo is None:
            inst.fail("padding: trim: this torch has no DataLoader iterator to trim batches in")
        else:
            inst._undo.append(undo)
            inst.applied("padding: trim: each DataLoader batch cut to its longest attention-masked sequence")
    inst._undo.append(inst.backward.install())
    if c.parallel is not None:
        _start_parallel(inst)
    elif c.full_offload:
        inst._start_full_offload()
    if c.accumulation_steps > 1 and c.accumulation_split in ("loader", "arguments"):
        _split_outside(inst)
    watch = inst._watch = ModelWatch(inst.accept, inst.on_model, inst.missing, inst.matches)
    inst._undo.append(watch.start())


def _start_parallel(inst: Installation) -> None:
    """``parallel`` (``memdoctor.levers.parallel``): the rank's group, its DataLoaders sharded, and the
    engine's wrap at the model's optimizer, inside the model watch's like full offload's."""
    started = start_parallel(inst.config, inst.applied, inst.fail)
    if started is not None:
        inst._full, inst._sharding, undo = started
        inst._undo.extend(undo)


def _split_outside(inst: Installation) -> None:
    """Micro-batching outside the model's forward, installed before the script runs: at the DataLoader
    (``memdoctor.levers.loopsplit``) or through the script's own arguments (``levers.scriptargs``)."""
    c = inst.config
    if c.accumulation_split == "arguments":
        if not c.script_args:
            inst.fail("accumulation_split: arguments needs script_args (the options to add)")
            return
        args = ScriptArguments(c.script_args)
        inst._split = args
        inst._undo.append(args.install())
        inst.applied(args.describe())
        return
    if c.precision == "fp16" and c.grad_scaler is not None:
        inst.fail(
            "accumulation_split: loader with precision fp16: memdoctor's loss scaling and the deferred "
            "optimizer step do not combine; use bf16, or remove accumulation_steps from the config"
        )
        return
    expected = c.micro_batch * c.accumulation_steps if c.micro_batch else None

    def training() -> bool:  # and not taken over by a framework's own accumulation (HF, Lightning)
        return inst.ours("accumulation") and (inst.model is None or inst.model.training)

    split = LoopSplit(c.accumulation_steps, inst.backward, inst.fail, training, expected)
    inst._split = split
    inst._undo.append(split.install())
    size = f" of {c.micro_batch} samples" if c.micro_batch else ""
    inst.applied(
        f"micro-batching: each training DataLoader batch split into {c.accumulation_steps} micro-batches"
        f"{size}, the loop's step body run once per micro-batch, optimizer/scheduler/GradScaler steps and "
        "zero_grad deferred to each batch's last; the script's optimizer steps and LR schedule are unchanged"
    )


def _frameworks(config: PlanConfig) -> FrameworkPatch:
    """The HF Trainer / Lightning path (``memdoctor.levers.frameworks``): their own switches first."""
    return patch_frameworks(config)
