"""Our tokenizer, chat template and ModelInfo against transformers' reading of the same files."""

from __future__ import annotations

import pytest

from service.api.chat_template import ChatTemplateError, render_chat
from service.contract.config import load_settings
from worker.loading.gguf_checkpoint import GGUFCheckpoint
from worker.loading.model_loader import model_info
from worker.loading.tokenizer import tokenizer_from_folder

TEXTS = [
    "Hello world!",
    "  leading spaces, trailing  \n\nand blank lines\t\ttabs",
    "héllo wörld, naïve café, Ærøskøbing",
    "日本語のテキスト、中文，한국어",
    "emoji 🙂🚀 and a ZWJ family 👨‍👩‍👧",
    "numbers 1234567890 3.14159 -42 1e-5",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # square\n",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Japan?"},
        {"role": "assistant", "content": "Tokyo"},
        {"role": "user", "content": "And of Italy? ünïcödé"},
    ],
]


@pytest.fixture(scope="module")
def checkpoint(smollm_path):
    return GGUFCheckpoint(smollm_path)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_gives_transformers_token_ids(checkpoint, hf_smollm_tokenizer, text):
    ours = checkpoint.tokenizer.tokenizer

    assert ours.encode(text).ids == hf_smollm_tokenizer(text)["input_ids"]
    assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_renders_like_transformers(checkpoint, hf_smollm_tokenizer, messages):
    ours = render_chat(checkpoint.tokenizer.chat_template, messages, add_generation_prompt=True)

    assert ours == hf_smollm_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_chat_template_raise_exception_becomes_a_chat_template_error():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"

    with pytest.raises(ChatTemplateError, match="user first"):
        render_chat(template, [{"role": "assistant", "content": "hi"}])


def test_model_info_from_gguf_metadata(checkpoint):
    settings = load_settings(model=str(checkpoint.path), max_model_len=1024, served_model_name="smol")

    info = model_info(checkpoint, settings)

    assert (info.name, info.max_model_len, info.vocab_size) == ("smol", 1024, 49152)
    assert (info.eos_token_ids, info.bos_token_id, info.add_bos_token) == ([2], 1, False)
    assert info.chat_template == checkpoint.tokenizer.chat_template
    assert info.tokenizer_json == checkpoint.tokenizer.tokenizer.to_str()


def test_model_length_is_the_models_own_when_not_capped(checkpoint):
    assert model_info(checkpoint, load_settings(model=str(checkpoint.path))).max_model_len == 8192


def test_folder_tokenizer_reads_tokenizer_json_and_the_chat_template(hf_smollm_tokenizer, tmp_path):
    hf_smollm_tokenizer.save_pretrained(tmp_path)

    info = tokenizer_from_folder(tmp_path, {"eos_token_id": 2, "bos_token_id": 1})

    assert info.tokenizer.encode(TEXTS[6]).ids == hf_smollm_tokenizer(TEXTS[6])["input_ids"]
    assert info.chat_template == hf_smollm_tokenizer.chat_template
    assert info.eos_token_ids == [2] and info.bos_token_id == 1
