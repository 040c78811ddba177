"""CPU autocast what-if check (issue 15): for tiny models of several shapes, the activation bytes at the
peak measured in fp32, measured under ``torch.autocast("cpu", torch.bfloat16)``, and what the planner
predicts for adding bf16 autocast from the fp32 profile alone (``memory_parts``' activations plus its
autocast weight cache: the ledger counts autocast's 16-bit weight copies as saved tensors).

    PYTHONPATH=. python benchmarks/amp_whatif_check.py [--modules] [--cuda] [--resnet50 BATCH]
        [--traces DIR [--reuse]]

Each model is profiled in process (``ProfileSession`` with the precision collector), twice: the fp32 run
is the plan's calibration, the bf16 run the measurement the prediction is checked against. ``--modules``
adds the saved bytes per module type, fp32 and bf16. ``--traces DIR`` keeps the profiles there; with
``--reuse`` they are read back instead of profiled again (a GPU's profiles re-checked on any machine).
``--cuda`` runs the same check under CUDA autocast on the GPU; ``--resnet50 BATCH`` adds torchvision's
ResNet-50 on 224x224 images (the issue's plain-loop workload; torchvision must be installed).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memdoctor.analysis.layers import layer_table
from memdoctor.analysis.steps import peak_step
from memdoctor.capture.collectors import make_collectors
from memdoctor.capture.session import ProfileSession
from memdoctor.device import default_device
from memdoctor.errors import TraceError
from memdoctor.plan.config import Config
from memdoctor.plan.measure import measured_workload
from memdoctor.plan.memory import memory_parts
from memdoctor.report import build_summary
from memdoctor.trace import Trace, TraceWriter, load_trace
from memdoctor.trace.records import make_header

Batch = tuple[torch.Tensor, torch.Tensor]


class BasicBlock(nn.Module):
    """A ResNet basic block: conv-BN-ReLU twice and a residual add."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + x)


class TinyResNet(nn.Module):
    """Stem (conv, BN, ReLU, max-pool), basic blocks, average pool, a Linear head: returns logits."""

    def __init__(self, width: int = 16, blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = nn.Sequential(*[BasicBlock(width) for _ in range(blocks)])
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(self.layer1(x)), 1))


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (h.view(b, t, self.heads, -1).transpose(1, 2) for h in self.qkv(x).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) / (k.size(-1) ** 0.5)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.gelu = nn.GELU()
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(self.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """The minimal-GPT shape: token and position embeddings, pre-LN blocks with eager softmax attention,
    a head tied to the token embedding, and the loss in the root's own code from ``logits.float()``."""

    def __init__(self, vocab: int = 96, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(64, width)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList([GPTBlock(width, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1))))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


class TinyLSTM(nn.Module):
    """Embedding, a two-layer LSTM, dropout and a Linear decoder (word_language_model's shape)."""

    def __init__(self, vocab: int = 96, width: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.decoder = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(idx))
        return self.decoder(self.drop(out))


def _tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return BertForSequenceClassification(config)


def _image_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)  # the loss in the loop, as the ResNet-50 plain loop does


def _gpt_step(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(idx, y)[1]


def _lm_step(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def _bert_step(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(input_ids=idx, labels=y).loss


def _resnet50() -> nn.Module:
    import torchvision  # type: ignore[import-untyped]

    return torchvision.models.resnet50()


def shapes(resnet50: int = 0) -> dict[str, tuple[Callable[[], nn.Module], Callable[[], Batch], Any]]:
    """name -> (model factory, batch factory, step computing the loss); ``resnet50``: its batch (0: none)."""
    images = (lambda: torch.randn(8, 3, 64, 64), lambda: torch.randint(0, 10, (8,)))
    tokens = (lambda: torch.randint(0, 96, (8, 32)), lambda: torch.randint(0, 96, (8, 32)))
    return {
        "resnet-like CNN": (TinyResNet, lambda: (images[0](), images[1]()), _image_step),
        "GPT-like (root loss)": (TinyGPT, lambda: (tokens[0](), tokens[1]()), _gpt_step),
        "LSTM LM": (TinyLSTM, lambda: (tokens[0](), tokens[1]()), _lm_step),
        "BERT-like (HF)": (
            _tiny_bert,
            lambda: (tokens[0](), torch.randint(0, 2, (8,))),
            _bert_step,
        ),
    } | (
        {
            f"torchvision ResNet-50 b{resnet50}": (
                _resnet50,
                lambda: (torch.randn(resnet50, 3, 224, 224), torch.randint(0, 1000, (resnet50,))),
                _image_step,
            )
        }
        if resnet50
        else {}
    )


def profile(name: str, autocast: bool, path: Path, where: str, resnet50: int = 0) -> Trace:
    """One in-process profile of ``name`` on ``where`` (cpu, cuda), in fp32 or under bf16 autocast."""
    make_model, make_batch, step = shapes(resnet50)[name]
    torch.manual_seed(0)
    model = make_model().to(where)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    records: list[dict[str, Any]] = []
    collectors, _ = make_collectors(["precision"])
    device = default_device()
    session = ProfileSession(steps=1, warmup=1, sink=records.append, device=device, collectors=collectors)
    with session:
        for _ in range(3):
            batch = tuple(t.to(where) for t in make_batch())
            with torch.autocast(where, dtype=torch.bfloat16, enabled=autocast):
                loss = step(model, *batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # the writer appends
    writer = TraceWriter(path)
    writer.write(make_header(device=device.describe(), settings={"warmup": 1, "steps": 1}))
    for rec in records:
        writer.write(rec)
    writer.write({"type": "end", "status": "completed", "message": "", "exit_code": 0})
    writer.close()
    return load_trace(path)


def activations_at_peak(trace: Trace) -> int:
    return int((build_summary(trace).get("categories") or {}).get("activations") or 0)


def predicted_bf16(trace: Trace) -> int:
    """The planner's activations (and autocast weight cache) for adding bf16 autocast to the fp32 run."""
    w = measured_workload(trace, build_summary(trace))
    assert w is not None, "no memory figures in the fp32 trace"
    parts = memory_parts(w, Config(precision="bf16"), [], [])
    return parts["activations"] + parts["autocast_weight_cache"]


def by_type(trace: Trace) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in layer_table(trace, peak_step(trace)):
        kind = "(root's own code)" if r["index"] == 0 else str(r["type"])
        out[kind] = out.get(kind, 0) + int(r["activation_self_bytes"] or 0)
    return out


def check(name: str, tmp: Path, where: str = "cpu", resnet50: int = 0, reuse: bool = False) -> dict[str, Any]:
    """fp32 and bf16 activations at the peak, measured, and the prediction from the fp32 run."""
    stem = f"{where}-" + "".join(c if c.isalnum() or c in "-." else "_" for c in name)
    paths = [tmp / f"{stem}-{kind}.jsonl.gz" for kind in ("fp32", "bf16")]
    if reuse:
        fp32, bf16 = (load_trace(p) for p in paths)
    else:
        runs = zip((False, True), paths, strict=True)
        fp32, bf16 = (profile(name, amp, p, where, resnet50) for amp, p in runs)
    measured, predicted = activations_at_peak(bf16), predicted_bf16(fp32)
    return {
        "model": name,
        "fp32": activations_at_peak(fp32),
        "bf16_measured": measured,
        "bf16_predicted": predicted,
        "error": predicted / measured - 1 if measured else None,
        "types_fp32": by_type(fp32),
        "types_bf16": by_type(bf16),
    }


def main(argv: list[str]) -> None:
    where = "cuda" if "--cuda" in argv else "cpu"
    resnet50 = int(argv[argv.index("--resnet50") + 1]) if "--resnet50" in argv else 0
    keep = argv[argv.index("--traces") + 1] if "--traces" in argv else None
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in shapes(resnet50):
            try:
                rows.append(check(name, Path(keep or tmp), where, resnet50, "--reuse" in argv))
            except (RuntimeError, TraceError) as e:  # oneDNN's bf16 LSTM needs a CPU with bf16 support
                failed.append(f"{name}: not measurable here under {where} bf16 autocast: {str(e)[:70]}")
    print("| model | fp32 activations | bf16 measured | bf16 predicted | error |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        err = f"{100 * r['error']:+.1f}%" if r["error"] is not None else "-"
        print(f"| {r['model']} | {r['fp32']} | {r['bf16_measured']} | {r['bf16_predicted']} | {err} |")
    for line in failed:
        print(f"\n{line}")
    if "--modules" in argv:
        for r in rows:
            print(f"\n{r['model']}: saved bytes per module type, fp32 -> bf16")
            for kind, b in r["types_fp32"].items():
                after = r["types_bf16"].get(kind, 0)
                print(f"  {kind:28s} {b:>10d} -> {after:>10d}  ({after / b if b else 0:.2f})")


if __name__ == "__main__":
    main(sys.argv[1:])
