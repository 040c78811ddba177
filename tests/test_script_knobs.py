"""The script's own batch-size and accumulation knobs (issue 15, point 3): ``argparse`` options, and
config variables that a configurator sets from argv.

nanoGPT's shape: module-level globals (``batch_size = 12``, ``gradient_accumulation_steps = 2``) that a
configurator ``exec``'d by the script overrides from ``--name=value`` entries of ``sys.argv``
(``tests/corpus/configurator.py``). In-process: what profile records (only knobs a trial run of the
configurator really sets), what the planner makes of them, and ``memdoctor run``'s lever: the values
appended to the script's command line (or, for argparse, added to the parse that knows them), and
gradients after one optimizer step equal to the unmodified run's (fp32, batches drawn in order so the
two runs see the same samples), for both kinds of knob.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from memdoctor.capture.knobs import ConfiguratorWatch, trial_knobs
from memdoctor.launch.script import prepare_sys, run_script
from memdoctor.levers.install import install
from memdoctor.plan.splits import split_of

CONFIGURATOR = Path(__file__).parent / "corpus" / "configurator.py"
TOL = 1e-5

CONFIGURED = """
import os
import torch
from torch import nn

batch_size = 12
gradient_accumulation_steps = 2
max_iters = 1
learning_rate = 0.1
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "{configurator}")).read())
"""
ARGPARSE = """
import argparse
import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=12)
p.add_argument("--grad-accum", type=int, default=2)
p.add_argument("--max-iters", type=int, default=1)
args = p.parse_args()
batch_size, gradient_accumulation_steps, max_iters = args.batch_size, args.grad_accum, args.max_iters
learning_rate = 0.1
"""
BODY = """
torch.manual_seed(0)
data = torch.randn(96, 6)
target = torch.randint(0, 3, (96,))
position = 0


def get_batch():
    global position
    x, y = data[position : position + batch_size], target[position : position + batch_size]
    position += batch_size
    return x, y


model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
for it in range(max_iters):
    for _ in range(gradient_accumulation_steps):
        x, y = get_batch()
        loss = nn.functional.cross_entropy(model(x), y) / gradient_accumulation_steps
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""
SCRIPT = CONFIGURED + BODY


@pytest.fixture
def script(tmp_path: Path) -> Iterator[Path]:
    shutil.copy(CONFIGURATOR, tmp_path / "configurator.py")
    (tmp_path / "allowlist.py").write_text(  # reads argv, but sets only the learning rate
        "import sys\nfor a in sys.argv[1:]:\n    if a.startswith('--learning_rate='):\n"
        "        globals()['learning_rate'] = float(a.split('=')[1])\n"
    )
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(configurator="configurator.py"))
    argv = sys.argv
    yield path
    sys.argv = argv


def _run(path: Path, args: list[str], extra: list[str] | None = None) -> list[list[torch.Tensor]]:
    """Run ``path`` as ``python path args`` (plus a plan's ``argv_extra``); the gradients at each
    optimizer step, observed from outside the script."""
    grads: list[list[torch.Tensor]] = []

    def seen(opt: torch.optim.Optimizer, *_: Any) -> None:
        grads.append([p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None])

    handle = register_optimizer_step_pre_hook(seen)
    try:
        prepare_sys({"script": str(path), "args": args, "argv_extra": extra or []})
        run_script(str(path))
    finally:
        handle.remove()
    return grads


def _watched(path: Path, args: list[str]) -> ConfiguratorWatch:
    watch = ConfiguratorWatch()
    stop = watch.start()
    try:
        _run(path, args)
    finally:
        stop()
    return watch


def test_a_configurator_is_seen_and_its_knobs_verified_by_trial(script: Path) -> None:
    watch = _watched(script, ["--batch_size=6"])
    assert len(watch.found) == 1
    knobs = trial_knobs(watch.found[0])
    assert knobs is not None
    assert knobs.as_field() == {
        "batch_option": "--batch_size",
        "batch_value": 6,  # the script's own override: what it trains with
        "accumulation_option": "--gradient_accumulation_steps",
        "accumulation_value": 2,
        "style": "argv",
    }
    assert sys.argv[1:] == ["--batch_size=6"]  # the trial left the script's argv as it was


def test_globals_that_argv_cannot_set_are_not_knobs(script: Path) -> None:
    script.write_text(SCRIPT.format(configurator="allowlist.py"))
    watch = _watched(script, [])
    assert len(watch.found) == 1  # it reads argv and the script has a batch_size ...
    assert trial_knobs(watch.found[0]) is None  # ... but --batch_size=N does not set it
    script.write_text(SCRIPT.replace("exec(open(", "print(open(").format(configurator="configurator.py"))
    assert _watched(script, []).found == []  # no exec: nothing to try


# style -> the script's head, its argument for 3 iterations, the plan's arguments for k = 4
STYLES = {
    "argv": (CONFIGURED, ["--max_iters=3"], ["--batch_size=3", "--gradient_accumulation_steps=8"]),
    "argparse": (ARGPARSE, ["--max-iters", "3"], ["--batch-size", "3", "--grad-accum", "8"]),
}


@pytest.mark.parametrize("style", list(STYLES))
def test_profile_records_the_knobs_and_the_planner_splits_through_them(script: Path, style: str) -> None:
    from memdoctor.capture.dataloader import DataCollector
    from memdoctor.capture.session import ProfileSession

    head, three_iterations, planned = STYLES[style]
    script.write_text((head + BODY).format(configurator="configurator.py"))
    records: list[dict[str, Any]] = []
    session = ProfileSession(steps=2, warmup=0, sink=records.append, collectors=[DataCollector()])
    with session:
        _run(script, three_iterations)  # the root is known at its first step; its loss at the next
    facts = [r["data"] for r in records if r["type"] == "collector" and r["name"] == "data"][-1]
    loop = facts["loop"]
    assert loop["knobs"]["style"] == style and loop["knobs"]["batch_value"] == 12
    split = split_of(SimpleNamespace(collected={"data": facts}))
    assert (split.kind, split.style) == ("arguments", style)
    assert split.script_args(4) == planned
    assert split.allows(4) and not split.allows(5)


@pytest.mark.parametrize("style", list(STYLES))
def test_run_passes_the_knobs_and_keeps_the_gradients(script: Path, style: str) -> None:
    head, _, planned = STYLES[style]  # 12 x 2 = 3 x 8
    script.write_text((head + BODY).format(configurator="configurator.py"))
    want = _run(script, [])
    lines: list[str] = []
    config = {"memdoctor_config": 1, "accumulation_steps": 4, "accumulation_split": "arguments"}
    inst = install({**config, "script_args": planned}, say=lines.append)
    try:
        got = _run(script, [], inst.argv_args())
        notes = inst.finish()
    finally:
        inst.remove()
    assert sys.argv[1:] == (planned if style == "argv" else [])  # argparse: added to the parse only
    assert not notes, notes
    assert len(want) == len(got) == 1
    for a, b in zip(want[0], got[0], strict=True):
        torch.testing.assert_close(b, a, atol=TOL, rtol=TOL)
    assert any(" ".join(planned) in line for line in lines)


def test_run_says_when_the_script_did_not_take_the_values(script: Path) -> None:
    script.write_text(SCRIPT.format(configurator="allowlist.py"))
    config = {"memdoctor_config": 1, "accumulation_steps": 4, "accumulation_split": "arguments"}
    args = ["--batch_size=3", "--gradient_accumulation_steps=8"]
    inst = install({**config, "script_args": args}, say=lambda _: None)
    try:
        _run(script, [], inst.argv_args())
        notes = inst.finish()
    finally:
        inst.remove()
    assert notes and "batch_size is 12, not 3" in notes[0]
