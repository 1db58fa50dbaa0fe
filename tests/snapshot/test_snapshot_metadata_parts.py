"""The metadata in parts (a base sent once, a delta per snapshot): exactly the whole text
once expanded, and every malformed part refused with a message saying what is wrong."""

from __future__ import annotations

import json

import pytest

from swap_state.common.segment import plan_segment
from swap_state.common.snapshot_errors import SnapshotInvalid
from swap_state.common.snapshot_metadata import TensorMetadata, encode_metadata, tagged_scalar
from swap_state.common.snapshot_metadata_parts import base_id, encode_base, encode_delta, parse_base, parse_delta

SPECS = [("a.exp_avg", "float32", (4, 8)), ("a.exp_avg_sq", "float32", (4, 8)), ("b.exp_avg", "float32", (3,))]
TENSORS = plan_segment(SPECS, 4096, 1).tensors
META = {"a.exp_avg": TensorMetadata("a", "exp_avg", (8, 8), (4, 0)), "a.exp_avg_sq": TensorMetadata("a", "exp_avg_sq"),
        "b.exp_avg": TensorMetadata("b", "exp_avg")}
GROUPS = [{"lr": 0.001, "betas": [0.9, 0.95]}, {"lr": tagged_scalar(0.5, "float32"), "weight_decay": 0.0}]


def test_parts_expand_to_the_whole_metadata():
    base = encode_base(META, {"tied": "a"}, ["a", "b"], [1, 0])
    delta = encode_delta(GROUPS, [7.0, 6.0])
    whole = encode_metadata(META, {"a": GROUPS[1], "b": GROUPS[0]}, {"a": 7.0, "b": 6.0}, {"tied": "a"})
    assert parse_delta(delta, parse_base(base, TENSORS)).expand().raw == whole
    assert base_id(base) == base_id(base) != base_id(base + " ")
    same = encode_metadata(META, {"a": GROUPS[1], "b": GROUPS[0]}, {"a": 5.0, "b": 5.0}, {"tied": "a"})
    assert parse_delta(encode_delta(GROUPS, 5.0), parse_base(base, TENSORS)).expand().raw == same


@pytest.mark.parametrize("base, message", [
    ("[]", "must be a JSON object"),
    ('{"fqns": ["a"], "groups": []}', "1 fqns but 0 group indices"),
    ('{"fqns": [""], "groups": [0]}', "non-empty strings"),
    ('{"fqns": ["a"], "groups": [-1]}', "non-negative integers"),
    ('{"tensors": {"zzz": {}}}', "not a segment tensor"),
    ('{"fqns": ["a"], "groups": [NaN]}', "not standard JSON|not valid JSON"),
])
def test_a_malformed_base_is_refused(base, message):
    with pytest.raises(SnapshotInvalid, match=message):
        parse_base(base, TENSORS)


@pytest.mark.parametrize("delta, message", [
    ({"group_params": [{}], "steps": [1, 2]}, "1 param groups, the base names 2"),
    ({"group_params": GROUPS, "steps": [1]}, "steps must be a list of 2 values"),
    ({"group_params": GROUPS, "steps": [1, "x"]}, "must be a number or a tensor"),
    ({"group_params": [GROUPS[0], {"lr": {"__tensor__": "x"}}], "steps": [1, 2]}, "must be a number"),
    ({"group_params": "x", "steps": [1, 2]}, "list of objects"),
])
def test_a_malformed_delta_is_refused(delta, message):
    base = parse_base(encode_base(META, None, ["a", "b"], [1, 0]), TENSORS)
    with pytest.raises(SnapshotInvalid, match=message):
        parse_delta(json.dumps(delta), base)


def test_parts_are_bounded_like_the_whole_text():
    with pytest.raises(SnapshotInvalid, match="more than the limit of 10"):
        parse_base(encode_base(META, None, ["a"], [0]), TENSORS, max_bytes=10)
