"""The pure-Paddle paged attention backend against dense causal attention computed in numpy."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from service.contract import wire
from worker.attention.reference import PagedAttentionBackend
from worker.inputs.step_inputs import RequestState, build_step_inputs

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 8, 4, 64
# (tokens already in the cache, tokens computed this step): decodes, a fresh prefill, a prefill chunk.
REQUESTS = [(9, 1), (0, 11), (5, 1), (6, 7), (0, 1), (13, 3)]


def dense_attention(query, keys, values, positions):
    """Causal softmax attention of queries at `positions` over keys/values of positions 0..."""
    group = NUM_HEADS // NUM_KV_HEADS
    keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", query, keys) / np.sqrt(HEAD_DIM)
    scores = np.where(np.arange(len(keys))[None, None, :] <= positions[None, :, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, values).reshape(len(query), -1)


@pytest.mark.parametrize("query_tile, max_score_elements", [(256, 1 << 24), (4, 300)])
def test_paged_attention_equals_dense_attention_over_each_requests_context(query_tile, max_score_elements):
    rng = np.random.default_rng(0)
    free_blocks = list(rng.permutation(NUM_BLOCKS))
    states, contexts = [], []
    for i, (num_cached, num_new) in enumerate(REQUESTS):
        length = num_cached + num_new
        blocks = [int(free_blocks.pop()) for _ in range(-(-length // BLOCK_SIZE))]
        states.append(RequestState(f"r{i}", list(range(length)), length, wire.SamplingParams(), blocks, num_cached))
        contexts.append([rng.standard_normal((length, NUM_KV_HEADS, HEAD_DIM), dtype=np.float32) for _ in "kv"])
    key_cache = rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=np.float32)
    value_cache = key_cache.copy()
    for state, (keys, values) in zip(states, contexts):  # what earlier steps stored
        for position in range(state.num_computed_tokens):
            block, offset = state.block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE
            key_cache[block, offset], value_cache[block, offset] = keys[position], values[position]
    inputs = build_step_inputs([(s, n) for s, (_, n) in zip(states, REQUESTS)], BLOCK_SIZE, NUM_BLOCKS)
    new_keys = np.concatenate([k[s.num_computed_tokens :] for s, (k, _) in zip(states, contexts)])
    new_values = np.concatenate([v[s.num_computed_tokens :] for s, (_, v) in zip(states, contexts)])
    query = rng.standard_normal((len(inputs.input_ids), NUM_HEADS, HEAD_DIM), dtype=np.float32)
    backend = PagedAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, query_tile, max_score_elements)
    key_tensor, value_tensor = paddle.to_tensor(key_cache), paddle.to_tensor(value_cache)

    metadata = backend.prepare(inputs)
    backend.write_kv(key_tensor, value_tensor, paddle.to_tensor(new_keys), paddle.to_tensor(new_values), metadata)
    output = backend.attend(paddle.to_tensor(query), key_tensor, value_tensor, metadata).numpy()

    for i, (keys, values) in enumerate(contexts):
        rows = slice(inputs.query_start[i], inputs.query_start[i + 1])
        expected = dense_attention(query[rows], keys, values, inputs.positions[rows])
        np.testing.assert_allclose(output[rows], expected, rtol=1e-4, atol=1e-5)
    if max_score_elements < 1 << 24:
        assert len(metadata.batches) > 2, "the small budget should split the segments into several batches"
