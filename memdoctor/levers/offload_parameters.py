"""Parameter offload: chosen modules' parameters kept in pinned host memory, each read through a
``torch.nn.utils.parametrize`` parametrization (``ToDevice``) that copies it to the module's device;
autograd copies the gradient back, so it accumulates on the host (see ``memdoctor.levers.offload``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn
from torch.nn.utils import parametrize

from memdoctor.levers.modnames import submodule
from memdoctor.levers.offload_host import fused_refusal, host_buffer, host_capturable, state_to, synchronize
from memdoctor.patching import Undo


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
            for p in submodule(self.root, name).parameters():
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
        empty = [n for n in self.names if not any(True for _ in submodule(self.root, n).parameters())]
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
        synchronize({a.device for a in anchors})

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
