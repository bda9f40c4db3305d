"""One choice's output: scheduler deltas in, text pieces with their logprobs out."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

from service.api.detokenizer import IncrementalDetokenizer
from service.api.stop import StopMatcher
from service.contract.wire import RequestDelta, TokenLogprob


@dataclass(frozen=True)
class SampledLogprobs:
    """The logprob of one generated token and the top alternatives at its position."""

    token_id: int
    logprob: float
    top: list[TokenLogprob]


@dataclass
class ChoicePiece:
    """New output of one choice; the last piece has `finish_reason` set."""

    index: int
    text: str
    logprobs: list[SampledLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0  # so far, including tokens whose text is held back


class ChoiceState:
    """Detokenizes, applies stop strings and pairs logprobs with text, for one choice.

    The logprobs of a token travel with the first piece emitted after it, so a piece never
    carries text whose tokens have not been reported, except text held back for a stop string.
    """

    def __init__(self, index: int, tokenizer: Tokenizer, prompt_token_ids: list[int], stop_strings: list[str]) -> None:
        self.index = index
        self.num_output_tokens = 0
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stop = StopMatcher(stop_strings)
        self._pending_logprobs: list[SampledLogprobs] = []

    def add(self, delta: RequestDelta) -> ChoicePiece | None:
        """The piece these tokens complete, or None while nothing new can be shown."""
        text = ""
        finish_reason = None
        for position, token_id in enumerate(delta.token_ids):
            self.num_output_tokens += 1
            self._record_logprobs(delta, position, token_id)
            text += self._stop.feed(self._detokenizer.add([token_id]))
            if self._stop.matched is not None:
                finish_reason = "stop"
                break
        else:
            if delta.finish_reason is not None:
                text += self._stop.feed(self._detokenizer.flush())
                text += self._stop.flush()
                finish_reason = "stop" if self._stop.matched is not None else delta.finish_reason
        if not text and finish_reason is None:
            return None
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        return ChoicePiece(self.index, text, logprobs, finish_reason, self.num_output_tokens)

    def _record_logprobs(self, delta: RequestDelta, position: int, token_id: int) -> None:
        if delta.logprobs is None or position >= len(delta.logprobs):
            return
        top = delta.top_logprobs[position] if delta.top_logprobs and position < len(delta.top_logprobs) else []
        self._pending_logprobs.append(SampledLogprobs(token_id, delta.logprobs[position], list(top)))
