"""Fixtures shared by every test.

The autouse ``no_leaked_hooks`` fails a test that leaves memdoctor's global state behind: the profiler
installs global module and optimizer hooks, saved-tensor hooks and threads, and its collectors wrap a few
torch functions (``Tensor.to``, the DataLoader iterator's ``__next__``, ...), and ``memdoctor run``'s
framework path patches the HF / Lightning Trainer classes through an import hook (``sys.meta_path``); a
leak would silently change every later test (and, in a user's process, every later step). Every such
patch goes through ``memdoctor.patching``, whose registry says what is still patched.

``pytest -m fast`` is the edit-test loop's subset: the in-process tests of ``FAST_FILES`` (not those
marked ``slow``). A fast test that starts a child process fails, so the subset stays what it says.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from memdoctor import patching

# One CPU thread per torch process, set before torch is first imported: this process, every xdist worker
# (started with this environment) and every child a test starts (they inherit it). The suite runs on 2
# cores with 2 workers, each starting training scripts in children; torch's default of a thread per core
# in each of them oversubscribes the cores, and OpenMP's idle threads spin: a corpus script's profiled
# child took 10.6 s of CPU with 2 threads, 4.5 s with 1, on this machine under load. Tiny models gain
# nothing from a second thread. A value set outside the suite is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# (module, attribute) of torch's global hook registries; a name the installed torch lacks is skipped.
_HOOK_REGISTRIES = (
    ("torch.nn.modules.module", "_global_forward_pre_hooks"),
    ("torch.nn.modules.module", "_global_forward_hooks"),
    ("torch.nn.modules.module", "_global_backward_hooks"),
    ("torch.nn.modules.module", "_global_backward_pre_hooks"),
    ("torch.optim.optimizer", "_global_optimizer_pre_hooks"),
    ("torch.optim.optimizer", "_global_optimizer_post_hooks"),
)
_THREAD_PREFIX = "memdoctor"
# In-process unit tests on tiny models and hand-built or recorded traces: together well under two minutes
# on two cores (``pytest -m fast --durations=20`` shows what each costs). The end-to-end runs of scripts,
# the fuzzers and the browser test stay outside.
FAST_FILES = frozenset(
    {
        "test_amp_whatif.py",
        "test_api.py",
        "test_architecture.py",
        "test_cli.py",
        "test_collectors.py",
        "test_compare.py",
        "test_compiled_summary.py",
        "test_config.py",
        "test_script_knobs.py",
        "test_device_stats.py",
        "test_devicefacts.py",
        "test_frames.py",
        "test_gradnorms.py",
        "test_histograms.py",
        "test_history.py",
        "test_host_optimizer.py",
        "test_loopsplit.py",
        "test_ledger_offload.py",
        "test_leave.py",
        "test_nvtx.py",
        "test_offload.py",
        "test_optimizers.py",
        "test_run_guards.py",
        "test_outside_modules.py",
        "test_levers_step_hooks.py",
        "test_permissions.py",
        "test_autocast_outputs.py",
        "test_trace_json.py",
        "test_plan.py",
        "test_plan_accuracy_recorded.py",
        "test_plan_card.py",
        "test_plan_full_offload.py",
        "test_plan_levers.py",
        "test_plan_offload_device.py",
        "test_plan_rules.py",
        "test_precision_capture.py",
        "test_precision_plan.py",
        "test_progress.py",
        "test_redact.py",
        "test_report.py",
        "test_report_numbers.py",
        "test_report_visuals.py",
        "test_report_firstscreen.py",
        "test_reprofile.py",
        "test_reprofile_checkpoint.py",
        "test_reprofile_state.py",
        "test_session_schedule.py",
        "test_steps_found.py",
        "test_story_scenario.py",
        "test_story_workload.py",
        "test_summary.py",
        "test_trace_limits.py",
        "test_trace_writer_caps.py",
        "test_transfers.py",
        "test_verify_failures.py",
        "test_viewers.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in FAST_FILES and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)


@pytest.fixture(autouse=True)
def fast_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``fast`` test may not start a child process: the subset is the no-child-process loop."""
    if request.node.get_closest_marker("fast") is None:
        return
    platform.processor()  # cached after its one ``uname -p``, which the device description asks for

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("a test marked fast started a child process: mark it slow")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


_THREAD_GRACE_S = 2.0


def leaked_hooks() -> list[str]:
    """Names of torch's global hook registries that are not empty (torch imported only if already used)."""
    if "torch" not in sys.modules:
        return []
    leaks = [f"{mod}.{attr}" for mod, attr, registry in _registries() if registry]
    if _saved_tensor_hooks_installed():
        leaks.append("saved-tensor default hooks (torch.autograd.graph.saved_tensors_hooks)")
    return leaks


def _registries() -> Iterator[tuple[str, str, Any]]:
    for mod, attr in _HOOK_REGISTRIES:
        module = sys.modules.get(mod)
        registry = getattr(module, attr, None) if module is not None else None
        if registry is not None:
            yield mod, attr, registry


def _saved_tensor_hooks_installed() -> bool:
    autograd = getattr(sys.modules["torch"]._C, "_autograd", None)
    top = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return False
    try:
        return top(True) is not None
    except Exception:  # a torch whose signature differs: skip this check
        return False


def _clear_hooks() -> None:
    """Remove leaked hooks so that one leaking test does not fail every test after it."""
    for _, _, registry in _registries():
        registry.clear()
    autograd = getattr(sys.modules["torch"]._C, "_autograd", None) if "torch" in sys.modules else None
    while autograd is not None and _saved_tensor_hooks_installed():
        autograd._pop_saved_tensors_default_hooks()


def _memdoctor_threads(before: set[int]) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t.ident not in before and t.name.startswith(_THREAD_PREFIX) and t.is_alive()
    ]


def leaked_patches(before: list[patching.Patch]) -> list[str]:
    """memdoctor's class and module patches installed during the test and still there (the registry of
    ``memdoctor.patching``, the one way memdoctor patches); undone here, newest first, so one leak does
    not fail later tests."""
    leaks = [patch for patch in patching.installed() if patch not in before]
    for patch in reversed(leaks):
        patch.undo()
    return [patch.where() for patch in leaks]


def leaked_threads(before: set[int]) -> list[str]:
    """``memdoctor*`` threads started during the test and still alive after a short grace."""
    deadline = time.monotonic() + _THREAD_GRACE_S
    for thread in _memdoctor_threads(before):
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in _memdoctor_threads(before)]


@pytest.fixture(autouse=True)
def no_leaked_hooks() -> Iterator[None]:
    already = leaked_hooks()
    if already:
        _clear_hooks()
    threads_before = {t.ident for t in threading.enumerate() if t.ident is not None}
    patched_before = patching.installed()
    finders_before = list(sys.meta_path)
    yield
    hooks = leaked_hooks()
    threads = leaked_threads(threads_before)
    patches = leaked_patches(patched_before)
    if hooks:
        _clear_hooks()
    problems = [f"global torch hooks left installed: {', '.join(hooks)}"] if hooks else []
    problems += [f"threads left running: {', '.join(threads)}"] if threads else []
    problems += [f"functions left patched: {', '.join(patches)}"] if patches else []
    # memdoctor's own import hooks; a library imported for the first time may add its own (six does)
    finders = [f for f in sys.meta_path if f not in finders_before and _ours(f)]
    for finder in finders:  # an import hook left behind would patch every later import of its module
        sys.meta_path.remove(finder)
    problems += [f"import hooks left in sys.meta_path: {finders}"] if finders else []
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


def _ours(finder: object) -> bool:
    return type(finder).__module__.split(".")[0] == "memdoctor"
