"""The on-disk format: ``.metadata`` (schema, parsing, validation, values), data files with
their indexes, and where each saved chunk lies. Bytes and records; no storage, no planning."""
