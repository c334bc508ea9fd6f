"""Unpicklers that resolve only the globals they are given: how a pickle is read without
running code from it.

A pickle names the classes and functions it needs (``find_class``) and may hold persistent ids
that call a loader; either can run code. Every pickle this library reads on the caller's behalf
(torch DCP's ``.metadata``, HyperParallel's records and exchange files, plain byte values) goes
through a subclass of :class:`AllowlistUnpickler`, which says which globals it admits
(:meth:`~AllowlistUnpickler.admit`) and which error a refusal raises
(:meth:`~AllowlistUnpickler.refusal`, naming the global and the file). A refused global is
never imported or called; persistent ids are always refused.

What it is not: the allowlists themselves, which belong to the formats that read them
(:mod:`..format.torch_pickles`, :mod:`.file_exchange`, :mod:`..interop.hyper_parallel.importing`,
:mod:`..planning.hyper_parallel_plans`).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["AllowlistUnpickler"]


class AllowlistUnpickler(pickle.Unpickler):
    """Resolves a global only when :meth:`admit` answers it; refuses persistent ids.

    ``where`` names what is being read (a file, a key) in the refusal. Subclasses override
    :meth:`admit` (default: nothing) and :meth:`refusal` (default: ``pickle.UnpicklingError``).

    Example::

        class PlainOnly(AllowlistUnpickler):
            pass  # admits no global: numbers, strings, bytes and containers only

        PlainOnly(raw, "step.pkl").load()
    """

    def __init__(self, file: Any, where: str):
        super().__init__(io.BytesIO(file) if isinstance(file, (bytes, bytearray, memoryview)) else file)
        self.where = where

    def admit(self, module: str, name: str) -> Any | None:
        """The object ``module.name`` stands for in this format, or None to refuse it."""
        return None

    def refusal(self, what: str) -> Exception:
        """The error raised for ``what`` (``"module.name"``, or ``"a persistent id (...)"``)."""
        return pickle.UnpicklingError(f"{self.where}: refusing {what}; this pickle may name no such global")

    def find_class(self, module: str, name: str) -> Any:
        found = self.admit(module, name)
        if found is None:
            raise self.refusal(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise self.refusal(f"a persistent id ({pid!r:.60})")
