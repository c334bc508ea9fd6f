"""RegionTensor follows what a conversion does to checkpoint tensors without their values: every
operation it follows gives the values torch gives (checked by materializing the blocks), the blocks
it hands the planner are the few a layout change needs, and what it cannot follow is refused."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.components.checkpoint.region_tensor import RegionTensor, UnsupportedRegionOp, materialize

X = torch.arange(24, dtype=torch.float32).reshape(6, 4) * 1.5 - 7
Y = torch.randn(6, 4).to(torch.bfloat16)
SOURCES = {"x": X, "y": Y}


def leaf(name: str) -> RegionTensor:
    return RegionTensor.leaf(name, tuple(SOURCES[name].shape), SOURCES[name].dtype)


FOLLOWED = {
    "reshape": lambda t: t.reshape(4, 6),
    "reshape_cutting_rows": lambda t: t.t().reshape(3, 8),
    "view_flatten": lambda t: t.view(2, 3, 4).flatten(),
    "unflatten_permute": lambda t: t.unflatten(0, (2, 3)).permute(2, 0, 1),
    "transpose_contiguous": lambda t: torch.transpose(t, 0, 1).contiguous(),
    "strided_slice": lambda t: t[1::2, ::3],
    "int_index_none_ellipsis": lambda t: t[2, None, ...],
    "negative_index": lambda t: t[-1],
    "narrow_select": lambda t: t.narrow(1, 1, 2).select(0, -2),
    "split_sections": lambda t: torch.split(t, [1, 5], dim=0)[1],
    "chunk_unbind": lambda t: torch.stack(t.chunk(3, dim=0)[1].unbind(0), dim=1),
    "squeeze_unsqueeze": lambda t: t.unsqueeze(1).unsqueeze(0).squeeze(),
    "cat_with_itself": lambda t: torch.cat([t, t[:2]], dim=0),
    "stack_transpose_reshape": lambda t: torch.stack([t, t * 2]).transpose(0, 2).reshape(-1),
    "scalar_arithmetic": lambda t: (2 - t) / 4 + 1,
    "divide_floor": lambda t: torch.div(t, 3, rounding_mode="floor"),
    "negate": lambda t: -torch.neg(t),
    "to_dtype": lambda t: t.to(torch.bfloat16).float() * 3,
    "T_property": lambda t: t.T[1:3],
    "interleave_halves": lambda t: t.reshape(3, 2, 4).transpose(0, 1).reshape(6, 4),
}


@pytest.mark.parametrize("name", sorted(FOLLOWED))
def test_a_followed_operation_gives_torchs_values(name):
    fn = FOLLOWED[name]
    region, real = fn(leaf("x")), fn(X)
    assert isinstance(region, RegionTensor)
    assert tuple(region.shape) == tuple(real.shape) and region.dtype == real.dtype
    assert torch.equal(materialize(region, SOURCES), real)


def test_concatenating_dtypes_promotes_and_the_cast_lands_before_the_next_step():
    region = torch.cat([leaf("y"), leaf("x")]) + 0.1
    real = torch.cat([Y, X]) + 0.1
    assert region.dtype == torch.float32 and torch.equal(materialize(region, SOURCES), real)
    blocks = region.remap_blocks()
    from_y = next(b for b in blocks if b.source == "y")
    values = from_y.post[0](Y[:1])  # the first step casts y's bfloat16 values before adding
    assert values.dtype == torch.float32


def test_grouped_qkv_is_one_block_per_head_and_projection():
    q = RegionTensor.leaf("q", (8, 16), torch.float32)
    k = RegionTensor.leaf("k", (4, 16), torch.float32)
    v = RegionTensor.leaf("v", (4, 16), torch.float32)
    grouped = torch.cat([q.reshape(2, 4, 16), k.reshape(2, 2, 16), v.reshape(2, 2, 16)], dim=1).flatten(0, 1)
    blocks = sorted(grouped.remap_blocks(), key=lambda b: b.offsets)
    assert [(b.source, b.offsets[0], b.lengths[0], b.base[0]) for b in blocks] == [
        ("q", 0, 4, 0), ("k", 4, 2, 0), ("v", 6, 2, 0), ("q", 8, 4, 4), ("k", 12, 2, 2), ("v", 14, 2, 2)]


def test_stacked_experts_are_one_block_per_expert():
    experts = [RegionTensor.leaf(f"e{i}", (3, 5), torch.float32) for i in range(4)]
    stacked = torch.stack(experts)
    assert [(b.source, b.offsets) for b in stacked.remap_blocks()] == [(f"e{i}", (i, 0, 0)) for i in range(4)]


def test_a_transpose_reads_with_swapped_steps():
    (block,) = leaf("x").t().remap_blocks()
    assert block.coeff == ((0, 1), (1, 0)) and block.lengths == (4, 6)


@pytest.mark.parametrize("fn, needle", [
    (lambda t: t * t, "Python numbers"),
    (lambda t: t + torch.ones(6, 4), "real tensors|first is not followed|Python numbers"),
    (lambda t: torch.flip(t, dims=[0]), "flip is not followed"),
    (lambda t: t[::-1], "step"),
    (lambda t: t[torch.tensor([0, 1])], "indexing a region"),
    (lambda t: t.sum(), "sum"),
    (lambda t: bool(t), "bool"),
    (lambda t: t.item(), "item"),
    (lambda t: t.view(torch.int32), "reinterprets"),
    (lambda t: t.copy_(X), "copy_"),
])
def test_what_cannot_be_followed_is_refused(fn, needle):
    with pytest.raises((UnsupportedRegionOp, ValueError, AttributeError), match=needle):
        fn(leaf("x"))


def test_bad_arguments_fail_as_torch_fails_them():
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        leaf("x").reshape(5, 5)


def test_an_empty_checkpoint_tensor_has_no_blocks():
    empty = RegionTensor.leaf("e", (0, 4), torch.float32)
    assert empty.remap_blocks() == [] and tuple(empty.reshape(4, 0).shape) == (4, 0)
