"""One rank of the two-process engine tests (``tests/test_engines_*.py``): a tiny model under DDP or
FSDP2 on gloo, trained a few steps in a ``ProfileSession`` writing that rank's trace to
``OUT/rank-K/trace.jsonl.gz`` (no report: matplotlib would cost seconds a rank) and, beside it, what
the tensors held (``truth.json``), measured here with no help from memdoctor: the storages of the
parameters, gradients and optimizer state (each once), DDP's buckets as a comm hook sees them, and
FSDP2's gathered parameters as the modules hold them mid-forward.

Started with ``torch.multiprocessing.start_processes`` (fork: the children share the test's imported
torch, so a test costs its training, not two imports).
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memdoctor.capture import link
from memdoctor.capture.session import ProfileSession
from memdoctor.trace import TRACE_FILENAME, TraceWriter, load_trace, make_end, make_header

STEPS, WARMUP = 3, 1
ITERATIONS = WARMUP + STEPS + 1  # the forward after the last profiled step ends it
UNEVEN_WAIT_S = 1.0
WATCHED = "blocks.1.fc2"  # the module at whose forward the FSDP2 test reads the gathered buffers


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(32, 5)  # 5 rows: FSDP2 pads the shards of 2 ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def launch(out: Path, engine: str, option: bool, uneven: bool = False) -> None:
    """Run ``run`` on two ranks (fork), each writing ``out/rank-K``."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(run, args=(2, port, str(out), engine, option, uneven), nprocs=2, start_method="fork")


def run(rank: int, world: int, port: int, out: str, engine: str, option: bool, uneven: bool) -> None:
    """``engine``: ``ddp`` (``option``: gradient_as_bucket_view) or ``fsdp2`` (``option``:
    reshard_after_forward). ``uneven``: rank 1 profiles one step fewer, so the ranks reach the link
    measurement at different steps, and each may wait for the other only ``UNEVEN_WAIT_S``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if uneven:
        link.WAIT_S = UNEVEN_WAIT_S
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    net = Net()
    buckets: dict[int, int] = {}
    if engine == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=option)
        model.register_comm_hook(buckets, _bucket_hook)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block, reshard_after_forward=option)
        model = fully_shard(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    truth: dict[str, Any] = {"steps": [], "forward": []}
    watched = dict(net.named_modules())[WATCHED]
    watched.register_forward_hook(lambda *_: truth["forward"].append(_gathered(net)))
    gen = torch.Generator().manual_seed(rank)
    folder = Path(out) / f"rank-{rank}"
    folder.mkdir(parents=True)
    writer = TraceWriter(folder / TRACE_FILENAME, fsync=False)
    writer.write(make_header(device={"kind": "cpu"}, settings={"warmup": WARMUP, "steps": STEPS}))
    steps = STEPS - 1 if uneven and rank == 1 else STEPS
    with ProfileSession(steps=steps, warmup=WARMUP, sink=writer.write) as session:
        for _ in range(ITERATIONS):
            buckets.clear()
            loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
            loss.backward()
            opt.step()
            truth["steps"].append(_held(net, opt, buckets))
            opt.zero_grad(set_to_none=True)
    end = make_end(status="completed", message="", steps_recorded=session.steps_recorded, duration_s=0.0)
    writer.write({"type": "end", **end})
    writer.close()
    (folder / "truth.json").write_text(json.dumps(truth))
    dist.destroy_process_group()


def _bucket_hook(seen, bucket):  # type: ignore[no-untyped-def]  # DDP reads the annotations: none
    """DDP's own all-reduce, averaged as DDP does, noting each bucket's storage."""
    buf = bucket.buffer()
    seen[buf.untyped_storage().data_ptr()] = buf.untyped_storage().nbytes()
    buf.div_(dist.get_world_size())
    work = dist.all_reduce(buf, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _storages(tensors: list[torch.Tensor]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        if st.nbytes():
            out[st.data_ptr()] = st.nbytes()
    return out


def _held(net: nn.Module, opt: torch.optim.Optimizer, buckets: dict[int, int]) -> dict[str, int]:
    """What the tensors hold after the optimizer step, each storage once."""
    params = _storages(list(net.parameters()))
    grads = _storages([p.grad for p in net.parameters() if p.grad is not None])
    state = _storages([v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
    return {
        "parameters": sum(params.values()),
        "gradients_and_buckets": sum({**grads, **buckets}.values()),
        "bucket_storages": sum(buckets.values()),
        "gradient_storages": sum(grads.values()),
        "optimizer_state": sum(state.values()),
    }


def _gathered(net: nn.Module) -> int:
    """FSDP2's unsharded parameters held now: the parameters the modules hold as plain tensors (a
    gathered module's are; a resharded one's are DTensor shards), plus the all-gather output FSDP2
    keeps for the next copy-out and the reduce-scatter inputs it keeps, each storage once."""
    plain = [p for p in net.parameters() if not hasattr(p, "to_local")]
    held = _storages(plain)
    for m in net.modules():
        state = getattr(m, "_get_fsdp_state", None)
        ctx = getattr(state(), "_comm_ctx", None) if state else None
        if ctx is None:
            continue
        if ctx.all_gather_state is not None:
            held.update(_storages([ctx.all_gather_state.all_gather_result.all_gather_output]))
        held.update(_storages([s.reduce_scatter_input for s in ctx.reduce_scatter_states]))
    return sum(held.values())


def load(out: Path, rank: int) -> tuple[Any, dict[str, Any]]:
    """(the rank's trace, what its tensors held)."""
    folder = out / f"rank-{rank}"
    return load_trace(folder / TRACE_FILENAME), json.loads((folder / "truth.json").read_text())
