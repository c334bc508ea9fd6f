"""The rules' contract: transformers' own classes where transformers has scoped rules, else the
fallback (``transforms_fallback``), which follows the same contract for hand-written rules."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.components.checkpoint import conversion_ops, transforms_fallback, weight_conversion
from hyper_parallel.components.checkpoint.load_groups import build_load_groups, select_unique_converter

fb = transforms_fallback


def test_the_face_uses_transformers_rules_when_it_has_scoped_ones():
    core = pytest.importorskip("transformers.core_model_loading")
    if not any("scope_prefix" in getattr(k, "__slots__", ()) for k in core.WeightConverter.__mro__):
        pytest.skip("this transformers has no scoped rules")
    assert weight_conversion.USES_TRANSFORMERS
    assert weight_conversion.WeightConverter is core.WeightConverter
    assert issubclass(conversion_ops.AddScalar, core.ConversionOps)


def test_fallback_renames_with_glob_components_and_name_boundaries():
    rule = fb.WeightRenaming("experts.*.w1.weight", "experts.gate.weight")
    assert rule.rename_source_key("layers.3.experts.12.w1.weight") == ("layers.3.experts.gate.weight",
                                                                        "experts.*.w1.weight")
    assert rule.rename_source_key("layers.3.experts.12.w1.weight_scale") == ("layers.3.experts.12.w1.weight_scale",
                                                                              None)
    assert rule.was_used()


def test_fallback_scope_limits_a_rule_to_keys_under_a_module():
    rule = fb.WeightRenaming("norm.weight", "norm.scale")
    rule.scope_prefix, rule.base_model_prefix = "vision", "model"
    assert rule.rename_source_key("model.vision.norm.weight")[0] == "model.vision.norm.scale"
    assert rule.rename_source_key("vision.norm.weight")[0] == "vision.norm.scale"
    assert rule.rename_source_key("text.norm.weight") == ("text.norm.weight", None)
    assert not fb.WeightRenaming("a", "b").was_used()


def test_fallback_converter_collects_experts_and_names_the_result_by_its_layer():
    merge = fb.WeightConverter(["experts.*.w1.weight"], "experts.w1", [_Stack()])
    keys = [f"layers.0.experts.{i}.w1.weight" for i in (0, 1, 2)]
    values = {k: torch.full((2,), float(i)) for i, k in enumerate(keys)}
    names = set()
    for key in keys:
        name, pattern = fb.rename_source_key(key, [], [merge])
        names.add(name)
        merge.add_tensor(name, key, pattern, lambda k=key: values[k])
    assert names == {"layers.0.experts.w1"}
    out = merge.convert("layers.0.experts.w1")
    assert list(out) == ["layers.0.experts.w1"] and torch.equal(out["layers.0.experts.w1"],
                                                                torch.stack([values[k] for k in keys]))
    assert not merge.collected_tensors  # converting empties the collection


def test_fallback_rename_adds_or_drops_the_base_model_prefix_to_name_a_model_tensor():
    targets = {"model.norm.weight": 1, "lm_head.weight": 2}
    assert fb.rename_source_key("norm.weight", [], [], "model", targets) == ("model.norm.weight", None)
    assert fb.rename_source_key("model.lm_head.weight", [], [], "model", targets) == ("lm_head.weight", None)


def test_fallback_needs_an_operation_and_patterns():
    with pytest.raises(ValueError, match="needs an operation"):
        fb.WeightConverter("a", "b", [])
    with pytest.raises(ValueError, match="patterns"):
        fb.WeightRenaming([], "b")


def test_a_key_matching_two_unscoped_converters_is_refused_naming_it():
    first = weight_conversion.WeightConverter("w.weight", "w.weight", [_Stack()])
    second = weight_conversion.WeightConverter("w.weight", "w.weight", [_Stack()])
    with pytest.raises(ValueError, match="'m.w.weight' matched source pattern 'w.weight'"):
        build_load_groups(None, ["m.w.weight"], {"m.w.weight": torch.zeros(1)}, [first, second],
                          lambda k: (lambda: torch.zeros(1)))
    assert select_unique_converter("w.weight", "m.w.weight", [first]) is first


def test_natural_order_puts_expert_2_before_10():
    keys = ["e.10.w", "e.2.w", "e.1.w"]
    assert sorted(keys, key=fb.dot_natural_key) == ["e.1.w", "e.2.w", "e.10.w"]
    assert sorted(keys, key=weight_conversion.dot_natural_key) == ["e.1.w", "e.2.w", "e.10.w"]


class _Stack(weight_conversion.ConversionOps):
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {target_patterns[0]: torch.stack(input_dict[source_patterns[0]])}
