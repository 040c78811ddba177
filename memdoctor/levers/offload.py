"""Offload for ``memdoctor run`` and ``memdoctor.apply``: optimizer state, and chosen modules' parameters,
kept in host memory while the script trains as it wrote it.

Why not accelerate (the obvious library for it): its ``cpu_offload`` / ``AlignDevicesHook`` are inference
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

from collections.abc import Iterable

import torch
from torch import nn

from memdoctor.levers.offload_optimizer import OptimizerOffload
from memdoctor.levers.offload_parameters import ParameterOffload
from memdoctor.patching import Undo

__all__ = ["OptimizerOffload", "ParameterOffload", "install_offload"]


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
