"""`blockserve` command line: one subcommand per role, plus tools."""

from __future__ import annotations

import argparse
import json
import math
import sys

from service.config import SettingsError, load_settings


def _simulate(args: argparse.Namespace) -> int:
    from service.scheduler.scheduler import SchedulerConfig
    from service.scheduler.simulator import CostModel, simulate
    from service.workload import NAMED_WORKLOADS, Workload, make_trace

    settings = load_settings()
    input_lengths, output_lengths = NAMED_WORKLOADS[args.workload]
    trace = make_trace(
        Workload(args.num_requests, input_lengths, output_lengths, args.request_rate, args.burstiness, seed=args.seed)
    )
    policies = ["lifo", "min_recompute"] if args.policy == "all" else [args.policy]
    rows = []
    for policy in policies:
        config = SchedulerConfig(
            num_blocks=args.num_blocks,
            block_size=settings.block_size,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=settings.max_model_len or 8192,
            enable_prefix_caching=settings.enable_prefix_caching,
            preemption_policy=policy,
        )
        report = simulate(trace, config, CostModel())
        rows.append({"policy": policy, **report.as_dict()})
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
    else:
        for row in rows:
            print(
                f"{row['policy']:>14}: {row['output_tokens_per_s']:9.1f} output tok/s  "
                f"{row['num_preemptions']:6d} preemptions  {row['num_recomputed_tokens']:9d} recomputed tokens  "
                f"KV usage {row['mean_kv_usage']:.2f}  TTFT p50/p99 {row['ttft_p50_s']:.3f}/{row['ttft_p99_s']:.3f} s  "
                f"TPOT p50/p99 {1000 * row['tpot_p50_s']:.1f}/{1000 * row['tpot_p99_s']:.1f} ms  "
                f"finished {row['num_finished']}/{row['num_requests']}"
            )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    sim = commands.add_parser("simulate", help="run a synthetic trace through the scheduler, no model")
    sim.add_argument("--workload", choices=["long-output", "long-input", "chat", "fixed"], default="chat")
    sim.add_argument("--num-requests", type=int, default=1000)
    sim.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf = all at once")
    sim.add_argument("--burstiness", type=float, default=1.0)
    sim.add_argument("--num-blocks", type=int, default=2048, help="KV-cache blocks of the simulated accelerator")
    sim.add_argument("--policy", choices=["lifo", "min_recompute", "all"], default="all")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--json", action="store_true", help="print the reports as JSON")
    sim.set_defaults(handler=_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except SettingsError as exc:
        print(f"blockserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
