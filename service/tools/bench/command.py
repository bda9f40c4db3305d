"""`blockserve bench`: one trace, against a server or through the simulator."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

from service.tools.workload import NAMED_WORKLOADS, LengthDistribution, TenantMix, Workload, make_trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of an OpenAI-compatible server")
    parser.add_argument("--model", default=None, help="model name; default: the first of /v1/models")
    parser.add_argument("--workload", choices=sorted(NAMED_WORKLOADS) + ["custom"], default="chat")
    parser.add_argument("--input-len", type=int, default=128, help="custom workload: mean prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="custom workload: mean output tokens")
    parser.add_argument("--length-kind", choices=["fixed", "uniform", "chat"], default="fixed")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf = all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=32_000, help="prompt token ids are drawn below this")
    parser.add_argument(
        "--shared-prefixes", type=int, default=0, help="each prompt starts with one of this many common prefixes"
    )
    parser.add_argument("--shared-prefix-len", type=int, default=256, help="tokens of each common prefix")
    parser.add_argument(
        "--tenant",
        action="append",
        type=TenantMix.parse,
        default=[],
        metavar="NAME:SHARE[:RATE[:WEIGHT]]",
        help="a tenant of the trace (repeat for each): its share of the requests, its own arrival rate (default: "
        "the trace's times its share) and, for --simulate, its weight; sent as OpenAI's `user`, reported apart",
    )
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let requests stop at EOS")
    # Greedy by default; a server's draw (temperature, top_p, top_k) costs what greedy does not.
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    parser.add_argument("--top-p", type=float, default=None, help="top_p of every request (default: not sent)")
    parser.add_argument("--top-k", type=int, default=None, help="top_k of every request (default: not sent)")
    parser.add_argument(
        "--json-schema",
        type=json_schema_argument,
        default=None,
        metavar="JSON|@PATH",
        help="constrain every request's output to this JSON Schema (sent as response_format; requests then stop at "
        "EOS: to measure a fixed output length, give a schema whose texts are longer than --output-len)",
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--metrics-url", default=None, help="scheduler /metrics to sample (KV usage, preemptions)")
    parser.add_argument("--result-dir", type=Path, default=None, help="write result.json and PNG plots here")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--simulate", action="store_true", help="run the trace through the simulator instead")
    parser.add_argument(
        "--num-blocks", type=int, default=2048, help="--simulate: KV blocks of the simulated accelerator"
    )


def build_trace(args: argparse.Namespace):
    if args.workload == "custom":
        lengths = (
            LengthDistribution(args.length_kind, args.input_len),
            LengthDistribution(args.length_kind, args.output_len),
        )
    else:
        lengths = NAMED_WORKLOADS[args.workload]
    return make_trace(
        Workload(
            args.num_requests,
            *lengths,
            args.request_rate,
            args.burstiness,
            vocab_size=args.vocab_size,
            seed=args.seed,
            num_shared_prefixes=args.shared_prefixes,
            shared_prefix_len=args.shared_prefix_len if args.shared_prefixes else 0,
            tenants=tuple(args.tenant),
        )
    )


def json_schema_argument(text: str) -> dict:
    """--json-schema: a JSON Schema object, as JSON text or `@path` of a file holding it."""
    try:
        schema = json.loads(Path(text[1:]).read_text() if text.startswith("@") else text)
    except (OSError, json.JSONDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"not a JSON Schema: {exc}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError("a JSON Schema is an object")
    return schema


def sampling_fields(args: argparse.Namespace) -> dict:
    """The sampling fields every request sends: temperature, top_p / top_k where given, and the JSON Schema as
    response_format where given."""
    fields = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    if args.json_schema is not None:
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": args.json_schema, "strict": True},
        }
    return {name: value for name, value in fields.items() if value is not None}


def ignores_eos(args: argparse.Namespace) -> bool:
    """Whether requests ask to run past EOS: not when a schema constrains them (the grammar decides the end)."""
    return args.ignore_eos and args.json_schema is None


def run(args: argparse.Namespace) -> int:
    trace = build_trace(args)
    result = _simulate(args, trace) if args.simulate else asyncio.run(_serve(args, trace))
    if args.result_dir is not None:
        args.result_dir.mkdir(parents=True, exist_ok=True)
        (args.result_dir / "result.json").write_text(json.dumps(result, indent=2))
        print(f"results in {args.result_dir}")
    return 0


def _simulate(args: argparse.Namespace, trace) -> dict:
    from service.contract.config import load_settings
    from service.scheduler.scheduler import SchedulerConfig
    from service.scheduler.split_table import split_table_config_from
    from service.tools.simulator import simulate

    settings = load_settings()
    config = SchedulerConfig.from_settings(settings, args.num_blocks)
    report = simulate(
        trace, config, split_table=split_table_config_from(settings), overlapped=settings.async_scheduling
    ).as_dict()
    print(json.dumps(report, indent=2))
    return {"mode": "simulate", "workload": args.workload, "report": report}


async def _serve(args: argparse.Namespace, trace) -> dict:
    import time

    from service.tools.bench.client import first_model, run_trace
    from service.tools.bench.metrics_sampler import MetricsTimeline, sample_until
    from service.tools.bench.report import format_report, summarize

    model = args.model or await first_model(args.url)
    timeline, stop, first_sample = MetricsTimeline(), asyncio.Event(), asyncio.Event()
    sampler = None
    if args.metrics_url:
        sampler = asyncio.create_task(
            sample_until(args.metrics_url, stop, first_sample, timeline, 0.5, time.perf_counter())
        )
        await first_sample.wait()  # the baseline, so counter deltas cover exactly this run
    timings, started, finished = await run_trace(
        args.url, model, trace, ignores_eos(args), args.max_concurrency, args.timeout_s, sampling_fields(args)
    )
    if sampler is not None:
        stop.set()
        await sampler
    slo = {name: limit / 1000 for name, limit in (("ttft", args.slo_ttft_ms), ("tpot", args.slo_tpot_ms)) if limit}
    report = summarize(timings, finished - started, slo)
    print(format_report(report))
    result = {
        "mode": "serve",
        "url": args.url,
        "model": model,
        "workload": args.workload,
        "sampling": sampling_fields(args),
        "report": report.as_dict(),
    }
    if args.metrics_url:
        result["server"] = {
            name: timeline.delta(name) for name in ("preemptions", "recomputed_tokens", "generation_tokens")
        }
        if timeline.delta("constrained_step_s") > 0:  # the grammar masks' share of the steps that had them
            share = timeline.delta("grammar_mask_s") / timeline.delta("constrained_step_s")
            result["server"]["grammar_mask_share"] = share
            print(f"grammar masks: {100 * share:.1f}% of the worker time of steps with constrained rows")
        result["server"]["max_kv_usage"] = max(timeline.series["kv_usage"], default=0.0)
        print(f"server: {result['server']}")
    if args.result_dir is not None:
        from service.tools.bench.plots import kv_timeline, latency_cdfs

        args.result_dir.mkdir(parents=True, exist_ok=True)
        latency_cdfs(timings, args.result_dir / "latency_cdf.png")
        if timeline.times_s:
            kv_timeline(timeline, args.result_dir / "kv_usage.png")
    return result
