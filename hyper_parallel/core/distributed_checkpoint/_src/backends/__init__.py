"""Storage: the StorageWriter/StorageReader protocols, the local-filesystem and fsspec backends,
O_DIRECT helpers, and the one place that picks a backend for a location."""
