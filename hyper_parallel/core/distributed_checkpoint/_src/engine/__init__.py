"""The save and load procedures: the phases and status exchanges of a checkpoint (where and
with which ranks, the save's planning exchange, the load target), the commit protocol,
rank-local fragments and saves, the one metadata reader, incremental saves, saves in flight."""
