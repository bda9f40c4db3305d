"""A GGUF file's SentencePiece vocabulary (`tokenizer.ggml.model == "llama"`) as a `tokenizers.Tokenizer`.

The construction is transformers' (5.23, `transformers/integrations/gguf/gguf_tokenizer_mapping.py`, which hands
the vocabulary to its `LlamaTokenizer` and `GemmaTokenizer`), and the `tokenizer.json` transformers' converter
writes for Llama 2 and Mistral: a BPE model with byte fallback (`<0x0A>` and the like stand for the bytes no piece
spells), its merges recovered from the pieces' scores (transformers' `generate_merges`), spaces spelled `▁`; the
decoder turns `▁` back into spaces, byte tokens into bytes, and drops the space the encoder put in front.

The space in front follows `tokenizer.ggml.add_space_prefix` (default true, as in llama.cpp) and is a normalizer
(`Prepend("▁")`), not the `Metaspace` pre-tokenizer transformers' `LlamaTokenizer` uses: a text that starts with
spaces gets one more, as SentencePiece and llama.cpp give it (`"  hi"` is `▁▁▁hi`; `Metaspace` makes it `▁▁hi`), and
the text after each special token gets it too, as llama.cpp's SentencePiece tokenizer does. transformers builds
Phi-3's this way; for Llama and Mistral it differs from SentencePiece on a text that starts with a space.

Gemma's files (architectures gemma, gemma2, gemma3) get transformers' two fixes: tokens of two or more spaces that
the file spells with real spaces (llama.cpp's converter writes its user-defined pieces so) are spelled with `▁`, and
the merges are ordered by the tokens' place in the file, not by their scores. The caller adds the user-defined ones
as tokens matched whole in the text (`normalized`: in the text as spelled with `▁`), as llama.cpp and SentencePiece
match them, so a run of more spaces than the longest such token splits as theirs does.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers

SPACE = "\u2581"  # ▁, SentencePiece's spelling of a space
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def sentencepiece_bpe(
    tokens: list[str],
    scores: list[float] | None,
    *,
    add_space_prefix: bool = True,
    unknown_token: str | None = None,
    architecture: str | None = None,
) -> Tokenizer:
    """The tokenizer of a SentencePiece BPE vocabulary; special tokens are for the caller to add."""
    tokens = gguf_pieces(tokens, architecture)
    if architecture in GEMMA_ARCHITECTURES:
        merge_order = {token: -index for index, token in enumerate(tokens)}
    elif scores:
        merge_order = dict(zip(tokens, scores))
    else:  # no scores: earlier pieces merge first, as SentencePiece numbers them
        merge_order = {token: -index for index, token in enumerate(tokens)}
    vocab = {token: index for index, token in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab,
        merges=merges_from_scores(vocab, merge_order),
        unk_token=unknown_token,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    spaces = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if add_space_prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def gguf_pieces(tokens: list[str], architecture: str | None) -> list[str]:
    """The vocabulary as the tokenizer spells it: Gemma's tokens of spaces with `▁`."""
    if architecture not in GEMMA_ARCHITECTURES:
        return list(tokens)
    return [SPACE * len(token) if " " in token and not token.strip() else token for token in tokens]


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best-scoring piece first (transformers'
    `generate_merges`, as its SentencePiece extractor recovers a BPE model's merges)."""
    merges = []
    for piece, score in scores.items():
        splits = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))]
        pairs = [(left, right) for left, right in splits if left in vocab and right in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, score) for left, right in pairs)
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
