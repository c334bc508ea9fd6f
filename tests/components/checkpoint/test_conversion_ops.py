"""The conversion steps of ``components.checkpoint.conversion_ops``: each gives the layout it promises
(written out by hand here), its reverse undoes it, it refuses rules of the wrong shape, and it traces
into region reads that give the same values."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.components.checkpoint import (
    AddScalar,
    ConcatenateWithSections,
    DeinterleaveGateQKV,
    DeinterleaveQKV,
    InterleaveGateQKV,
    InterleaveQKV,
    Split,
)
from hyper_parallel.components.checkpoint.region_tensor import RegionTensor, materialize

KV, GROUPS, D, DV, WIDTH = 2, 3, 2, 3, 5


def rows(n: int, start: float = 0.0) -> torch.Tensor:
    """``n`` rows whose first column numbers them, so a layout can be read off."""
    t = torch.randn(n, WIDTH)
    t[:, 0] = torch.arange(n, dtype=torch.float32) + start
    return t


def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rows(KV * GROUPS * D, 0), rows(KV * D, 100), rows(KV * DV, 200)


def run(op, inputs: dict, sources: list[str], targets: list[str]) -> dict:
    return op.convert({k: [v] for k, v in inputs.items()}, source_patterns=sources, target_patterns=targets)


def test_interleave_qkv_groups_each_kv_heads_queries_key_and_value():
    q, k, v = qkv()
    out = run(InterleaveQKV(KV, GROUPS, D, DV, source_is_fused=False), {"q": q, "k": k, "v": v}, ["q", "k", "v"],
              ["qkv"])["qkv"]
    expected = []
    for h in range(KV):
        expected += [q[h * GROUPS * D:(h + 1) * GROUPS * D], k[h * D:(h + 1) * D], v[h * DV:(h + 1) * DV]]
    assert torch.equal(out, torch.cat(expected))


def test_interleave_qkv_from_a_fused_source_equals_from_separate_ones():
    q, k, v = qkv()
    separate = run(InterleaveQKV(KV, GROUPS, D, DV, False), {"q": q, "k": k, "v": v}, ["q", "k", "v"], ["t"])["t"]
    fused = run(InterleaveQKV(KV, GROUPS, D, DV, True), {"f": torch.cat([q, k, v])}, ["f"], ["t"])["t"]
    assert torch.equal(separate, fused)


@pytest.mark.parametrize("fused", [False, True])
def test_deinterleave_qkv_undoes_interleave(fused):
    q, k, v = qkv()
    op = InterleaveQKV(KV, GROUPS, D, DV, source_is_fused=fused)
    inputs, sources = ({"f": torch.cat([q, k, v])}, ["f"]) if fused else ({"q": q, "k": k, "v": v}, ["q", "k", "v"])
    grouped = run(op, inputs, sources, ["t"])["t"]
    back = run(op.reverse_op, {"t": grouped}, ["t"], sources)
    assert isinstance(op.reverse_op, DeinterleaveQKV)
    for name, tensor in inputs.items():
        assert torch.equal(back[name], tensor)


def test_gated_interleave_puts_gate_rows_after_each_groups_value_rows():
    kv, groups, d, dv = 2, 2, 2, 2
    query_gate, k, v = rows(kv * groups * 2 * d, 0), rows(kv * d, 100), rows(kv * dv, 200)
    out = run(InterleaveGateQKV(kv, groups, d, dv), {"qg": query_gate, "k": k, "v": v}, ["qg", "k", "v"],
              ["t"])["t"]
    expected = []
    for h in range(kv):
        heads = [h * groups + g for g in range(groups)]  # query heads of this kv head
        expected += [query_gate[2 * d * i: 2 * d * i + d] for i in heads]  # their query rows
        expected += [k[h * d:(h + 1) * d], v[h * dv:(h + 1) * dv]]
        expected += [query_gate[2 * d * i + d: 2 * d * (i + 1)] for i in heads]  # their gate rows
    assert torch.equal(out, torch.cat(expected))
    back = run(DeinterleaveGateQKV(kv, groups, d, dv), {"t": out}, ["t"], ["qg", "k", "v"])
    assert torch.equal(back["qg"], query_gate) and torch.equal(back["k"], k) and torch.equal(back["v"], v)


def test_add_scalar_adds_in_the_tensors_dtype_and_reverses():
    t = torch.randn(7).to(torch.bfloat16)
    out = run(AddScalar(1.0), {"w": t}, ["w"], ["w"])["w"]
    assert out.dtype == torch.bfloat16 and torch.equal(out, t + 1.0)
    assert torch.equal(run(AddScalar(1.0).reverse_op, {"w": out}, ["w"], ["w"])["w"], out - 1.0)


def test_concatenate_with_sections_checks_sizes_and_split_undoes_it():
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    cat = run(ConcatenateWithSections((2, 4)), {"a": a, "b": b}, ["a", "b"], ["t"])["t"]
    assert torch.equal(cat, torch.cat([a, b]))
    parts = run(ConcatenateWithSections((2, 4)).reverse_op, {"t": cat}, ["t"], ["a", "b"])
    assert isinstance(ConcatenateWithSections((2, 4)).reverse_op, Split)
    assert torch.equal(parts["a"], a) and torch.equal(parts["b"], b)
    with pytest.raises(ValueError, match=r"expected sizes \(2, 4\).*found \(4, 2\)"):
        run(ConcatenateWithSections((2, 4)), {"a": b, "b": a}, ["a", "b"], ["t"])
    with pytest.raises(ValueError, match="has 6 there"):
        run(Split((2, 5)), {"t": cat}, ["t"], ["a", "b"])


@pytest.mark.parametrize("make, sources, targets, needle", [
    (lambda: InterleaveQKV(KV, GROUPS, D, DV, False), ["q", "k"], ["t"], "3 source pattern"),
    (lambda: AddScalar(2.0), ["a"], ["b", "c"], "1 target pattern"),
    (lambda: Split((1, 2)), ["a"], ["b"], "2 target pattern"),
])
def test_a_rule_of_the_wrong_shape_is_refused_naming_its_patterns(make, sources, targets, needle):
    with pytest.raises(ValueError, match=needle):
        make().convert({s: [torch.zeros(6, 5)] for s in sources}, source_patterns=sources, target_patterns=targets)


@pytest.mark.parametrize("bad", [(3,), (2, 0), (2.0, 1)])
def test_sections_must_be_two_or_more_positive_integers(bad):
    with pytest.raises(ValueError, match="sections"):
        Split(bad)


def test_gqa_sizes_must_be_positive_integers():
    with pytest.raises(ValueError, match="query_head_dim"):
        InterleaveQKV(2, 2, 0, 2, False)


def _traced_equals_real(op, tensors: dict, sources: list[str], targets: list[str]) -> None:
    leaves = {k: RegionTensor.leaf(k, tuple(t.shape), t.dtype) for k, t in tensors.items()}
    traced = run(op, leaves, sources, targets)
    real = run(op, tensors, sources, targets)
    assert traced.keys() == real.keys()
    for name, region in traced.items():
        assert isinstance(region, RegionTensor), f"{type(op).__name__} did not trace"
        assert torch.equal(materialize(region, tensors), real[name])


def test_every_step_traces_into_regions_with_the_same_values():
    q, k, v = qkv()
    _traced_equals_real(InterleaveQKV(KV, GROUPS, D, DV, False), {"q": q, "k": k, "v": v}, ["q", "k", "v"], ["t"])
    _traced_equals_real(InterleaveQKV(KV, GROUPS, D, DV, True), {"f": torch.cat([q, k, v])}, ["f"], ["t"])
    grouped = run(InterleaveQKV(KV, GROUPS, D, DV, False), {"q": q, "k": k, "v": v}, ["q", "k", "v"], ["t"])["t"]
    _traced_equals_real(DeinterleaveQKV(KV, GROUPS, D, DV, False), {"t": grouped}, ["t"], ["q", "k", "v"])
    qg = rows(2 * 2 * 2 * 2)
    _traced_equals_real(InterleaveGateQKV(2, 2, 2, 2), {"qg": qg, "k": rows(4), "v": rows(4)}, ["qg", "k", "v"],
                        ["t"])
    _traced_equals_real(DeinterleaveGateQKV(2, 2, 2, 2), {"t": rows(24)}, ["t"], ["qg", "k", "v"])
    _traced_equals_real(AddScalar(0.5), {"w": torch.randn(5).to(torch.bfloat16)}, ["w"], ["w"])
    _traced_equals_real(ConcatenateWithSections((2, 3), dim=1), {"a": torch.randn(4, 2), "b": torch.randn(4, 3)},
                        ["a", "b"], ["t"])
    _traced_equals_real(Split((1, 3), dim=1), {"t": torch.randn(2, 4)}, ["t"], ["a", "b"])
