"""torch DCP's private (underscore) options this library's classes take by name only to refuse
them, each with the reason, so torch code that passes one learns what is not supported and
what to do instead rather than meeting a generic ``TypeError`` (or an option silently dropped).

torch 2.13 has two: ``FileSystemWriter(_extensions=...)`` and ``FsspecWriter(_extensions=...)``
(stream transforms, e.g. zstd compression, applied to each item's bytes) and
``FileSystemReader(_extension_registry=...)`` (the transforms a reader may undo). Its
``save``/``load``/``async_save`` and Hugging Face storage classes take none.

What it is not: the mapping of torch's own storage objects onto ours
(:mod:`..backends.torch_storage`), which refuses a torch writer built with ``_extensions``.
"""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedValueError

__all__ = ["PRIVATE_OPTIONS", "refuse_private_options"]

#: option -> why it is refused and what to do instead
PRIVATE_OPTIONS: dict[str, str] = {
    "_extensions": (
        "torch's stream transforms (e.g. ZStandard compression of each item) are not supported: data files are "
        "plain safetensors that any safetensors reader opens, checksummed per block, with no transform stage. "
        "Pass no _extensions (compress at the storage layer if you need to)"),
    "_extension_registry": (
        "a registry of torch stream-transform extensions is not taken: reading a checkpoint torch wrote with "
        "transforms undoes torch's built-in ones (its default registry) and no others, and this library's own "
        "checkpoints have none. Pass no _extension_registry"),
}


def refuse_private_options(owner: str, **given: Any) -> None:
    """Raise, naming ``owner``, the option and the reason, for each of torch's private options
    in ``given`` that asks for something (None and an empty sequence ask for nothing).

    Raises:
        UnsupportedValueError: e.g. ``FileSystemWriter(_extensions=[ZStandard()])``.
    """
    for name, value in given.items():
        if value is None or (isinstance(value, (list, tuple)) and not value):
            continue
        raise UnsupportedValueError(f"{owner}({name}={value!r}): {PRIVATE_OPTIONS[name]}")
