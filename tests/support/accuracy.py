"""How close a worker precision (BLOCKSERVE_DTYPE, BLOCKSERVE_QUANTIZATION) computes to float32 on the same
model: the mean KL divergence of the next-token distributions over a fixed English text, and the greedy
tokens on the 8 reference prompts, teacher-forced on float32's own continuation (agreement per token)
and free-running (continuations identical to float32's)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.contract import wire
from service.contract.config import load_settings
from tests.support.model_engine import LocalEngine
from worker.inputs.step_inputs import RequestState, build_step_inputs
from worker.model_runner import ModelRunner

ENGLISH_TEXT = (Path(__file__).resolve().parents[1] / "data" / "english_text.txt").read_text(encoding="utf-8")
REFERENCE_PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter who",
    "Les trois couleurs primaires sont",
    "Water boils at a temperature of",
    "日本の首都は東京です。大阪は",
    "List three uses of a paperclip, then explain which one is the most surprising and why:",
    "import numpy as np\n",
]
NUM_GREEDY_TOKENS = 32
NUM_KV_BLOCKS = 128


def load_runner(
    model_path: Path, precision: str, kernels: str = "custom", cpu_isa: str = "auto", onednn: str = "auto"
) -> ModelRunner:
    """A runner for `precision` = DTYPE:QUANTIZATION[:KV_CACHE_DTYPE] (e.g. bfloat16:none, auto:int8,
    bfloat16:none:int8), its custom CPU kernels capped at `cpu_isa` (BLOCKSERVE_CPU_ISA), BLOCKSERVE_ONEDNN=`onednn`."""
    dtype, quantization, kv_cache_dtype = (precision.split(":") + ["auto"])[:3]
    settings = load_settings(
        model=os.fspath(model_path),
        num_kv_blocks=NUM_KV_BLOCKS,
        kernels=kernels,
        cpu_isa=cpu_isa,
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        onednn=onednn,
    )
    return ModelRunner(settings)


def encode(runner: ModelRunner, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(runner.model_info.tokenizer_json).encode(text).ids


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


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


KL_ROWS_AT_ONCE = 16  # positions per pass: float64 arrays of a few MB, not one of ~180 MB (fresh pages cost here)


def mean_kl_nats(reference_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean over positions of KL(reference || candidate) of the next-token distributions, in nats."""
    total = 0.0
    for start in range(0, len(logits), KL_ROWS_AT_ONCE):
        rows = slice(start, start + KL_ROWS_AT_ONCE)
        reference, candidate = log_softmax(reference_logits[rows]), log_softmax(logits[rows])
        total += float((np.exp(reference) * (reference - candidate)).sum())
    return total / len(logits)


def greedy_continuations(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy continuation, the prompts decoded together through the real scheduler."""
    engine = LocalEngine(runner, max_num_batched_tokens=256)
    greedy = wire.SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add(f"p{index}", prompt, greedy)
    outputs = engine.run()
    return [outputs[f"p{index}"] for index in range(len(prompts))]


@dataclass(frozen=True)
class Accuracy:
    mean_kl_nats: float  # on ENGLISH_TEXT
    greedy_agreement: float  # share of float32's greedy tokens this precision also picks, given the same prefix
    identical_continuations: int  # of the reference prompts, free-running


class Float32Reference:
    """float32's logits on the text and greedy continuations of the prompts, computed once."""

    def __init__(self, runner: ModelRunner):
        self.text_ids = encode(runner, ENGLISH_TEXT)
        self.text_logits = paged_logits(runner, self.text_ids, chunk_size=128)
        self.prompts = [encode(runner, prompt) for prompt in REFERENCE_PROMPTS]
        self.continuations = greedy_continuations(runner, self.prompts)

    def accuracy_of(self, runner: ModelRunner) -> Accuracy:
        kl = mean_kl_nats(self.text_logits, paged_logits(runner, self.text_ids, chunk_size=128))
        agreed = 0
        for prompt, continuation in zip(self.prompts, self.continuations):
            logits = paged_logits(runner, prompt + continuation, chunk_size=128)
            picked = logits[len(prompt) - 1 : -1].argmax(axis=-1)
            agreed += int((picked == np.array(continuation)).sum())
        identical = sum(
            ours == theirs for ours, theirs in zip(greedy_continuations(runner, self.prompts), self.continuations)
        )
        return Accuracy(kl, agreed / (len(self.prompts) * NUM_GREEDY_TOKENS), identical)
