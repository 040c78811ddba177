"""Prediction accuracy of the planner (issue 4, point 6): predicted vs measured peak on the GPU.

Run on a CUDA machine from the repository root (not run in CI; the lead runs it on the device):

    python benchmarks/plan_accuracy.py --out /tmp/plan-accuracy [--workloads bert,gpt2,vit,llama]

For each workload it (1) profiles the unchanged training step with ``memdoctor profile`` (this very
script in ``--train`` mode), (2) asks the planner for a plan at several budgets and also builds fixed
what-ifs (checkpoint every block, micro-batch 1/2, bf16 autocast, 8-bit optimizer state where
bitsandbytes is installed), (3) runs each config bare in its own process, with the config applied
(``torch.utils.checkpoint`` around the named modules, gradient accumulation, autocast), and records
``torch.cuda.max_memory_allocated()`` / ``max_memory_reserved()`` over the steps after warm-up, and
(4) prints predicted vs measured with the error; results go to OUT/results.json.

Target (issue 4): mean absolute error <= 5% and no under-prediction worse than 5% (an under-prediction
is an OOM for the user).

``--train`` mode (what the child processes run): ``--workload NAME --config JSON --steps N``; prints one
JSON line with the measured peaks. ``--device cpu --tiny`` runs the whole pipeline as a smoke test
(peaks are then not measured).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GiB = 1024**3


# ----------------------------------------------------------------------------------------- workloads


def build(name: str, tiny: bool, device: Any) -> tuple[Any, Any]:
    """``(model, make_batch)`` for a workload; ``make_batch(batch_size)`` returns the model's kwargs."""
    import torch
    import transformers as tf

    if name == "bert":
        cfg = tf.BertConfig(num_labels=2, attn_implementation="sdpa")
        if tiny:
            cfg = tf.BertConfig(
                hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
            )
        model, seq, vocab = tf.BertForSequenceClassification(cfg), (64 if tiny else 512), cfg.vocab_size

        def batch(b: int) -> dict[str, Any]:
            ids = torch.randint(1, vocab, (b, seq), device=device)
            return {"input_ids": ids, "labels": torch.randint(0, 2, (b,), device=device)}

        return model.to(device), batch
    if name == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000) if tiny else tf.GPT2Config()
        model, seq = tf.GPT2LMHeadModel(cfg), (64 if tiny else 512)

        def batch(b: int) -> dict[str, Any]:
            ids = torch.randint(0, cfg.vocab_size, (b, seq), device=device)
            return {"input_ids": ids, "labels": ids}

        return model.to(device), batch
    if name == "vit":  # the same model as benchmarks/workloads/vit_train.py
        cfg = _workload("vit_train").build_config(tiny)
        model = tf.ViTForImageClassification(cfg)

        def batch(b: int) -> dict[str, Any]:
            px = torch.randn(b, 3, cfg.image_size, cfg.image_size, device=device)
            return {"pixel_values": px, "labels": torch.randint(0, 10, (b,), device=device)}

        return model.to(device), batch
    if name == "llama":  # the ~1B decoder of benchmarks/workloads/llama_decoder.py
        cfg = _workload("llama_decoder").build_config(tiny)
        model, seq = tf.LlamaForCausalLM(cfg), (64 if tiny else 1024)

        def batch(b: int) -> dict[str, Any]:
            ids = torch.randint(0, cfg.vocab_size, (b, seq), device=device)
            return {"input_ids": ids, "labels": ids}

        return model.to(device), batch
    raise SystemExit(f"unknown workload {name!r}")


def _workload(name: str) -> Any:
    """A module of benchmarks/workloads/ (run as scripts there, so their folder goes on the path)."""
    import importlib

    folder = str(Path(__file__).resolve().parent / "workloads")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


BATCH = {"bert": 32, "gpt2": 8, "vit": 64, "llama": 4}
TINY_BATCH = {"bert": 4, "gpt2": 2, "vit": 4, "llama": 2}
# Plan levers this benchmark's training loop does not apply (the allocator is set in ``child``); a
# config using one is skipped rather than measured without it.
UNAPPLIED = ("padding", "offload_parameters", "attention")


def apply_checkpoints(model: Any, names: list[str]) -> None:
    """Wrap each named module's forward in non-reentrant ``torch.utils.checkpoint``."""
    import torch.utils.checkpoint as cp

    modules = dict(model.named_modules())
    for name in names:
        mod = modules[name]
        inner = mod.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            return cp.checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        mod.forward = forward


class OffloadedAdamW:
    """Optimizer-state offload as the planner means it: AdamW and fp32 master copies of the parameters
    live on the CPU; each step copies the gradients to the host, steps there and copies the parameters
    back (what ZeRO-Offload does, without DeepSpeed). Nothing of the optimizer stays on the GPU."""

    def __init__(self, params: Any, lr: float) -> None:
        import torch

        self.params = [p for p in params if p.requires_grad]
        self.host = [torch.nn.Parameter(p.detach().to("cpu", copy=True)) for p in self.params]
        self.opt = torch.optim.AdamW(self.host, lr=lr)

    def step(self) -> None:
        for p, h in zip(self.params, self.host, strict=True):
            h.grad = None if p.grad is None else p.grad.to("cpu")
        self.opt.step()
        for p, h in zip(self.params, self.host, strict=True):
            p.data.copy_(h.data)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def optimizer(model: Any, kind: str) -> Any:
    import torch

    if kind == "8bit":
        import bitsandbytes as bnb  # optional: the config is skipped where it is not installed

        return bnb.optim.AdamW8bit(model.parameters(), lr=1e-5)
    if kind == "offload":
        return OffloadedAdamW(model.parameters(), lr=1e-5)
    if kind != "as-is":
        raise SystemExit(f"optimizer {kind!r}: not applied by this benchmark")
    return torch.optim.AdamW(model.parameters(), lr=1e-5)


def train(args: argparse.Namespace) -> None:
    """One config, bare (no memdoctor): measured peaks over the steps after the first."""
    import torch

    device = torch.device(args.device)
    torch.manual_seed(0)
    config = json.loads(args.config)
    unapplied = [k for k in UNAPPLIED if config.get(k) not in (None, "as-is", [])]
    if unapplied:  # measured without them, the comparison would be wrong: skip the config instead
        raise SystemExit(f"not applied by this benchmark: {', '.join(unapplied)}")
    model, make_batch = build(args.workload, args.tiny, device)
    model.train()
    apply_checkpoints(model, config.get("checkpoint") or [])
    opt = optimizer(model, config.get("optimizer", "as-is"))
    accum = int(config.get("accumulation_steps", 1))
    batch = (TINY_BATCH if args.tiny else BATCH)[args.workload] // accum
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.get("precision", "fp32"))
    peaks: list[tuple[int, int]] = []
    times: list[float] = []
    cuda = device.type == "cuda"
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for _ in range(accum):
            ctx = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
            with ctx:
                loss = model(**make_batch(batch)).loss / accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
        times.append((time.perf_counter() - t) * 1e3)
    rest = peaks[1:] or peaks
    print(
        json.dumps(
            {
                "max_allocated": max((a for a, _ in rest), default=None),
                "max_reserved": max((r for _, r in rest), default=None),
                "step_ms": statistics.median(times[1:] or times),
            }
        )
    )


# ----------------------------------------------------------------------------------------- the suite


def child(
    args: argparse.Namespace, workload: str, config: dict[str, Any], log: Path
) -> dict[str, Any] | None:
    cmd = [sys.executable, __file__, "--train", "--workload", workload, "--config", json.dumps(config)]
    cmd += ["--steps", str(args.steps), "--device", args.device] + (["--tiny"] if args.tiny else [])
    env = dict(os.environ)
    if config.get("allocator"):  # read once, when CUDA starts: set it for the child
        env["PYTORCH_CUDA_ALLOC_CONF"] = config["allocator"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def profile(args: argparse.Namespace, workload: str, out: Path) -> Path:
    folder = out / f"{workload}-profile"
    cmd = [
        sys.executable,
        "-m",
        "memdoctor",
        "profile",
        "--steps",
        "3",
        "-o",
        str(folder),
        "--force",
        __file__,
    ]
    cmd += [
        "--",
        "--train",
        "--workload",
        workload,
        "--config",
        "{}",
        "--steps",
        "6",
        "--device",
        args.device,
    ]
    cmd += ["--tiny"] if args.tiny else []
    subprocess.run(cmd, check=False)
    return folder / "trace.jsonl.gz"


def configs(trace_path: Path, budgets: list[int]) -> list[tuple[str, Any]]:
    """``(label, Prediction)``: the planner's plan at each budget and the fixed what-ifs."""
    from memdoctor.plan.alternatives import block_stack
    from memdoctor.plan.config import Config
    from memdoctor.plan.model import predict, workload
    from memdoctor.plan.planner import make_plan
    from memdoctor.plan.target import Target
    from memdoctor.report import build_summary
    from memdoctor.trace import load_trace

    trace = load_trace(trace_path)
    w = workload(trace, build_summary(trace))
    assert w is not None, f"{trace_path}: no memory figure"
    out: list[tuple[str, Any]] = [("as profiled", predict(w, Config()))]
    blocks = tuple(c.name for c in block_stack(trace, w))
    out.append(("checkpoint every block", predict(w, Config(checkpoint=blocks))))
    out.append(("micro-batch 1/2", predict(w, Config(accumulation_steps=2))))
    out.append(("bf16 autocast", predict(w, Config(precision="bf16"))))
    out.append(("8-bit optimizer", predict(w, Config(optimizer="8bit"))))
    for b in budgets:
        plan = make_plan(w, Target(b))
        if plan.chosen is not None and not plan.fits_as_is:
            out.append((f"plan for {b / GiB:g} GiB", plan.chosen))
    return out


def suite(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for wl in args.workloads.split(","):
        trace = profile(args, wl, out)
        peak = None
        for label, pred in configs(trace, [int(float(g) * GiB) for g in args.budgets.split(",")]):
            measured = child(args, wl, pred.config.as_dict(), out / f"{wl}-{len(rows)}.log")
            peak = (measured or {}).get("max_reserved")
            err = None if not peak else (pred.reserved_bytes - peak) / peak
            alloc = (measured or {}).get("max_allocated")
            rows.append(
                {
                    "workload": wl,
                    "config": label,
                    "predicted": pred.as_dict(),
                    "measured": measured,
                    "error_reserved": err,
                    "error_allocated": (pred.peak_bytes - alloc) / alloc if alloc else None,
                }
            )
            shown = "failed/skipped" if measured is None else f"{peak / GiB:.2f} GiB" if peak else "n/a"
            pct = "" if err is None else f" error {100 * err:+.1f}%"
            print(
                f"{wl:6} {label:28} predicted {pred.reserved_bytes / GiB:6.2f} GiB measured {shown}{pct}",
                flush=True,
            )
    errs = [r["error_reserved"] for r in rows if r["error_reserved"] is not None]
    stats = {
        "pairs": len(errs),
        "mean_abs_error": statistics.mean(abs(e) for e in errs) if errs else None,
        "worst_under_prediction": min(errs, default=None),
    }
    (out / "results.json").write_text(json.dumps({"rows": rows, "stats": stats}, indent=2, sort_keys=True))
    print(json.dumps(stats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", action="store_true", help="child mode: run one config and print its peaks")
    ap.add_argument("--workload", default="bert")
    ap.add_argument("--config", default="{}")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny models: a CPU smoke test of the pipeline")
    ap.add_argument("--out", default="/tmp/plan-accuracy")
    ap.add_argument("--workloads", default="bert,gpt2,vit,llama")
    ap.add_argument("--budgets", default="8,6,4", help="GiB, comma-separated: the planner's budgets")
    args = ap.parse_args()
    train(args) if args.train else suite(args)


if __name__ == "__main__":
    main()
