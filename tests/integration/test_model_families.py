"""Every model family the worker runs against transformers on torch fp32, from tiny random Hugging Face folders
built here (tests/support/tiny_families.py): logprobs within 1e-3 at every position of a prompt computed in
chunks, and the same greedy tokens through chunked prefill and mixed steps, on the custom and pure-Paddle kernels.
Prompts are longer than the sliding windows (8 tokens) and than Phi-3's longrope original length (32 tokens).
The families llama.cpp converts are served from GGUF files too, written as its converter writes them
(tests/support/family_gguf.py), against transformers on the folder of the same weights."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from service.contract import wire
from service.contract.config import load_settings
from tests.support.accuracy import REFERENCE_PROMPTS, encode, log_softmax, paged_logits
from tests.support.family_gguf import write_family_gguf
from tests.support.model_engine import LocalEngine
from tests.support.tiny_families import (
    FAMILY_MODELS,
    GGUF_FAMILY_MODELS,
    LONGROPE_ORIGINAL_LENGTH,
    SLIDING_WINDOW,
    save_tiny_model,
)
from worker.attention.custom_kernels import CustomPagedAttention
from worker.attention.reference import RotaryPagedAttention
from worker.model_runner import ModelRunner

NUM_KV_BLOCKS = 128
TOKEN_BUDGET = 24  # prompts of 40+ tokens are prefilled in chunks, beside other requests' decodes
NUM_GREEDY_TOKENS = 16
MAX_LOGPROB_ERROR = 1e-3
# The longest reference prompt and another: 35-50 tokens, several windows and past longrope's original length.
LONG_PROMPTS = [REFERENCE_PROMPTS[other] + " " + REFERENCE_PROMPTS[2] for other in (1, 3, 5, 6)]
# Families whose layers are Llama's once loaded: the fused decoder stack runs them on the custom kernels.
FUSED = {"phi3", "phi3-longrope", "ernie4_5"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, hf_smollm_tokenizer) -> dict[str, str]:
    """Every family's tiny model, saved once."""
    found = {}
    for name in FAMILY_MODELS:
        folder = tmp_path_factory.mktemp(name)
        save_tiny_model(name, folder, hf_smollm_tokenizer)
        found[name] = os.fspath(folder)
    return found


@pytest.fixture(scope="module", params=FAMILY_MODELS)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=["custom", "paddle"])
def kernels(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(folders, family):
    from transformers import AutoModelForCausalLM

    folder = folders[family]
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def runner(folders, family, kernels) -> ModelRunner:
    settings = load_settings(model=folders[family], num_kv_blocks=NUM_KV_BLOCKS, kernels=kernels, dtype="float32")
    return ModelRunner(settings)


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


def max_logprob_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(log_softmax(ours) - log_softmax(theirs)).max())


def test_the_family_runs_on_the_attention_and_layers_its_details_allow(runner, family, kernels):
    fused = runner.model.kernels.fused_stack(runner.attention, runner.model.config)
    if kernels == "paddle":
        assert isinstance(runner.attention, RotaryPagedAttention)
    else:
        assert isinstance(runner.attention, CustomPagedAttention)
    assert (fused is not None) == (kernels == "custom" and family in FUSED)


def test_logprobs_match_transformers_at_every_position_of_a_prompt_computed_in_chunks(runner, reference):
    token_ids = encode(runner, LONG_PROMPTS[0])
    assert len(token_ids) > max(LONGROPE_ORIGINAL_LENGTH, 4 * SLIDING_WINDOW)

    ours = paged_logits(runner, token_ids, chunk_size=7)

    assert max_logprob_error(ours, reference_logits(reference, token_ids)) < MAX_LOGPROB_ERROR


def test_greedy_tokens_match_transformers_through_chunked_prefill_and_mixed_steps(runner, reference):
    engine = LocalEngine(runner, TOKEN_BUDGET)
    greedy = wire.SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    prompts = {f"p{i}": encode(runner, text) for i, text in enumerate(LONG_PROMPTS)}
    assert min(map(len, prompts.values())) > max(LONGROPE_ORIGINAL_LENGTH, 4 * SLIDING_WINDOW)
    for request_id, prompt_ids in prompts.items():
        engine.add(request_id, prompt_ids, greedy)

    outputs = engine.run()

    assert engine.num_chunked_prefills() > 0 and engine.num_mixed_steps() > 0
    for request_id, prompt_ids in prompts.items():
        assert outputs[request_id] == reference_greedy(reference, prompt_ids, NUM_GREEDY_TOKENS), request_id


@pytest.mark.parametrize("kernels_name", ["custom", "paddle"])
def test_phi3_longrope_served_within_its_original_length_takes_the_short_factors(folders, kernels_name):
    """transformers takes the short factors for sequences up to original_max_position_embeddings; a worker serving
    no longer sequences (BLOCKSERVE_MAX_MODEL_LEN) does too, and one serving longer ones the long factors."""
    from transformers import AutoModelForCausalLM

    folder = folders["phi3-longrope"]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    settings = load_settings(
        model=folder, num_kv_blocks=16, kernels=kernels_name, dtype="float32", max_model_len=LONGROPE_ORIGINAL_LENGTH
    )
    runner = ModelRunner(settings)
    token_ids = encode(runner, REFERENCE_PROMPTS[2])[:LONGROPE_ORIGINAL_LENGTH]

    ours = paged_logits(runner, token_ids, chunk_size=5)

    assert max_logprob_error(ours, reference_logits(reference, token_ids)) < MAX_LOGPROB_ERROR


def test_a_sliding_window_that_holds_every_served_token_is_no_window_and_the_fused_stack_serves_it(folders):
    settings = load_settings(
        model=folders["mistral"],
        num_kv_blocks=16,
        kernels="custom",
        dtype="float32",
        block_size=SLIDING_WINDOW,
        max_model_len=SLIDING_WINDOW,
    )
    runner = ModelRunner(settings)

    assert isinstance(runner.attention, CustomPagedAttention)
    assert runner.model.kernels.fused_stack(runner.attention, runner.model.config) is not None


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, hf_smollm_tokenizer, smollm_path) -> dict[str, tuple[str, str]]:
    """(GGUF file, folder of the same weights) of every family llama.cpp converts."""
    found = {}
    for name, overrides in GGUF_FAMILY_MODELS.items():
        folder = tmp_path_factory.mktemp(f"{name}-for-gguf")
        save_tiny_model(name, folder, hf_smollm_tokenizer, **overrides)
        path = folder.parent / f"{folder.name}.gguf"
        write_family_gguf(folder, path, smollm_path)
        found[name] = os.fspath(path), os.fspath(folder)
    return found


@pytest.mark.parametrize("name", list(GGUF_FAMILY_MODELS))
def test_a_gguf_file_of_the_family_matches_transformers_on_its_folder(gguf_files, name):
    """On the custom kernels: a GGUF file loads into the same layers for either kernels, whose arithmetic the
    folder tests above hold to transformers on both (the pure-Paddle variant doubled this test's time in CI)."""
    from transformers import AutoModelForCausalLM

    kernels_name = "custom"
    path, folder = gguf_files[name]
    settings = load_settings(model=path, num_kv_blocks=NUM_KV_BLOCKS, kernels=kernels_name, dtype="float32")
    runner = ModelRunner(settings)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    token_ids = encode(runner, LONG_PROMPTS[1])
    engine = LocalEngine(runner, TOKEN_BUDGET)
    engine.add("greedy", token_ids, wire.SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True))

    ours = paged_logits(runner, token_ids, chunk_size=7)
    greedy = engine.run()["greedy"]

    assert runner.model.config.architecture == name.removesuffix("-longrope")
    if name == "phi3-longrope":  # the factors read from the file's tensors, the long ones past the original length
        assert runner.model.config.rope.rope_type == "longrope" and runner.model.config.rope.long_factor[1] == 2.5
    assert max_logprob_error(ours, reference_logits(reference, token_ids)) < MAX_LOGPROB_ERROR
    assert greedy == reference_greedy(reference, token_ids, NUM_GREEDY_TOKENS)


def test_an_unsupported_rope_scaling_stops_the_worker_at_start_up_with_the_configuration_error(
    folders, tmp_path, monkeypatch
):
    """Exit 78 through the configuration-error path: one line naming the rope type, listing the supported ones, and
    the setting to change."""
    import shutil

    import worker.process as worker_process
    from service.contract.configuration_exit import ConfigurationError

    folder = tmp_path / "qwen3-yarn"
    shutil.copytree(folders["qwen3"], folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    config_path.write_text(json.dumps(config))
    monkeypatch.setattr(worker_process, "serve_worker", lambda *_: pytest.fail("the worker served the model"))

    with pytest.raises(ConfigurationError) as refused:
        worker_process.run_worker(load_settings(model=os.fspath(folder), kernels="paddle"))

    message = str(refused.value)
    assert "\n" not in message
    assert "rope type 'yarn' is not supported (supported: default, linear, llama3, longrope)" in message
    assert f"set BLOCKSERVE_MODEL, now {folder}" in message
