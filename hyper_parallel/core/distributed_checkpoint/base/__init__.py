"""The vocabulary every layer shares: errors, N-d boxes, atomic files, the protobuf wire format,
cross-rank exchanges and thread priority. Imports nothing else of the package."""
