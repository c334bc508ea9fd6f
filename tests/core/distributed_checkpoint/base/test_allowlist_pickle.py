"""base/allowlist_pickle: the one way every pickle is read without running code from it."""

from __future__ import annotations

import collections
import os
import pickle

import pytest

from hyper_parallel.core.distributed_checkpoint._src.base.allowlist_pickle import AllowlistUnpickler


class _Runs:
    def __reduce__(self):
        return (os.system, ("echo ran",))


class _Persistent(pickle.Pickler):
    def persistent_id(self, obj):
        return "pid" if obj == "ref" else None


def _persistent_pickle(value) -> bytes:
    import io

    buf = io.BytesIO()
    _Persistent(buf).dump(value)
    return buf.getvalue()


class OrderedOnly(AllowlistUnpickler):
    def admit(self, module, name):
        return collections.OrderedDict if (module, name) == ("collections", "OrderedDict") else None


def test_plain_data_reads_and_nothing_else_resolves():
    plain = {"a": [1, 2.5, "x", b"y", None, True], "b": (1, 2), "c": {3, 4}}
    assert AllowlistUnpickler(pickle.dumps(plain), "plain.pkl").load() == plain
    with pytest.raises(pickle.UnpicklingError, match=r"plain\.pkl: refusing posix\.system|plain\.pkl: refusing os"):
        AllowlistUnpickler(pickle.dumps(_Runs()), "plain.pkl").load()


def test_a_subclass_admits_its_globals_and_names_the_refused_one():
    od = collections.OrderedDict(a=1)
    assert OrderedOnly(pickle.dumps(od), "f").load() == od
    with pytest.raises(pickle.UnpicklingError, match="refusing builtins.print"):
        OrderedOnly(pickle.dumps(print), "f").load()


def test_persistent_ids_are_always_refused():
    with pytest.raises(pickle.UnpicklingError, match="a persistent id"):
        OrderedOnly(_persistent_pickle(["ref"]), "f").load()


def test_the_subclass_chooses_the_error():
    class Mine(AllowlistUnpickler):
        def refusal(self, what):
            return ValueError(f"{self.where}: no {what}")

    with pytest.raises(ValueError, match="k: no builtins.print"):
        Mine(pickle.dumps(print), "k").load()
