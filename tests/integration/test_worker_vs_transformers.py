"""The worker's model in float32 against transformers on torch fp32, loading the same files (the other
precisions are held to float32 in test_worker_accuracy.py).

Three models: SmolLM2 from its Q4_1 GGUF (llama, tied embeddings), a tiny random Qwen2 folder
(q/k/v biases, untied lm_head, fp32 safetensors) and a tiny random Llama folder with llama3 rope
scaling stored in bf16. Greedy generation goes through chunked prefill, mixed prefill+decode
steps and preemptions with recompute, driven by the real scheduler and engine loop. A fourth, a tiny random
Llama whose head_dim (20) the custom attention kernels cannot take, is served at the default precision.
"""

from __future__ import annotations

import os
import weakref

import numpy as np
import pytest
import torch

import worker.process as worker_process
from service.contract import wire
from service.contract.config import load_settings
from service.contract.configuration_exit import ConfigurationError
from tests.support.accuracy import REFERENCE_PROMPTS, encode, paged_logits
from tests.support.model_engine import LocalEngine
from worker.attention.reference import RotaryPagedAttention
from worker.model_runner import ModelRunner

NUM_KV_BLOCKS = 128
TOKEN_BUDGET = 24
TIGHT_NUM_BLOCKS = 12  # of 16 tokens: the 8 greedy requests outgrow it, and some are preempted
NUM_GREEDY_TOKENS = 32

LONG_TEXT = REFERENCE_PROMPTS[2] + " " + REFERENCE_PROMPTS[6]  # over two blocks of 16 tokens
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
def models(request, kernels, smollm_path, hf_smollm_tokenizer, hf_smollm_model, tmp_path_factory):
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
    settings = load_settings(
        model=os.fspath(model_path), num_kv_blocks=NUM_KV_BLOCKS, kernels=kernels, dtype="float32", quantization="none"
    )
    runner = ModelRunner(settings)
    assert runner.kernels["kernels"] == kernels and runner.kernels["dtype"] == "float32"
    assert runner.kernels["quantization"] == "none"
    if request.param == "smollm2-gguf":
        return runner, hf_smollm_model
    reference = AutoModelForCausalLM.from_pretrained(os.fspath(hf_dir), dtype=torch.float32, **hf_kwargs).eval()
    return runner, reference


def reference_logits(reference, token_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0].numpy()


# reference -> {(prompt, num_tokens): its greedy tokens}: the session's SmolLM2 reference answers the same prompts for
# both kernels' runners (its greedy continuations took ~20 s of each greedy test on a 2-core VM).
GREEDY_OF_REFERENCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference_greedy(reference, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation with its own KV cache, never stopping at EOS (computed once per
    reference, prompt and length)."""
    known = GREEDY_OF_REFERENCE.setdefault(reference, {})
    key = (tuple(prompt_ids), num_tokens)
    if key not in known:
        known[key] = greedy_tokens(reference, prompt_ids, num_tokens)
    return list(known[key])


def greedy_tokens(reference, prompt_ids: list[int], num_tokens: int) -> list[int]:
    tokens = []
    with torch.no_grad():
        out = reference(torch.tensor([prompt_ids]), use_cache=True)
        while True:
            tokens.append(int(out.logits[0, -1].argmax()))
            if len(tokens) == num_tokens:
                return tokens
            out = reference(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


def test_logits_match_transformers_for_every_position(models):
    runner, reference = models
    token_ids = encode(runner, REFERENCE_PROMPTS[2])

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
    prompts = {f"p{i}": encode(runner, text) for i, text in enumerate(REFERENCE_PROMPTS)}
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


@pytest.fixture(scope="module")
def head_dim_20_folder(tmp_path_factory, hf_smollm_tokenizer):
    """A tiny random Llama whose heads are 20 wide (OpenLLaMA-3B's are 100): a multiple of neither 16 (the C++
    attention) nor 8 (the CUDA one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama-head-dim-20")
    dims = {**TINY_DIMS, "hidden_size": 80, "head_dim": 20}
    torch.manual_seed(2)
    LlamaForCausalLM(LlamaConfig(**dims, tie_word_embeddings=False)).save_pretrained(folder)
    hf_smollm_tokenizer.save_pretrained(folder)
    return folder


def test_a_model_whose_heads_the_custom_attention_cannot_take_is_served_in_float32_and_matches_transformers(
    head_dim_20_folder,
):
    """The attention is chosen before the precision: the pure-Paddle attention computes and caches in float32, so
    the default precision of the custom kernels (bfloat16) gives way to float32 for weights and cache alike."""
    from transformers import AutoModelForCausalLM

    settings = load_settings(model=os.fspath(head_dim_20_folder), num_kv_blocks=NUM_KV_BLOCKS, kernels="custom")
    runner = ModelRunner(settings)
    token_ids = encode(runner, LONG_TEXT)

    ours = paged_logits(runner, token_ids, chunk_size=7)

    assert isinstance(runner.attention, RotaryPagedAttention)
    assert runner.kernels["kernels"] == "custom" and runner.kernels["dtype"] == "float32"
    assert runner.kv_cache.dtype == "float32"
    reference = AutoModelForCausalLM.from_pretrained(os.fspath(head_dim_20_folder), dtype=torch.float32).eval()
    assert relative_error(ours, reference_logits(reference, token_ids)) < 1e-3


def test_an_explicit_bfloat16_for_such_a_model_is_refused_at_start_up_naming_its_head_dim(
    head_dim_20_folder, monkeypatch
):
    settings = load_settings(model=os.fspath(head_dim_20_folder), kernels="custom", dtype="bfloat16")
    monkeypatch.setattr(worker_process, "serve_worker", lambda *_: pytest.fail("the worker served the model"))

    with pytest.raises(ConfigurationError) as refused:
        worker_process.run_worker(settings)

    assert "BLOCKSERVE_DTYPE=bfloat16" in str(refused.value) and "head_dim 20" in str(refused.value)
    assert "computes in float32" in str(refused.value)
