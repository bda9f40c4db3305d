"""A tiny Llama GGUF whose tokenizer is SentencePiece (tests/support/sentencepiece_gguf.py) served end to end on the
worker's side: the runner loads it, its ModelInfo carries the file's special ids and chat template, the api's
model encodes a chat as SentencePiece does behind the BOS, and grammars build on its tokenizer."""

from __future__ import annotations

import os

import pytest

from service.api.served_model import ServedModel
from service.contract.config import load_settings
from tests.support.sentencepiece_gguf import CHAT_TEMPLATE, LLAMA_STYLE, write_tiny_llama_gguf
from worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sentencepiece") / "tiny-llama-sp.gguf"
    processor = write_tiny_llama_gguf(path, LLAMA_STYLE)
    runner = ModelRunner(load_settings(model=os.fspath(path), num_kv_blocks=16, kernels="paddle", dtype="float32"))
    return processor, runner


def test_the_model_info_carries_the_files_special_tokens_and_template(model):
    processor, runner = model
    info = runner.model_info

    assert (info.bos_token_id, info.eos_token_ids, info.add_bos_token) == (
        processor.bos_id(),
        [processor.eos_id()],
        True,
    )
    assert info.chat_template == CHAT_TEMPLATE
    assert info.vocab_size == processor.GetPieceSize()
    assert runner.grammars.problem is None


def test_the_api_encodes_a_chat_as_sentencepiece_does_after_the_bos(model):
    processor, runner = model
    served = ServedModel(runner.model_info)

    ids = served.encode_chat([{"role": "user", "content": "Hello  wörld 中文\nagain"}])

    assert ids == [processor.bos_id(), *processor.encode("[INST] Hello  wörld 中文\nagain [/INST]")]
    assert served.decode(ids) == "[INST] Hello  wörld 中文\nagain [/INST]"
