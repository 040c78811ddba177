"""GPT-2 small causal-LM training with the Hugging Face `Trainer`: the benchmark for framework-driven loops.

GPT-2 small (`GPT2Config()` defaults: 12 layers, 768 wide, 124M parameters), batch 8, sequences of 512
tokens, fp32 unless `--bf16`. The loop lives inside `transformers.Trainer`, so memdoctor finds the steps
through the optimizer that the Trainer wraps, not through code of ours:

    python benchmarks/workloads/gpt2_trainer.py --steps 20 --timing-file /tmp/gpt2_steps.jsonl
    memdoctor profile benchmarks/workloads/gpt2_trainer.py -- --timing-file /tmp/gpt2_steps_profiled.jsonl

`--tiny` builds a 2-layer, 64-wide GPT-2 with a 1000-token vocabulary (and, unless given, batch 2 and
length 64) for a CPU smoke run.

For `benchmarks/story_scenario.py --workload gpt2-trainer` (effective batch 16 under an 8 GiB cap), the
levers are the Trainer's own arguments: `--grad-accum N` (with `--batch-size 16/N`: micro-batching by
hand), `--gradient-checkpointing` (`TrainingArguments(gradient_checkpointing=True)`, non-reentrant; named
`activation_checkpointing` in newer transformers) and `--bf16`. `--memory-cap-gib G` (or
`STORY_MEMORY_CAP_GIB`) and `--peak-file PATH` work as in bert_story.py (the same functions): the cap is
set before the model is built, the peak JSON is written at exit, with `oom: true` after a CUDA OOM.

Timing: with `--timing-file PATH`, a `TrainerCallback.on_step_end` appends one JSON line
`{"step": i, "step_ms": ...}` to PATH after every optimizer step i (1-based, the Trainer's global_step),
flushed at once. `step_ms` is the wall time between consecutive step ends, each taken after
`torch.cuda.synchronize()` on CUDA; step 1 is timed from `on_train_begin`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from typing import Any

import torch
from bert_story import add_run_flags, apply_cap, write_peak  # the story workload's flags, cap and peak file
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)


class SyntheticText(Dataset):
    """Random token ids of full length (as when text is packed into fixed-size blocks); labels = inputs."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (size, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class StepTimingCallback(TrainerCallback):
    """Appends {"step", "step_ms"} JSON lines, one per optimizer step, flushed as they are written."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in on_train_end)
        self.last = time.perf_counter()

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.last = self._now()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        now = self._now()
        record = {"step": state.global_step, "step_ms": round((now - self.last) * 1e3, 3)}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.last = now

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.file.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=None, help="per-device batch; default 8 (2 with --tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="default 512 (64 with --tiny)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (Trainer max_steps)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): bf16 autocast")
    p.add_argument(
        "--gradient-checkpointing", action="store_true", help="TrainingArguments(gradient_checkpointing=True)"
    )
    p.add_argument("--tiny", action="store_true", help="2 layers, 64 wide, vocab 1000: a CPU smoke run")
    p.add_argument("--attn", choices=["eager", "sdpa"], default="sdpa", help="attn_implementation")
    add_run_flags(p)
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 2 if args.tiny else 8
    if args.seq_len is None:
        args.seq_len = 64 if args.tiny else 512
    return args


def build_config(args: argparse.Namespace) -> GPT2Config:
    if args.tiny:
        return GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=2,
            vocab_size=1000,
            n_positions=128,
            bos_token_id=999,
            eos_token_id=999,
            attn_implementation=args.attn,
        )
    return GPT2Config(attn_implementation=args.attn)  # GPT-2 small


def checkpointing_arguments(on: bool) -> dict[str, Any]:
    """TrainingArguments' checkpointing switch under the name this transformers reads.

    transformers 5.2x renamed ``gradient_checkpointing[_kwargs]`` to ``activation_checkpointing[_kwargs]``
    (the old names stay as deprecated mirrors); memdoctor's own HF path checkpoints non-reentrant, so the
    hand lever does too.
    """
    if not on:
        return {}
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {name: True, name + "_kwargs": {"use_reentrant": False}}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the Trainer trains
    apply_cap(device, args.memory_cap_gib)

    config = build_config(args)
    if args.seq_len > config.n_positions:
        raise SystemExit(f"--seq-len {args.seq_len} > n_positions {config.n_positions}")
    model = GPT2LMHeadModel(config)

    n_samples = args.steps * args.batch_size * args.grad_accum
    dataset = SyntheticText(n_samples, args.seq_len, config.vocab_size, seed=args.seed)
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="gpt2_trainer_"),  # nothing is saved there
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        bf16=args.bf16,
        use_cpu=device.type == "cpu",
        seed=args.seed,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        **checkpointing_arguments(args.gradient_checkpointing),
    )
    callbacks: list[TrainerCallback] = [StepTimingCallback(args.timing_file)] if args.timing_file else []
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=callbacks)
    oom = False
    try:
        result = trainer.train()
    except torch.OutOfMemoryError:
        oom = True
        raise
    finally:
        write_peak(args.peak_file, device, oom, trainer.state.global_step)
    print(f"trained {result.global_step} steps, mean loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
