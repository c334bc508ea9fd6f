"""The one dtype table: torch dtype <-> our dtype name <-> safetensors dtype name <-> item size.

Our names (``"float32"``, ``"bfloat16"``, ...) are what ``.metadata`` and every other file
of this library record; safetensors' names (``"F32"``, ``"BF16"``, ...) are what data files
and foreign safetensors headers hold. Every reader and writer of either goes through here,
so a dtype added once is known everywhere. Unknown names raise MetadataError.
"""

from __future__ import annotations

import torch

from .errors import MetadataError

# dtype name -> (torch dtype, safetensors dtype name or None when it has none)
_DTYPES: dict[str, tuple[torch.dtype, str | None]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
    "float8_e4m3fnuz": (torch.float8_e4m3fnuz, "F8_E4M3FNUZ"),
    "float8_e5m2fnuz": (torch.float8_e5m2fnuz, "F8_E5M2FNUZ"),
    "float8_e8m0fnu": (torch.float8_e8m0fnu, None),
    "complex64": (torch.complex64, "C64"),
    "complex128": (torch.complex128, None),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint8": (torch.uint8, "U8"),
    "uint16": (torch.uint16, "U16"),
    "uint32": (torch.uint32, "U32"),
    "uint64": (torch.uint64, "U64"),
    "bool": (torch.bool, "BOOL"),
}
_NAME_OF = {dt: name for name, (dt, _) in _DTYPES.items()}
DTYPE_NAMES: tuple[str, ...] = tuple(sorted(_DTYPES))  # every name ``.metadata`` may hold

# Safetensors' dtype names -> ours. F8_E8M0 is a safetensors dtype too, but data files of
# this library store float8_e8m0fnu as raw U8 (safetensors' torch binding cannot read it).
_FROM_SAFETENSORS = {st: name for name, (_, st) in _DTYPES.items() if st} | {"F8_E8M0": "float8_e8m0fnu"}


def dtype_name(dtype: torch.dtype) -> str:
    """The metadata name of a torch dtype; raises for dtypes the format cannot hold."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise MetadataError(f"dtype {dtype} is not supported by the checkpoint format") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a metadata dtype name; raises MetadataError for an unknown name."""
    try:
        return _DTYPES[name][0]
    except (KeyError, TypeError):
        raise MetadataError(f"unknown dtype {name!r} in metadata") from None


def is_dtype_name(name: object) -> bool:
    """Whether ``name`` is a dtype name ``.metadata`` may hold."""
    return isinstance(name, str) and name in _DTYPES


def safetensors_dtype(name: str) -> str | None:
    """Safetensors' name for the dtype, or None (then the entry is stored as raw U8)."""
    return _DTYPES[name][1]


def dtype_from_safetensors(st: str) -> str | None:
    """Our dtype name for a safetensors dtype name (``"BF16"`` -> ``"bfloat16"``), or None."""
    return _FROM_SAFETENSORS.get(st) if isinstance(st, str) else None


def itemsize(name: str) -> int:
    """Bytes per element of a metadata dtype name."""
    return torch_dtype(name).itemsize
