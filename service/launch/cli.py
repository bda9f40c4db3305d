"""`blockserve` command line: one subcommand per role, plus tools."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time

from service.contract.config import Settings, SettingsError, check_setting_names, load_settings
from service.contract.configuration_exit import (
    ConfigurationError,
    configuration_error_line,
    end_with_configuration_error,
)

log = logging.getLogger("blockserve")


def _configure_logging(role: str) -> None:
    logging.basicConfig(
        level=os.environ.get("BLOCKSERVE_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
    )


def _start_role(role: str, settings: Settings) -> None:
    log.info("effective settings: %s", settings.redacted())
    if role == "scheduler":
        from service.scheduler.server import run_scheduler

        run_scheduler(settings)
    elif role == "worker":
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        from worker.process import run_worker

        run_worker(settings)
    else:
        from service.api.app import run_api

        run_api(settings)


def _role(args: argparse.Namespace) -> int:
    _configure_logging(args.command)
    settings = load_settings()
    check_setting_names(settings)
    _start_role(args.command, settings)
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Run scheduler, worker and api as child processes (see service/launch/supervisor.py) until SIGINT/SIGTERM, or until
    a role ends with a configuration error: then exit with its line and status."""
    from service.launch.supervisor import Supervisor, role_environments

    if args.strict_settings:
        os.environ["BLOCKSERVE_STRICT_SETTINGS"] = "1"  # for the roles too: they inherit it
    _configure_logging("serve")
    settings = load_settings()
    unknown = set(check_setting_names(settings))
    # Named once here: the roles would name them again.
    inherited = {name: value for name, value in os.environ.items() if name not in unknown}
    supervisor = Supervisor(role_environments(inherited, settings.scheduler_addr, settings.worker_addr))
    stop_requested = False

    def request_stop(*_: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    supervisor.start()
    log.info("serving on http://%s:%d (metrics on :%d)", settings.host, settings.port, settings.metrics_port)
    configuration_error = None
    while not (stop_requested or configuration_error):
        time.sleep(0.2)
        configuration_error = supervisor.check(time.monotonic())
    log.info("stopping: in-flight requests get %.0f s to finish", settings.drain_timeout_s)
    supervisor.stop(settings.drain_timeout_s)
    return end_with_configuration_error(configuration_error) if configuration_error else 0


def _keys(args: argparse.Namespace) -> int:
    """Print a new set of CURVE key pairs as the entries of the chart's keys Secret, or (inside a pod)
    make that Secret unless it exists."""
    from service.contract.socket_auth import KEY_OWNERS, new_key_pair, secret_entries

    entries = secret_entries({owner: new_key_pair() for owner in KEY_OWNERS})
    if args.kubernetes_secret:
        from service.launch.kube_secret import KubernetesError, create_secret_once

        try:
            created = create_secret_once(args.kubernetes_secret, entries, dict(args.label))
        except KubernetesError as exc:
            print(f"blockserve keys: {exc}", file=sys.stderr)
            return 1
        print(f"Secret {args.kubernetes_secret}: {'created' if created else 'exists already, left as it is'}")
        return 0
    for name, value in entries.items():
        print(f"{name}={value}")
    return 0


def _label(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not (key and equals):
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _simulate(args: argparse.Namespace) -> int:
    from service.scheduler.scheduler import SchedulerConfig
    from service.scheduler.split_table import SplitTableConfig
    from service.tools.simulator import CostModel, simulate
    from service.tools.workload import NAMED_WORKLOADS, Workload, make_trace

    settings = load_settings()
    input_lengths, output_lengths = NAMED_WORKLOADS[args.workload]
    workload = Workload(
        args.num_requests,
        input_lengths,
        output_lengths,
        args.request_rate,
        args.burstiness,
        seed=args.seed,
        high_priority_share=args.high_priority_share,
    )
    trace = make_trace(workload)
    runs = [(policy, policy, None) for policy in (["lifo", "min_recompute"] if args.policy == "all" else [args.policy])]
    runs += [
        (
            f"legacy@{ratio}",
            settings.preemption_policy,
            SplitTableConfig(ratio, settings.legacy_dec_blocks, settings.legacy_disable_recover),
        )
        for ratio in args.legacy_ratios
    ]
    rows = []
    for label, policy, split_table in runs:
        config = SchedulerConfig.from_settings(settings, args.num_blocks, preemption_policy=policy)
        report = simulate(trace, config, CostModel(), split_table, overlapped=settings.async_scheduling)
        rows.append({"scheduler": label, **report.as_dict()})
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
    else:
        for row in rows:
            print(
                f"{row['scheduler']:>14}: {row['output_tokens_per_s']:9.1f} output tok/s  "
                f"{row['num_preemptions']:6d} preemptions  {row['num_recomputed_tokens']:9d} recomputed tokens  "
                f"KV usage {row['mean_kv_usage']:.2f}  TTFT p50/p99 {row['ttft_p50_s']:.3f}/{row['ttft_p99_s']:.3f} s  "
                f"TPOT p50/p99 {1000 * row['tpot_p50_s']:.1f}/{1000 * row['tpot_p99_s']:.1f} ms  "
                f"finished {row['num_finished']}/{row['num_requests']} (failed {row['num_failed']}, rejected {row['num_rejected']})"
            )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run scheduler, worker and api on this machine")
    serve.add_argument(
        "--strict-settings",
        action="store_true",
        help="refuse to start on a BLOCKSERVE_ variable that names no setting (BLOCKSERVE_STRICT_SETTINGS=1)",
    )
    serve.set_defaults(handler=_serve)
    keys = commands.add_parser(
        "keys",
        help="print new CURVE keys for the scheduler, api and worker "
        "(kubectl create secret generic NAME --from-env-file=<that output>)",
    )
    keys.add_argument(
        "--kubernetes-secret",
        metavar="NAME",
        help="inside a pod: create Secret NAME in its namespace with new keys unless it exists (the chart's Job)",
    )
    keys.add_argument(
        "--label",
        action="append",
        default=[],
        type=_label,
        metavar="KEY=VALUE",
        help="a label of that Secret (repeatable)",
    )
    keys.set_defaults(handler=_keys)
    for role, description in (
        ("api", "the OpenAI-compatible HTTP service (stateless; run as many as you like)"),
        ("scheduler", "the sidecar that owns the KV-cache block table"),
        ("worker", "the model and its paged KV cache"),
    ):
        commands.add_parser(role, help=description).set_defaults(handler=_role)

    sim = commands.add_parser("simulate", help="run a synthetic trace through the scheduler, no model")
    sim.add_argument("--workload", choices=["long-output", "long-input", "chat", "fixed"], default="chat")
    sim.add_argument("--num-requests", type=int, default=1000)
    sim.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf = all at once")
    sim.add_argument("--burstiness", type=float, default=1.0)
    sim.add_argument("--num-blocks", type=int, default=2048, help="KV-cache blocks of the simulated accelerator")
    sim.add_argument("--policy", choices=["lifo", "min_recompute", "all"], default="all")
    sim.add_argument(
        "--legacy-ratios",
        type=lambda text: [float(r) for r in text.split(",") if r],
        default=[],
        help="also run the legacy split-table scheduler at these KV_CACHE_RATIO values, e.g. 0.5,0.75",
    )
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument(
        "--high-priority-share", type=float, default=0.0, help="share of requests with priority -1 (the rest 0)"
    )
    sim.add_argument("--json", action="store_true", help="print the reports as JSON")
    sim.set_defaults(handler=_simulate)

    from service.tools.bench import command as bench_command

    bench = commands.add_parser(
        "bench", help="benchmark an OpenAI-compatible server (or the simulator) on a seeded trace"
    )
    bench_command.add_arguments(bench)
    bench.set_defaults(handler=bench_command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (SettingsError, ConfigurationError) as exc:
        return end_with_configuration_error(configuration_error_line(args.command, exc))


if __name__ == "__main__":
    sys.exit(main())
