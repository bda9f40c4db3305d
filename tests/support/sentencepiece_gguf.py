"""Tiny SentencePiece BPE models trained here (byte fallback on, ~300 pieces) and their vocabularies written into a
GGUF file's `tokenizer.*` keys the way llama.cpp's converter writes them (`_create_vocab_sentencepiece`): pieces,
scores, token types, the special ids and `add_space_prefix`."""

from __future__ import annotations

import io
from pathlib import Path

import gguf
import sentencepiece

TRAINING_TEXT = (Path(__file__).resolve().parents[1] / "data" / "english_text.txt").read_text(encoding="utf-8")
VOCAB_SIZE = 500
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
# Llama 2's numbering (unk, bos, eos first) and Gemma's (pad, eos, bos, unk), with Gemma's turn markers and its runs
# of 2 to 31 spaces user-defined.
LLAMA_STYLE = dict(
    unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True, user_defined_symbols=[], control_symbols=[]
)
GEMMA_STYLE = dict(
    pad_id=0,
    eos_id=1,
    bos_id=2,
    unk_id=3,
    add_dummy_prefix=False,
    user_defined_symbols=["<start_of_turn>", "<end_of_turn>", *("\u2581" * n for n in range(2, 32))],
    control_symbols=["<mask>"],
    pad_piece="<pad>",
    bos_piece="<bos>",
    eos_piece="<eos>",
)


def train_sentencepiece(style: dict) -> sentencepiece.SentencePieceProcessor:
    """A BPE model of VOCAB_SIZE pieces trained on the test English text, in `style`'s numbering."""
    lines = [line for line in TRAINING_TEXT.splitlines() if line.strip()]
    lines += ["naïve café 1234567890", "def f(x):\n    return x", "Hello  world\n\nagain"]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        byte_fallback=True,
        character_coverage=1.0,
        remove_extra_whitespaces=False,
        split_digits=True,
        normalization_rule_name="identity",
        minloglevel=2,
        **style,
    )
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


def token_type(
    processor: sentencepiece.SentencePieceProcessor, token_id: int, user_defined: set[str]
) -> gguf.TokenType:
    if processor.IsUnknown(token_id):
        return gguf.TokenType.UNKNOWN
    if processor.IsControl(token_id):
        return gguf.TokenType.CONTROL
    if processor.IsUnused(token_id):
        return gguf.TokenType.UNUSED
    if processor.IsByte(token_id):
        return gguf.TokenType.BYTE
    if processor.IdToPiece(token_id) in user_defined:
        return gguf.TokenType.USER_DEFINED
    return gguf.TokenType.NORMAL


def add_sentencepiece_tokenizer(
    writer: gguf.GGUFWriter,
    processor: sentencepiece.SentencePieceProcessor,
    style: dict,
    *,
    spaces_as_spaces: bool = False,
    space_runs_user_defined: bool = True,
    scores: bool = True,
) -> None:
    """The model's vocabulary, trained in `style`, under llama.cpp's tokenizer keys. `spaces_as_spaces` spells pieces
    of only `▁` with real spaces, as llama.cpp's converter writes Gemma's user-defined ones; without
    `space_runs_user_defined` those are typed normal; without `scores` every score is 0."""
    pieces = [processor.IdToPiece(i) for i in range(processor.GetPieceSize())]
    if spaces_as_spaces:
        pieces = [" " * len(p) if len(p) > 1 and set(p) == {"\u2581"} else p for p in pieces]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(pieces)
    writer.add_token_scores([processor.GetScore(i) if scores else 0.0 for i in range(len(pieces))])
    user_defined = set(style["user_defined_symbols"])
    if not space_runs_user_defined:
        user_defined = {piece for piece in user_defined if set(piece) != {"\u2581"}}
    writer.add_token_types([token_type(processor, i, user_defined) for i in range(len(pieces))])
    writer.add_bos_token_id(processor.bos_id())
    writer.add_eos_token_id(processor.eos_id())
    writer.add_unk_token_id(processor.unk_id())
    if processor.pad_id() >= 0:
        writer.add_pad_token_id(processor.pad_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(style["add_dummy_prefix"])
    writer.add_chat_template(CHAT_TEMPLATE)


def write_tokenizer_gguf(path: Path, architecture: str, style: dict, **options) -> sentencepiece.SentencePieceProcessor:
    """A GGUF file of `architecture` holding only a trained model's tokenizer keys; the model, for reference."""
    processor = train_sentencepiece(style)
    writer = gguf.GGUFWriter(str(path), architecture)
    add_sentencepiece_tokenizer(writer, processor, style, **options)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return processor


def write_tiny_llama_gguf(path: Path, style: dict) -> sentencepiece.SentencePieceProcessor:
    """A tiny random Llama (2 layers, hidden 32) whose vocabulary is a SentencePiece model trained here, as one
    GGUF file in float32; the SentencePiece model, for reference."""
    import numpy as np

    from tests.support.family_gguf import _write_keys

    processor = train_sentencepiece(style)
    vocab, hidden, ffn, heads, kv_heads, head_dim, layers = processor.GetPieceSize(), 32, 64, 4, 2, 8, 2
    config = dict(
        max_position_embeddings=256,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
    )
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.2, shape).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    _write_keys(writer, "llama", config)
    add_sentencepiece_tokenizer(writer, processor, style)
    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    for layer in range(layers):
        norms = ("attn_norm", "ffn_norm")
        shapes = dict(
            attn_q=(heads * head_dim, hidden),
            attn_k=(kv_heads * head_dim, hidden),
            attn_v=(kv_heads * head_dim, hidden),
            attn_output=(hidden, heads * head_dim),
            ffn_gate=(ffn, hidden),
            ffn_up=(ffn, hidden),
            ffn_down=(hidden, ffn),
        )
        for name in norms:
            writer.add_tensor(f"blk.{layer}.{name}.weight", np.ones(hidden, np.float32))
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{layer}.{name}.weight", weight(*shape))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output.weight", weight(vocab, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return processor
