"""Which request holds which blocks: the layer between the scheduler and the block pool.

The scheduler asks it for a new request's cached prefix, for room for more tokens or None when
the pool is short, to cache computed full blocks, to free a request's blocks, what preempting a
request would cost, and what running requests still owe the admission reserve. The scheduler
never sees reference counts or block fields; the pool never sees requests.

Blocks are freed as soon as a request ends or is preempted, even while a step in flight still
computes it: the worker runs steps in order, so a later step that gives a freed block to another
request writes it only after the earlier step is done with it, and a block is cached only once
the step that wrote it has returned.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.contract.block_hashes import extend_block_hashes
from service.scheduler.block_pool import BlockPool
from service.scheduler.request import Request

MAX_OUTPUT_TOKENS_CONSIDERED = 4096  # a longer remaining output is counted as this long


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(slots=True, eq=False)
class HeldBlocks:
    """A running request's blocks and what it owes the admission reserve."""

    block_ids: list[int]
    num_cached_blocks: int = 0  # leading blocks already in (or taken from) the prefix cache
    owed_prompt_blocks: int = 0
    owed_output_blocks: int = 0


class KVCacheManager:
    """The unified table: every request takes blocks from one pool as it grows."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.num_slots: dict[Request, int] = {}  # tokens each running request's blocks hold (read per step)
        self._held: dict[Request, HeldBlocks] = {}
        self._block_hashes: dict[Request, list[int]] = {}  # chained hashes of its full blocks, until it ends
        self.owed_prompt_blocks = 0  # sums over running requests (see `owed_blocks`)
        self.owed_output_blocks = 0

    def pool_usage(self) -> list[tuple[str, int, int]]:
        """(pool, capacity, used blocks) of each table: one here; the split tables have two."""
        return [("unified", self.pool.num_blocks, self.pool.num_blocks - self.pool.num_free_blocks)]

    def take_cache_events(self) -> tuple[list[int], list[bool]]:
        """The hashes cached (True) or evicted (False) since the last call, in order."""
        return self.pool.take_cache_events()

    def block_ids(self, request: Request) -> list[int]:
        held = self._held.get(request)
        return held.block_ids if held else []

    def admission_problem(self, num_prompt_tokens: int, max_num_tokens: int) -> str | None:
        """Why a request of this size could never be served, or None."""
        needed = blocks_for(max_num_tokens - 1, self.block_size)
        if needed > self.pool.num_blocks:
            return (
                f"the request needs up to {needed} KV-cache blocks "
                f"({max_num_tokens} tokens) but the whole cache holds {self.pool.num_blocks}"
            )
        return None

    # ------------------------------------------------------------------ blocks in and out

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks of the request's longest cached prefix (the last token is always recomputed)."""
        if not self.pool.enable_prefix_caching:
            return []
        max_blocks = (len(request.token_ids) - 1) // self.block_size
        return self.pool.find_cached_prefix(self._hashes(request, max_blocks), request.token_ids, max_blocks)

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        computed_blocks: list[int] | None = None,
        num_tokens_to_fit: int = 0,
        num_blocks_to_keep_free: int = 0,
    ) -> list[int] | None:
        """Make the request's blocks hold `num_tokens` tokens, taking `computed_blocks` (its cached
        prefix) first; return the blocks it gained. None, and nothing taken, if the pool is short,
        or if `num_tokens_to_fit` tokens would not fit with `num_blocks_to_keep_free` blocks to spare.
        Runs for every decode that opens a block (all of them in one step, when admitted together): lean."""
        computed_blocks = computed_blocks or []
        if not self.fits(request, max(num_tokens, num_tokens_to_fit), computed_blocks, num_blocks_to_keep_free):
            return None
        needed = blocks_for(num_tokens, self.block_size) - len(self.block_ids(request)) - len(computed_blocks)
        if computed_blocks:
            self.pool.touch(computed_blocks)
        new_block_ids = self._take(
            request, computed_blocks + self.pool.allocate(needed) if needed > 0 else computed_blocks
        )
        if computed_blocks:
            self._held[request].num_cached_blocks += len(computed_blocks)
        return new_block_ids

    def fits(self, request: Request, num_tokens: int, computed_blocks: list[int], num_blocks_to_keep_free: int) -> bool:
        """Whether the request's blocks could hold `num_tokens` tokens, its cached prefix `computed_blocks`
        taken first, with `num_blocks_to_keep_free` blocks to spare."""
        needed = blocks_for(num_tokens, self.block_size) - len(self.block_ids(request)) - len(computed_blocks)
        spare = self.pool.num_free_blocks - num_blocks_to_keep_free
        return needed <= (spare - self.pool.num_free_among(computed_blocks) if computed_blocks else spare)

    def cache_blocks(self, computed: list[tuple[Request, int]]) -> None:
        """Register in the prefix cache each request's full blocks among its first `num_computed_tokens`
        ((request, num_computed_tokens) pairs). A step's filled blocks go in one call: requests admitted
        together fill their blocks in the same step, a thousand at once."""
        if not self.pool.enable_prefix_caching:
            return
        size, held_of = self.block_size, self._held
        full_blocks = []  # (block id, hash, token ids)
        for request, num_computed_tokens in computed:
            held = held_of.get(request)
            num_full = num_computed_tokens // size
            if held is None or num_full <= held.num_cached_blocks:
                continue  # ended or preempted since, or nothing new
            hashes, token_ids, block_ids = self._hashes(request, num_full), request.token_ids, held.block_ids
            for index in range(held.num_cached_blocks, num_full):
                full_blocks.append((block_ids[index], hashes[index], token_ids[index * size : (index + 1) * size]))
            held.num_cached_blocks = num_full
        self.pool.cache_blocks(full_blocks)

    def free(self, request: Request) -> None:
        """Give back the request's blocks (its tail first: evicted first); its hashes stay for a resume."""
        if (held := self._drop(request)) is not None:
            self.pool.free(held.block_ids)

    def forget(self, request: Request) -> None:
        """The request has ended: free its blocks and drop its hashes."""
        self.free(request)
        self._block_hashes.pop(request, None)

    def recompute_cost(self, request: Request) -> int:
        """Tokens the request must compute again if preempted now: leading blocks another request also
        holds stay cached for sure; the rest count, since memory pressure is what evicts freed blocks."""
        kept_blocks = self.pool.num_shared_leading(self.block_ids(request))
        return max(0, request.num_computed_tokens - kept_blocks * self.block_size)

    # ------------------------------------------------------------------ the admission reserve

    def owed_blocks(self, request: Request) -> tuple[int, int]:
        """(unfinished-prompt blocks, future-output blocks) that `request` still needs beyond what it holds."""
        return self._owed(request, len(self.block_ids(request)))

    def _owed(self, request: Request, num_held: int) -> tuple[int, int]:
        size = self.block_size
        num_tokens = len(request.token_ids)
        prompt_end = -(-num_tokens // size)
        final_end = -(-(min(request.max_num_tokens, num_tokens + MAX_OUTPUT_TOKENS_CONSIDERED) - 1) // size)
        return max(0, prompt_end - num_held), max(0, final_end - max(num_held, prompt_end))

    def on_token(self, request: Request) -> None:
        """A token was appended: what it owes changes only if the token opens a block or its output is capped."""
        num_tokens = len(request.token_ids)
        if num_tokens % self.block_size == 1 or request.max_num_tokens - num_tokens >= MAX_OUTPUT_TOKENS_CONSIDERED:
            held = self._held.get(request)
            if held is not None:
                self._refresh_owed(request, held)

    def _take(self, request: Request, block_ids: list[int]) -> list[int]:
        """Add blocks (already referenced in the pool) to what the request holds; return them."""
        held = self._held.get(request)
        if held is None:
            held = self._held[request] = HeldBlocks([])
        held.block_ids += block_ids
        self.num_slots[request] = len(held.block_ids) * self.block_size
        self._refresh_owed(request, held)
        return block_ids

    def _drop(self, request: Request) -> HeldBlocks | None:
        """Stop tracking what the request holds (its owed blocks too); the caller frees the blocks."""
        held = self._held.pop(request, None)
        if held is not None:
            del self.num_slots[request]
            self.owed_prompt_blocks -= held.owed_prompt_blocks
            self.owed_output_blocks -= held.owed_output_blocks
        return held

    def _refresh_owed(self, request: Request, held: HeldBlocks) -> None:
        owed_prompt, owed_output = self._owed(request, len(held.block_ids))
        self.owed_prompt_blocks += owed_prompt - held.owed_prompt_blocks
        self.owed_output_blocks += owed_output - held.owed_output_blocks
        held.owed_prompt_blocks, held.owed_output_blocks = owed_prompt, owed_output

    def _hashes(self, request: Request, num_blocks: int) -> list[int]:
        """The request's block hashes, computed up to at least `num_blocks` full blocks."""
        hashes = self._block_hashes.setdefault(request, [])
        if len(hashes) < num_blocks:
            extend_block_hashes(hashes, request.token_ids, self.block_size)
        return hashes
