"""The chained hash of a sequence's full KV-cache blocks: the one definition the scheduler's prefix
cache and the api's router share, so the api knows which engine holds which prefix.

A block's hash is Python's hash of (its parent block's hash, its token ids): deterministic for
integers in every process of one Python version (the image pins it).
"""

from __future__ import annotations

ROOT_HASH = 0


def extend_block_hashes(block_hashes: list[int], token_ids: list[int], block_size: int) -> None:
    """Append the chained hash (parent hash + token ids) of every new full block of a sequence."""
    parent_hash = block_hashes[-1] if block_hashes else ROOT_HASH
    for start in range(len(block_hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash((parent_hash, tuple(token_ids[start : start + block_size])))
        block_hashes.append(parent_hash)
