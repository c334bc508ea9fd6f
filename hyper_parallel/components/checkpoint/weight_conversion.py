"""The rules that rename and convert Hugging Face checkpoint tensors into a model's: transformers'
own where it has them, else :mod:`.transforms_fallback`.

Transformers 5 ships, per model, a list of ``WeightRenaming``/``WeightConverter`` rules
(``transformers.conversion_mapping``): a Qwen3-MoE checkpoint stores ``experts.{i}.gate_proj``
and ``experts.{i}.up_proj`` per expert, and the model one stacked ``experts.gate_up_proj``. Both
loaders of this package apply those rules as transformers does, so they load a model what
``from_pretrained`` would. When the installed transformers has scoped rules (5.x), the names
below are transformers' objects; otherwise they are the fallback's, and a model's own mapping is
just the ``key_mapping`` renames.

Names: ``ConversionOps`` (a conversion step; subclass it for your own), ``WeightRenaming``,
``WeightConverter``, ``dot_natural_key`` (the order keys are collected in, experts 2 before 10),
``rename_source_key`` and ``get_model_conversion_mapping`` (the model's rules, ``key_mapping``
renames first). ``USES_TRANSFORMERS`` says which implementation is in use.
"""

from __future__ import annotations

from typing import Any

from . import transforms_fallback

__all__ = ["ConversionOps", "WeightRenaming", "WeightConverter", "dot_natural_key", "rename_source_key",
           "get_model_conversion_mapping", "USES_TRANSFORMERS"]


def _transformers_rules() -> Any:
    """transformers' ``core_model_loading`` when its rules are scoped (5.x), else None."""
    try:
        from transformers import conversion_mapping, core_model_loading
    except ImportError:
        return None
    converter = getattr(core_model_loading, "WeightConverter", None)
    if converter is None or not any("scope_prefix" in getattr(k, "__slots__", ()) for k in converter.__mro__):
        return None
    if not hasattr(conversion_mapping, "get_model_conversion_mapping"):
        return None
    return core_model_loading, conversion_mapping


_RULES = _transformers_rules()
USES_TRANSFORMERS: bool = _RULES is not None

if _RULES is not None:
    ConversionOps = _RULES[0].ConversionOps
    WeightRenaming = _RULES[0].WeightRenaming
    WeightConverter = _RULES[0].WeightConverter
    dot_natural_key = _RULES[0].dot_natural_key
    rename_source_key = _RULES[0].rename_source_key
    get_model_conversion_mapping = _RULES[1].get_model_conversion_mapping
else:
    ConversionOps = transforms_fallback.ConversionOps
    WeightRenaming = transforms_fallback.WeightRenaming
    WeightConverter = transforms_fallback.WeightConverter
    dot_natural_key = transforms_fallback.dot_natural_key
    rename_source_key = transforms_fallback.rename_source_key
    get_model_conversion_mapping = transforms_fallback.get_model_conversion_mapping
