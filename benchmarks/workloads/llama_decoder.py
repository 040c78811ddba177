"""A ~1B-parameter Llama-style decoder (built from a config, random weights: nothing is downloaded),
trained on next-token prediction in a plain PyTorch loop, fp32, AdamW: the model that cannot fit an
8 GiB card without offload or an 8-bit optimizer (fp32 weights 3.8 GiB, gradients as much again, AdamW
state twice that).

    memdoctor profile --budget 8GiB benchmarks/workloads/llama_decoder.py -- --steps 8

Hidden 2048, 16 layers, 16 heads, MLP 5632, vocabulary 32000: 0.95B parameters; batch 4 × 1024 tokens.
The weights are created on the device directly (no 4 GB host copy). `--tiny` is a 2-layer, 64-wide
model for a CPU smoke run. `--timing-file` as in bert_story.py.
"""

from __future__ import annotations

import argparse

import torch
from bert_story import StepTimer  # the same per-step timing lines as the story's workload
from transformers import LlamaConfig, LlamaForCausalLM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=None, help="default 4 (2 with --tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="default 1024 (64 with --tiny)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps to run")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64: a CPU smoke run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing-file", default=None, metavar="PATH", help="append per-step JSON timing lines")
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 2 if args.tiny else 4
    if args.seq_len is None:
        args.seq_len = 64 if args.tiny else 1024
    return args


def build_config(tiny: bool) -> LlamaConfig:
    if tiny:
        return LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=1000,
        )
    return LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=2048,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    config = build_config(args.tiny)
    with device:
        model = LlamaForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed)
    timer = StepTimer(args.timing_file, device)
    loss = None
    try:
        for step in range(1, args.steps + 1):
            ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=g)
            ids = ids.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ids
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            timer.step_end(step)
    finally:
        timer.close()
    if loss is not None:
        print(f"trained {args.steps} steps, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
