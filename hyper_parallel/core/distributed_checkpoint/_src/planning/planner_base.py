"""What the save planner and the load planner share: their common options and the renaming of keys.

A planner of this library sees a state dict as a flat ``{key: value}`` map. Both on save and
on load it may store keys under other names: :meth:`BoxPlannerBase.transform_key` /
:meth:`~BoxPlannerBase.transform_state_dict` (a subclass's hooks), then the
``topology_mapper`` option. On load each renamed key must lead back to the target's key it
came from, so the renaming remembers where every new key came from
(:meth:`~BoxPlannerBase.original_key`). ``flatten_state_dict=False`` is checked the same way
on both sides.

Kept in one place so that :class:`~.save_planner.BoxSavePlanner`,
:class:`~.load_planner.BoxLoadPlanner` and :class:`~.standard_planner.StandardPlanner` (both
at once) rename keys by one rule: a checkpoint saved with a planner loads with the same
planner's renaming.

What it is not: the planning of writes (:mod:`.save_planner`) or reads (:mod:`.load_planner`).
"""

from __future__ import annotations

from typing import Any

from ..base.errors import StateDictMismatchError, UnsupportedValueError
from ..state.flatten import renamed_path
from ..state.topology_mapper import MapperLike, as_topology_mapper, rename_keys

__all__ = ["BoxPlannerBase", "check_flags"]

# the protocol calls of each side (:mod:`.planner`), to name the planner a call needs
_SIDE_OF_CALL = {**dict.fromkeys(("set_up_save", "create_local_save_plan", "create_global_save_plan",
                                  "resolve_data"), "save"),
                 **dict.fromkeys(("set_up_load", "create_local_load_plan", "resolve_target", "finish_load"), "load")}


def check_flags(**flags: Any) -> None:
    """Refuse an option that must be True or False and is not (a TypeError naming it)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


class BoxPlannerBase:
    """The options and key renaming of this library's save and load planners.

    Options (set by :meth:`_set_options`; see :class:`~.standard_planner.StandardPlanner`
    for what each does): ``allow_pickle``, ``topology_mapper``, ``flatten_state_dict``,
    ``flatten_sharded_tensors``.

    Hooks for subclasses: :meth:`transform_key` (rename or drop one key) or, for changes
    that need the whole map, :meth:`transform_state_dict` (called with the flattened
    ``{key: value}`` map).
    """

    def _set_options(self, allow_pickle: bool, topology_mapper: MapperLike | None, flatten_state_dict: bool,
                     flatten_sharded_tensors: bool) -> None:
        """Store the shared options (checked by the caller: :func:`check_flags`) and the
        renaming's per-call state."""
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.allow_pickle = allow_pickle
        self.topology_mapper = as_topology_mapper(topology_mapper)
        self._paths: dict[str, tuple] = {}
        self._origin: dict[str, str] = {}
        self._origin_identity = True

    def __getattr__(self, name: str) -> Any:
        """Called only for a name the planner lacks: a planner of one side asked for the other
        side's protocol (a load planner passed to ``save``) says which planner to pass."""
        side = _SIDE_OF_CALL.get(name)
        if side is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)
        raise AttributeError(
            f"{type(self).__qualname__} has no {name}: it plans only {'loads' if side == 'save' else 'saves'}. "
            f"Pass a planner that can {side} ({'BoxSavePlanner' if side == 'save' else 'BoxLoadPlanner'} or a "
            "subclass, or StandardPlanner, which does both)", name=name, obj=self)

    def transform_key(self, key: str) -> str | None:
        """The checkpoint key of one flattened key, or None to leave it out; the identity."""
        return key

    def transform_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Rename or filter flattened keys (default: :meth:`transform_key` on each key).

        Overriding this instead of :meth:`transform_key` works too; on load, renamed keys
        are traced back to the target's keys by value identity, or by calling this on the
        one key alone.
        """
        if type(self).transform_key is BoxPlannerBase.transform_key:
            return state_dict
        out = {}
        for key, value in state_dict.items():
            new = self.transform_key(key)
            if new is not None:
                out[new] = value
        return out

    def original_key(self, key: str) -> str | None:
        """On load: the target's key that checkpoint key ``key`` was renamed from (None if unknown)."""
        return self._origin.get(key, key if self._origin_identity else None)

    def _transform(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """:meth:`transform_state_dict`, then ``topology_mapper``, remembering where each new
        key came from."""
        out = self.transform_state_dict(state_dict)
        self._origin_identity = out is state_dict
        self._origin = {} if out is state_dict else _trace_origins(self, state_dict, out)
        mapper = self.topology_mapper
        if mapper is not None:
            try:
                names = rename_keys(out, mapper)
            except ValueError as exc:
                raise StateDictMismatchError(str(exc)) from None
            mapped: dict[str, Any] = {}
            origin: dict[str, str] = {}
            paths: dict[str, tuple] = {}
            for key, value in out.items():
                new = names[key]
                mapped[new] = value
                paths[new] = renamed_path(self._path(key), new)  # stays nested where it was
                source = self._origin.get(key, key if self._origin_identity else None)
                if source is not None:
                    origin[new] = source
            out, self._origin, self._origin_identity, self._paths = mapped, origin, False, paths
        return out

    def _check_flat(self, state_dict: dict[str, Any], what: str) -> None:
        """``flatten_state_dict=False`` is honoured where flattening changes nothing: refuse a
        value stored through a nested container (torch would store that container as one
        pickled object; this library stores its leaves)."""
        if self.flatten_state_dict:
            return
        nested = next((k for k in state_dict if len(self._path(k)) > 1), None)
        if nested is not None:
            top = self._path(nested)[0]
            raise UnsupportedValueError(
                f"{what}: flatten_state_dict=False, but {top!r} is a nested container (holding {nested!r}): "
                "torch DCP would store it as one pickled object, this library stores each leaf under its "
                "flattened key and returns it nested on load. Use flatten_state_dict=True (the default), or "
                "pass a state dict whose values are not nested containers")

    def _path(self, key: str) -> tuple:
        return self._paths.get(key) or tuple(key.split("."))


def _trace_origins(planner: BoxPlannerBase, before: dict[str, Any], after: dict[str, Any]) -> dict[str, str]:
    """For a custom ``transform_state_dict``: new key -> original key, where it can be told.

    A value object found under exactly one original key names it; otherwise (equal small
    ints, None...) each candidate is transformed alone and the one that yields the new key
    wins. Keys that stay ambiguous are left out (loading a new value into them then raises).
    """
    by_id: dict[int, list[str]] = {}
    for key, value in before.items():
        by_id.setdefault(id(value), []).append(key)
    origin: dict[str, str] = {}
    for new, value in after.items():
        if new in before and before[new] is value:
            origin[new] = new
            continue
        candidates = by_id.get(id(value), [])
        if len(candidates) > 1:
            candidates = [k for k in candidates if new in planner.transform_state_dict({k: before[k]})]
        if len(candidates) == 1:
            origin[new] = candidates[0]
    return origin


