"""Start blockserve processes on free loopback ports for tests, and stop them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now and never handed out before by this process (the kernel may offer a
    just-released port again: two settings of one stack would then collide)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT and port + 1 not in _HANDED_OUT:  # some stacks take port + 1 as well
            _HANDED_OUT.update((port, port + 1))
            return port


def loopback_env(**overrides: str) -> dict[str, str]:
    """An environment with fresh loopback addresses for every socket."""
    env = dict(os.environ)
    env.update(
        BLOCKSERVE_HOST="127.0.0.1",
        BLOCKSERVE_PORT=str(free_port()),
        BLOCKSERVE_SCHEDULER_ADDR=f"tcp://127.0.0.1:{free_port()}",
        BLOCKSERVE_WORKER_ADDR=f"tcp://127.0.0.1:{free_port()}",
        BLOCKSERVE_METRICS_PORT=str(free_port()),
        PYTHONUNBUFFERED="1",
    )
    env.update(overrides)
    return env


def start(args: list[str], env: dict[str, str], log_path: Path, cwd: Path = ROOT) -> subprocess.Popen:
    """`python *args` from `cwd` (this checkout; another one's folder runs that checkout's code)."""
    log = open(log_path, "ab")
    return subprocess.Popen([sys.executable, *args], env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen, timeout_s: float = 10) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def stop_all(processes) -> None:
    """Stop in drain order, as `blockserve serve` does: api replicas, then scheduler, then workers."""

    def rank(process: subprocess.Popen) -> int:
        args = " ".join(map(str, process.args))
        return 0 if args.endswith(" api") else 1 if args.endswith(" scheduler") else 2

    for process in sorted(processes, key=rank):
        stop(process)


def wait_ready(base_url: str, timeout_s: float = 120) -> None:
    """Wait until an api answers /ready with 200."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{base_url} did not become ready within {timeout_s} s")


def metric_samples(port: str | int, name: str | None = None) -> list:
    """The samples (with their labels) a /metrics endpoint shows: all, or those of one series name."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    return samples if name is None else [sample for sample in samples if sample.name == name]


def scrape(port: str | int) -> dict[str, float]:
    """Metric samples by name, summed over label sets."""
    totals: dict[str, float] = {}
    for sample in metric_samples(port):
        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


class FakeStack:
    """`num_engines` × (scheduler + model-free worker), and one api over all of them, as processes on
    loopback ports (a context manager). `engines[i]` is engine i's environment; `processes` maps
    "scheduler-i", "worker-i" and "api" to their processes."""

    def __init__(
        self,
        log_dir: Path,
        num_engines: int = 1,
        role_env: dict[str, dict[str, str]] | None = None,
        **env_overrides: str,
    ):
        defaults = {"BLOCKSERVE_NUM_KV_BLOCKS": "24", "BLOCKSERVE_BLOCK_SIZE": "4", "FAKE_STEP_DELAY_S": "0.005"}
        self.engines = [loopback_env(**{**defaults, **env_overrides}) for _ in range(num_engines)]  # overrides win
        addresses = ",".join(engine["BLOCKSERVE_SCHEDULER_ADDR"] for engine in self.engines)
        self.env = {**self.engines[0], "BLOCKSERVE_SCHEDULER_ADDR": addresses}  # the api's
        self.url = f"http://127.0.0.1:{self.env['BLOCKSERVE_PORT']}"
        self.metrics_port = self.env["BLOCKSERVE_METRICS_PORT"]  # engine 0's scheduler
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen] = {}
        self.role_env = role_env or {}  # "scheduler", "worker" or "api" -> settings of that role alone (keys)

    def __enter__(self) -> "FakeStack":
        for index, engine in enumerate(self.engines):
            for args, role in (
                (["-m", "service.launch.cli", "scheduler"], "scheduler"),
                (["-m", "tests.support.fake_worker_process"], "worker"),
            ):
                name = f"{role}-{index}"
                env = {**engine, **self.role_env.get(role, {})}
                self.processes[name] = start(args, env, self.log_dir / f"{name}.log")
        api_env = {**self.env, **self.role_env.get("api", {})}
        self.processes["api"] = start(["-m", "service.launch.cli", "api"], api_env, self.log_dir / "api.log")
        wait_ready(self.url, timeout_s=60)
        return self

    def __exit__(self, *_: object) -> None:
        stop_all(self.processes.values())
