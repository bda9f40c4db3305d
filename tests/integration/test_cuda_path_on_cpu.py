"""The CUDA path's pieces that this CPU build can run: step inputs built from deltas by the device
op's own kernels (emulated) inside the real ModelRunner, the choice of the CUDA kernels on a GPU
device, and moving a model onto its device in its dtype."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

import worker.kernels.cuda_ops as cuda_ops_module
import worker.kernels.selection as kernels_module
from service.contract import wire
from service.contract.config import load_settings
from tests.gpu.kernel_library import HostArrays, KernelError, KernelLibrary, build_emulated_library
from tests.support.host_copies import HostCopies
from tests.support.model_engine import LocalEngine
from worker.attention.custom_kernels import QUERY_TILE, CustomPagedAttention
from worker.attention.reference import RotaryPagedAttention
from worker.host.model_to_device import map_model_tensors
from worker.inputs.device_inputs import DeviceInputs
from worker.inputs.model_inputs import HostInputs
from worker.inputs.step_delta import StepDelta
from worker.kernels.cpu import CustomKernels
from worker.kernels.cpu_isa import IsaSet
from worker.kernels.cuda import CudaKernels
from worker.kernels.reference import PaddleKernels
from worker.kernels.selection import select_kernels
from worker.layers.linear import PaddleLinear, TiedLmHead, linear
from worker.layers.precision import Precision
from worker.model_runner import ModelRunner
from worker.models.config import ModelConfig, RopeConfig
from worker.models.llama import LlamaForCausalLM

PROMPT_IDS = [504, 3575, 282, 4649, 314, 253, 1345, 1185, 28, 284, 260, 1345, 282]
STEP_OUTPUTS = ("input_ids", "positions", "slot_mapping", "query_start", "context_lens", "block_table")


class EmulatedStepInputOps:
    """bs_prepare_step_inputs on CPU tensors, computed by the CUDA op's kernels through the SIMT emulation."""

    def __init__(self, library: KernelLibrary):
        self.library = library
        self.num_calls = 0

    def bs_prepare_step_inputs(self, delta, block_tables, last_sampled, num_requests, num_tokens, width, block_size):
        self.num_calls += 1
        step = StepDelta(delta.numpy(), num_requests, num_tokens, width)
        outputs, tables = self.library.prepare_step_inputs(step, block_tables.numpy(), last_sampled.numpy(), block_size)
        paddle.assign(paddle.to_tensor(tables), block_tables)  # the op updates the tables in place
        return [paddle.to_tensor(outputs[name]) for name in STEP_OUTPUTS] + [block_tables]


@pytest.fixture(scope="module")
def emulated_ops(tmp_path_factory) -> EmulatedStepInputOps:
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the emulated kernels")
    library = KernelLibrary(build_emulated_library(tmp_path_factory.mktemp("emulated_kernels")), HostArrays())
    return EmulatedStepInputOps(library)


@pytest.fixture(scope="module")
def runner(smollm_path):
    return ModelRunner(load_settings(model=os.fspath(smollm_path), num_kv_blocks=64, max_model_len=2048))


def crowded_engine(runner) -> LocalEngine:
    """Three prompts of one block on 4 blocks of 16 tokens, small chunks: prefill chunks, decodes,
    new blocks every 16 tokens, and the newest request preempted and recomputed as they grow."""
    engine = LocalEngine(runner, max_num_batched_tokens=8, num_blocks=4, preemption_policy="lifo", overlapped=True)
    engine.add("other", PROMPT_IDS[::-1], wire.SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))
    engine.add("greedy", PROMPT_IDS[:5], wire.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    engine.add("seeded", PROMPT_IDS, wire.SamplingParams(temperature=0.9, seed=1234, max_tokens=12, ignore_eos=True))
    return engine


def test_inputs_built_from_step_deltas_serve_the_tokens_of_host_built_inputs(runner, emulated_ops):
    """The worker loop's order (next step prepared while one computes: decodes' tokens pending, taken from
    last_sampled), preemption (slots released and taken again), blocks added as requests grow."""
    host = crowded_engine(runner)
    expected = host.run_pipelined()
    assert host.finished["seeded"].num_preemptions > 0

    max_blocks = -(-runner.model_info.max_model_len // runner.block_size)
    runner.step_inputs = DeviceInputs(emulated_ops, runner.block_size, num_slots=4, max_blocks_per_slot=max_blocks)
    try:
        assert crowded_engine(runner).run_pipelined() == expected
    finally:
        runner.step_inputs = HostInputs(runner.attention)
    assert emulated_ops.num_calls > 10


def test_a_gpu_device_chooses_the_cuda_kernels_with_paddle_linears(monkeypatch):
    fake_ops = SimpleNamespace(bs_add_rms_norm=lambda *args: ("out", "summed"))
    monkeypatch.setattr(kernels_module.paddle, "get_device", lambda: "gpu:0")
    monkeypatch.setattr(cuda_ops_module, "load_cuda_ops", lambda: fake_ops)

    choice = select_kernels("auto")

    assert isinstance(choice.kernels, CudaKernels) and choice.kernels.ops is fake_ops
    assert choice.describe()["kernels"] == "cuda" and choice.describe()["kernels_isa"] == "cuda"
    assert choice.kernels.add_rms_norm("x", "w", "residual", 1e-5) == ("out", "summed")
    assert choice.kernels.fused_stack(object(), tiny_config()) is None  # no CUDA bs_decoder_stack: op by op
    weight = np.ones((4, 8), dtype=np.float32)
    bfloat16 = Precision("bfloat16", "none", "test")
    assert isinstance(linear(choice.kernels, weight, None, bfloat16), PaddleLinear)  # cuBLAS through paddle.matmul


def tiny_config(head_dim: int = 16, num_heads: int = 2, num_kv_heads: int = 1) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=32,
        hidden_size=num_heads * head_dim,
        intermediate_size=24,
        num_layers=2,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        rope=RopeConfig(),
    )


# (kernels, num_heads, num_kv_heads, head_dim, taken). The CUDA attention holds a head of a multiple of 8 elements
# (16-byte rows) up to 256, and up to 32 query heads per kv head (a block's rows); the C++ CPU attention works on
# whole AVX-512 vectors of a head: multiples of 16, any group.
ATTENTION_HEADS = [
    *(("cuda", 2, 1, head_dim, True) for head_dim in (8, 16, 24, 64, 128, 248, 256)),
    *(("cuda", 2, 1, head_dim, False) for head_dim in (4, 12, 20, 100, 260, 264, 512)),
    *(("cuda", num_heads, num_kv_heads, 64, True) for num_heads, num_kv_heads in ((32, 1), (64, 2), (32, 32))),
    *(("cuda", num_heads, num_kv_heads, 64, False) for num_heads, num_kv_heads in ((33, 1), (64, 1), (66, 2))),
    *(("cpu", 2, 1, head_dim, True) for head_dim in (16, 32, 48, 64, 128, 256, 512)),
    *(("cpu", 2, 1, head_dim, False) for head_dim in (8, 12, 20, 24, 40, 100, 264)),
    ("cpu", 64, 1, 64, True),
]


@pytest.mark.parametrize("kind, num_heads, num_kv_heads, head_dim, taken", ATTENTION_HEADS)
def test_custom_attention_takes_heads_it_can_hold_and_leaves_the_rest_to_paddle(
    emulated_ops, kind, num_heads, num_kv_heads, head_dim, taken
):
    """The heads a model's custom attention gets, and why the others run in pure Paddle. For the CUDA kernels the
    kernel's own plan (the emulated build of kernel_api.cu) refuses exactly the heads the worker does not give it."""
    config = tiny_config(head_dim, num_heads, num_kv_heads)
    kernels = CudaKernels(SimpleNamespace()) if kind == "cuda" else CustomKernels(SimpleNamespace(), IsaSet())

    problem = kernels.attention_problem(config)
    attention = kernels.attention(config, 16, SimpleNamespace())

    assert (problem is None) == taken, problem
    assert isinstance(attention, CustomPagedAttention if taken else RotaryPagedAttention)
    if not taken:
        group = num_heads // num_kv_heads
        assert f"head_dim {head_dim} " in problem or f"{group} query heads share a kv head" in problem, problem
    if kind == "cuda":
        query_shape, cache_shape = (1, num_heads, head_dim), (1, 16, num_kv_heads, head_dim)
        try:
            emulated_ops.library.plan_attention(query_shape, 1, cache_shape, 1, QUERY_TILE, HostArrays.num_sms)
        except KernelError as refusal:
            assert not taken, refusal
        else:
            assert taken, "the CUDA kernel plans heads the worker leaves to Paddle"


def tiny_model(config: ModelConfig) -> LlamaForCausalLM:
    rng = np.random.default_rng(0)
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.norm.weight": (config.hidden_size,),
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        shapes |= {
            p + "input_layernorm.weight": (config.hidden_size,),
            p + "post_attention_layernorm.weight": (config.hidden_size,),
            p + "self_attn.q_proj.weight": (q, config.hidden_size),
            p + "self_attn.k_proj.weight": (kv, config.hidden_size),
            p + "self_attn.v_proj.weight": (kv, config.hidden_size),
            p + "self_attn.o_proj.weight": (config.hidden_size, q),
            p + "mlp.gate_proj.weight": (config.intermediate_size, config.hidden_size),
            p + "mlp.up_proj.weight": (config.intermediate_size, config.hidden_size),
            p + "mlp.down_proj.weight": (config.hidden_size, config.intermediate_size),
        }
    weights = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    float32 = Precision("float32", "none", "test")
    return LlamaForCausalLM(config, weights, config.max_position_embeddings, PaddleKernels(), float32)


def test_moving_a_model_converts_every_weight_once_and_keeps_the_rotary_tables_float32():
    model = tiny_model(tiny_config())
    calls = []

    def to_bfloat16(tensor, cast):
        calls.append(cast)
        return tensor.astype("bfloat16") if cast else tensor.clone()

    map_model_tensors(model, to_bfloat16)

    layer = model.layers[0]
    weights = [model.embed_tokens.table, model.norm, layer.input_norm, layer.qkv.weight, layer.down.weight]
    assert all(w.dtype == paddle.bfloat16 for w in weights)
    assert isinstance(model.lm_head, TiedLmHead) and model.lm_head.embedding is model.embed_tokens.table  # still tied
    assert {model.rotary.cos.dtype, model.rotary.sin.dtype} == {paddle.float32}
    num_weights = 2 + model.config.num_layers * 6  # embedding, final norm; per layer 2 norms and 4 linears
    assert calls.count(True) == num_weights and calls.count(False) == 3  # cos, sin, rotate_half


def test_a_step_copies_from_the_model_to_the_host_once(runner, monkeypatch):
    """What waits for a GPU: launch queues the forward without a copy back, finish copies the samples once."""

    def new_request(request_id: str, prompt: list[int], sampling: wire.SamplingParams, block: int):
        return wire.NewRequest(
            request_id=request_id,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            sampling=sampling,
            block_ids=[block],
            num_computed_tokens=0,
            num_scheduled_tokens=len(prompt),
        )

    greedy_with_logprobs, drawn = wire.SamplingParams(temperature=0.0, logprobs=2), wire.SamplingParams(temperature=0.8)
    step = wire.SchedulerOutput(
        step_id=1,
        new_requests=[
            new_request("a", PROMPT_IDS, greedy_with_logprobs, 0),
            new_request("b", PROMPT_IDS[:5], drawn, 1),
        ],
    )
    copies = HostCopies(monkeypatch)

    launched = runner.launch(runner.prepare(step))
    assert copies.shapes == []
    result = runner.finish(launched)

    assert result.error is None and len(result.sampled) == 2 and len(copies) == 1
    runner.execute(wire.SchedulerOutput(step_id=2, finished_request_ids=["a", "b"]))
