"""Name mapping between topologies (HyperParallel's path ``distributed_checkpoint.topology_mapper``).

A face over :mod:`._src.state.topology_mapper`: one :class:`TopologyMapper` takes HyperParallel's form
(``TopologyMapper(target_to_checkpoint_fqn={...})`` with ``map_fqn`` and
``compute_required_shards``) and ours (a callable, or ``rules=`` of regexes), and is what
``StandardPlanner(topology_mapper=...)``, ``reshard`` and ``offline_transform`` take.
"""

from ._src.state.topology_mapper import MapperLike, TopologyMapper, as_topology_mapper, rename_keys

__all__ = ["TopologyMapper", "MapperLike", "as_topology_mapper", "rename_keys"]
