"""The worker's model against transformers on torch fp32, loading the same files.

Three models: SmolLM2 from its Q4_1 GGUF (llama, tied embeddings), a tiny random Qwen2 folder
(q/k/v biases, untied lm_head, fp32 safetensors) and a tiny random Llama folder with llama3 rope
scaling stored in bf16. Greedy generation goes through chunked prefill, mixed prefill+decode
steps and preemptions with recompute, driven by the real scheduler and engine loop.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gpu_worker.model_runner import ModelRunner
from gpu_worker.step_inputs import RequestState, build_step_inputs
from service import wire
from service.config import load_settings
from tests.support.model_engine import LocalEngine

NUM_KV_BLOCKS = 128
TOKEN_BUDGET = 24
TIGHT_NUM_BLOCKS = 12  # of 16 tokens: the 8 greedy requests outgrow it, and some are preempted
NUM_GREEDY_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter who",
    "Les trois couleurs primaires sont",
    "Water boils at a temperature of",
    "日本の首都は東京です。大阪は",
    "List three uses of a paperclip, then explain which one is the most surprising and why:",
    "import numpy as np\n",
]
LONG_TEXT = PROMPTS[2] + " " + PROMPTS[6]  # over two blocks of 16 tokens
TINY_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=49152,
    initializer_range=0.2,
)


def tiny_qwen2(folder, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**TINY_DIMS, tie_word_embeddings=False)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def tiny_llama3_bf16(folder, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    torch.manual_seed(1)
    config = LlamaConfig(**TINY_DIMS, tie_word_embeddings=True, rope_parameters=rope, max_position_embeddings=4096)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module", params=["custom", "paddle"])
def kernels(request) -> str:
    """BLOCKSERVE_KERNELS of the runner: every test passes on both paths."""
    return request.param


@pytest.fixture(scope="module", params=["smollm2-gguf", "qwen2-folder", "llama3-bf16-folder"])
def models(request, kernels, smollm_path, hf_smollm_tokenizer, tmp_path_factory):
    """(our ModelRunner, transformers' model) for the same files."""
    from transformers import AutoModelForCausalLM

    if request.param == "smollm2-gguf":
        model_path, hf_kwargs = smollm_path, dict(gguf_file=smollm_path.name)
        hf_dir = smollm_path.parent
    else:
        model_path = hf_dir = tmp_path_factory.mktemp(request.param)
        build = tiny_qwen2 if request.param == "qwen2-folder" else tiny_llama3_bf16
        build(hf_dir, hf_smollm_tokenizer)
        hf_kwargs = {}
    runner = ModelRunner(load_settings(model=os.fspath(model_path), num_kv_blocks=NUM_KV_BLOCKS, kernels=kernels))
    assert runner.kernels["kernels"] == kernels
    reference = AutoModelForCausalLM.from_pretrained(os.fspath(hf_dir), dtype=torch.float32, **hf_kwargs).eval()
    return runner, reference


def paged_logits(runner: ModelRunner, token_ids: list[int], chunk_size: int) -> np.ndarray:
    """Logits of every position, computed chunk by chunk through the paged KV cache."""
    num_blocks = -(-len(token_ids) // runner.block_size)
    state = RequestState("logits", list(token_ids), len(token_ids), wire.SamplingParams(), list(range(num_blocks)), 0)
    chunks = []
    while state.num_computed_tokens < len(token_ids):
        num_tokens = min(chunk_size, len(token_ids) - state.num_computed_tokens)
        hidden = runner.forward(build_step_inputs([(state, num_tokens)], runner.block_size, runner.num_kv_blocks))
        chunks.append(runner.model.compute_logits(hidden).numpy())
        state.num_computed_tokens += num_tokens
    return np.concatenate(chunks)


def reference_logits(reference, token_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0].numpy()


def reference_greedy(reference, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation with its own KV cache, never stopping at EOS."""
    tokens = []
    with torch.no_grad():
        out = reference(torch.tensor([prompt_ids]), use_cache=True)
        while True:
            tokens.append(int(out.logits[0, -1].argmax()))
            if len(tokens) == num_tokens:
                return tokens
            out = reference(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)


def encode(runner: ModelRunner, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(runner.model_info.tokenizer_json).encode(text).ids


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


def test_logits_match_transformers_for_every_position(models):
    runner, reference = models
    token_ids = encode(runner, PROMPTS[2])

    ours = paged_logits(runner, token_ids, chunk_size=len(token_ids))

    assert relative_error(ours, reference_logits(reference, token_ids)) < 1e-3


def test_logits_match_when_the_prompt_is_computed_in_chunks(models):
    runner, reference = models
    token_ids = encode(runner, LONG_TEXT)

    ours = paged_logits(runner, token_ids, chunk_size=7)

    assert relative_error(ours, reference_logits(reference, token_ids)) < 1e-3


def test_greedy_generation_matches_transformers_through_chunking_mixing_and_preemption(models):
    runner, reference = models
    engine = LocalEngine(runner, TOKEN_BUDGET, num_blocks=TIGHT_NUM_BLOCKS)
    greedy = wire.SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    prompts = {f"p{i}": encode(runner, text) for i, text in enumerate(PROMPTS)}
    for request_id, prompt_ids in prompts.items():
        engine.add(request_id, prompt_ids, greedy)

    outputs = engine.run()

    assert engine.num_chunked_prefills() > 0 and engine.num_mixed_steps() > 0
    assert engine.scheduler.counters.num_preemptions > 0
    for request_id, prompt_ids in prompts.items():
        assert outputs[request_id] == reference_greedy(reference, prompt_ids, NUM_GREEDY_TOKENS), request_id


def test_prefix_cache_hit_reads_blocks_another_request_computed(models):
    runner, reference = models
    engine = LocalEngine(runner, TOKEN_BUDGET)
    shared = encode(runner, LONG_TEXT)[: 2 * runner.block_size]
    engine.add("first", shared + encode(runner, " and then"), wire.SamplingParams(temperature=0.0, max_tokens=1))
    engine.run()
    second_prompt = shared + encode(runner, " Meanwhile, far away,")

    engine.add("second", second_prompt, wire.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    outputs = engine.run()

    assert engine.finished["second"].num_cached_tokens == 2 * runner.block_size
    assert outputs["second"] == reference_greedy(reference, second_prompt, 8)
