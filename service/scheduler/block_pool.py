"""The one KV-cache block table: allocation, reference counts and the prefix cache.

Knows blocks, not requests. Every operation costs O(blocks touched).

Free blocks sit in one ordered dict used as a doubly linked list: allocation takes from the
head; a freed block that holds a cached prefix goes to the tail (evicted last, LRU), an
unhashed one to the head (reused first). A block stays findable by its hash until it is
handed out again, so a preempted request that resumes finds whatever was not evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())  # what the cached hash stands for


class BlockPool:
    """A fixed number of blocks of `block_size` tokens, with an optional prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.num_cached_free = 0  # free blocks that still hold a cached prefix
        # Changes to the set of cached hashes, in order, until taken (the api's router follows them).
        self._event_hashes: list[int] = []
        self._event_cached: list[bool] = []  # True: the hash was cached; False: evicted

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks held by live requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / len(self.blocks)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` free blocks (evicting cached ones, LRU first), or None."""
        if num_blocks > len(self._free):
            return None
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; in reverse, so a request's tail is evicted first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
                else:
                    self.num_cached_free += 1

    def find_cached_prefix(self, block_hashes: list[int], token_ids: list[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached run of a sequence's first full blocks (at most `max_blocks`).

        A hit is verified against the stored token ids, so a hash collision is a miss.
        """
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        hits = []
        for index, block_hash in enumerate(block_hashes[:max_blocks]):
            block_id = self._cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(
                token_ids[index * size : (index + 1) * size]
            ):
                break
            hits.append(block_id)
        return hits

    def num_free_among(self, block_ids: list[int]) -> int:
        """How many of these blocks are free (cached, unreferenced): `touch` takes them off the free list."""
        return sum(1 for block_id in block_ids if self.blocks[block_id].ref_count == 0)

    def num_shared_leading(self, block_ids: list[int]) -> int:
        """How many leading blocks of this run more than one holder references."""
        num_shared = 0
        for block_id in block_ids:
            if self.blocks[block_id].ref_count < 2:
                break
            num_shared += 1
        return num_shared

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks found by `find_cached_prefix`."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
                self.num_cached_free -= 1
            block.ref_count += 1

    def cache_blocks(self, full_blocks: list[tuple[int, int, list[int]]]) -> None:
        """Register full blocks in the prefix cache: (block id, its hash, its token ids) each."""
        if not self.enable_prefix_caching:
            return
        blocks, cached = self.blocks, self._cached
        for block_id, block_hash, token_ids in full_blocks:
            block = blocks[block_id]
            if block.block_hash is None and block_hash not in cached:
                block.block_hash = block_hash
                block.token_ids = tuple(token_ids)
                cached[block_hash] = block_id
                self._event_hashes.append(block_hash)
                self._event_cached.append(True)

    def cached_hashes(self) -> list[int]:
        """Every hash in the prefix cache now."""
        return list(self._cached)

    def take_cache_events(self) -> tuple[list[int], list[bool]]:
        """The hashes cached (True) or evicted (False) since the last call, in order."""
        events = self._event_hashes, self._event_cached
        self._event_hashes, self._event_cached = [], []
        return events

    def _evict(self, block: KVBlock) -> None:
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
            self._event_hashes.append(block.block_hash)
            self._event_cached.append(False)
        block.block_hash = None
        block.token_ids = ()
        self.num_cached_free -= 1
