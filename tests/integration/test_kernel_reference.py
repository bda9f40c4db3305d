"""The NumPy references of the GPU harness (tests/support/kernel_reference.py) against the pure-Paddle
path, the reference of the CPU custom ops: so CPU and GPU kernels answer to the same thing."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from service.contract import wire
from tests.gpu.kernel_checks import ATTENTION_GEOMETRIES, mixed_batch
from tests.support import kernel_reference as ref
from tests.support.numerics import attention_config
from worker.inputs.device_inputs import DeviceInputs
from worker.inputs.step_delta import StepRecord
from worker.inputs.step_inputs import RequestState, StepInputs, build_step_inputs, fill_pending_tokens
from worker.kernels.reference import PaddleKernels
from worker.layers.rotary import RotaryEmbedding
from worker.models.config import RopeConfig

MAX_POSITIONS = 1024


def test_rope_tables_are_the_models():
    for head_dim, theta in [(64, 10000.0), (16, 500000.0)]:
        rotary = RotaryEmbedding(RopeConfig(theta=theta), head_dim, MAX_POSITIONS)
        cos, sin = ref.rope_tables(MAX_POSITIONS, head_dim, theta)
        np.testing.assert_array_equal(cos, rotary.cos.numpy())
        np.testing.assert_array_equal(sin, rotary.sin.numpy())


@pytest.mark.parametrize("rows, width", [(1, 576), (33, 72), (5, 37)])
def test_add_rms_norm_and_silu_and_mul_references_match_paddle(rows, width):
    rng = np.random.default_rng(width)
    x, residual = (rng.standard_normal((rows, width), dtype=np.float32) * 3 for _ in range(2))
    weight = rng.standard_normal(width, dtype=np.float32)
    for res in (None, residual):
        expected = PaddleKernels().add_rms_norm(
            paddle.to_tensor(x), paddle.to_tensor(weight), None if res is None else paddle.to_tensor(res), 1e-5
        )
        for got, want in zip(ref.add_rms_norm(x, res, weight, 1e-5), expected):
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    gate_up = rng.standard_normal((rows, 2 * width), dtype=np.float32) * 6
    expected = PaddleKernels().silu_and_mul(paddle.to_tensor(gate_up)).numpy()
    np.testing.assert_allclose(ref.silu_and_mul(gate_up), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", ATTENTION_GEOMETRIES)
def test_rope_cache_write_and_paged_attention_references_match_the_paddle_backend(
    num_heads, num_kv_heads, head_dim, block_size
):
    rng = np.random.default_rng(head_dim)
    batch = mixed_batch(rng, block_size)
    tokens = len(batch["positions"])
    config = attention_config(num_heads, num_kv_heads, head_dim, MAX_POSITIONS)
    rotary = RotaryEmbedding(config.rope, head_dim, MAX_POSITIONS)
    inputs = StepInputs(
        input_ids=np.zeros(tokens, dtype=np.int64),
        positions=batch["positions"],
        slot_mapping=batch["slot_mapping"],
        query_start=batch["query_start"],
        context_lens=batch["context_lens"],
        block_table=batch["block_table"],
        logits_indices=np.zeros(0, dtype=np.int64),
        sampling_requests=[],
        pending_tokens=[],
    )
    cache = rng.standard_normal((2, batch["num_blocks"], block_size, num_kv_heads, head_dim), dtype=np.float32)
    qkv = rng.standard_normal((tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype=np.float32)
    attention = PaddleKernels().attention(config, block_size, rotary)
    key_cache, value_cache = paddle.to_tensor(cache[0]), paddle.to_tensor(cache[1])
    output = attention.attend_qkv(paddle.to_tensor(qkv), key_cache, value_cache, attention.prepare(inputs))

    cos, sin = ref.rope_tables(MAX_POSITIONS, head_dim)
    query, keys, values = ref.rope_write_kv(
        qkv, batch["positions"], cos, sin, batch["slot_mapping"], cache[0], cache[1], num_heads, num_kv_heads
    )
    np.testing.assert_allclose(keys, key_cache.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(values, value_cache.numpy())
    expected = ref.paged_attention(
        query, keys, values, batch["query_start"], batch["context_lens"], batch["block_table"]
    )
    np.testing.assert_allclose(expected, output.numpy(), rtol=1e-4, atol=1e-5)


def state(request_id: str, token_ids: list[int], block_ids: list[int], computed: int, awaiting: bool) -> RequestState:
    return RequestState(request_id, token_ids, len(token_ids), wire.SamplingParams(), block_ids, computed, awaiting)


def device_built(device: DeviceInputs, host: StepInputs, scheduled, tables, last_sampled) -> dict[str, np.ndarray]:
    """What the device kernels (their reference) make of the step's delta; commits its blocks, as launch does."""
    delta = device.prepare(host, scheduled)
    built = ref.step_inputs_from_delta(
        delta.packed, delta.num_requests, delta.num_tokens, tables, last_sampled, device.block_size, delta.table_width
    )
    for request, _ in scheduled:
        device.slots.commit(request.request_id, len(request.block_ids))
    return built


def assert_same_inputs(built: dict[str, np.ndarray], host: StepInputs) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "query_start", "context_lens", "block_table"):
        np.testing.assert_array_equal(built[name], getattr(host, name), err_msg=name)


def test_step_inputs_from_deltas_are_the_host_built_inputs():
    """Step 2 is built while step 1 computes: its decodes' tokens are pending on the host and come from
    last_sampled on the device; its blocks were sent with step 1 and only the new one goes with step 2."""
    block_size, num_blocks = 4, 32
    device = DeviceInputs(ops=None, block_size=block_size, num_slots=4, max_blocks_per_slot=8)
    tables, last_sampled = np.zeros((4, 8), dtype=np.int64), np.zeros(4, dtype=np.int64)
    prefilling = state("prefilling", list(range(100, 110)), [12, 2], computed=0, awaiting=False)
    fresh = state("fresh", [40, 41], [30], computed=0, awaiting=False)

    step_1 = [(prefilling, 6), (fresh, 2)]  # fresh samples its third token
    host_1 = build_step_inputs(step_1, block_size, num_blocks)
    assert_same_inputs(device_built(device, host_1, step_1, tables, last_sampled), host_1)
    prefilling.num_computed_tokens, fresh.num_computed_tokens, fresh.awaiting_token = 6, 2, True  # launched

    prefilling.block_ids.append(7)  # step 2's delta
    step_2 = [(prefilling, 4), (fresh, 1)]
    host_2 = build_step_inputs(step_2, block_size, num_blocks)
    built_before_sampling = device.prepare(host_2, step_2)
    # Step 1 finishes: its sample goes to fresh's slot on the device, and to its state on the host.
    last_sampled[device.slots.slot_of("fresh")] = 78
    fresh.token_ids.append(78)
    assert fill_pending_tokens(host_2) == [] and host_2.input_ids[-1] == 78
    built = ref.step_inputs_from_delta(
        built_before_sampling.packed, 2, 5, tables, last_sampled, block_size, built_before_sampling.table_width
    )
    assert_same_inputs(built, host_2)
    records = built_before_sampling.packed[: 2 * len(StepRecord)].reshape(2, len(StepRecord))
    assert records[:, StepRecord.NUM_NEW_BLOCKS].tolist() == [1, 0]  # only the new block; none sent twice
    assert built_before_sampling.packed[records[0, StepRecord.NEW_BLOCKS_OFFSET]] == 7
