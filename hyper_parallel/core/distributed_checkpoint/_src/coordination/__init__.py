"""The cross-rank protocol: how the ranks of a save or load agree, and fail together."""
