"""Values a checkpoint cannot hold are refused with an error naming the key (the innermost item
at fault) and its type, with or without ``allow_pickle``, and saying whether pickle would
take it; nothing is written. One process, real files."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint import StandardPlanner, load, save
from hyper_parallel.core.distributed_checkpoint._src.base.errors import UnsupportedValueError


def _generator():
    yield 1


class _Unanswering(torch.Tensor):
    """A tensor subclass that answers no tensor question (as ShardedTensor did before it was supported)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"torch function {func.__name__!r} not supported")


UNPICKLABLE = {
    "lambda": (lambda: lambda x: x, "builtins.function"),
    "generator": (_generator, "builtins.generator"),
    "lock": (threading.Lock, "_thread.lock"),
}


def _save(tmp_path, state, allow_pickle):
    path = str(tmp_path / "ckpt")
    save(state, checkpoint_id=path, no_dist=True, planner=StandardPlanner(allow_pickle=allow_pickle))
    return path


@pytest.mark.parametrize("allow_pickle", [False, True])
@pytest.mark.parametrize("name", sorted(UNPICKLABLE))
def test_a_value_pickle_refuses_is_refused_naming_key_and_type(tmp_path, name, allow_pickle):
    make, type_name = UNPICKLABLE[name]
    state = {"w": torch.ones(2), "extra": {"hook": make()}}
    with pytest.raises(UnsupportedValueError) as info:
        _save(tmp_path, state, allow_pickle)
    msg = str(info.value)
    assert msg.startswith(f"'extra.hook': a {type_name} cannot be saved"), msg
    assert "pickle refuses it" in msg
    assert "allow_pickle=True to save" not in msg  # offering pickle would not help
    assert not os.path.exists(tmp_path / "ckpt" / ".metadata")


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_the_innermost_item_at_fault_is_named(tmp_path, allow_pickle):
    state = {"opt": {"hooks": ({"ok": 1, "bad": _generator()},)}}
    with pytest.raises(UnsupportedValueError, match=r"^'opt\.hooks\.0\.bad': a builtins\.generator cannot be saved"):
        _save(tmp_path, state, allow_pickle)


def test_a_picklable_value_without_allow_pickle_names_the_option(tmp_path):
    with pytest.raises(UnsupportedValueError, match=r"^'s': a builtins\.set can only be saved with pickle.*"
                                                   r"allow_pickle=True"):
        _save(tmp_path, {"s": {1, 2}}, False)


def test_a_picklable_value_with_allow_pickle_round_trips(tmp_path):
    path = _save(tmp_path, {"s": {1, 2}}, True)
    assert load(path=path, planner=StandardPlanner(allow_pickle=True)) == {"s": {1, 2}}


def test_a_module_in_the_state_dict_is_saved_through_its_state_dict(tmp_path):
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    path = _save(tmp_path, {"m": module}, False)
    got = load(path=path)
    assert torch.equal(got["m"]["weight"], module.weight.detach())
    assert torch.equal(got["m"]["bias"], module.bias.detach())


def test_a_tensor_subclass_that_answers_nothing_is_refused_naming_key_and_type(tmp_path):
    t = torch.ones(2).as_subclass(_Unanswering)
    with pytest.raises(UnsupportedValueError, match=r"^'w': a .*_Unanswering \(a torch\.Tensor subclass\) cannot be "
                                                   r"saved.*RuntimeError"):
        _save(tmp_path, {"w": t}, False)
