"""torch DCP's ``planner_helpers`` import path: the reads that fill local chunks from saved ones.

A face over :mod:`.planning.chunk_reads`.
"""

from .planning.chunk_reads import create_read_items_for_chunk_list

__all__ = ["create_read_items_for_chunk_list"]
