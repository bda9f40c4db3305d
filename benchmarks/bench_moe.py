"""A mixture of experts' decode step against a dense model with the same active parameters, on the custom CPU
kernels in the same precision: Qwen3-MoE of 64 experts, 8 chosen per token (each expert's MLP `--expert-width`
wide), and Qwen3 whose MLP is 8 experts wide; the same attention, embedding and lm_head; random weights from
transformers (no download). The two take turns step by step in one process (bench_worker.py's timing); shown: the
median step and its MLP part (the router and bs_moe_experts, or the dense gate|up, SiLU and down), and their ratios.

At 16 sequences a step's 128 choices touch ~55 of the 64 experts of a layer (64 * (1 - (63/64)^128)): the experts'
GEMMs read ~7x the dense MLP's weights, so where the step is bound by reading weights the MLP cannot be as fast.

Run: OMP_NUM_THREADS=2 python benchmarks/bench_moe.py [--steps N] [--layers N] [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_worker's timing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_worker  # noqa: E402
import torch  # noqa: E402

from service.contract.config import default_model_path, load_settings  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402

NUM_EXPERTS, TOP_K = 64, 8
SHAPE = dict(
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=2048,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
BATCHES = (1, 16)


def save_models(root: Path, layers: int, expert_width: int, tokenizer) -> dict[str, Path]:
    """The MoE model and its dense peer (the same shape, its MLP TOP_K experts wide), saved under `root`."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    configs = {
        "moe": Qwen3MoeConfig(
            **SHAPE,
            num_hidden_layers=layers,
            intermediate_size=TOP_K * expert_width,
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=expert_width,
            norm_topk_prob=True,
        ),
        "dense": Qwen3Config(**SHAPE, num_hidden_layers=layers, intermediate_size=TOP_K * expert_width),
    }
    folders = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        folders[name] = root / name
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    return folders


def subject(name: str, folder: Path, dtype: str) -> bench_worker.Subject:
    settings = load_settings(model=os.fspath(folder), num_kv_blocks=512, kernels="custom", dtype=dtype)
    runner = ModelRunner(settings)
    weight_bytes = runner.model.weight_bytes()
    timers = bench_worker.Timers()
    runner.model._mlp = timers.wrap("mlp", runner.model._mlp)  # both run op by op (q/k norms): every layer's MLP
    return bench_worker.Subject(name, runner, timers, bench_worker.Workload(runner), weight_bytes)


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=9, help="timed steps per case (the median is shown)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--expert-width", type=int, default=384, help="each expert's moe_intermediate_size")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    gguf = Path(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(os.fspath(gguf.parent), gguf_file=gguf.name)
    with tempfile.TemporaryDirectory() as root:
        folders = save_models(Path(root), args.layers, args.expert_width, tokenizer)
        subjects = [subject(name, folder, args.dtype) for name, folder in folders.items()]
    probe = bench_worker.ReadProbe()
    rows = {}
    for batch in BATCHES:
        medians = bench_worker.time_decode(subjects, batch, args.steps, probe)
        rows[batch] = {s.name: (seconds, parts.get("mlp", 0.0)) for s, (seconds, parts) in zip(subjects, medians)}
    print(f"CPU: {bench_worker.cpu_name()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, {args.dtype}")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} (the machine is shared)")
    print(
        f"{args.layers} layers, hidden {SHAPE['hidden_size']}: MoE {NUM_EXPERTS} experts x {args.expert_width}, top "
        f"{TOP_K}; dense MLP {TOP_K * args.expert_width}; weights MoE "
        f"{subjects[0].weight_bytes / 2**20:.0f} MiB, dense {subjects[1].weight_bytes / 2**20:.0f} MiB"
    )
    print(
        f"{'decode':10} {'MoE step':>10} {'dense step':>11} {'ratio':>6} {'MoE MLP':>10} {'dense MLP':>10} {'ratio':>6}"
    )
    for batch, row in rows.items():
        (moe_step, moe_mlp), (dense_step, dense_mlp) = row["moe"], row["dense"]
        print(
            f"B={batch:<8} {moe_step * 1e3:7.2f} ms {dense_step * 1e3:8.2f} ms {moe_step / dense_step:5.2f}x "
            f"{moe_mlp * 1e3:7.2f} ms {dense_mlp * 1e3:7.2f} ms {moe_mlp / dense_mlp:5.2f}x"
        )


if __name__ == "__main__":
    main()
