"""A configuration no restart can mend ends `blockserve serve` with one line and status 78; a crash of a working
worker is still restarted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import gguf
import httpx
import numpy as np
import pytest

from service.contract.configuration_exit import CONFIGURATION_ERROR_STATUS, TERMINATION_MESSAGE_VARIABLE
from service.launch import supervisor
from tests.support.processes import ROOT, loopback_env, start, stop, wait_ready

MODEL_LINE = re.compile(
    r"blockserve worker: configuration error: .* is not supported .*\(set BLOCKSERVE_MODEL, now (?P<path>\S+), "
    r"to a readable model this worker supports\)"
)


def write_mamba_gguf(path) -> None:
    """A GGUF file of an architecture the worker does not run."""
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_serve_on_an_unsupported_model_stops_every_role_within_10_s_with_one_line(tmp_path):
    model = tmp_path / "mamba.gguf"
    write_mamba_gguf(model)
    # Pure-Paddle kernels: the time is blockserve's, not a first build of the custom ops (minutes, once per source).
    env = loopback_env(BLOCKSERVE_MODEL=str(model), BLOCKSERVE_KERNELS="paddle", BLOCKSERVE_MAX_NUM_SEQ="4")

    started = time.monotonic()
    served = subprocess.run(
        [sys.executable, "-m", "service.launch.cli", "serve"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed_s = time.monotonic() - started

    last_line = served.stderr.strip().splitlines()[-1]
    assert served.returncode == CONFIGURATION_ERROR_STATUS, served.stderr[-3000:]
    assert MODEL_LINE.fullmatch(last_line) and "'mamba'" in last_line, last_line
    assert MODEL_LINE.fullmatch(last_line)["path"] == str(model)
    assert "Traceback" not in served.stderr and "restarting" not in served.stderr
    assert elapsed_s < 10, served.stderr[-3000:]
    # The misspelt setting is named once, by `serve`, not again by each role.
    (warning,) = [line for line in served.stderr.splitlines() if "BLOCKSERVE_MAX_NUM_SEQ " in line]
    assert "WARNING [serve]" in warning and "the closest is BLOCKSERVE_MAX_NUM_SEQS" in warning


def test_a_worker_on_a_model_folder_it_does_not_support_leaves_its_line_as_the_termination_message(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "foo"}))
    termination_log = tmp_path / "termination-log"
    termination_log.write_text("")
    env = loopback_env(
        BLOCKSERVE_MODEL=str(model), BLOCKSERVE_KERNELS="paddle", **{TERMINATION_MESSAGE_VARIABLE: str(termination_log)}
    )

    worker = subprocess.run(
        [sys.executable, "-m", "service.launch.cli", "worker"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )

    line = "blockserve worker: configuration error: model_type 'foo' is not supported"
    assert worker.returncode == CONFIGURATION_ERROR_STATUS, worker.stderr[-3000:]
    assert worker.stderr.strip().splitlines()[-1].startswith(line)
    assert termination_log.read_text().startswith(line) and termination_log.read_text().count("\n") == 1


def test_the_supervisor_restarts_no_role_that_exits_with_a_configuration_error(monkeypatch):
    def start_role(child: supervisor.Child, now: float) -> None:
        if child.role == "worker":
            code = (
                "import os, sys; open(os.environ[sys.argv[1]], 'w').write('blockserve worker: configuration error: x\\n');"
                f" sys.exit({CONFIGURATION_ERROR_STATUS})"
            )
            child.process = subprocess.Popen([sys.executable, "-c", code, TERMINATION_MESSAGE_VARIABLE], env=child.env)
        else:
            child.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        child.started_at, child.restart_at = now, None

    monkeypatch.setattr(supervisor.Child, "start", start_role)
    roles = supervisor.Supervisor({role: dict(os.environ) for role in supervisor.ROLES_IN_START_ORDER})
    roles.start()
    try:
        roles.children["worker"].process.wait(30)
        assert roles.check(time.monotonic()) == "blockserve worker: configuration error: x"
        assert roles.children["worker"].restart_at is None  # no restart scheduled
        assert all(roles.children[role].running for role in ("scheduler", "api"))  # the caller stops them
    finally:
        roles.stop(drain_timeout_s=0)
    assert not any(child.running for child in roles.children.values())


@pytest.fixture
def serve(tmp_path):
    """`blockserve serve` on the real model, ready; yields (process, its log, its api's URL)."""
    env = loopback_env(BLOCKSERVE_QUANTIZATION="gguf", BLOCKSERVE_HUGE_PAGES="0", BLOCKSERVE_NUM_KV_BLOCKS="16")
    log = tmp_path / "serve.log"
    process = start(["-m", "service.launch.cli", "serve"], env, log)
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    try:
        wait_ready(url, timeout_s=180)
        yield process, log, url
    finally:
        stop(process, timeout_s=60)


def complete(url: str) -> str:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]


def test_a_working_worker_killed_with_sigkill_is_restarted_and_serves_again(serve):
    process, log, url = serve
    before = complete(url)
    (worker_pid,) = re.findall(r"started the worker process \(pid (\d+)\)", log.read_text())

    os.kill(int(worker_pid), signal.SIGKILL)

    deadline = time.monotonic() + 30
    while "restarted the worker process" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    assert f"the worker process (pid {worker_pid}) exited with code -9; restarting it in 1 s" in log.read_text()
    wait_ready(url, timeout_s=180)
    assert complete(url) == before
    assert process.poll() is None
