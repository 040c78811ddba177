"""The ledger under offload: the categories count only tensors on the profiled device.

memdoctor's offload (memdoctor/levers/offload.py) keeps the optimizer's state on the host, steps the
optimizer on host copies swapped into ``p.data`` / ``p.grad`` (the profiler's optimizer hooks run inside
that swapped step), and keeps chosen modules' parameters and their gradients on the host for good. None
of those host tensors is in the GPU allocator, so none may be in ``parameters``, ``gradients`` or
``optimizer_state`` (else ``other`` = allocator − ledger goes negative, as it did on the H200).

On a CPU machine host and device are one, so the integration tests stand a predicate in for "on the
device" (``ProfileSession._resident``): every tensor is on the device except the host ones offload
made, which are known by storage (the host master copies and gradient buffers, the optimizer's state,
the offloaded parameters and their gradients). ``MEMDOCTOR_TEST_DEVICE=cuda python -m pytest
tests/test_ledger_offload.py`` runs the same tests on a GPU with the session's own CUDA test and no
stand-in, and checks ``other`` is not negative.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from memdoctor.capture.discovery import storage_key
from memdoctor.capture.session import ProfileSession, resident_check
from memdoctor.device import CudaDevice, Device, FakeDevice
from memdoctor.levers.offload import OptimizerOffload, ParameterOffload
from memdoctor.trace import StepRecord

DEVICE = torch.device(os.environ.get("MEMDOCTOR_TEST_DEVICE", "cpu"))  # where the model runs
ON_GPU = DEVICE.type == "cuda"
F32 = 4
EMBED, MID, HEAD = 20 * 8 * F32, (8 * 8 + 8) * F32, 20 * 8 * F32  # Tiny's parameters, in bytes


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(ids))))


class _CudaStub(FakeDevice):
    """A GPU session's device without a GPU: kind "cuda", no index."""

    kind = "cuda"


class _Indexed:
    """Stands in for a tensor on GPU ``index`` (``resident_check`` reads ``get_device()`` only)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def get_device(self) -> int:
        return self.index


def test_resident_check_counts_every_tensor_on_a_cpu_session_and_only_the_gpus_on_a_cuda_one() -> None:
    assert resident_check(Device()) is None  # CPU: host and device are one
    assert resident_check(FakeDevice()) is None  # the tests' GPU stand-in keeps CPU tensors counted
    any_gpu = resident_check(_CudaStub())
    assert any_gpu is not None
    assert not any_gpu(torch.zeros(2)) and not any_gpu(torch.zeros(2, device="meta"))
    gpu1 = _CudaStub()
    gpu1.index = 1  # type: ignore[attr-defined]
    on_gpu1 = resident_check(gpu1)
    assert on_gpu1 is not None
    assert on_gpu1(_Indexed(1)) and not on_gpu1(_Indexed(0))  # type: ignore[arg-type]
    assert not on_gpu1(torch.zeros(2))  # a host tensor (get_device() is -1)
    if ON_GPU:
        here = resident_check(CudaDevice())
        assert here is not None and here(torch.zeros(2, device=DEVICE)) and not here(torch.zeros(2))


def _host_tensors(
    opt: torch.optim.Optimizer, opt_off: OptimizerOffload, par_off: ParameterOffload
) -> Callable[[Any], bool]:
    """The stand-in for "on the device" on a CPU: not one of the host tensors offload made."""

    def host() -> set[int]:
        out = set()
        for master, grad_buffer in opt_off._buffers.values():
            out |= {storage_key(t) for t in (master, grad_buffer) if t is not None}
        for state in opt.state.values():
            out |= {storage_key(v) for v in state.values() if isinstance(v, torch.Tensor)}
        for p in par_off.params.values():
            out |= {storage_key(t) for t in (p, p.grad) if t is not None}
        return out

    return lambda t: storage_key(t) not in host()


def _profile(
    start_late: bool = False, steps: int = 3, device: Device | None = None
) -> tuple[list[StepRecord], ProfileSession, list[Any]]:
    """Profile Tiny with AdamW's state on the host and the embedding's parameters on the host.

    ``start_late``: the session starts between the first backward and its optimizer step, so the model
    is first found, and its parameters first counted, inside the swapped step. ``device``: the session's
    on a CPU (default ``Device()``); on a GPU always the GPU."""
    torch.manual_seed(0)
    model = Tiny().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    par_off = ParameterOffload(model, ["embed"], device=DEVICE, host="cpu", optimizers=[opt])
    undo_params = par_off.install()
    opt_off = OptimizerOffload(opt, host="cpu", resident=par_off.params.values())
    undo_opt = opt_off.install()
    records: list[dict[str, Any]] = []
    session = ProfileSession(
        steps=steps, warmup=1, device=CudaDevice() if ON_GPU else device or Device(), sink=records.append
    )
    if not ON_GPU:  # the stand-in; an attribute the old code lacked, so its figures are checked as they are
        session._resident = _host_tensors(opt, opt_off, par_off)  # type: ignore[assignment]
    # what the history ledger is told the step's gradients are (its known addresses), and the real ones
    known: list[tuple[int, set[int]]] = []  # (step, addresses): ledger steps only
    real: list[set[int]] = []  # one a training step (the session's step i is iteration i)
    by_module = session._grads_by_module

    def grads_by_module() -> dict[tuple[int, int], int]:
        out = by_module()
        known.append((session._step_index, set(session._data.grad_ptrs)))
        return out

    session._grads_by_module = grads_by_module  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    try:
        for i in range(steps + 3):
            if i == 0 and not start_late:
                session.start()
            ids = torch.randint(0, 20, (4, 6), generator=g).to(DEVICE)
            nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
            if i == 0 and start_late:
                session.start()
            real.append({storage_key(p.grad) for p in (*model.mid.parameters(), model.head.weight)})
            opt.step()
            opt.zero_grad(set_to_none=True)
            if session._done:
                break
        session.finish()
        masters = [m for m, _ in opt_off._buffers.values()]
        # the state seen from outside the swapped step, while the offload is installed (undoing it
        # brings AdamW's state back to the device)
        session.scan_outside = session._scan_opt_state()  # type: ignore[attr-defined]
    finally:
        session.stop()
        undo_opt()
        undo_params()
    steps_ = {r["step"]: StepRecord.from_record(r) for r in records if r["type"] == "step"}
    session.grad_addresses = (known, real)  # type: ignore[attr-defined]
    return [steps_[k] for k in sorted(steps_)], session, masters


def _column(step: StepRecord, session: ProfileSession, col: str) -> dict[str, int]:
    names = session.models[0].info.names
    return {n: v for n, v in zip(names, step.modules[0][col], strict=True) if v}


def _opt_pre(step: StepRecord) -> int:
    return step.timeline["event"].index("opt_pre")  # type: ignore[union-attr]


def test_offloaded_state_parameters_and_gradients_are_not_device_memory() -> None:
    records, session, masters = _profile()
    profiled = [r for r in records if not r.warmup and r.detail == "full"]
    assert profiled, [r.detail for r in records]
    for step in profiled:
        tl = step.timeline
        cats = step.memory["categories_at_peak"]
        # AdamW's state is on the host, also while the optimizer's hooks run inside its swapped step
        assert set(tl["optimizer_state"]) == {0}, tl["optimizer_state"]  # type: ignore[arg-type]
        assert cats["optimizer_state"] == 0
        assert _column(step, session, "optimizer_state_bytes") == {}
        # the embedding's parameters live on the host; the host masters of the swap are not parameters
        assert set(tl["parameters"]) == {MID + HEAD}, tl["parameters"]  # type: ignore[arg-type]
        # at the optimizer step the device gradients of mid and head are held by the swap (counted),
        # the embedding's accumulates on the host (not)
        assert tl["gradients"][_opt_pre(step)] == MID + HEAD  # type: ignore[index]
        assert _column(step, session, "grad_bytes") == {"mid": MID, "head": HEAD}
        if ON_GPU:
            assert cats["other"] is not None and cats["other"] >= 0, cats
    assert session._params_bytes == MID + HEAD
    assert not {storage_key(m) for m in masters} & set(session._param_ptrs)
    # the allocator-history ledger knows the device gradients the swap holds, by address (from the
    # gradient hooks, installed once the model is found: at the first optimizer step, so not in step 0)
    known, real = session.grad_addresses  # type: ignore[attr-defined]
    later = [(step, ptrs) for step, ptrs in known if step > 0]
    assert len(later) >= 2 and all(ptrs == real[step] for step, ptrs in later), (known, real)


def test_the_optimizer_state_cached_inside_the_swapped_step_is_what_a_scan_outside_it_finds() -> None:
    _, session, _ = _profile()
    assert session._opt_cache is not None
    _, by_module, total, ptrs = session._opt_cache  # scanned inside the swapped step (the post hook)
    assert (by_module, total, ptrs) == session.scan_outside  # type: ignore[attr-defined]
    assert total == 0 and session._opt_bytes == 0


def test_parameters_first_found_inside_the_swapped_step_are_counted_where_they_live() -> None:
    records, session, masters = _profile(start_late=True)
    assert session._params_bytes == MID + HEAD
    assert not {storage_key(m) for m in masters} & set(session._param_ptrs)
    later = [r for r in records if not r.warmup and r.detail == "full"]
    assert later and all(set(r.timeline["parameters"]) == {MID + HEAD} for r in later)  # type: ignore[arg-type]


def test_timing_steps_count_the_swapped_gradients_at_the_optimizer_step() -> None:
    """Steps between the ledger steps have no gradient hooks: their gradients are counted inside the
    swapped step, from the parameters known to live on the device."""
    records, _, _ = _profile(steps=4, device=_CudaStub())
    timing = [r for r in records if r.detail == "timing"]
    assert timing, [r.detail for r in records]
    for step in timing:
        tl = step.timeline
        assert tl["gradients"][_opt_pre(step)] == MID + HEAD  # type: ignore[index]
        assert set(tl["optimizer_state"]) == {0}  # type: ignore[arg-type]
        assert set(tl["parameters"]) == {MID + HEAD}  # type: ignore[arg-type]


@pytest.mark.skipif(ON_GPU, reason="the CPU session's behaviour; on a GPU the tests above check CUDA's")
def test_a_cpu_session_counts_host_tensors_each_once() -> None:
    """Without the stand-in, a CPU session counts host tensors (host and device are one memory), but
    the master copies the swapped step runs on are not parameters: the parameters count once."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    undo = OptimizerOffload(opt, host="cpu").install()
    records: list[dict[str, Any]] = []
    session = ProfileSession(steps=2, warmup=1, sink=records.append)
    try:
        with session:
            for _ in range(4):
                ids = torch.randint(0, 20, (4, 6))
                nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if session._done:
                    break
    finally:
        undo()
    last = StepRecord.from_record([r for r in records if r["type"] == "step"][-1])
    params = EMBED + MID + HEAD
    assert set(last.timeline["parameters"]) == {params}  # type: ignore[arg-type]
    assert last.timeline["gradients"][_opt_pre(last)] == params  # type: ignore[index]
    # exp_avg and exp_avg_sq of each parameter, and the step counters (a CPU tensor each)
    assert last.memory["categories_at_peak"]["optimizer_state"] >= 2 * params
