"""Step time of each model family against Llama's fused path at the same size (SmolLM2-135M's shape), on the custom
CPU kernels: random weights from transformers (no download), the families taking turns step by step as in
bench_worker.py (whose cases and timing this reuses), ratios to the fused Llama of the same dtype.

Llama-shaped families (Phi-3, ERNIE 4.5, Mistral or Qwen without a window shorter than the served length) run the
fused decoder stack; the others run op by op over the same kernels ("llama op by op" shows what fusing alone is
worth). A sliding window shorter than the served length ("gemma3 window": 128 keys on its sliding layers) is the
custom attention's own.

Run: OMP_NUM_THREADS=2 python benchmarks/bench_families.py [--steps N] [--families NAME ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_worker's cases and timers
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_worker  # noqa: E402
import torch  # noqa: E402

from service.contract.config import default_model_path, load_settings  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=2048,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MAX_MODEL_LEN = 1024
# name -> (transformers config class name, its settings beyond the shape, dtype, layers fused)
SUBJECTS = {
    "llama": ("LlamaConfig", {}, "bfloat16", True),
    "llama op by op": ("LlamaConfig", {}, "bfloat16", False),
    "qwen3": ("Qwen3Config", {}, "bfloat16", True),
    "phi3": ("Phi3Config", {}, "bfloat16", True),
    "olmo2": ("Olmo2Config", {}, "bfloat16", True),
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22), "bfloat16", True),
    "smollm3": ("SmolLM3Config", {}, "bfloat16", True),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=MAX_MODEL_LEN, query_pre_attn_scalar=64), "bfloat16", True),
    "llama f32": ("LlamaConfig", {}, "float32", True),
    "gemma3 window": ("Gemma3TextConfig", dict(sliding_window=128, query_pre_attn_scalar=64), "bfloat16", True),
}
CASES = ((1, "decode"), (8, "decode"), (1, "prefill"))
PREFILL_LEN = 256


def save_model(config_name: str, settings: dict, folder: Path, tokenizer) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**SMOLLM2_135M, **settings)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def subject(name: str, folder: Path) -> bench_worker.Subject:
    _, _, dtype, fused = SUBJECTS[name]
    settings = load_settings(
        model=os.fspath(folder), num_kv_blocks=512, kernels="custom", dtype=dtype, max_model_len=MAX_MODEL_LEN
    )
    runner = ModelRunner(settings)
    runner.model.kernels.fuse_layers = fused
    weight_bytes = runner.model.weight_bytes()  # before the timers wrap the layers' linears
    timers = bench_worker.Timers()
    bench_worker.instrument(runner, timers)
    return bench_worker.Subject(name, runner, timers, bench_worker.Workload(runner), weight_bytes)


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per case (the median is shown)")
    parser.add_argument("--families", nargs="+", default=list(SUBJECTS), choices=list(SUBJECTS))
    args = parser.parse_args()
    gguf = Path(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(os.fspath(gguf.parent), gguf_file=gguf.name)
    with tempfile.TemporaryDirectory() as root:
        subjects = []
        for name in args.families:
            folder = Path(root) / name.replace(" ", "-")
            config_name, settings, _, _ = SUBJECTS[name]
            save_model(config_name, settings, folder, tokenizer)
            subjects.append(subject(name, folder))
        fused = {
            s.name: s.runner.model.kernels.fused_stack(s.runner.attention, s.runner.model.config) for s in subjects
        }
        results = {s.name: {} for s in subjects}
        probe = bench_worker.ReadProbe()
        for batch, kind in CASES:
            if kind == "decode":
                medians = bench_worker.time_decode(subjects, batch, args.steps, probe)
            else:
                medians = bench_worker.time_prefill(subjects, batch, PREFILL_LEN, max(3, args.steps // 2))
            for s, (seconds, _) in zip(subjects, medians):
                results[s.name][f"{kind} B={batch}" if kind == "decode" else f"prefill {batch}x{PREFILL_LEN}"] = seconds
    print(f"CPU: {bench_worker.cpu_name()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    cases = list(next(iter(results.values())))
    print(f"{'family':16} {'dtype':9} {'layers':9} {'attention':10} " + " ".join(f"{c:>22}" for c in cases))
    for s in subjects:
        dtype = s.runner.kernels["dtype"]
        baseline = results["llama f32" if dtype == "float32" else "llama"] if "llama" in results else None
        cells = []
        for case in cases:
            ms = results[s.name][case] * 1e3
            ratio = f" ({results[s.name][case] / baseline[case]:.2f}x)" if baseline else ""
            cells.append(f"{ms:9.2f} ms{ratio:>10}")
        layers = "fused" if fused[s.name] is not None else "op by op"
        attention = type(s.runner.attention).__name__.replace("PagedAttention", "")
        print(f"{s.name:16} {dtype:9} {layers:9} {attention:10} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
