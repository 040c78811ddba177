"""Train a GPT-2 causal language model with the Hugging Face `Trainer`.

Here the training loop lives inside `transformers.Trainer`: the script only builds a model, a dataset and
`TrainingArguments`, then calls `trainer.train()`. memdoctor profiles it unmodified:

    memdoctor profile examples/hf_trainer.py -- --batch-size 4

The defaults build a tiny 2-layer GPT-2 that runs in seconds on a CPU; `--small` gives GPT-2 small
(124M parameters). The data is synthetic token ids, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class SyntheticText(Dataset):
    """Random token sequences of varying length, right-padded; padding is masked out of the loss."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(max(2, seq_len // 2), seq_len + 1, (size,), generator=g)
        self.tokens = torch.randint(0, vocab_size, (size, seq_len), generator=g)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(self.seq_len) < self.lengths[i]).long()
        input_ids = self.tokens[i] * mask  # pad with token 0
        labels = input_ids.masked_fill(mask == 0, -100)  # -100: ignored by the loss
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=4, help="per-device train batch size")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (Trainer max_steps)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    p.add_argument("--small", action="store_true", help="GPT-2 small sizes (768 wide, 12 layers, 12 heads)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)

    if args.small:
        config = GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)
    else:
        config = GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=2,
            vocab_size=1000,
            n_positions=128,
            bos_token_id=999,
            eos_token_id=999,
        )  # the defaults (50256) lie outside vocab
    if args.seq_len > config.n_positions:
        raise SystemExit(f"--seq-len {args.seq_len} is longer than n_positions {config.n_positions}")
    model = GPT2LMHeadModel(config)

    n_samples = args.steps * args.batch_size * args.grad_accum
    dataset = SyntheticText(n_samples, args.seq_len, config.vocab_size, seed=args.seed)

    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf_trainer_"),  # nothing is saved, but Trainer wants a dir
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    result = trainer.train()
    print(f"trained {result.global_step} steps, mean loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
