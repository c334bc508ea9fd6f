"""The save and load procedures: the phases and status exchanges of a checkpoint, the commit
protocol, rank-local fragments, the one metadata reader, incremental saves, saves in flight."""
