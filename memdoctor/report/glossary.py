"""One-line explanations of the terms the report uses that a reader may not know.

The report lists them at its end (``#glossary``) and its ``term`` macro puts the same line on a term
where it is used, as the ``title`` of an ``<abbr>`` (a tooltip) linking to the list.
"""

from __future__ import annotations

# key -> (the term as the report prints it, one line saying what it means)
TERMS: dict[str, tuple[str, str]] = {
    "allocated": (
        "allocated vs reserved",
        "allocated: the bytes live tensors use; reserved: what PyTorch's caching allocator holds from the "
        "GPU (allocated plus cached free blocks). An out-of-memory error happens when reserved cannot grow.",
    ),
    "checkpointing": (
        "activation checkpointing",
        "a module keeps only its inputs in the forward and recomputes what it needs in the backward: less "
        "memory for activations, paid for with about one more forward of that module.",
    ),
    "expandable_segments": (
        "expandable segments",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets the allocator grow its memory blocks in "
        "place, so free memory is not lost to fragmentation between blocks of different sizes.",
    ),
    "accumulation": (
        "micro-batch and gradient accumulation",
        "each batch is split into smaller micro-batches whose gradients are summed before one optimizer "
        "step: the same update, with the activations of one micro-batch at a time.",
    ),
    "autocast": (
        "autocast (bf16/fp16)",
        "torch.autocast runs matrix multiplications in 16-bit floats, halving their activations; fp16 also "
        "needs a GradScaler so that small gradients do not round to zero.",
    ),
    "ninegrid": (
        "nine-grid",
        "where the run sits on two axes, compute intensity and parameter scale (low/medium/high each), plus "
        "its data traits: the cell sets which levers the planner tries first.",
    ),
    "roofline": (
        "roofline",
        "a GPU's speed limit: FLOPs per byte moved above its ridge point are limited by arithmetic, below "
        "it by memory bandwidth.",
    ),
    "activations": (
        "activations",
        "tensors a layer's forward saves for its backward; they are freed as the backward passes the layer.",
    ),
    "optimizer_state": (
        "optimizer state",
        "what the optimizer keeps per parameter: AdamW holds two fp32 tensors, twice the parameters' bytes.",
    ),
}


def glossary_rows() -> list[dict[str, str]]:
    """``[{key, term, text}]`` in the order the report lists them."""
    return [{"key": k, "term": term, "text": text} for k, (term, text) in TERMS.items()]


# the glossary line a plan's lever uses: a lever's text (memdoctor.plan.config) containing the key
LEVER_TERMS: dict[str, str] = {
    "checkpoint": "checkpointing",
    "expandable_segments": "expandable_segments",
    "autocast": "autocast",
    "gradient accumulation": "accumulation",
}
