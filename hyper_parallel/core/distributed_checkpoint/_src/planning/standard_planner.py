"""StandardPlanner: the default planner, for save and for load (HyperParallel's code uses it for both).

Save planning is :class:`~.save_planner.BoxSavePlanner`'s, load planning
:class:`~.load_planner.BoxLoadPlanner`'s (the options and key renaming both share:
:mod:`.planner_base`); :class:`StandardPlanner` is both at once, with HyperParallel's planner
calls (:mod:`.hyper_parallel_plans`) on top. ``StandardSavePlanner`` and ``StandardLoadPlanner``
(HyperParallel's names) are this same class.
"""

from __future__ import annotations

from ..state.topology_mapper import MapperLike
from .hyper_parallel_plans import HyperParallelPlannerCalls
from .load_planner import BoxLoadPlanner
from .planner_base import check_flags
from .save_planner import BoxSavePlanner

__all__ = ["StandardPlanner", "StandardSavePlanner", "StandardLoadPlanner"]


class StandardPlanner(HyperParallelPlannerCalls, BoxSavePlanner, BoxLoadPlanner):
    """The default planner for save and load.

    HyperParallel's planner calls (``configure_planner``, ``build_local_plan``, ...) work on it
    too, for code that drives a planner itself (:mod:`.hyper_parallel_plans`).

    Why a subclass of both planners (not an object holding one of each): one object serves a
    save and a load, as HyperParallel's code and ours pass it to both, so it stays an instance
    of :class:`~.planner.SavePlanner`, :class:`~.planner.LoadPlanner` and of each split
    planner; a subclass's hook (``transform_key``, ``resolve_data``, ...) overrides the one
    method that save or load calls, with no forwarding that could bypass it; and the plan
    cache's scope (``cache_key``: the class's name and the options) stays this class's. It
    defines no planning of its own: every method it has is the split planners' (or
    :class:`~.hyper_parallel_plans.HyperParallelPlannerCalls`'), so the two cannot drift apart.

    Hooks for subclasses: :meth:`transform_key` (rename or drop one key) or, for changes
    that need the whole map, :meth:`transform_state_dict` (called on save and on load with
    the flattened ``{key: value}`` map); and every protocol method of
    :class:`~.planner.SavePlanner` / :class:`~.planner.LoadPlanner`. On load, every value
    kind (tensors, plain values, bytes, Stateful objects) goes back to the target key it
    was renamed from.

    Args:
        allow_pickle: save and load values that need pickle.
        enable_plan_caching: reuse the global save plan while the structure is unchanged.
        convert_dtype: on load, fill a target of another dtype through the saved dtype.
        allow_partial_load: HyperParallel's name for ``load(strict=False)``.
        flatten_state_dict: torch DCP's option. True (default): nested containers are stored
            flattened (``"optim.state.0.exp_avg"``) and load returns them nested. False is
            honoured where it means the same thing, a state dict whose values are not nested
            containers; one holding a nested container is refused (torch would store it as one
            pickled object), naming the key.
        flatten_sharded_tensors: torch DCP's option for nested legacy ``ShardedTensor`` values
            (FSDP1 with 2-D parallelism); either value is accepted. A ShardedTensor is saved as its
            shards (each a chunk of the global tensor) and loads in place; one whose local shards
            are not plain tensors is refused, naming the key.
        dedup_replicated_tensors: torch DCP's deprecated option (no effect there either);
            ``remove_redundancy``: HyperParallel's name. Replicated chunks are always written
            once.
        broadcast_replicated_tensors: HyperParallel's load option for plans it drives itself
            (:mod:`.hyper_parallel_plans`): mark shards several ranks load the same for one reader. Our
            ``load`` shares such reads whatever this says.
        dedup_save_to_lowest_rank: torch DCP's option (``save_to_minimum_rank``: HyperParallel's
            name). False (default): a tensor held whole by several ranks (a plain tensor, a
            replicated DTensor of one box) is written by the least-loaded holder, largest
            first; True: by its lowest rank. The boxes of a sharded tensor with replicas are
            written by the replicas in turn either way (the format derives the writer from the
            layout).
        topology_mapper: renames keys after :meth:`transform_state_dict`: on load, each
            target key to the checkpoint key it is read from; on save, each key to the key
            stored (e.g. a pipeline stage's local layer numbers to the whole model's). A
            :class:`~.topology_mapper.TopologyMapper`, a ``{name: name}`` mapping, a callable
            or ``(regex, replacement)`` rules; two keys mapped to one name raise
            :class:`StateDictMismatchError`.

    Example — save and load every key under a new prefix::

        class Prefixed(StandardPlanner):
            def transform_key(self, key):
                return "v2." + key

    Example — stage 1 of a PP=2 split, whose layers are numbered from 0, loads layers 2-3
    of a whole-model checkpoint::

        mapper = TopologyMapper(rules=[(r"^layers\\.(\\d+)\\.", lambda m: f"layers.{int(m[1]) + 2}.")])
        load(stage.state_dict(), ckpt, planner=StandardPlanner(topology_mapper=mapper))
    """


    def __init__(self, allow_pickle: bool = False, *, enable_plan_caching: bool = True,
                 convert_dtype: bool = True, allow_partial_load: bool = False,
                 topology_mapper: MapperLike | None = None, flatten_state_dict: bool = True,
                 flatten_sharded_tensors: bool = True, dedup_replicated_tensors: bool | None = None,
                 dedup_save_to_lowest_rank: bool = False, remove_redundancy: bool = True,
                 save_to_minimum_rank: bool = False, broadcast_replicated_tensors: bool = False):
        del dedup_replicated_tensors  # replicated chunks are always written once
        self.remove_redundancy = remove_redundancy  # HyperParallel's plans only (seed_plans); ours always dedup
        self.broadcast_replicated_tensors = broadcast_replicated_tensors
        check_flags(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=flatten_sharded_tensors,
                    dedup_save_to_lowest_rank=dedup_save_to_lowest_rank, save_to_minimum_rank=save_to_minimum_rank)
        self._set_options(allow_pickle, topology_mapper, flatten_state_dict, flatten_sharded_tensors)
        self._set_save_options(enable_plan_caching, dedup_save_to_lowest_rank or save_to_minimum_rank)
        self._set_load_options(convert_dtype, allow_partial_load)


StandardSavePlanner = StandardPlanner
StandardLoadPlanner = StandardPlanner
