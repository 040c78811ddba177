"""The report's one-sentence verdict, written from the summary's own figures."""

from __future__ import annotations

from typing import Any

from memdoctor.units import format_bytes

CATEGORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "other": "other (temporaries, workspaces, allocator slack)",
    # A DDP or FSDP2 rank's engine buffers (``memdoctor.analysis.layers.ENGINE_CATEGORIES``)
    "gradient_buckets": "DDP gradient buckets",
    "sharding_buffers": "FSDP2 gathered parameters and all-gather / reduce-scatter buffers",
}


_FAULT_WORDS = {
    "oom": "out of memory",
    "exception": "an exception",
    "crashed": "a crash",
    "killed": "a signal",
    "unknown": "an unknown cause (the trace has no end record)",
}


def headline(summary: dict[str, Any]) -> str:
    """The report's one-sentence verdict, from the summary's own figures."""
    fault = summary.get("fault")
    if fault:
        return fault_sentence(summary, fault)
    if summary.get("peak_memory_bytes") is None:
        why = (summary.get("status_message") or "").partition("; ")[2]  # the run's reason, where it has one
        because = f" ({why})" if why else ""
        return f"No training step was recorded{because}, so there is no memory figure to report."
    return peak_sentence(summary)


def peak_sentence(summary: dict[str, Any]) -> str:
    """E.g. ``Measured peak 11.40 GiB allocated of 8.00 GiB budget: 62% of it activations.`` The page
    quotes other peaks too (extrapolated, predicted, reserved), so this one says its kind."""
    peak = summary["peak_memory_bytes"]
    text = f"Measured peak {format_bytes(peak)} {peak_memory_word(summary)}"
    limit, kind = memory_limit(summary)
    if limit:
        name = summary["device"].get("name") or "GPU"
        text += f" of {format_bytes(limit)} " + (f"on the {name}" if kind == "device memory" else kind)
        if peak > limit:
            text += f" ({format_bytes(peak - limit)} over)"
    cats = {k: v for k, v in summary["categories"].items() if v}
    if not cats or not peak:
        return text + "."
    top = max(cats, key=lambda k: cats[k])
    return text + f": {round(100 * cats[top] / peak)}% of it {CATEGORY_LABELS[top].split(' (')[0]}."


def peak_memory_word(summary: dict[str, Any]) -> str:
    """Which memory the measured peak counts: the CUDA allocator's ``allocated`` bytes, else the tensors
    memdoctor accounted for (a CPU run has no allocator; reserved memory is never the headline's)."""
    return "in tensors" if summary.get("peak_source") == "accounting" else "allocated"


def memory_limit(summary: dict[str, Any]) -> tuple[int | None, str]:
    """The line the peak is judged against: the budget, else the memory cap, else a GPU's total memory.

    Returns ``(bytes, kind)`` with kind ``"budget"``, ``"memory cap"`` or ``"device memory"``.
    """
    device = summary["device"]
    if summary.get("budget_bytes"):
        return summary["budget_bytes"], "budget"
    if device.get("memory_cap_bytes"):
        return device["memory_cap_bytes"], "memory cap"
    if device.get("kind") == "cuda" and device.get("total_memory_bytes"):
        return device["total_memory_bytes"], "device memory"
    return None, ""


def fault_sentence(summary: dict[str, Any], fault: dict[str, Any]) -> str:
    """E.g. ``The script died of CUDA out of memory at step 0, in the backward of encoder.layer.11, ...``"""
    text = _fault_subject(summary, fault)
    complete = sum(1 for row in summary.get("steps") or [] if row.get("complete"))
    if fault.get("step") is not None:
        text += f" at step {fault['step']}"
    elif fault.get("kind") in ("exception", "oom", "script_exit", "interrupted") and not complete:
        text += " before its first training step"  # the script said where: in no step yet
    else:  # a hard death: no Python frame said where
        text += f" after {complete} complete step{'s' if complete != 1 else ''}"
    text += _fault_place(fault)
    return text + _fault_memory(summary) + "."


def _fault_memory(summary: dict[str, Any]) -> str:
    """``, with 7.62 GiB allocated (budget 8.00 GiB)`` from the last sample before the fault."""
    live = summary.get("live_at_fault") or {}
    held = (live.get("allocator") or {}).get("allocated")
    text = f", with {format_bytes(held)} allocated when it died (measured)" if held else ""
    if not held and live.get("categories"):
        held = sum(v or 0 for v in live["categories"].values())
        text = f", with {format_bytes(held)} in tensors (measured)" if held else ""
    limit, kind = memory_limit(summary)
    return text[:-1] + (f"; {kind} {format_bytes(limit)})" if limit else ")") if text else ""


def _fault_subject(summary: dict[str, Any], fault: dict[str, Any]) -> str:
    """``The script died of ...``, or the verb that fits a run that was stopped rather than died."""
    kind, signal = fault.get("kind"), fault.get("signal")
    if kind == "interrupted":
        return "The run was interrupted (Ctrl-C)"
    if kind == "timeout":
        return "The run was stopped by --timeout"
    if kind == "stopped":  # memdoctor was sent SIGTERM or SIGHUP; the message names it
        name = next((w for w in str(fault.get("message", "")).split() if w.startswith("SIG")), "a signal")
        return f"The run was stopped by {name.rstrip(',;')} sent to memdoctor"
    if kind == "output_failed":
        return "Recording stopped: the trace could not be written"
    if kind == "script_exit":
        return f"The script called sys.exit({fault.get('exit_code')})"
    if kind == "killed" and signal:
        return f"The script was killed by {signal}"
    return f"The script died of {_fault_cause(summary, fault)}"


def _fault_cause(summary: dict[str, Any], fault: dict[str, Any]) -> str:
    kind = fault.get("kind")
    if kind == "oom":
        return "CUDA out of memory" if summary["device"].get("kind") == "cuda" else "out of memory"
    if fault.get("exception_type"):
        return str(fault["exception_type"])
    if kind == "crashed" and fault.get("signal"):
        return f"a crash ({fault['signal']})"
    if kind == "crashed" and fault.get("exit_code") is not None:
        return f"an abrupt exit with code {fault['exit_code']} (os._exit, or native code ending the process)"
    return _FAULT_WORDS.get(str(kind), str(kind or "an unknown cause"))


def _fault_place(fault: dict[str, Any]) -> str:
    phase, module = fault.get("phase"), fault.get("module_name")
    if phase in ("forward", "backward"):
        return f", in the {phase} of {module}" if module else f", in the {phase} pass"
    if phase == "optimizer":
        return ", in the optimizer step"
    return f", in {module}" if module else ""
