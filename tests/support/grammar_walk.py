"""Random walks through a grammar, holding GrammarMatchers.accepts (the worker's check of a greedy row's token
after its draw) to the mask it stands in for."""

from __future__ import annotations

import numpy as np

from worker.sample.grammar import GrammarMatchers
from worker.sample.token_mask import allowed_tokens


def check_accepts_against_masks(matchers: GrammarMatchers, grammar: str, seed: int, max_steps: int = 80) -> int:
    """Walk `grammar` on tokens its masks allow; at every state ask `accepts` of each allowed token, random
    tokens, the first 256 ids (single characters in a byte-level BPE: other spellings of forced text) and EOS, and
    assert it answers as the mask. The number of (state, token) pairs asked."""
    rng = np.random.default_rng(seed)
    matcher = matchers.start(grammar, [])
    eos_ids = list(matchers._eos_token_ids)
    asked = 0
    for _ in range(max_steps):
        allowed = allowed_tokens(matchers.fill([matcher]), matchers.vocab_size)[0]
        allowed_ids = np.flatnonzero(allowed)
        candidates = {
            *allowed_ids[:200].tolist(),
            *rng.integers(0, matchers.vocab_size, 200).tolist(),
            *range(min(256, matchers.vocab_size)),
            *eos_ids,
        }
        for token_id in candidates:
            assert matchers.accepts(matcher, token_id) == allowed[token_id], (token_id, matcher.compute_ff_bytes())
        asked += len(candidates)
        if matcher.is_stopped():
            break
        token_id = int(rng.choice(allowed_ids))
        if token_id in eos_ids:
            break
        matchers.advance(matcher, token_id, "walk")
    return asked
