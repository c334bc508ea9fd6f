"""Rewriting checkpoints for new layouts: reshard (one file per destination rank) and the
offline transforms and conversions built on it."""
