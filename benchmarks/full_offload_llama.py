"""Issue 15, point 4: a ~1.1B Llama-style decoder whose fp32 parameters and gradients alone exceed an 8 GiB
card (4.4 GB + 4.4 GB, AdamW state 8.8 GB), trained under accelerate or in a plain loop.

The same file is the unmodified workload and the hand configuration with the same engine:

- as the workload (no ``--hand-*`` flag), for memdoctor::

      memdoctor profile --budget 8GiB benchmarks/full_offload_llama.py -- --accelerate --steps 6
      memdoctor run --config memdoctor-report/memdoctor.yaml benchmarks/full_offload_llama.py -- \\
          --accelerate --steps 12 --timing-file /tmp/memdoctor.jsonl

- as the hand configuration, under the same cap (``--memory-cap-gib``:
  ``torch.cuda.set_per_process_memory_fraction``, as ``memdoctor profile --budget`` caps)::

      python benchmarks/full_offload_llama.py --accelerate --memory-cap-gib 8 --hand-offload \\
          --hand-checkpoint --steps 12 --timing-file /tmp/hand.jsonl   [--bf16]

  ``--hand-offload`` applies FSDP2 ``fully_shard`` with ``CPUOffloadPolicy`` itself (each decoder layer,
  then the root; one process, a gloo+NCCL group of one), ``--hand-checkpoint`` HF's own gradient
  checkpointing of every layer, ``--bf16`` autocast.

Each step appends ``{"step", "step_ms", "optimizer_ms", "reserved_bytes", "allocated_bytes"}`` to
``--timing-file``;
``optimizer_ms`` is the optimizer step alone (under full offload: AdamW on the host; with the state
bytes it calibrates ``memdoctor.plan.timing.CPU_OPTIMIZER_BYTES_PER_S``, printed at the end).

Hidden 2048, 22 layers, 32 heads with 4 key/value heads, MLP 5632, vocabulary 32000 (TinyLlama's
shape): 1.10B parameters; batch 4 x 1024 tokens; random weights, nothing downloaded. ``--tiny`` is a
2-layer, 64-wide model for a CPU smoke run (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=None, help="default 4 (2 with --tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="default 1024 (32 with --tiny)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps to run")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64: a CPU smoke run")
    p.add_argument("--accelerate", action="store_true", help="the loop under accelerate's Accelerator")
    p.add_argument("--bf16", action="store_true", help="forward and loss under torch.autocast(bfloat16)")
    p.add_argument("--hand-offload", action="store_true", help="FSDP2 fully_shard + CPUOffloadPolicy by hand")
    p.add_argument("--hand-checkpoint", action="store_true", help="HF gradient checkpointing of every layer")
    p.add_argument("--memory-cap-gib", type=float, default=None, help="cap this process's CUDA memory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--timing-file", default=None, metavar="PATH", help="append per-step JSON lines")
    args = p.parse_args(argv)
    args.batch_size = args.batch_size or (2 if args.tiny else 4)
    args.seq_len = args.seq_len or (32 if args.tiny else 1024)
    return args


def build_config(tiny: bool) -> LlamaConfig:
    if tiny:
        return LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
        )
    return LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
    )


def hand_offload(model: torch.nn.Module) -> None:
    """What an expert types for one GPU: a process group of one, each layer sharded with CPU offload,
    then the root (before the optimizer is built over the sharded parameters)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in model.model.layers:
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)


def cap_memory(gib: float | None, device: torch.device) -> None:
    if gib is None or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), index)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state the step reads (DTensors: their local shards; a gradient
    counted as its parameter's size: zero_grad has freed them by now)."""
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            tensors = [p, p, *optimizer.state.get(p, {}).values()]
            total += sum(_local(t).numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class Timer:
    def __init__(self, path: str | None, device: torch.device) -> None:
        self.sync = device.type == "cuda"
        self.file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115
        self.rows: list[dict[str, Any]] = []
        self.last = self.now()

    def now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def step_end(self, step: int, optimizer_ms: float) -> None:
        now = self.now()
        reserved = torch.cuda.max_memory_reserved() if self.sync else None
        allocated = torch.cuda.max_memory_allocated() if self.sync else None
        row = {"step": step, "step_ms": round((now - self.last) * 1e3, 3)}
        row["optimizer_ms"] = round(optimizer_ms, 3)
        row["reserved_bytes"] = reserved
        row["allocated_bytes"] = allocated
        self.rows.append(row)
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        self.last = now


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(args.device)
    cap_memory(args.memory_cap_gib, device)
    accelerator = None
    if args.accelerate:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=device.type == "cpu")
    config = build_config(args.tiny)
    model = LlamaForCausalLM(config)  # on the host: the device copy comes from .to or accelerate
    model.train()
    if args.hand_checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.hand_offload:
        hand_offload(model)
    elif accelerator is None:
        model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(0)
    timer = Timer(args.timing_file, device)
    autocast = torch.autocast(device.type, torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    loss = None
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=g).to(device)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        if accelerator is not None:
            accelerator.backward(loss)
        else:
            loss.backward()
        started = timer.now()
        optimizer.step()
        optimizer_ms = (timer.now() - started) * 1e3
        optimizer.zero_grad(set_to_none=True)
        timer.step_end(step, optimizer_ms)
    report(args, timer, optimizer, loss)


def report(args: argparse.Namespace, timer: Timer, optimizer: torch.optim.Optimizer, loss: Any) -> None:
    """Samples/s from the median of the steps after the first two, the peak reserved memory, and the
    host optimizer's rate in bytes of state per second (to calibrate the planner's assumption)."""
    rows = timer.rows[2:] or timer.rows
    step_ms = statistics.median(r["step_ms"] for r in rows)
    opt_ms = statistics.median(r["optimizer_ms"] for r in rows)
    stepped = state_bytes(optimizer)
    out = {
        "samples_per_s": round(args.batch_size * 1e3 / step_ms, 3),
        "step_ms": step_ms,
        "optimizer_ms": opt_ms,
        "state_bytes": stepped,
        "optimizer_bytes_per_s": round(stepped / (opt_ms / 1e3)) if opt_ms else None,
        "max_reserved_bytes": timer.rows[-1]["reserved_bytes"],
        "max_allocated_bytes": timer.rows[-1]["allocated_bytes"],
        "last_loss": None if loss is None else round(loss.detach().item(), 4),
        "cpu_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
