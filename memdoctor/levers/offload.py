"""Offload for ``memdoctor run`` and ``memdoctor.apply``: optimizer state, and chosen modules' parameters,
kept in host memory while the script trains as it wrote it.

Why not accelerate (the library issue 5 names): its ``cpu_offload`` / ``AlignDevicesHook`` are inference
hooks. They replace a module's parameter objects on every forward, so the optimizer the script built
never sees a gradient, and training silently stops updating those weights. Its optimizer-state offload
exists only through DeepSpeed ZeRO-Offload, which needs DeepSpeed (not installed here, nor on the GPU
machine) and a DeepSpeed engine the script does not build. So this module uses torch's own machinery:

- **Optimizer state** (``OptimizerOffload``): the script's optimizer object, its ``param_groups`` and
  its parameter objects stay as they are (``zero_grad``, LR schedulers, ``GradScaler.unscale_``,
  ``clip_grad_norm_`` keep working on the device gradients). Only ``optimizer.step`` is wrapped: each
  parameter with a gradient and its gradient are copied into pinned host buffers made once (one
  synchronise), ``p.data`` / ``p.grad`` are swapped to them, the optimizer's own step runs there (so its
  state is created and kept on the host), the updated values are copied back into the device storage,
  and ``p.data`` / ``p.grad`` are swapped back.
- **Parameters** (``ParameterOffload``): each chosen module's parameters keep their objects but move
  to pinned host memory (``p.data = ...``), and a parametrization
  (``torch.nn.utils.parametrize``, ``ToDevice``) copies them to the module's device each time the module
  reads them; autograd copies the gradient back, so it accumulates on the host.

The execution device and the host are parameters (defaults: the parameter's device, and "cpu"), so the
mechanics can be tested on a machine without a GPU.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.nn.utils import parametrize

from memdoctor.patching import Undo, set_attr

Say = Callable[[str], None]


def _pin(host: torch.device) -> bool:
    """Pinned memory makes non_blocking copies truly asynchronous; it needs CUDA (not on CPU-only torch)."""
    return host.type == "cpu" and torch.cuda.is_available()


def host_buffer(like: torch.Tensor, host: torch.device) -> torch.Tensor:
    """An empty host tensor shaped like ``like`` (same dtype), pinned where that is possible."""
    return torch.empty(like.shape, dtype=like.dtype, device=host, pin_memory=_pin(host))


def _synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for the copies queued on each CUDA device's current stream (no-op for the CPU)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


def _params(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield group, p


def _fused_on(device_type: str) -> bool:
    """Whether torch has fused optimizer kernels for ``device_type`` (a private list, feature-checked)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch without the list: say no, and the fused flag is refused by name
        return False
    return device_type in _get_fused_kernels_supported_devices()


def fused_refusal(
    optimizer: torch.optim.Optimizer, on_host: Callable[[torch.Tensor], bool], host: torch.device
) -> str | None:
    """``fused=True`` on a group stepping host parameters works where torch has fused kernels for the
    host (the CPU, in torch >= 2.4); else the flag is refused by name (no silent change of kernels)."""
    for group in optimizer.param_groups:
        if group.get("fused") and any(on_host(p) for p in group["params"]) and not _fused_on(host.type):
            return (
                f"{type(optimizer).__name__}(fused=True) has no fused kernels on {host.type} in this torch; "
                "build it without fused=True"
            )
    return None


def host_capturable(
    optimizer: torch.optim.Optimizer, on_host: Callable[[torch.Tensor], bool]
) -> tuple[list[str], Undo]:
    """``capturable=True`` (for CUDA graphs) needs device parameters: set it to False on the groups that
    step host parameters, which computes the same update. Returns (notes, undo)."""
    changed = [
        g for g in optimizer.param_groups if g.get("capturable") and any(on_host(p) for p in g["params"])
    ]
    for group in changed:
        group["capturable"] = False

    def undo() -> None:
        for group in changed:
            group["capturable"] = True

    notes = [f"capturable=False on {len(changed)} param group(s) stepped on the host"] if changed else []
    return notes, undo


# torch.optim classes whose fused CPU kernel (torch >= 2.4) computes the same update (dense gradients only)
_FUSED_ON_CPU = ("Adam", "AdamW")


class HostFlags:
    """The param-group flags for a step on the host, set on each group the step meets (``apply`` each
    step: ``load_state_dict`` brings new group dicts), put back by ``undo``.

    ``capturable=True`` (CUDA graphs) needs device parameters: False on the host computes the same
    update. Where the script left the kernel to torch (``fused`` and ``foreach`` unset, Adam/AdamW), the
    step uses torch's fused CPU kernel: torch's own default there is its per-tensor loop, about 3x slower
    on the CPU (measured: AdamW, 33M parameters, 2 cores: 51 ms vs 16 ms per step), and the CPU step is
    offload's main cost. The same update, to float rounding; a script's explicit choice is kept.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, host: torch.device) -> None:
        self.optimizer = optimizer
        cls = type(optimizer)
        self.fuse = (
            cls.__module__.startswith("torch.optim.")
            and cls.__name__ in _FUSED_ON_CPU
            and _fused_on(host.type)
        )
        self._seen: list[dict[str, Any]] = []
        self._changed: list[tuple[dict[str, Any], str, Any]] = []
        self.notes: list[str] = []

    def apply(self) -> None:
        for group in self.optimizer.param_groups:
            if any(group is g for g in self._seen):
                continue
            self._seen.append(group)
            if group.get("capturable"):
                self._set(group, "capturable", False, "capturable=False on the host")
            if (
                self.fuse
                and group.get("fused") is None
                and group.get("foreach") is None
                and not group.get("differentiable")
                and all(torch.is_floating_point(p) for p in group["params"])
            ):
                self._set(group, "fused", True, "stepped with torch's fused CPU kernel (fused=True)")

    def _set(self, group: dict[str, Any], key: str, value: Any, note: str) -> None:
        self._changed.append((group, key, group.get(key)))
        group[key] = value
        if note not in self.notes:
            self.notes.append(note)

    def undo(self) -> None:
        while self._changed:
            group, key, value = self._changed.pop()
            group[key] = value
        self._seen.clear()


def state_to(
    optimizer: torch.optim.Optimizer,
    where: Callable[[torch.Tensor], torch.device],
    only: set[int] | None = None,
) -> None:
    """Move each parameter's (of ``only``, by id, if given) optimizer-state tensors to ``where(param)``.

    A scalar ``step`` of a group that is neither fused nor capturable stays where torch keeps it (the CPU).
    """
    for group, p in _params(optimizer):
        state = optimizer.state.get(p)
        if not state or (only is not None and id(p) not in only):
            continue
        target = where(p)
        host_step = not (group.get("fused") or group.get("capturable"))
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.device == target:
                continue
            if key == "step" and value.dim() == 0 and host_step and value.device.type == "cpu":
                continue
            state[key] = value.to(target)


class OptimizerOffload:
    """``optimizer.step`` run on host copies of the parameters and gradients: the state lives on the host.

    ``resident``: parameters that already live on the host (``ParameterOffload``): they step in place.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        host: str | torch.device = "cpu",
        resident: Iterable[Any] = (),
    ) -> None:
        self.optimizer = optimizer
        self.host = torch.device(host)
        self.resident = {id(p) for p in resident}
        self.notes: list[str] = []
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def refusal(self) -> str | None:
        """Why this optimizer cannot step on the host faithfully, or None."""
        if isinstance(self.optimizer, torch.optim.LBFGS):
            return "LBFGS evaluates its closure several times per step; offload runs it once, before the step"
        return None

    def install(self) -> Undo:
        why = self.refusal()
        if why is not None:
            raise ValueError(why)
        refused = fused_refusal(self.optimizer, lambda p: True, self.host)
        if refused is not None:
            raise ValueError(refused)
        flags = HostFlags(self.optimizer, self.host)
        flags.apply()
        self.notes = flags.notes
        opt = self.optimizer
        original = opt.step
        offload = self

        def step(self_opt: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
            loss = None
            if closure is not None:  # as the optimizers of torch.optim (but LBFGS) do: once, first
                with torch.enable_grad():
                    loss = closure()
            moved = offload._to_host()
            try:
                flags.apply()  # groups a load_state_dict brought since
                state_to(self_opt, lambda p: offload.host)  # state a checkpoint loaded onto the device
                original()
            finally:
                offload._back(moved)
            return loss

        # An LR scheduler built before marked the step it wrapped; keep the mark (else it warns). A bound
        # method, so that a scheduler built later wraps it the same way (memdoctor.levers.autocast too).
        if getattr(original, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        step_undo = set_attr(opt, "step", types.MethodType(step, opt))

        def undo() -> None:
            step_undo()
            flags.undo()
            state_to(opt, lambda p: p.device)  # the original step expects its state beside the parameters

        return undo

    def _to_host(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Copy each device parameter with a gradient, and the gradient, to its host buffers (queued, then
        one synchronise); swap ``p.data`` / ``p.grad`` to them. Returns (param, device data, device grad)."""
        queued = []
        devices = set()
        for _, p in _params(self.optimizer):
            if p.grad is None or id(p) in self.resident:
                continue
            master, grad_buffer = self._buffer(p)
            master.copy_(p.detach(), non_blocking=True)
            if grad_buffer is None:  # a sparse gradient: copied as it is
                host_grad = p.grad.to(self.host)
            else:
                host_grad = grad_buffer.copy_(p.grad, non_blocking=True)
            queued.append((p, master, host_grad))
            devices.add(p.device)
        _synchronize(devices)
        moved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        for p, master, host_grad in queued:
            data, grad = p.data, p.grad
            p.grad = None  # a gradient must sit on its parameter's device: unset it across the swap
            p.data = master
            p.grad = host_grad
            moved.append((p, data, grad))
        return moved

    def _back(self, moved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> None:
        """Copy the updated host values into the device storage and swap the device tensors back. The
        copies are queued on the stream; the next step's copies to the host queue after them."""
        for p, data, grad in moved:
            data.copy_(p.data, non_blocking=True)
            p.grad = None
            p.data = data
            p.grad = grad

    def _buffer(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The parameter's host master copy and gradient buffer, made once (again if a shape changed)."""
        master, grad_buffer = self._buffers.get(id(p), (None, None))
        grad = p.grad
        assert grad is not None
        if master is None or master.shape != p.shape or master.dtype != p.dtype:
            master = host_buffer(p, self.host)
            grad_buffer = None
        if grad.is_sparse:
            grad_buffer = None
        elif grad_buffer is None or grad_buffer.shape != grad.shape or grad_buffer.dtype != grad.dtype:
            grad_buffer = host_buffer(grad, self.host)
        self._buffers[id(p)] = (master, grad_buffer)
        return master, grad_buffer


class ToDevice(nn.Module):
    """The parametrization: the host parameter, copied to where the module runs each time it is read.

    The copy's backward copies the gradient back to the host parameter. ``anchor`` (an empty buffer, not
    saved) records the device and dtype the module is moved to later (``model.to(device)`` after the
    optimizer was built, as ``accelerator.prepare`` does), while the parameter itself stays on the host.
    """

    anchor: torch.Tensor

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("anchor", torch.empty(0, device=device, dtype=dtype), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        anchor = self.anchor
        dtype = anchor.dtype if x.is_floating_point() else x.dtype
        return x.to(anchor.device, dtype, non_blocking=True)


class ParameterOffload:
    """The parameters of the named modules of ``root`` kept on the host, copied in while they run.

    Every module of ``root`` holding one of those parameters (a tied ``lm_head.weight``) is treated the
    same, so a tie stays a tie. ``optimizers``: their state of these parameters follows them (to the host
    now, back on undo).
    """

    def __init__(
        self,
        root: nn.Module,
        names: Iterable[str],
        *,
        device: str | torch.device | None = None,
        host: str | torch.device = "cpu",
        optimizers: Iterable[torch.optim.Optimizer] = (),
    ) -> None:
        self.root = root
        self.names = list(names)
        self.device = None if device is None else torch.device(device)
        self.host = torch.device(host)
        self.optimizers = list(optimizers)
        self.params: dict[int, nn.Parameter] = {}
        self.owners: list[tuple[nn.Module, str, str]] = []  # (module, attribute, qualified name)
        self.notes: list[str] = []
        self._find()

    def _find(self) -> None:
        for name in self.names:
            for p in self.root.get_submodule(name).parameters():
                self.params[id(p)] = p
        seen: set[int] = set()
        for qual, module in self.root.named_modules(remove_duplicate=False):
            if id(module) in seen:
                continue
            seen.add(id(module))
            for attr, p in module._parameters.items():
                if p is not None and id(p) in self.params:
                    self.owners.append((module, attr, f"{qual}.{attr}" if qual else attr))

    def tied(self) -> list[str]:
        """Parameters held outside the named modules too (tied weights), offloaded with them."""
        if "" in self.names:
            return []
        inside = tuple(f"{n}." for n in self.names)
        return [q for _, _, q in self.owners if not q.startswith(inside)]

    def refusal(self) -> str | None:
        """Why these modules cannot be offloaded, or None."""
        empty = [n for n in self.names if not any(True for _ in self.root.get_submodule(n).parameters())]
        if empty:
            return f"{', '.join(map(repr, empty))} holds no parameters"
        taken = [
            q
            for m, a, q in self.owners
            if parametrize.is_parametrized(m, a) or isinstance(m, parametrize.ParametrizationList)
        ]
        if taken:
            return f"{', '.join(taken)} already has a parametrization (torch.nn.utils.parametrize)"
        for opt in self.optimizers:
            refused = fused_refusal(opt, lambda q: id(q) in self.params, self.host)
            if refused is not None:
                return refused
        return None

    def install(self) -> Undo:
        """Offload (or raise ``ValueError`` naming why not); the undo puts everything back."""
        why = self.refusal()
        if why is not None:
            raise ValueError(why)
        undo: list[Undo] = []

        def remove() -> None:
            while undo:
                undo.pop()()

        try:
            self._install(undo)
        except BaseException:
            remove()
            raise
        return remove

    def _install(self, undo: list[Undo]) -> None:
        ids = set(self.params)
        anchors = {i: ToDevice(self.device or p.device, p.dtype) for i, p in self.params.items()}
        for p in self.params.values():
            _move(p, self._host_copy)

        def back() -> None:
            for i, p in self.params.items():
                device = anchors[i].device  # where the module is now (it may have moved since)
                _move(p, _copier(device))
            for opt in self.optimizers:
                state_to(opt, lambda q: q.device, only=ids)

        undo.append(back)
        for opt in self.optimizers:
            notes, flags_undo = host_capturable(opt, lambda q: id(q) in ids)
            self.notes += notes
            undo.append(flags_undo)
            state_to(opt, lambda q: self.host, only=ids)  # state made before (a resumed optimizer)
            undo.append(_synchronizing(opt, list(anchors.values())))
        first: set[int] = set()
        for module, attr, _ in self.owners:
            held = module._parameters[attr]
            assert held is not None
            p = held
            # a tied parameter's other holders copy it in themselves: their own parametrization
            to_device = anchors[id(p)] if id(p) not in first else ToDevice(anchors[id(p)].device, p.dtype)
            first.add(id(p))
            undo.append(_parametrize(module, attr, to_device))

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        return host_buffer(t, self.host).copy_(t)


def _copier(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(device)


def _move(p: nn.Parameter, to: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace ``p``'s storage (and its gradient's) with ``to(...)`` of it, the Parameter object kept."""
    with torch.no_grad():
        grad = p.grad
        p.grad = None  # a gradient must sit on its parameter's device: unset across the move
        p.data = to(p.detach())
        if grad is not None:
            p.grad = to(grad)


def _synchronizing(opt: torch.optim.Optimizer, anchors: list[ToDevice]) -> Undo:
    """Before each step, wait for the device: the step updates host parameters in place, which an earlier
    non_blocking copy to the device (say, of a forward never backpropagated) may still be reading."""

    def wait(optimizer: Any, args: Any, kwargs: Any) -> None:
        _synchronize({a.device for a in anchors})

    return opt.register_step_pre_hook(wait).remove


def _parametrize(module: nn.Module, attr: str, to_device: ToDevice) -> Undo:
    """Register ``to_device`` on ``module.attr`` (the Parameter object kept as
    ``parametrizations.<attr>.original``), keep it on the host through ``module.to(...)``, and keep the
    state_dict's key ``attr``; the undo restores the module, its class and the Parameter."""
    parametrize.register_parametrization(module, attr, to_device, unsafe=True)
    plist = cast(nn.Module, module.parametrizations[attr])  # type: ignore[index]

    def apply_to_children(fn: Callable[..., Any], recurse: bool = True) -> nn.Module:
        for child in plist.children():  # the ToDevice anchors follow the module; ``original`` stays
            child._apply(fn)
        return plist

    plist._apply = apply_to_children  # type: ignore[method-assign]
    inner = f"parametrizations.{attr}.original"

    def saved(mod: nn.Module, state: dict[str, Any], prefix: str, meta: Any) -> None:
        if prefix + inner in state:
            state[prefix + attr] = state.pop(prefix + inner)

    def loading(mod: nn.Module, state: dict[str, Any], prefix: str, *rest: Any) -> None:
        if prefix + attr in state:
            state[prefix + inner] = state.pop(prefix + attr)

    handles = [module.register_state_dict_post_hook(saved), module.register_load_state_dict_pre_hook(loading)]

    def undo() -> None:
        for handle in handles:
            handle.remove()
        if parametrize.is_parametrized(module, attr):
            parametrize.remove_parametrizations(module, attr, leave_parametrized=False)

    return undo


def install_offload(
    root: nn.Module,
    parameters: Iterable[str],
    optimizers: list[torch.optim.Optimizer],
    undo: list[Undo],
) -> tuple[ParameterOffload | None, list[OptimizerOffload]]:
    """A plan's offload on ``root``, for ``memdoctor run`` and ``memdoctor.apply`` alike: the named
    modules' parameters first (their optimizer state does not exist yet, or follows them), then the
    state of each of ``optimizers`` (empty: no optimizer-state offload), with the host-resident
    parameters stepping in place. Each undo goes onto ``undo`` as it is installed, so a later failure
    leaves nothing the caller cannot remove; ValueError names the part that cannot apply."""
    names = list(parameters)
    params, resident = None, []
    if names:
        params = ParameterOffload(root, names, optimizers=optimizers)
        try:
            undo.append(params.install())
        except ValueError as exc:
            raise ValueError(f"offload_parameters: {exc}") from None
        resident = list(params.params.values())
    offloads = []
    for opt in optimizers:
        offload = OptimizerOffload(opt, resident=resident)
        try:
            undo.append(offload.install())
        except ValueError as exc:
            raise ValueError(f"optimizer: offload: {exc}") from None
        offloads.append(offload)
    return params, offloads
