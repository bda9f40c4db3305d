"""A tiny model for the api's tests: a byte-level BPE tokenizer trained here and its ModelInfo."""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from service.contract import wire

MODEL_NAME = "tiny-test-model"
MAX_MODEL_LEN = 128
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN_ID = 2  # <|im_end|>
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. Hello world! Hello there, world.",
    "Once upon a time a small model served tokens to many clients, one block at a time.",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, emoji 🙂🚀.",
]


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE: characters outside its few merges span several tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return tokenizer


def tiny_model_info() -> wire.ModelInfo:
    tokenizer = tiny_tokenizer()
    return wire.ModelInfo(
        name=MODEL_NAME,
        max_model_len=MAX_MODEL_LEN,
        vocab_size=tokenizer.get_vocab_size(),
        eos_token_ids=[EOS_TOKEN_ID],
        bos_token_id=None,
        tokenizer_json=tokenizer.to_str(),
        chat_template=CHAT_TEMPLATE,
    )
