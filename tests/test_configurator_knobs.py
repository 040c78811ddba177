"""The script's own knobs when they are config variables, not argparse options (issue 15, point 3).

nanoGPT's shape: module-level globals (``batch_size = 12``, ``gradient_accumulation_steps = 4``) that a
configurator ``exec``'d by the script overrides from ``--name=value`` entries of ``sys.argv``
(``tests/corpus/configurator.py``). In-process: what profile records (only knobs a trial run of the
configurator really sets), what the planner makes of them, and ``memdoctor run``'s lever: the values
appended to the script's command line, and gradients after one optimizer step equal to the unmodified
run's (fp32, batches drawn in order so the two runs see the same samples).
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

SCRIPT = """
import os
import torch
from torch import nn

batch_size = 12
gradient_accumulation_steps = 2
max_iters = 1
learning_rate = 0.1
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "{configurator}")).read())

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


def test_profile_records_the_knobs_and_the_planner_splits_through_them(script: Path) -> None:
    from memdoctor.capture.dataloader import DataCollector
    from memdoctor.capture.session import ProfileSession

    records: list[dict[str, Any]] = []
    session = ProfileSession(steps=2, warmup=0, sink=records.append, collectors=[DataCollector()])
    with session:
        _run(script, ["--max_iters=3"])  # the root is known at its first step; its loss at the next
    facts = [r["data"] for r in records if r["type"] == "collector" and r["name"] == "data"][-1]
    loop = facts["loop"]
    assert loop["knobs"]["style"] == "argv" and loop["knobs"]["batch_value"] == 12
    split = split_of(SimpleNamespace(collected={"data": facts}))
    assert (split.kind, split.style) == ("arguments", "argv")
    assert split.script_args(4) == ["--batch_size=3", "--gradient_accumulation_steps=8"]
    assert split.allows(4) and not split.allows(5)


def test_run_appends_the_knobs_and_keeps_the_gradients(script: Path) -> None:
    want = _run(script, [])
    lines: list[str] = []
    args = ["--batch_size=3", "--gradient_accumulation_steps=8"]  # 12 x 2 = 3 x 8
    config = {"memdoctor_config": 1, "accumulation_steps": 4, "accumulation_split": "arguments"}
    inst = install({**config, "script_args": args}, say=lines.append)
    try:
        got = _run(script, [], inst.argv_args())
        notes = inst.finish()
    finally:
        inst.remove()
    assert sys.argv[1:] == args
    assert not notes, notes
    assert len(want) == len(got) == 1
    for a, b in zip(want[0], got[0], strict=True):
        torch.testing.assert_close(b, a, atol=TOL, rtol=TOL)
    assert any("appended to its command line" in line for line in lines)


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
