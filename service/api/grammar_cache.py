"""Compiled grammars by their constraint's canonical text: built once, off the event loop, within a time limit.

Identical constraints (n > 1, a client sending one schema with every request) share one build, even while it
runs. The cache is bounded in entries and in characters, least recently used out first, so a flood of distinct
schemas does not grow memory without bound. A build that outlasts `timeout_s` answers its request with a 400; it
runs on in its thread (llguidance cannot be interrupted; its parser limits bound the work) and its result is kept
for the next request that asks. Builds run on `num_threads` threads, so slow ones queue there and never on the
event loop or the engine's step loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from service.api.constraints import Constraint, ConstraintError, GrammarError, check_constraint_use
from service.api.errors import ApiError
from service.api.protocol import GenerationRequest

CACHE_ENTRIES = 1024
CACHE_CHARS = 64 * 1024 * 1024
COMPILE_TIMEOUT_S = 5.0
COMPILE_THREADS = 2


class GrammarCache:
    """Grammars by constraint; `for_request` is what a route asks."""

    def __init__(
        self,
        *,
        max_entries: int = CACHE_ENTRIES,
        max_chars: int = CACHE_CHARS,
        timeout_s: float = COMPILE_TIMEOUT_S,
        num_threads: int = COMPILE_THREADS,
        on_compiled: Callable[[str, float], None] = lambda kind, seconds: None,
        on_request: Callable[[str], None] = lambda kind: None,
    ) -> None:
        self._on_request = on_request
        self._max_entries = max_entries
        self._max_chars = max_chars
        self._timeout_s = timeout_s
        self._on_compiled = on_compiled
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        # (kind, text) -> the build: its grammar, or the GrammarError that says why there is none
        self._builds: OrderedDict[tuple[str, str], Future[str]] = OrderedDict()
        self._num_chars = 0

    def __len__(self) -> int:
        return len(self._builds)

    async def for_request(self, body: GenerationRequest) -> str | None:
        """The grammar of the request's one constraint, None without one; a 400 naming the field for a constraint
        that is malformed, contradicts another field or cannot be enforced."""
        try:
            constraint = body.constraint()
            check_constraint_use(constraint, body.ignore_eos)
        except ConstraintError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        if constraint is None:
            return None
        self._on_request(constraint.kind)
        return await self.grammar(constraint)

    async def grammar(self, constraint: Constraint) -> str | None:
        """The constraint's grammar; a 400 naming its field if it has none, or if its build takes too long (None for a
        best-effort constraint)."""
        build = self._build_of(constraint)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(build)), self._timeout_s)
        except GrammarError as exc:
            problem = str(exc)
        except asyncio.TimeoutError:  # Python 3.10's, apart from the builtin TimeoutError
            problem = f"its grammar takes longer than {self._timeout_s:g} s to build."
        if constraint.best_effort:
            return None
        raise ApiError(400, f"Invalid value for '{constraint.param}': {problem}", param=constraint.param)

    def _build_of(self, constraint: Constraint) -> Future[str]:
        key = (constraint.kind, constraint.text)
        build = self._builds.get(key)
        if build is not None:
            self._builds.move_to_end(key)
            return build
        build = self._pool.submit(self._timed, constraint)
        self._builds[key] = build
        self._num_chars += len(constraint.text)
        while len(self._builds) > self._max_entries or (self._num_chars > self._max_chars and len(self._builds) > 1):
            (_, text), _ = self._builds.popitem(last=False)
            self._num_chars -= len(text)
        return build

    def _timed(self, constraint: Constraint) -> str:
        started = time.perf_counter()
        try:
            return constraint.grammar()
        finally:
            self._on_compiled(constraint.kind, time.perf_counter() - started)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
