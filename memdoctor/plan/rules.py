"""Rules: small functions over the measurements, each returning findings with their evidence.

A finding is ``{rule, severity, title, evidence, saving_bytes, cost_fraction, confidence}``:
``severity`` is ``critical`` (the run does not fit its budget and this helps), ``warning`` or ``info``;
``saving_bytes`` the expected peak saving (0 when the rule is about time or health); ``cost_fraction``
the expected change in step time as a fraction of the measured step (negative: faster; None: unknown);
``confidence`` ``high`` / ``medium`` / ``low`` (how much of it rests on assumptions). A rule that lacks
its measurement stays silent: "not measured" is said by the report's sections, not by a rule.

Each rule's docstring is the explanation a user reads. ``RULES`` is the ordered list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from memdoctor.analysis.steps import peak_step
from memdoctor.plan.alternatives import block_stack
from memdoctor.plan.config import Config
from memdoctor.plan.measure import ATTENTION_SITE
from memdoctor.plan.memory import AMP_ACTIVATION_FACTOR, AMP_WEIGHT_CACHE_FACTOR, memory_parts, outermost
from memdoctor.plan.model import predict
from memdoctor.plan.ninegrid import lever_priority
from memdoctor.plan.padding import PAD_MULTIPLE
from memdoctor.plan.planner import grad_scaler
from memdoctor.plan.reprofiled import peak_words
from memdoctor.plan.target import Target, fits
from memdoctor.plan.timing import amp_time_factor
from memdoctor.plan.workload import Candidate, Workload
from memdoctor.trace import Trace
from memdoctor.units import format_bytes

CHECKPOINT_ACTIVATION_SHARE = 0.3  # activations at least this share of the peak
ATTENTION_SHARE = 0.02  # attention temporaries at least this share of the peak
FRAGMENTATION_BYTES = 256 * 1024**2
FRAGMENTATION_SHARE = 0.10  # reserved-but-unallocated at least this share of the reserved peak
STARVATION_WAIT = 0.10  # the loader's wait at least this share of the step
PADDING_SHARE = 0.15  # padding at least this share of the token positions
OPTIMIZER_STATE_SHARE = 0.25  # optimizer state at least this share of the budget
PARAM_OFFLOAD_SHARE = 0.05  # offloadable parameters + gradients at least this share of the budget


@dataclass
class RuleInput:
    """What every rule may read: the trace, its summary, the calibrated workload and the target."""

    trace: Trace
    summary: dict[str, Any]
    workload: Workload | None
    target: Target | None
    priority: Sequence[str] | None = None  # lever families in the nine-grid cell's order

    def over_budget(self) -> bool:
        if self.workload is None or self.target is None:
            return False
        return not fits(predict(self.workload, Config()), self.target)


Finding = dict[str, Any]


def finding(
    rule: str,
    severity: str,
    title: str,
    evidence: str,
    saving_bytes: int = 0,
    cost_fraction: float | None = 0.0,
    confidence: str = "medium",
) -> Finding:
    cost = None if cost_fraction is None else round(cost_fraction, 4)
    return {
        "rule": rule,
        "severity": severity,
        "title": title,
        "evidence": evidence,
        "saving_bytes": int(saving_bytes),
        "cost_fraction": cost,
        "confidence": confidence,
    }


def _step_fraction(ms: float | None, w: Workload) -> float | None:
    return None if ms is None or not w.step_ms else ms / w.step_ms


def checkpointing(x: RuleInput) -> list[Finding]:
    """Activation checkpointing: the saved activations dominate the peak. Checkpointing a module keeps
    only its inputs and recomputes its forward in backward: memory for compute. The saving assumes every
    block of the largest repeated stack is checkpointed (the plan picks the modules that are needed)."""
    w = x.workload
    if w is None or w.activations < CHECKPOINT_ACTIVATION_SHARE * w.peak_bytes or not w.candidates:
        return []
    blocks = outermost(_stack(x))
    if len(blocks) < 2:
        return []
    saving = checkpoint_saving(w, blocks)
    ms = sum(c.forward_ms for c in blocks)
    held = f"activations are {format_bytes(w.activations)} of the {peak_words(x.trace, w)}"
    if not w.complete:
        held = (
            f"activations come to {format_bytes(w.activations)} extrapolated to the whole step (the run "
            f"died at {format_bytes(w.peak_bytes)} allocated, measured)"
        )
    evidence = (
        f"{held}; checkpointing the {len(blocks)} blocks {blocks[0].name} ... frees "
        f"{format_bytes(saving)} net of them for {ms:.1f} ms of recomputation"
    )
    if sum(c.free_bytes for c in blocks) > w.activations:
        evidence += (
            f" (what the blocks free, measured one by one, adds up to "
            f"{format_bytes(sum(c.free_bytes for c in blocks))}, more than the activations at the peak: "
            "the saving is capped at them)"
        )
    severity = "critical" if x.over_budget() else "info"
    conf = "high" if w.complete else "low"
    return [
        finding(
            "checkpointing", severity, "checkpoint activations", evidence, saving, _step_fraction(ms, w), conf
        )
    ]


def checkpoint_saving(w: Workload, chosen: list[Candidate]) -> int:
    """The peak bytes checkpointing ``chosen`` saves, as the planner's memory model counts it
    (``memory_parts``): a module nested in another chosen one adds nothing, what is freed never exceeds
    the activations at the peak, and the largest module's activations come back while it is recomputed.
    So the finding's figure is the plan's, and never more than what it saves from."""
    config = Config(checkpoint=tuple(c.name for c in chosen))
    after = memory_parts(w, config, outermost(chosen), [])["activations"]
    return max(0, w.activations - after)


def _stack(x: RuleInput) -> list[Candidate]:
    assert x.workload is not None
    return block_stack(x.trace, x.workload)


def mixed_precision(x: RuleInput) -> list[Finding]:
    """Mixed precision: bf16 autocast where the card has it (no loss scaling needed); else fp16 with a
    GradScaler whose initial scale comes from the measured gradient range; and a warning with evidence
    where fp16 would overflow or flush gradients to zero. From the precision section's verdict. A
    script already under its own autocast is told so, with nothing to save."""
    prec, w = x.summary.get("precision"), x.workload
    if w is not None and w.script_autocast:
        title = f"already trains under its own {w.script_autocast} autocast"
        return [finding("mixed_precision", "info", title, w.script_precision or title, 0, 0.0, "high")]
    if not prec:
        return []
    bf16 = x.target.card.bf16 if x.target and x.target.card else prec.get("bf16_available")
    verdict = prec.get("verdict")
    saving = _amp_saving(w)
    cost = _amp_cost(w, "bf16" if bf16 else "fp16", x.target)
    if bf16:
        evidence = f"the card has native bf16; precision verdict: {prec.get('title')} ({prec.get('reason')})"
        return [finding("mixed_precision", "info", "train in bf16 autocast", evidence, saving, cost)]
    if verdict == "bf16_only":
        evidence = f"no native bf16 on this card, and fp16 is not safe: {prec.get('reason')}"
        return [finding("mixed_precision", "warning", "do not use fp16 here", evidence, 0, 0.0, "high")]
    scale = prec.get("suggested_init_scale_log2")
    settings = grad_scaler(w) if w is not None else None
    scaler = f"GradScaler(init_scale=2**{scale})" if scale is not None else "GradScaler()"
    if settings is not None:
        scaler = f"GradScaler(init_scale=2**{scale}, growth_interval={settings['growth_interval']})"
    evidence = f"no native bf16; {prec.get('title')}: {prec.get('reason')}; use fp16 autocast with {scaler}"
    return [finding("mixed_precision", "info", "train in fp16 with a GradScaler", evidence, saving, cost)]


def _amp_saving(w: Workload | None) -> int:
    if w is None:
        return 0
    acts = w.activations * w.amp_share * (1 - AMP_ACTIVATION_FACTOR)
    return max(0, int(acts - w.matmul_param_bytes * AMP_WEIGHT_CACHE_FACTOR))


def _amp_cost(w: Workload | None, precision: str, target: Target | None) -> float | None:
    """Autocast's time change from the device's capabilities where measured (``amp_time_factor``)."""
    if w is None or w.fwd_bwd_ms is None:
        return None
    card = target.card.name if target is not None and target.card is not None else None
    factor, _ = amp_time_factor(w, precision, card)
    return _step_fraction(w.fwd_bwd_ms * (factor - 1), w)


def memory_efficient_attention(x: RuleInput) -> list[Finding]:
    """Memory-efficient attention: eager attention materialises seq x seq score and probability tensors
    per head; ``torch.nn.functional.scaled_dot_product_attention`` (``attn_implementation="sdpa"`` in
    transformers) never does. Fires on the peak ledger's temporaries allocated in attention code."""
    led = x.summary.get("peak_ledger") or {}
    sites = [
        (str(s), int(b)) for s, b in led.get("temporaries_by_site") or [] if ATTENTION_SITE.search(str(s))
    ]
    total = sum(b for _, b in sites)
    peak = x.summary.get("peak_memory_bytes") or 0
    if not sites or not peak or total < ATTENTION_SHARE * peak:
        return []
    evidence = (
        f"{format_bytes(total)} of temporaries at the peak come from attention code, first {sites[0][0]} "
        f"({format_bytes(sites[0][1])}); the probabilities saved for backward grow with seq x seq too"
    )
    return [
        finding("memory_efficient_attention", "warning", "use SDPA / flash attention", evidence, total, 0.0)
    ]


def allocator_fragmentation(x: RuleInput) -> list[Finding]:
    """Allocator fragmentation: the caching allocator reserved much more than was allocated at the peak,
    or had to free its cache and retry. ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` lets
    segments grow in place instead of leaving unusable gaps."""
    step = peak_step(x.trace)
    alloc = (step.memory.get("allocator") or {}) if step else {}
    reserved, allocated = alloc.get("max_reserved"), alloc.get("max_allocated")
    retries = int(alloc.get("num_alloc_retries") or 0)
    if not isinstance(reserved, int) or not isinstance(allocated, int):
        return []
    gap = reserved - allocated
    if retries == 0 and (gap < FRAGMENTATION_BYTES or gap < FRAGMENTATION_SHARE * reserved):
        return []
    evidence = (
        f"measured at the peak step: reserved {format_bytes(reserved)} vs allocated "
        f"{format_bytes(allocated)} "
        f"({format_bytes(gap)} unused in the cache), {retries} allocation "
        f"retr{'y' if retries == 1 else 'ies'}"
    )
    return [
        finding("allocator_fragmentation", "warning", "set expandable_segments", evidence, gap, 0.0, "medium")
    ]


def dataloader_starvation(x: RuleInput) -> list[Finding]:
    """Data-loader starvation: the training loop waits for the next batch for a measurable share of the
    step. More ``num_workers``, ``pin_memory=True`` and ``persistent_workers=True`` hide the loading."""
    wait = x.summary.get("dataloader_wait_fraction")
    if not isinstance(wait, (int, float)) or wait < STARVATION_WAIT:
        return []
    evidence = f"the loop waited for data {wait:.0%} of the step time"
    return [
        finding("dataloader_starvation", "warning", "feed the GPU faster", evidence, 0, -float(wait), "high")
    ]


def dynamic_padding(x: RuleInput) -> list[Finding]:
    """Dynamic padding: many token positions are padding. Pad each batch to its own longest sequence
    (``DataCollatorWithPadding``), or bucket by length, with ``pad_to_multiple_of=8``/``16``; size the
    budget for the largest batch the data can produce, not the average one: the longest batch sets the
    peak, so the saving is that batch's (the mean batch's shorter length saves time)."""
    pad, w = x.summary.get("padding_fraction"), x.workload
    if not isinstance(pad, (int, float)) or pad < PADDING_SHARE:
        return []
    lengths = (x.summary.get("data") or {}).get("lengths") or {}
    saving = int(w.activations * pad) if w else 0
    evidence = f"{pad:.0%} of the token positions are padding"
    if lengths.get("p90") is not None:
        evidence += f"; real lengths p50 {lengths['p50']:g}, p90 {lengths['p90']:g}, max {lengths['max']}"
    if w is not None and w.padding is not None:
        saving = padding_peak_saving(w)
        evidence += (
            f"; the longest batch ({w.padding.worst_longest} of {w.padding.padded} tokens) sets the peak: "
            f"padded to its longest, it frees {format_bytes(saving) if saving else 'nothing'} there"
        )
    cost = -float(pad) * (w.fwd_bwd_ms / w.step_ms) if w and w.fwd_bwd_ms and w.step_ms else None
    return [finding("dynamic_padding", "info", "pad dynamically", evidence, saving, cost, "medium")]


def padding_peak_saving(w: Workload) -> int:
    """The activations the longest measured batch sheds when padded to its own longest sequence (to a
    multiple of ``PAD_MULTIPLE``): the planner's padding scale, so the finding and the plan agree."""
    if w.padding is None:
        return 0
    return int(w.activations * (1.0 - w.padding.ratio("trim", PAD_MULTIPLE)))


def optimizer_state(x: RuleInput) -> list[Finding]:
    """Optimizer state: Adam-style optimizers keep two fp32 moments per parameter. An 8-bit optimizer
    (bitsandbytes ``AdamW8bit``) keeps them in a quarter of the bytes; offloading them to the CPU frees
    them all, at the cost of moving gradients and parameters over PCIe every step."""
    w, t = x.workload, x.target
    if w is None or t is None or w.optimizer_state < OPTIMIZER_STATE_SHARE * t.budget_bytes:
        return []
    share = w.optimizer_state / t.budget_bytes
    evidence = f"optimizer state is {format_bytes(w.optimizer_state)}, {share:.0%} of the budget"
    return [
        finding(
            "optimizer_state", "info", "8-bit optimizer state", evidence, int(w.optimizer_state * 0.75), 0.0
        )
    ]


def parameter_offload(x: RuleInput) -> list[Finding]:
    """Parameter offload: the largest parameter holders with the least compute per byte (input
    embeddings, then LM heads) can keep their parameters on the CPU and stream them in while they run
    (accelerate ``device_map``/``cpu_offload``, DeepSpeed ZeRO-3 ``offload_param``): their gradients
    leave the GPU, at a PCIe cost every step. Fires when those modules hold at least 5% of the budget."""
    w, t = x.workload, x.target
    if w is None or t is None or not w.param_holders or not t.offloads(w):
        return []
    held = sum(h.param_bytes + h.grad_bytes for h in w.param_holders)
    if held < PARAM_OFFLOAD_SHARE * t.budget_bytes:
        return []
    names = tuple(h.name for h in w.param_holders)
    moved = predict(w, Config(offload_parameters=names), offload_bytes_per_s=t.link(w))
    left = moved.breakdown["parameters"] + moved.breakdown["gradients"]
    saving = w.parameters + w.gradients - left
    if saving <= 0:
        return []
    ms = moved.time_parts.get("parameter_offload")
    evidence = (
        f"{', '.join(names)} hold {format_bytes(held)} of parameters and gradients for "
        f"{sum(h.forward_ms or 0.0 for h in w.param_holders):.1f} ms of forward; moving them costs "
        + (
            f"{ms:.1f} ms a step ({moved.time_basis.get('parameter_offload')})"
            if ms is not None
            else "an unknown time (no host-link bandwidth)"
        )
    )
    return [
        finding(
            "parameter_offload",
            "info",
            "offload embedding/head parameters",
            evidence,
            saving,
            _step_fraction(ms, w),
            "low",
        )
    ]


def gradient_health(x: RuleInput) -> list[Finding]:
    """Gradient health: NaN/Inf, exploding or vanishing gradients, from the gradient-norm flags."""
    out = []
    for flag in x.summary.get("grad_flags") or []:
        kind, module = flag.get("kind"), flag.get("module")
        severity = {"nonfinite": "critical", "scaler_skipped": "info"}.get(str(kind), "warning")
        title = "GradScaler skipped steps" if kind == "scaler_skipped" else f"{kind} gradients"
        title += f" in {module}" if module else ""
        out.append(finding("gradient_health", severity, title, str(flag.get("evidence")), 0, 0.0, "high"))
    return out


# In the default lever order (``memdoctor.plan.ninegrid.lever_priority(None)``); ``run_rules`` reorders
# the memory rules by the workload's nine-grid cell.
RULES: tuple[Callable[[RuleInput], list[Finding]], ...] = (
    checkpointing,
    parameter_offload,
    optimizer_state,
    dynamic_padding,
    memory_efficient_attention,
    allocator_fragmentation,
    mixed_precision,
    dataloader_starvation,
    gradient_health,
)


# The lever family each memory rule proposes (``memdoctor.plan.ninegrid.lever_priority`` orders them).
RULE_FAMILY = {
    "checkpointing": "checkpoint",
    "parameter_offload": "offload",
    "optimizer_state": "8bit",
    "dynamic_padding": "padding",
    "memory_efficient_attention": "attention",
    "allocator_fragmentation": "allocator",
    "mixed_precision": "precision",
}


def run_rules(x: RuleInput) -> list[Finding]:
    """Every rule's findings, ordered by the nine-grid cell: critical findings that are not about
    memory (NaN gradients) first, then the memory rules in the cell's lever order (``x.priority``,
    the default order without a cell), then the rest in ``RULES`` order."""
    found = [f for rule in RULES for f in rule(x)]
    order = list(x.priority or lever_priority(None))

    def key(item: tuple[int, Finding]) -> tuple[int, int, int]:
        i, f = item
        family = RULE_FAMILY.get(f["rule"])
        if family is None:
            return (0 if f["severity"] == "critical" else 2, 0, i)
        return (1, order.index(family) if family in order else len(order), i)

    return [f for _, f in sorted(enumerate(found), key=key)]
