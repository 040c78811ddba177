"""Fuzzing the config loader: every input loads or raises ConfigError, nothing else."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from memdoctor.config import PlanConfig, dump_config, parse_config
from memdoctor.errors import ConfigError

pytestmark = pytest.mark.fuzz

FUZZ = settings(max_examples=1000, deadline=None, derandomize=True)

KEYS = [
    "memdoctor_config", "checkpoint", "precision", "grad_scaler", "micro_batch", "accumulation_steps",
    "optimizer", "padding", "attention", "allocator", "data_loader", "provenance", "init_scale",
    "growth_interval", "num_workers", "pin_memory", "trace", "fits", "unknown", "pad_to_multiple_of",
    "offload_parameters", "full_offload",
]  # fmt: skip
scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["fp32", "bf16", "fp16", "as-is", "8bit", "offload", "trim", "sdpa", "a.b", ""]),
    st.text(max_size=20),
)
value = st.recursive(
    scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), inner, max_size=4),
    ),
    max_leaves=12,
)
document = st.dictionaries(st.sampled_from(KEYS), value, max_size=8).map(
    lambda d: {"memdoctor_config": 1, **d} if "memdoctor_config" not in d else d
)


def _load_or_refuse(text: str) -> None:
    try:
        cfg = parse_config(text)
    except ConfigError as exc:
        assert "\n" not in str(exc)  # one line
        return
    assert isinstance(cfg, PlanConfig)
    assert parse_config(dump_config(cfg)) == cfg  # whatever loads, round-trips


@FUZZ
@given(doc=document)
def test_structured_documents_load_or_are_refused(doc: dict[str, Any]) -> None:
    _load_or_refuse(yaml.safe_dump(doc))


@settings(max_examples=1000, deadline=None, derandomize=True)
@given(text=st.text(alphabet=st.sampled_from(list("ab:-!&*[]{}|>#'\"\n %@`?,.1\t")), max_size=80))
def test_yaml_like_text_loads_or_is_refused(text: str) -> None:
    _load_or_refuse(text)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(text=st.text(max_size=200))
def test_arbitrary_text_loads_or_is_refused(text: str) -> None:
    _load_or_refuse(text)


valid = st.builds(
    PlanConfig,
    checkpoint=st.lists(st.text(min_size=1, max_size=12), max_size=4, unique=True).map(tuple),
    precision=st.sampled_from(["fp32", "bf16"]),
    micro_batch=st.one_of(st.none(), st.integers(1, 4096)),
    accumulation_steps=st.integers(1, 64),
    optimizer=st.sampled_from(["as-is", "8bit", "offload"]),
    padding=st.sampled_from(["as-is", "trim"]),
    pad_to_multiple_of=st.one_of(st.none(), st.sampled_from([8, 64])),
    offload_parameters=st.lists(st.text(min_size=1, max_size=12), max_size=2, unique=True).map(tuple),
    attention=st.sampled_from([None, "eager", "sdpa"]),
    allocator=st.one_of(st.none(), st.text(max_size=30)),
)


@settings(max_examples=700, deadline=None, derandomize=True)
@given(cfg=valid, key=st.sampled_from(KEYS), new=value, drop=st.booleans())
def test_a_valid_config_with_one_field_changed_loads_or_is_refused(
    cfg: PlanConfig, key: str, new: Any, drop: bool
) -> None:
    # every valid config round-trips exactly (this found PyYAML writing U+0085 unescaped, which reads
    # back as a line break: the writer escapes non-ASCII now)
    assert parse_config(dump_config(cfg)) == cfg
    doc = cfg.as_dict()
    if drop:
        doc.pop(key, None)
    else:
        doc[key] = new
    _load_or_refuse(yaml.safe_dump(doc))
