"""The autocast what-if's rule (``memdoctor.plan.measure.amp_factor``) on hand-built traces: adding
autocast halves every module's saved activations but those of the types it keeps in fp32 (losses,
embeddings, norms other than BatchNorm, max-pool indices; on CUDA softmax and dropout's bool mask), and
never a root's own code. Checked against measured autocast runs in ``test_amp_whatif_measured.py``."""

from __future__ import annotations

import pytest

from memdoctor.plan.config import Config
from memdoctor.plan.measure import amp_factor, measured_workload
from memdoctor.plan.memory import AMP_ACTIVATION_FACTOR, memory_parts
from memdoctor.report import build_summary
from tests.tracebuilder import MiB, Module, TraceBuilder

HALF = AMP_ACTIVATION_FACTOR


@pytest.mark.parametrize(
    ("module_type", "device", "factor"),
    [
        ("Conv2d", "cuda", HALF),
        ("Linear", "cpu", HALF),
        ("BatchNorm2d", "cuda", HALF),  # on neither autocast list: runs in the conv's 16-bit dtype
        ("SyncBatchNorm", "cuda", HALF),
        ("ReLU", "cuda", HALF),
        ("GELUActivation", "cpu", HALF),
        ("BertSelfAttention", "cuda", HALF),
        ("LayerNorm", "cuda", 1.0),
        ("LayerNorm", "cpu", 1.0),
        ("GroupNorm", "cuda", 1.0),
        ("LlamaRMSNorm", "cpu", 1.0),
        ("CrossEntropyLoss", "cpu", 1.0),
        ("MSELoss", "cuda", 1.0),
        ("Embedding", "cuda", 1.0),
        ("MaxPool2d", "cpu", 1.0),
        ("Softmax", "cuda", 1.0),
        ("Softmax", "cpu", HALF),  # CPU autocast has no fp32 softmax
        ("Dropout", "cuda", 1.0),  # a bool mask
        ("Dropout", "cpu", HALF),  # a mask in the input's dtype
        (None, "cuda", HALF),
    ],
)
def test_the_factor_follows_how_autocast_propagates_dtypes(
    module_type: str | None, device: str, factor: float
) -> None:
    assert amp_factor(module_type, device) == factor


def _cnn() -> list[Module]:
    """A ResNet stem and block: per module (name, type, parameter bytes, own saved bytes)."""
    return [
        ("", "TinyResNet", 0, 0),
        ("conv1", "Conv2d", 4096, 8 * MiB),
        ("bn1", "BatchNorm2d", 256, 32 * MiB),
        ("relu", "ReLU", 0, 32 * MiB),
        ("maxpool", "MaxPool2d", 0, 16 * MiB),
        ("layer1", "Sequential", 0, 0),
        ("layer1.0", "BasicBlock", 0, 0),
        ("layer1.0.conv1", "Conv2d", 9216, 0),
        ("layer1.0.bn1", "BatchNorm2d", 256, 8 * MiB),
        ("layer1.0.relu", "ReLU", 0, 8 * MiB),
        ("layer1.0.conv2", "Conv2d", 9216, 0),
        ("layer1.0.bn2", "BatchNorm2d", 256, 8 * MiB),
        ("layer1.0.drop", "Dropout", 0, 4 * MiB),
        ("fc", "Linear", 2560, 1 * MiB),
    ]


def _share(kind: str, modules: list[Module]) -> float:
    b = TraceBuilder(kind=kind)
    b.add_model(modules)
    b.add_steps(warmup=1, profiled=2)
    trace = b.end("completed").build()
    w = measured_workload(trace, build_summary(trace))
    assert w is not None
    return w.amp_share


def test_a_cnn_halves_its_batchnorm_and_keeps_its_max_pool_indices() -> None:
    kept_cuda = 16 + 4  # max-pool indices, and CUDA dropout's bool mask
    total = 8 + 32 + 32 + 16 + 8 + 8 + 8 + 4 + 1
    assert _share("cuda", _cnn()) == pytest.approx((total - kept_cuda) / total)
    assert _share("cpu", _cnn()) == pytest.approx((total - 16) / total)  # CPU dropout's mask halves


def test_the_roots_own_code_and_norms_are_never_halved() -> None:
    gpt = [
        ("", "GPT", 0, 40 * MiB),  # the root's logits.float() and loss: fp32 under autocast too
        ("wte", "Embedding", 1 * MiB, 1 * MiB),
        ("ln_1", "LayerNorm", 256, 10 * MiB),
        ("attn", "CausalSelfAttention", 0, 20 * MiB),
        ("attn.c_attn", "Linear", 1 * MiB, 10 * MiB),
        ("mlp_act", "GELU", 0, 19 * MiB),
    ]
    assert _share("cuda", gpt) == pytest.approx(49 / 100)


def test_the_memory_model_applies_the_share_to_the_activations() -> None:
    b = TraceBuilder(kind="cuda")
    b.add_model(_cnn())
    b.add_steps(warmup=1, profiled=2)
    trace = b.end("completed").build()
    w = measured_workload(trace, build_summary(trace))
    assert w is not None
    parts = memory_parts(w, Config(precision="bf16"), [], [])
    assert parts["activations"] == int(w.activations * (1 - w.amp_share * (1 - HALF)))
    assert parts["activations"] < w.activations * 0.65  # BatchNorm's and ReLU's bytes halve too
