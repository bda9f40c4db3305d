"""The worker's grammar matchers (llguidance): one per constrained request, following the tokens it keeps.

A request's matcher is a copy of its grammar's template (a copy costs ~1 µs, a new matcher ~1 ms; 8-25 ms for a
schema of 100-400 properties with patterns or enums), which a cache of bounded size keeps by grammar text. A template
not in the cache builds on a thread of its own from the step that brings its request, and the request's matcher
is made from it after that step's forward, when it first samples: the build runs beside the forward, not before it. A matcher starts from the request's output so far: a request
recomputed after a preemption, or resumed, replays its output tokens (~1 µs each), so its matcher is where its
tokens are without anything kept across the preemption. Each step the worker fills the masks of its constrained
rows in one call (llguidance's executor, on several threads, without the GIL) and, once the step's tokens are
drawn, advances each matcher by its token.

A greedy row on a CPU draws first and asks after (`accepts`): its token is the argmax of its logits, which is
the masked argmax wherever the grammar allows it (82% of the rows of benchmarks/bench_structured_outputs.py's
schema on SmolLM2, greedy); only the rows whose token the grammar refuses fill a mask and draw again
(model_runner.py), as llama.cpp's sampler does. On a GPU the drawn tokens feed the next step where they are, so
every constrained row is masked before its draw, its mask filled while the forward computes. `accepts` answers as the
mask would, from llguidance's forced tokens, its check of one token (validate_tokens) and, for EOS, whether the
grammar accepts here: in ~5 µs a row, against ~75 µs for a mask. tests/unit/test_grammar_sampling.py holds it to
the masks over random walks through several grammars.

The mask allows EOS only where the grammar accepts; where the grammar is complete it allows EOS alone, so the
output ends there with finish_reason stop.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance.numpy
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from service.contract import wire

log = logging.getLogger(__name__)

TEMPLATE_CACHE_ENTRIES = 256


class GrammarRefused(ValueError):
    """A request whose grammar (or whose output so far under it) this worker cannot serve; the message says why."""


@dataclass(frozen=True)
class PendingMatcher:
    """Stands in for a request's matcher while its grammar's template builds on the build thread;
    GrammarMatchers.resolve turns it into the matcher."""

    grammar: str
    output_token_ids: tuple[int, ...]


class GrammarMatchers:
    """Templates by grammar, new matchers from them, and the masks of a step's matchers."""

    def __init__(self, model_info: wire.ModelInfo, max_templates: int = TEMPLATE_CACHE_ENTRIES):
        self.vocab_size = model_info.vocab_size
        self.num_words = (model_info.vocab_size + 31) // 32
        self._eos_token_ids = list(model_info.eos_token_ids)
        self._eos = frozenset(self._eos_token_ids)
        self._max_templates = max_templates
        self._templates: OrderedDict[str, LLMatcher] = OrderedDict()
        # Templates building off the step loop (LLMatcher's build drops the GIL), by grammar; only the loop's
        # thread reads or writes either dict.
        self._building: dict[str, Future[LLMatcher]] = {}
        self._build_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-build")
        self._executor = LLExecutor()
        try:
            self._tokenizer: LLTokenizer | None = LLTokenizer(
                model_info.tokenizer_json, n_vocab=model_info.vocab_size, eos_token=self._eos_token_ids
            )
            self.problem = None
        except Exception as exc:  # a tokenizer llguidance cannot read: constrained requests are refused
            self._tokenizer, self.problem = None, f"this model's tokenizer cannot serve grammars ({exc})"
            log.warning("%s", self.problem)

    def start(self, grammar: str, output_token_ids: list[int] | tuple[int, ...]) -> LLMatcher:
        """A matcher for `grammar` that has consumed `output_token_ids`; GrammarRefused if there can be none.
        Where the template is not built yet, this builds it (or waits for its build) now."""
        matcher = self._template(grammar).deep_copy()
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            raise GrammarRefused(f"the output so far does not match the grammar: {_first_line(matcher.get_error())}")
        return matcher

    def begin(self, grammar: str, output_token_ids: list[int]) -> LLMatcher | PendingMatcher:
        """start() where the template is at hand; otherwise its build starts on the build thread and a
        PendingMatcher stands in, for `resolve` once the request samples (the worker resolves after its step's
        forward, so a template builds while the step computes)."""
        self._keep_built()
        if grammar in self._templates or self._tokenizer is None:
            return self.start(grammar, output_token_ids)
        if grammar not in self._building:
            self._building[grammar] = self._build_thread.submit(LLMatcher, self._tokenizer, grammar, log_level=0)
        return PendingMatcher(grammar, tuple(output_token_ids))

    def resolve(self, pending: PendingMatcher) -> LLMatcher:
        """The matcher `pending` stands for (waiting for its template); GrammarRefused if there can be none."""
        return self.start(pending.grammar, pending.output_token_ids)

    def _keep_built(self) -> None:
        """Templates whose builds finished into the cache (those of requests that ended before they sampled too)."""
        for grammar in [grammar for grammar, build in self._building.items() if build.done()]:
            try:
                self._template(grammar)
            except GrammarRefused:
                pass  # not cached: a request that asks for it again is refused then

    def _template(self, grammar: str) -> LLMatcher:
        template = self._templates.get(grammar)
        if template is not None:
            self._templates.move_to_end(grammar)
            return template
        if self._tokenizer is None:
            raise GrammarRefused(self.problem)
        build = self._building.pop(grammar, None)
        template = build.result() if build is not None else LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarRefused(f"the grammar does not compile: {_first_line(template.get_error())}")
        self._templates[grammar] = template
        if len(self._templates) > self._max_templates:
            self._templates.popitem(last=False)
        return template

    def fill(self, matchers: list[LLMatcher]) -> np.ndarray:
        """int32 [len(matchers), words]: each matcher's next-token mask. A matcher in error (which a masked draw
        never causes) allows EOS alone, so its request ends rather than draws from nothing."""
        bitmask = np.zeros((len(matchers), self.num_words), dtype=np.int32)
        working = [(matcher, row) for row, matcher in enumerate(matchers) if not matcher.is_error()]
        if len(working) == 1:
            matcher, row = working[0]
            matcher.unsafe_compute_mask_ptr(bitmask[row].ctypes.data, bitmask.shape[1] * 4)
        elif working:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, working, bitmask)
        words = bitmask.view(np.uint32)
        for row in set(range(len(matchers))) - {row for _, row in working}:
            for eos in self._eos_token_ids:
                words[row, eos // 32] |= np.uint32(1 << (eos % 32))
        return bitmask

    def accepts(self, matcher: LLMatcher, token_id: int) -> bool:
        """Whether the mask would allow `token_id` next: EOS where the grammar accepts; where the grammar forces
        the next bytes, only the first token of their tokenization (llguidance's mask allows no other spelling of
        them, though its grammar would); otherwise a token the grammar takes from here (validate_tokens)."""
        if matcher.is_error():
            return False
        if token_id in self._eos:
            return matcher.is_accepting()
        if matcher.is_stopped():
            return False
        if forced := matcher.compute_ff_tokens():
            return token_id == forced[0]
        return matcher.validate_tokens([token_id]) == 1

    @staticmethod
    def advance(matcher: LLMatcher, token_id: int, request_id: str) -> None:
        """Consume the token drawn for the matcher's request."""
        if not matcher.consume_token(token_id) and not matcher.is_stopped():
            log.error("request %s: its grammar rejects token %d: %s", request_id, token_id, matcher.get_error())


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no reason given"
