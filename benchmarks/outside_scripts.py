"""memdoctor's closed loop on pytorch/examples' own training scripts, unmodified (issue 15, point 6).

    python benchmarks/outside_scripts.py /work/.mirror/pytorch+examples/repo [--only dcgan,regression]
        [--results results.json] [--keep DIR] [--pythonpath DIR]

Extracts the scripts from a snapshot of the public pytorch/examples repository (a bare git directory)
into a temporary folder, makes the data each one needs there (no download), and runs on each, in tiny
settings on the CPU, the stages of ``tests/corpus/harness.py``: ``memdoctor profile``, ``plan`` under a
budget below the measured peak, ``run`` of that plan, and ``profile --budget --verify``. Prints a markdown
table (script, shape, profile, plan, run, verify, notes). Writes nothing into the project tree but the
``--results`` file when asked.

imagenet, dcgan and mnist_hogwild need torchvision; where the Python running memdoctor lacks it, they
are reported as not run (``--pythonpath`` adds a folder holding it to the scripts' import path).
imagenet's ``--dummy`` epoch is 1.28 million images, so its ``run`` stage is stopped at ``--run-timeout``
seconds: a run still going then, with no traceback, is recorded as such.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "corpus"))
from harness import Loop, Settings, close_the_loop, problems, profile_cell, stage_cell


@dataclass
class Example:
    """One script of the snapshot: where it is, how to call it tiny, what its data needs."""

    name: str
    folder: str
    script: str
    args: list[str]
    shape: str
    needs_torchvision: bool = False
    env: dict[str, str] = field(default_factory=dict)
    prepare: Callable[[Path, Settings], list[str]] | None = None  # makes its data; returns notes
    run_timeout_s: float | None = None  # the run stage stops here (a script that runs far longer)
    local: Path | None = None  # a script of this repository's corpus (tests/corpus), run where it is


def _word_corpus(folder: Path, _: Settings) -> list[str]:
    """data/wikitext-2/{train,valid,test}.txt: the layout data.Corpus reads (the snapshot lacks it)."""
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)]
    target = folder / "data" / "wikitext-2"
    target.mkdir(parents=True, exist_ok=True)
    for name, lines in (("train", 80), ("valid", 10), ("test", 10)):
        text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(lines))
        (target / f"{name}.txt").write_text(text + "\n")
    return ["a random 300-word corpus in data/wikitext-2 (80/10/10 lines of 12 words)"]


def _sine_waves(folder: Path, s: Settings) -> list[str]:
    """traindata.pt from the example's own generate_sine_wave.py, cut to 6 waves of 40 points (its
    LBFGS runs 20 closures a step, each stepping two LSTMCells in Python over every point)."""
    subprocess.run([s.python, "generate_sine_wave.py"], cwd=folder, check=True, capture_output=True)
    cut = (
        "import torch; d = torch.load('traindata.pt', weights_only=False); "
        "torch.save(d[:6, :40].copy(), 'traindata.pt')"
    )
    subprocess.run([s.python, "-c", cut], cwd=folder, check=True, capture_output=True)
    return ["traindata.pt from generate_sine_wave.py, cut to 6 x 40 points"]


def _mnist(folder: Path, _: Settings) -> list[str]:
    """../data/MNIST/raw in the idx format torchvision reads: 256 training and 64 test random digits."""
    import random

    rng = random.Random(0)
    raw = folder.parent / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", 256), ("t10k", 64)):
        pixels = bytes(rng.randrange(256) for _ in range(n * 28 * 28))
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + pixels)
        labels = bytes(rng.randrange(10) for _ in range(n))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels)
    return ["256 + 64 random digits written as MNIST idx files in ../data/MNIST/raw"]


EXAMPLES = [
    Example(
        "imagenet",
        "imagenet",
        "main.py",
        ["--dummy", "-a", "resnet18", "-b", "4", "-j", "0", "--epochs", "1", "--no-accel", "-p", "1"],
        "torchvision ResNet-18, loss in the loop (CrossEntropyLoss), SGD + StepLR",
        needs_torchvision=True,
        run_timeout_s=90,
    ),
    Example(
        "dcgan",
        "dcgan",
        "main.py",
        [
            *("--dataset", "fake", "--batchSize", "8", "--ngf", "8", "--ndf", "8", "--nz", "16"),
            *("--niter", "1", "--workers", "0", "--outf", "out", "--manualSeed", "1"),
        ],
        "GAN: netG and netD, two Adams, BCELoss, three backwards a batch",
        needs_torchvision=True,
    ),
    Example(
        "word_language_model",
        "word_language_model",
        "main.py",
        [
            *("--epochs", "1", "--emsize", "16", "--nhid", "16", "--batch_size", "4", "--bptt", "10"),
            *("--log-interval", "5", "--save", "model.pt"),
        ],
        "LSTM LM, sequence-first batches, parameters updated by hand (no torch.optim), clip_grad_norm_",
        env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"},  # it torch.load()s its whole saved model
        prepare=_word_corpus,
    ),
    Example(
        "time_sequence_prediction",
        "time_sequence_prediction",
        "train.py",
        ["--steps", "3"],
        "float64 LSTMCells, LBFGS with a closure",
        env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"},  # its torch.load of a numpy array
        prepare=_sine_waves,
    ),
    Example(
        "regression", "regression", "main.py", [], "poly fit, parameters updated by hand, no torch.optim"
    ),
    Example(
        "mnist_hogwild",
        "mnist_hogwild",
        "main.py",
        ["--epochs", "1", "--num-processes", "1", "--batch-size", "16", "--log-interval", "4"],
        "shared-memory model trained in a spawned process (torch.multiprocessing), SGD",
        needs_torchvision=True,
        prepare=_mnist,
    ),
]


CORPUS = Path(__file__).resolve().parents[1] / "tests" / "corpus"


CORPUS_SHAPES = {
    "imagenet_style": "ResNet-shaped CNN, loss in the loop (CrossEntropyLoss), SGD + StepLR, DataLoader",
    "dcgan_style": "GAN: netG and netD, two Adams, BCELoss, three backwards a batch",
    "word_lm_style": "LSTM LM, [seq, batch] batches, hand updates (no torch.optim), clip_grad_norm_",
    "time_seq_style": "float64 LSTMCells, LBFGS with a closure",
    "regression_style": "poly fit, get_batch(), hand updates (no torch.optim)",
    "hogwild_style": "shared-memory model trained in 1 spawned process, SGD",
    "hf_no_trainer_style": "accelerate + tiny GPT-2 from a config, model's own loss, accumulate()",
    "timm_style": "tiny ViT from a factory, label-smoothing loss in the loop, GradScaler(enabled=False)",
    "nanogpt_style": "GPT: own bf16 autocast, forward returns (logits, loss), get_batch(), --grad-accum",
    "gpt_configurator_style": "GPT: globals an exec'd configurator.py sets (--name=value), loss in the loop",
}


def corpus_examples() -> list[Example]:
    """This repository's own corpus (tests/corpus, the scripts tests/test_corpus.py runs)."""
    return [
        Example(path.stem, "", path.name, [], CORPUS_SHAPES.get(path.stem, "?"), local=path)
        for path in sorted(CORPUS.glob("*_style.py"))
    ]


def extract(snapshot: Path, folder: str, into: Path) -> list[str]:
    """Write every readable file of ``folder`` at the snapshot's HEAD under ``into``; the unreadable
    paths (objects missing from the snapshot, such as word_language_model's data) are returned."""
    listed = subprocess.run(
        ["git", "-C", str(snapshot), "ls-tree", "-r", "--name-only", "HEAD", "--", folder],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    missing = []
    for path in listed:
        blob = subprocess.run(
            ["git", "-C", str(snapshot), "cat-file", "blob", f"HEAD:{path}"], capture_output=True, check=False
        )
        if blob.returncode != 0:
            missing.append(path)
            continue
        (into / path).parent.mkdir(parents=True, exist_ok=True)
        (into / path).write_bytes(blob.stdout)
    return missing


STUB = """import sys, types

for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(name, types.ModuleType(name))
"""


def write_stub(folder: Path) -> Path:
    """A sitecustomize.py that stands in for torchvision's registrations of its compiled ops' meta and
    autograd kernels, which fail when its ``_C`` extension cannot load."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(STUB)
    return folder


def has_torchvision(s: Settings, pythonpath: str | None) -> bool:
    env = {**os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    probe = subprocess.run([s.python, "-c", "import torchvision"], env=env, capture_output=True, check=False)
    return probe.returncode == 0


@dataclass
class Row:
    example: str
    shape: str
    profile: str
    plan: str
    run: str
    verify: str
    notes: list[str]
    budget_bytes: int | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    stages: list[dict[str, object]] = field(default_factory=list)  # each command, with its output's end


def run_example(ex: Example, snapshot: Path, work: Path, s: Settings, pythonpath: str | None) -> Row:
    notes: list[str] = []
    if ex.needs_torchvision and not has_torchvision(s, pythonpath):
        return Row(ex.name, ex.shape, "not run: torchvision is not installed", "", "", "", notes)
    if ex.local is not None:
        folder = work / "cwd"
        folder.mkdir(parents=True, exist_ok=True)
        script = ex.local
    else:
        src = work / "examples"
        missing = extract(snapshot, ex.folder, src)
        notes += [f"missing from the snapshot: {', '.join(missing)}"] if missing else []
        folder = src / ex.folder
        script = folder / ex.script
    settings = Settings(**{**asdict(s), "env": {**s.env, **ex.env}})
    if ex.prepare is not None:
        notes += ex.prepare(folder, settings)
    loop = close_the_loop(
        script,
        ex.args,
        work / "memdoctor" / ex.name,
        settings,
        cwd=folder,
        pythonpath=pythonpath,
        run_timeout_s=ex.run_timeout_s,
    )
    return _row(ex, loop, notes)


def _row(ex: Example, loop: Loop, notes: list[str]) -> Row:
    run = stage_cell(loop, "run")
    stage = loop.stage("run")
    if ex.run_timeout_s and stage is not None and stage.code is None and not stage.traceback:
        run = f"still running at {ex.run_timeout_s:.0f} s (stopped by the runner; no traceback)"
    found = [p for p in problems(loop) if not (run.startswith("still running") and p.startswith("run:"))]
    return Row(
        ex.name,
        ex.shape,
        profile_cell(loop),
        stage_cell(loop, "plan"),
        run,
        stage_cell(loop, "verify"),
        notes + found,
        loop.budget_bytes,
        sum(st.seconds for st in loop.stages),
        sum(st.cpu_seconds for st in loop.stages),
        [
            {"name": st.name, "argv": st.argv[2:], "code": st.code, "seconds": round(st.seconds, 1)}
            | {"cpu_seconds": round(st.cpu_seconds, 1), "output_tail": st.tail(40)}
            for st in loop.stages
        ],
    )


def table(rows: list[Row]) -> str:
    head = (
        "| script | shape | profile | plan (budget) | run | verify | notes |\n|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        budget = f" ({r.budget_bytes / 1024:.0f} KiB)" if r.budget_bytes else ""
        cells = [r.example, r.shape, r.profile, r.plan + budget, r.run, r.verify, "; ".join(r.notes)]
        lines.append("| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", type=Path, help="a bare git directory of pytorch/examples")
    p.add_argument("--jobs", type=int, default=1, help="examples run at once")
    p.add_argument("--only", help="comma list of example names")
    p.add_argument("--corpus", action="store_true", help="also run this repository's tests/corpus scripts")
    p.add_argument("--results", type=Path, help="also write the rows as JSON here")
    p.add_argument("--keep", type=Path, help="work here (kept) instead of a temporary folder")
    p.add_argument("--pythonpath", help="a folder added to the scripts' import path (e.g. torchvision)")
    p.add_argument(
        "--stub-torchvision-ops",
        action="store_true",
        help="a torchvision whose compiled ops cannot load (a CUDA wheel beside a CPU torch): skip "
        "registering them (the models, datasets and utils these scripts use need none)",
    )
    p.add_argument("--budget-fraction", type=float, default=0.7)
    p.add_argument("--verify-rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a memdoctor command may take")
    args = p.parse_args(argv)
    every = EXAMPLES + (corpus_examples() if args.corpus else [])
    chosen = [e for e in every if not args.only or e.name in args.only.split(",")]
    s = Settings(
        budget_fraction=args.budget_fraction, verify_rounds=args.verify_rounds, timeout_s=args.timeout
    )
    with tempfile.TemporaryDirectory(prefix="outside-scripts-") as tmp:
        base = args.keep or Path(tmp)
        pythonpath = args.pythonpath
        if args.stub_torchvision_ops:
            pythonpath = os.pathsep.join(filter(None, [str(write_stub(Path(tmp) / "stub")), pythonpath]))

        def one(ex: Example) -> Row:
            row = run_example(ex, args.snapshot.resolve(), base / ex.name, s, pythonpath)
            print(f"{ex.name}: {row.seconds:.0f} s wall, {row.cpu_seconds:.0f} s CPU", file=sys.stderr)
            return row

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            rows = list(pool.map(one, chosen))
    print(table(rows))
    if args.results:
        args.results.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
        print(f"Wrote {args.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
