"""A tiny Qwen3-MoE made by transformers itself, its checkpoint, and a model with fused QKV to load it into.

``save_pretrained`` of transformers' ``Qwen3MoeForCausalLM`` writes what the Hub holds: separate
``q_proj``/``k_proj``/``v_proj`` and one ``gate_proj``/``up_proj``/``down_proj`` tensor per expert.
The model loaded into is the same transformers class (its experts stacked, ``gate_up_proj`` and
``down_proj``, which transformers' own conversion mapping merges per-expert tensors into) with each
attention's three projections replaced by one grouped ``linear_qkv`` (:class:`InterleaveQKV`), a
final norm stored as ``weight - 1`` (:class:`AddScalar`), and two custom steps: one that traces
(rotating a norm's halves) and one that does not (reversing a norm, which reads backwards).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hyper_parallel.components.checkpoint import AddScalar, ConversionOps, InterleaveQKV, WeightConverter

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.conversion_mapping")

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 4, 16


def tiny_config(layers: int = 2, experts: int = 4) -> Any:
    return transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=experts,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


def save_checkpoint(directory: Path, *, layers: int = 2, experts: int = 4, dtype: torch.dtype = torch.float32,
                    seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Write a tiny Qwen3-MoE with random weights as ``save_pretrained`` does; returns the directory."""
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(tiny_config(layers, experts)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    return directory


class _RotateHalves(ConversionOps):
    """A user's step written with torch ops that trace: the second half of a vector first."""

    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, Any]:
        (tensor,) = input_dict[source_patterns[0]]
        half = tensor.shape[0] // 2
        return {target_patterns[0]: torch.cat([tensor.narrow(0, half, tensor.shape[0] - half),
                                               tensor.narrow(0, 0, half)])}


class _Reverse(ConversionOps):
    """A user's step that does not trace (``torch.flip`` reads backwards): it runs on whole tensors."""

    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, Any]:
        (tensor,) = input_dict[source_patterns[0]]
        return {target_patterns[0]: torch.flip(tensor, dims=[0]) * 2.0}


def extra_rules() -> list[Any]:
    """The rules the fused model needs on top of transformers' own (fresh objects each call)."""
    groups = HEADS // KV_HEADS
    return [
        WeightConverter(["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                        "self_attn.linear_qkv.weight", [InterleaveQKV(KV_HEADS, groups, HEAD_DIM, HEAD_DIM, False)]),
        WeightConverter("model.norm.weight", "model.norm.weight", [AddScalar(1.0)]),
        WeightConverter("self_attn.q_norm.weight", "self_attn.q_norm.weight", [_RotateHalves()]),
        WeightConverter("self_attn.k_norm.weight", "self_attn.k_norm.weight", [_Reverse()]),
    ]


def fused_model(*, layers: int = 2, experts: int = 4, dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers' Qwen3-MoE, each attention's q/k/v replaced by one grouped ``linear_qkv`` (zeros)."""
    model = transformers.Qwen3MoeForCausalLM(tiny_config(layers, experts)).to(dtype)
    rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    for layer in model.model.layers:
        attention = layer.self_attn
        del attention.q_proj, attention.k_proj, attention.v_proj
        attention.linear_qkv = nn.Linear(HIDDEN, rows, bias=False, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def grouped_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The grouped layout written out by hand: per KV head, its query heads' rows, its key rows, its value rows."""
    per = (HEADS // KV_HEADS) * HEAD_DIM
    rows = []
    for h in range(KV_HEADS):
        rows += [q[h * per:(h + 1) * per], k[h * HEAD_DIM:(h + 1) * HEAD_DIM], v[h * HEAD_DIM:(h + 1) * HEAD_DIM]]
    return torch.cat(rows)
