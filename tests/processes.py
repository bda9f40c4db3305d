"""Start blockserve processes on free loopback ports for tests, and stop them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def start(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")
    return subprocess.Popen([sys.executable, *args], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen, timeout_s: float = 10) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
