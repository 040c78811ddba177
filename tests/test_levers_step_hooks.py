"""memdoctor's one-shot global optimizer-step hooks (the installer's first-step checks, the model watch)
must not disturb the script's step: torch iterates its global step hooks live while calling them, so a
hook that removed itself made ``optimizer.step()`` raise "OrderedDict mutated during iteration" whenever
another global hook was registered after it (another profiler, a library, memdoctor's own session)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from memdoctor.levers.install import install


def test_a_hook_registered_after_the_installers_sees_every_step() -> None:
    inst = install({"memdoctor_config": 1, "precision": "bf16"}, say=lambda line: None)
    seen: list[str] = []
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the plan is installed here
    later = [  # after the installer's own
        register_optimizer_step_pre_hook(lambda opt, a, k: seen.append("pre")),
        register_optimizer_step_post_hook(lambda opt, a, k: seen.append("post")),
    ]
    try:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        for handle in later:
            handle.remove()
        inst.remove()
    assert inst.model is model
    assert any(line.startswith("autocast bf16 around Sequential.forward") for line in inst.lines)
    assert seen == ["pre", "post"] * 3


def test_the_installers_hooks_are_gone_after_remove() -> None:
    from torch.optim import optimizer as torch_optimizer

    def count() -> Any:
        return len(torch_optimizer._global_optimizer_pre_hooks), len(
            torch_optimizer._global_optimizer_post_hooks
        )

    before = count()
    inst = install({"memdoctor_config": 1, "precision": "bf16"}, say=lambda line: None)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    inst.remove()
    assert count() == before
