"""The host's optimizer rate: how fast torch's foreach AdamW steps on this machine's CPU.

Why: under full offload (``full_offload``: FSDP2 with CPU offload) the optimizer steps on the host, and
that step is a large part of the step time (17.6 GB of parameters, gradients and state took 1.5-1.8 s on
the H200 host's 16 cores). A fixed assumption is wrong on any other host (2 shared cores step 8x
slower), so the profile measures it where it can matter: a CUDA run whose model state (parameters,
gradients, optimizer state) exceeds the device budget, the case the planner considers full offload for
(``plan.tiers.full_offload_configs``). Never on a CPU run, nor where the state fits: it costs nothing
there.

The test: one foreach AdamW step over ``HOST_OPTIMIZER_BYTES`` of parameters, gradients and state (a
warm-up step creates the state, then the median of ``HOST_OPTIMIZER_REPEATS`` timed steps): well under
half a second on a GPU host, once per run: torch's own optimizer on fresh fp32 tensors (the script's own
are not touched). The state is sized past a server CPU's last-level cache, whose rate a smaller test
would measure instead of memory's.
"""

from __future__ import annotations

import statistics
import time
import weakref
from typing import Any

import torch

# Parameters + gradients + two AdamW moments stepped by the test (fp32: 16 bytes a parameter), in
# tensors of ``TENSOR_BYTES`` each (a model's parameters are many tensors: foreach groups them).
HOST_OPTIMIZER_BYTES = 128 * 2**20
HOST_OPTIMIZER_REPEATS = 3
TENSOR_BYTES = 4 * 2**20
# The share of the budget a model state must exceed for full offload to be plausible (the planner
# keeps 10% of the budget free: ``plan.target.SAFETY_MARGIN``).
PLAUSIBLE_SHARE = 0.9
# Optimizers holding two moments per parameter (torch's Adam family): counted in the state estimate.
# The same set as ``memdoctor.plan.reprofiled``'s (capture and plan import neither; a test keeps them equal).
TWO_MOMENT_OPTIMIZERS = frozenset({"Adam", "AdamW", "NAdam", "RAdam", "Adamax"})
# memdoctor's own optimizers: torch's optimizer-step hooks are global, so the session's step hooks
# (``memdoctor.capture.optimizersteps``) would take this test's steps for the script's. On the H200 a
# 1.1B decoder that died in its first forward got a "complete" step 0 from it, and a plan built as if
# the whole model had run.
OWN_OPTIMIZERS: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def measure_host_optimizer(nbytes: int = HOST_OPTIMIZER_BYTES) -> dict[str, Any]:
    """The ``host_optimizer`` facts: bytes of parameters + gradients + state a foreach AdamW step on the
    CPU moves per second (the planner's ``CPU_OPTIMIZER_BYTES_PER_S``), with what was stepped and the
    CPU threads torch uses."""
    floats = max(1, nbytes // 16)  # a parameter, its gradient and two moments: 4 fp32 values
    size = max(1, min(floats, TENSOR_BYTES // 4))
    params = [torch.zeros(size, requires_grad=True) for _ in range(max(1, floats // size))]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    OWN_OPTIMIZERS.add(opt)
    times = []
    for i in range(HOST_OPTIMIZER_REPEATS + 1):
        start = time.perf_counter()
        opt.step()
        if i:  # the first step creates the state
            times.append(time.perf_counter() - start)
    stepped = 16 * size * len(params)
    return {
        "bytes_per_s": int(stepped / max(statistics.median(times), 1e-9)),
        "bytes": stepped,
        "repeats": HOST_OPTIMIZER_REPEATS,
        "threads": torch.get_num_threads(),
        "optimizer": "AdamW (foreach, fp32)",
    }


def state_estimate(roots: list[torch.nn.Module], optimizers: list[str], device_type: str = "cuda") -> int:
    """The model state on devices of ``device_type`` at the models' discovery: their parameters there, a
    gradient per trainable parameter byte, and two moments per gradient byte unless the optimizers seen
    are known not to be of Adam's family (the planner's own assumption when no optimizer step was
    measured)."""
    params = trainable = 0
    seen: set[int] = set()
    for root in roots:
        for p in root.parameters():
            if id(p) in seen or p.device.type != device_type:
                continue
            seen.add(id(p))
            params += p.numel() * p.element_size()
            trainable += p.numel() * p.element_size() if p.requires_grad else 0
    adam = not optimizers or set(optimizers) <= TWO_MOMENT_OPTIMIZERS
    return params + trainable + (2 * trainable if adam else 0)


def worth_measuring(kind: str, state: int, budget: int | None) -> bool:
    """Whether the host's optimizer rate can matter to the plan: on a CUDA device whose budget the model
    state exceeds (full offload's case; with the planner's safety margin: a state at 90% of it too)."""
    return kind == "cuda" and budget is not None and state > PLAUSIBLE_SHARE * budget
