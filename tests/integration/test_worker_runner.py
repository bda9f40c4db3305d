"""ModelRunner behaviour on SmolLM2 beyond matching transformers: seeds, logprobs, errors, cache size."""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import numpy as np
import paddle
import pytest

from service.contract import wire
from service.contract.config import load_settings
from tests.support.accuracy import ENGLISH_TEXT, encode, load_runner, paged_logits
from tests.support.model_engine import LocalEngine
from worker.attention.kv_cache import block_bytes, num_blocks_for
from worker.attention.metadata import HostAttentionMetadata
from worker.inputs.model_inputs import ModelInputs
from worker.inputs.step_inputs import RequestState, build_step_inputs
from worker.layers.linear import linear
from worker.layers.precision import Precision
from worker.model_runner import ModelRunner
from worker.models.llama_decoder_stack import STACK_STAGES, FusedDecoderStack, step_layout
from worker.sample.grammar import PendingMatcher

PROMPT_IDS = [504, 3575, 282, 4649, 314, 253, 1345, 1185, 28, 284, 260, 1345, 282]


@pytest.fixture(scope="module")
def runner(smollm_path):
    return ModelRunner(load_settings(model=os.fspath(smollm_path), num_kv_blocks=64, max_model_len=2048))


def new_request(request_id: str, sampling: wire.SamplingParams, block_ids: list[int]) -> wire.NewRequest:
    return wire.NewRequest(
        request_id=request_id,
        token_ids=PROMPT_IDS,
        num_prompt_tokens=len(PROMPT_IDS),
        sampling=sampling,
        block_ids=block_ids,
        num_computed_tokens=0,
        num_scheduled_tokens=len(PROMPT_IDS),
    )


@pytest.fixture(scope="module")
def float32_runner(smollm_path):
    return ModelRunner(
        load_settings(
            model=os.fspath(smollm_path), num_kv_blocks=64, max_model_len=2048, dtype="float32", quantization="none"
        )
    )


def test_seeded_sampling_repeats_with_other_batch_mates_and_after_preemption(float32_runner):
    """In float32, where a recompute's logits are the decode's to ~1e-4 (in bf16 the activations' rounding
    depends on how a step batches the tokens, so a draw near a boundary may differ: see worker/sample/sampler.py)."""
    runner = float32_runner
    seeded = wire.SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = LocalEngine(runner, max_num_batched_tokens=64)
    alone.add("seeded", PROMPT_IDS, seeded)
    expected = alone.run()["seeded"]

    # Three prompts of one block each on 4 blocks of 16 tokens: the newest, "seeded", is preempted as they grow.
    crowded = LocalEngine(runner, max_num_batched_tokens=8, num_blocks=4, preemption_policy="lifo")
    crowded.add("other", PROMPT_IDS[::-1], wire.SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    crowded.add("greedy", PROMPT_IDS[:5], wire.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    crowded.add("seeded", PROMPT_IDS, seeded)

    assert crowded.run()["seeded"] == expected
    assert crowded.finished["seeded"].num_preemptions > 0


def test_logprobs_are_sorted_and_include_the_chosen_token(runner):
    sampling = wire.SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    step = wire.SchedulerOutput(step_id=1, new_requests=[new_request("lp", sampling, [0])])

    (sampled,) = runner.execute(step).sampled
    runner.execute(wire.SchedulerOutput(step_id=2, finished_request_ids=["lp"]))

    top = sampled.top_logprobs
    assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True) and len(top) == 5
    assert top[0].token_id == sampled.token_id and top[0].logprob == pytest.approx(sampled.logprob)
    assert sum(np.exp(t.logprob) for t in top) <= 1.0 + 1e-6


def test_a_step_naming_an_unknown_request_returns_an_error_and_the_worker_keeps_serving(runner):
    bad = wire.SchedulerOutput(step_id=3, running_requests=[wire.RunningRequest("ghost", [], 1)])
    good = wire.SchedulerOutput(step_id=4, new_requests=[new_request("ok", wire.SamplingParams(temperature=0.0), [1])])

    assert "ghost" in runner.execute(bad).error
    result = runner.execute(good)

    assert result.error is None and len(result.sampled) == 1


def test_a_step_with_too_few_blocks_is_refused_not_computed(runner):
    step = wire.SchedulerOutput(
        step_id=5,
        new_requests=[
            wire.NewRequest(
                request_id="short",
                token_ids=PROMPT_IDS * 2,
                num_prompt_tokens=26,
                sampling=wire.SamplingParams(),
                block_ids=[2],
                num_computed_tokens=0,
                num_scheduled_tokens=26,
            )
        ],
    )

    assert "too few blocks" in runner.execute(step).error


def test_model_info_caps_the_length_and_names_the_special_tokens(runner):
    info = runner.model_info
    assert info.max_model_len == 2048 and info.vocab_size == 49152
    assert info.eos_token_ids == [2] and info.bos_token_id == 1 and info.add_bos_token is False
    assert (info.name, info.aliases) == ("SmolLM2-135M-Instruct", ["SmolLM2-135M-Instruct.Q4_1"])


def test_kv_cache_is_sized_from_memory_unless_a_block_count_is_set(runner):
    config = runner.model.config
    per_block = 2 * config.num_layers * 16 * config.num_kv_heads * config.head_dim * 4
    assert block_bytes(config, 16) == per_block
    assert num_blocks_for(config, 16, 100 * per_block + 1, None) == 100
    assert num_blocks_for(config, 16, 100 * per_block, 7) == 7
    assert runner.num_kv_blocks == 64 and runner.kv_cache.key_caches[0].shape == [64, 16, 3, 64]


def test_a_request_with_nonsense_sampling_is_refused_alone_and_its_batch_mates_are_computed(runner):
    greedy = wire.SamplingParams(temperature=0.0)
    first = wire.SchedulerOutput(
        step_id=20,
        new_requests=[
            new_request("nonsense", wire.SamplingParams(logprobs=100000), [10]),
            new_request("honest", greedy, [11]),
        ],
    )
    result = runner.execute(first)
    assert result.error is None and [t.request_id for t in result.sampled] == ["honest"]  # no token: ended alone
    assert list(result.refused) == ["nonsense"] and "logprobs must lie in [0, 20]" in result.refused["nonsense"]

    # The scheduler may have scheduled it again before it learnt: still not computed, not an unknown request.
    again = [wire.RunningRequest("nonsense", [], 1), wire.RunningRequest("honest", [], 1)]
    result = runner.execute(wire.SchedulerOutput(step_id=21, running_requests=again))
    assert result.error is None and [t.request_id for t in result.sampled] == ["honest"]
    assert list(result.refused) == ["nonsense"]  # said again: the scheduler ends it where it expects its token
    runner.execute(wire.SchedulerOutput(step_id=22, finished_request_ids=["nonsense", "honest"]))
    assert "nonsense" not in runner.refused_requests


def test_a_grammar_refused_once_built_ends_its_request_alone_after_its_step(runner):
    """A grammar not yet built builds beside the step's forward (GrammarMatchers.begin); one that does not compile
    ends its request then, refused with the reason and without a token, and its batch mates sample."""
    greedy = wire.SamplingParams(temperature=0.0)
    broken = wire.SamplingParams(temperature=0.0, grammar="start: missing_rule")
    step = wire.SchedulerOutput(
        step_id=25, new_requests=[new_request("broken", broken, [15]), new_request("honest", greedy, [16])]
    )
    prepared = runner.prepare(step)
    assert isinstance(runner.requests["broken"].matcher, PendingMatcher)  # not refused before the forward
    result = runner.finish(runner.launch(prepared))
    assert result.error is None and [t.request_id for t in result.sampled] == ["honest"]
    assert list(result.refused) == ["broken"] and "does not compile" in result.refused["broken"]
    assert "broken" not in runner.requests
    runner.execute(wire.SchedulerOutput(step_id=26, finished_request_ids=["broken", "honest"]))
    assert "broken" not in runner.refused_requests


def test_the_first_step_of_a_new_scheduler_drops_what_the_worker_still_held(runner):
    """A worker declared lost (pings unanswered) lives on and registers with a new scheduler, which
    knows nothing of the old requests: its first step says so, and the worker forgets them."""
    greedy = wire.SamplingParams(temperature=0.0)
    runner.execute(
        wire.SchedulerOutput(
            step_id=30,
            new_requests=[
                new_request("old", greedy, [12]),
                new_request("refused", wire.SamplingParams(logprobs=100000), [13]),
            ],
        )
    )
    assert "old" in runner.requests and "refused" in runner.refused_requests

    result = runner.execute(
        wire.SchedulerOutput(step_id=1, reset=True, new_requests=[new_request("new", greedy, [12])])
    )

    assert result.error is None and [t.request_id for t in result.sampled] == ["new"]
    assert set(runner.requests) == {"new"} and runner.refused_requests == {}
    runner.execute(wire.SchedulerOutput(step_id=2, finished_request_ids=["new"]))


def test_a_failed_sample_in_one_step_ends_only_its_requests_in_the_step_prepared_behind_it(runner, monkeypatch):
    """Overlapped: step 41 is prepared while step 40 computes, with "early"'s next token pending.
    Step 40's sampling fails, so "early" has no token: step 41 computes "late" (first sent in
    41) and leaves "early" out, instead of failing whole."""
    greedy = wire.SamplingParams(temperature=0.0)
    launched = runner.launch(
        runner.prepare(wire.SchedulerOutput(step_id=40, new_requests=[new_request("early", greedy, [14])]))
    )
    following = wire.SchedulerOutput(
        step_id=41,
        new_requests=[new_request("late", greedy, [15])],
        running_requests=[wire.RunningRequest("early", [], 1)],
    )
    prepared = runner.prepare(following)  # the scheduler's overlapped loop sent it before step 40 returned

    def failing_sample(*_):
        raise FloatingPointError("sampling failed")

    with monkeypatch.context() as patch:
        patch.setattr(runner.sampler, "draw", failing_sample)
        assert "sampling failed" in runner.finish(launched).error
    result = runner.finish(runner.launch(prepared))

    assert result.error is None and [t.request_id for t in result.sampled] == ["late"]
    runner.execute(wire.SchedulerOutput(step_id=42, finished_request_ids=["early", "late"]))


@pytest.mark.parametrize("chunk_size", [7, 24])
@pytest.mark.parametrize("precision", ["float32:none", "bfloat16:none", "auto:int8", "auto:gguf"])
def test_the_fused_decoder_stack_computes_exactly_what_its_single_ops_compute(smollm_path, precision, chunk_size):
    """bs_decoder_stack runs the kernels of the single ops in their order: prompt chunks and one-token steps
    give the same logits to the bit, in every weight format. From 16 tokens a bf16 step on AVX512-BF16 applies
    the SiLU-and-multiply inside the gate|up GEMM (chunks of 24), with silu_and_mul_row's arithmetic."""
    runner = load_runner(smollm_path, precision)
    token_ids = encode(runner, ENGLISH_TEXT)[:57]  # 8 chunks of 7 and one token, or 24, 24 and 9
    assert runner.model.kernels.fused_stack(runner.attention, runner.model.config) is not None

    fused = paged_logits(runner, token_ids, chunk_size=chunk_size)
    runner.model.kernels.fuse_layers = False
    single_ops = paged_logits(runner, token_ids, chunk_size=chunk_size)

    np.testing.assert_array_equal(fused, single_ops)


def batch_step_logits(runner: ModelRunner, scheduled: list[tuple[RequestState, int]]) -> np.ndarray:
    """Logits of one step of several sequences (each state's next `n` tokens), the states moved past them."""
    hidden = runner.forward(build_step_inputs(scheduled, runner.block_size, runner.num_kv_blocks))
    for state, n in scheduled:
        state.num_computed_tokens += n
    return runner.model.compute_logits(hidden).numpy()


@pytest.mark.parametrize("precision", ["float32:none", "bfloat16:none", "auto:gguf"])
def test_a_decode_of_many_sequences_writes_its_keys_inside_the_attention_and_computes_what_the_single_ops_do(
    smollm_path, precision
):
    """In a decode step of at least as many sequences as threads, each attention tile rotates its own token's
    query and key and writes its K and V just before it attends (bs::DecodeRope; the stack's "rope + KV write"
    stage is left empty): the logits are those of the single ops (rope_write_kv, then the attention) to the bit,
    and so is every layer's cache. A step of prompts keeps the stage."""
    runner = load_runner(smollm_path, precision)
    token_ids = encode(runner, ENGLISH_TEXT)
    threads = int(os.environ["OMP_NUM_THREADS"])  # tests/conftest.py sets it
    prompt_lens, decodes = [(9, 17, 30, 41, 3, 25)[i % 6] for i in range(max(6, threads))], 4
    assert len(token_ids) >= 300 + max(prompt_lens) + decodes
    blocks_each = -(-(max(prompt_lens) + decodes) // runner.block_size)
    stack = runner.model.kernels.fused_stack(runner.attention, runner.model.config)
    stack.time_stages = True
    caches = runner.kv_cache.key_caches + runner.kv_cache.value_caches
    rope_stage, attention_stage = STACK_STAGES.index("rope + KV write"), STACK_STAGES.index("attention")

    def run() -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """The prompts' and decodes' logits, the prompts' stage seconds and each decode step's (fused), from empty
        caches."""
        for cache in caches:
            cache.zero_()
        states = [
            RequestState(
                f"r{i}",
                token_ids[i * 60 % 300 : i * 60 % 300 + n + decodes],
                n,
                wire.SamplingParams(),
                list(range(i * blocks_each, (i + 1) * blocks_each)),
                0,
            )
            for i, n in enumerate(prompt_lens)
        ]
        logits = [batch_step_logits(runner, [(s, s.num_prompt_tokens) for s in states])]
        after_prompts = stack.stage_seconds.copy()
        decode_steps, before = [], after_prompts
        for _ in range(decodes):
            logits.append(batch_step_logits(runner, [(s, 1) for s in states]))
            decode_steps.append(stack.stage_seconds - before)
            before = stack.stage_seconds.copy()
        return np.concatenate(logits), after_prompts, decode_steps

    fused, prompt_seconds, decode_seconds = run()
    fused_caches = [c.numpy().copy() for c in caches]
    runner.model.kernels.fuse_layers = False
    single_ops, _, _ = run()

    assert prompt_seconds[rope_stage] > 0.01 * prompt_seconds[attention_stage]  # prompts: a stage of its own
    # Decodes: inside the attention, the stage two clock reads apart. Its least share over the decode steps: one
    # step's share can be a hiccup of the host (a full suite once measured 58 us against 1.7 ms of attention).
    assert min(step[rope_stage] / step[attention_stage] for step in decode_seconds) < 0.01, decode_seconds
    np.testing.assert_array_equal(fused, single_ops)
    for fused_cache, single_ops_cache in zip(fused_caches, caches, strict=True):
        np.testing.assert_array_equal(fused_cache, single_ops_cache.numpy())


def test_the_fused_decoder_stack_clocks_its_stages_only_when_asked_and_computes_the_same(smollm_path):
    """time_stages (bench_worker's breakdown of the fused step) adds each stage's wall time and changes nothing
    it computes; off (the service), nothing is added."""
    runner = load_runner(smollm_path, "auto:gguf")
    token_ids = encode(runner, ENGLISH_TEXT)[:23]
    stack = runner.model.kernels.fused_stack(runner.attention, runner.model.config)
    untimed = paged_logits(runner, token_ids, chunk_size=7)
    assert not stack.stage_seconds.any()

    stack.time_stages = True
    started = time.perf_counter()
    timed = paged_logits(runner, token_ids, chunk_size=7)
    elapsed = time.perf_counter() - started

    np.testing.assert_array_equal(timed, untimed)
    assert len(stack.stage_seconds) == len(STACK_STAGES)
    assert (stack.stage_seconds > 0).all() and stack.stage_seconds.sum() < elapsed


def test_the_fused_decoder_stack_lets_go_of_what_the_op_holds(smollm_path):
    """The op holds the layers' norms, weights and caches under a handle from the first call. release() lets go of
    them (a second release finds nothing) and the next call takes them again and computes the same; a call with
    a released handle is a clear error, not a read of freed memory; a stack that is dropped or replaced lets go."""
    runner = load_runner(smollm_path, "auto:gguf")
    model, ops = runner.model, runner.model.kernels.ops
    token_ids = encode(runner, ENGLISH_TEXT)[:23]
    stack = model.kernels.fused_stack(runner.attention, model.config)
    held = paged_logits(runner, token_ids, chunk_size=7)
    handle = stack.handle
    assert handle is not None

    stack.release()
    assert stack.handle is None and ops.bs_decoder_stack_release(handle).item() == 0
    held_again = paged_logits(runner, token_ids, chunk_size=7)
    np.testing.assert_array_equal(held_again, held)
    assert stack.handle.item() != handle.item()

    stack.hold = lambda *_: handle  # the released one
    with pytest.raises(Exception, match=f"no decoder stack is held under handle {handle.item()}"):
        paged_logits(runner, token_ids, chunk_size=7)
    del stack.hold

    replaced = stack.handle
    assert model.kernels.fused_stack(runner.attention, dataclasses.replace(model.config)) is not stack
    assert ops.bs_decoder_stack_release(replaced).item() == 0

    dropped = FusedDecoderStack(ops, runner.attention, model.config)
    dropped_handle = dropped.hold(model, runner.kv_cache)
    kept = FusedDecoderStack(ops, runner.attention, model.config)
    kept_handle = kept.hold(model, runner.kv_cache)
    del dropped
    gc.collect()
    assert ops.bs_decoder_stack_release(dropped_handle).item() == 0
    assert ops.bs_decoder_stack_release(kept_handle).item() == 1


def test_the_fused_decoder_stack_reads_the_step_from_one_layout_tensor(smollm_path):
    """On the host the step's token ids, positions, slots, query starts, context lengths and block table reach the
    op as one int64 tensor (one Paddle call per step instead of six), built only when the forward asks for it. The
    ids tensor and five metadata tensors (the single ops' inputs) packed into it give the same hidden states to the
    bit; a layout whose sizes do not add up, or of another dtype, or with an id outside the vocabulary, is a clear
    error, not a read past its end."""
    runner = load_runner(smollm_path, "auto:gguf")
    model, ops = runner.model, runner.model.kernels.ops
    token_ids = encode(runner, ENGLISH_TEXT)
    states = [
        RequestState(f"r{i}", token_ids[i * 20 : i * 20 + 19 + i], 19 + i, wire.SamplingParams(), [2 * i, 2 * i + 1], 0)
        for i in range(3)
    ]
    inputs = build_step_inputs([(s, len(s.token_ids)) for s in states], runner.block_size, runner.num_kv_blocks)
    host = runner.attention.prepare(inputs)
    assert isinstance(host, HostAttentionMetadata)
    from_host = ModelInputs(host, host_ids=inputs.input_ids)
    from_six = ModelInputs(host.split, uploaded_ids=paddle.to_tensor(inputs.input_ids))
    stack = model.kernels.fused_stack(runner.attention, model.config)

    from_layout = model.forward(from_host, runner.kv_cache, runner.attention).numpy()
    assert "input_ids" not in vars(from_host)  # the fused forward made no ids tensor
    layout = step_layout(from_six).numpy()
    np.testing.assert_array_equal(layout, host.layout.numpy())
    np.testing.assert_array_equal(layout[3 : 3 + len(inputs.input_ids)], inputs.input_ids)
    np.testing.assert_array_equal(stack(model, runner.kv_cache, step_layout(from_six)).numpy(), from_layout)
    too_many_tokens, unknown_token = layout.copy(), layout.copy()
    too_many_tokens[0] = 2**62
    unknown_token[3 + 5] = model.config.vocab_size
    bad_layouts = {
        "step layout": (layout[:-1], np.append(layout, 0), too_many_tokens, layout.astype(np.int32)),
        f"token id {model.config.vocab_size} outside the vocabulary": (unknown_token,),
    }
    for error, layouts in bad_layouts.items():
        for bad in layouts:
            with pytest.raises(Exception, match=error):
                ops.bs_decoder_stack(
                    stack.handle,
                    paddle.to_tensor(bad),
                    runner.attention.rotary.cos,
                    runner.attention.rotary.sin,
                    model.config.rms_norm_eps,
                    runner.attention.query_tile,
                    runner.attention.isa,
                    False,
                )
    np.testing.assert_array_equal(stack(model, runner.kv_cache, host.layout).numpy(), from_layout)  # still serving


def test_the_fused_decoder_stack_takes_each_layers_own_weight_formats(smollm_path):
    """A GGUF file may store a projection in other formats in some layers (llama.cpp's Q4_K_M keeps half the
    layers' ffn_down in Q6_K, served here in the dtype): the stack reads each layer's formats, and sees a
    layer replaced in the model's list."""
    runner = load_runner(smollm_path, "auto:gguf")
    model = runner.model
    token_ids = encode(runner, ENGLISH_TEXT)[:23]
    paged_logits(runner, token_ids, chunk_size=7)  # the stack has taken the layers' inputs once
    rng = np.random.default_rng(0)
    down = model.layers[1].down
    dense = (rng.standard_normal((down.out_features, down.in_features)) * 0.02).astype(np.float32)
    replaced = linear(model.kernels, dense, None, Precision("bfloat16", "none", "test"))
    assert replaced.format != down.format
    model.layers[1] = dataclasses.replace(model.layers[1], down=replaced)  # in place: the same list

    fused = paged_logits(runner, token_ids, chunk_size=7)
    model.kernels.fuse_layers = False
    single_ops = paged_logits(runner, token_ids, chunk_size=7)

    np.testing.assert_array_equal(fused, single_ops)
