"""CURVE settings checks, and `serve`'s supervisor without a model: environments, restarts with backoff."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import zmq

from service.contract import socket_auth
from service.contract.config import SettingsError, load_settings
from service.launch import supervisor


def test_half_configured_or_malformed_keys_fail_naming_the_setting():
    server = socket_auth.new_key_pair()
    with pytest.raises(SettingsError, match="BLOCKSERVE_CURVE_CLIENT_SECRET_KEY"):
        socket_auth.client_keys(load_settings(curve_server_key=server.public_key.decode()))
    with pytest.raises(SettingsError, match="BLOCKSERVE_CURVE_SERVER_KEY"):
        socket_auth.client_keys(
            load_settings(curve_server_key="short", curve_client_secret_key=server.secret_key.decode())
        )
    with pytest.raises(SettingsError, match="BLOCKSERVE_CURVE_API_CLIENT_KEYS"):
        socket_auth.CurveServer(load_settings(curve_server_secret_key=server.secret_key.decode()), zmq.Context(), print)
    with pytest.raises(SettingsError, match="BLOCKSERVE_CURVE_SERVER_SECRET_KEY"):
        socket_auth.CurveServer(load_settings(curve_server_secret_key="x" * 12), zmq.Context(), print)
    assert socket_auth.client_keys(load_settings()) is None  # no keys: plain sockets, as before


def test_serve_gives_each_role_loopback_sockets_and_fresh_keys_that_fit_together(tmp_path):
    base = {
        "PATH": "/bin",
        "BLOCKSERVE_CURVE_SERVER_KEY": "inherited",
        "BLOCKSERVE_SECRETS_DIR": str(tmp_path),
    }
    envs = supervisor.role_environments(base, "tcp://0.0.0.0:5560", "ipc:///tmp/worker")
    scheduler, api, worker = (envs[role] for role in ("scheduler", "api", "worker"))

    assert {env["BLOCKSERVE_SCHEDULER_ADDR"] for env in envs.values()} == {"tcp://127.0.0.1:5560"}
    assert {env["BLOCKSERVE_WORKER_ADDR"] for env in envs.values()} == {"ipc:///tmp/worker"}
    assert all(env["PATH"] == "/bin" and "BLOCKSERVE_SECRETS_DIR" not in env for env in envs.values())
    server_public = zmq.curve_public(scheduler["BLOCKSERVE_CURVE_SERVER_SECRET_KEY"].encode()).decode()
    assert api["BLOCKSERVE_CURVE_SERVER_KEY"] == worker["BLOCKSERVE_CURVE_SERVER_KEY"] == server_public
    api_public = zmq.curve_public(api["BLOCKSERVE_CURVE_CLIENT_SECRET_KEY"].encode()).decode()
    worker_public = zmq.curve_public(worker["BLOCKSERVE_CURVE_CLIENT_SECRET_KEY"].encode()).decode()
    assert (scheduler["BLOCKSERVE_CURVE_API_CLIENT_KEYS"], scheduler["BLOCKSERVE_CURVE_WORKER_CLIENT_KEYS"]) == (
        api_public,
        worker_public,
    )
    again = supervisor.role_environments(base, "tcp://0.0.0.0:5560", "ipc:///tmp/worker")
    assert again["api"]["BLOCKSERVE_CURVE_CLIENT_SECRET_KEY"] != api["BLOCKSERVE_CURVE_CLIENT_SECRET_KEY"]


def test_a_role_that_keeps_dying_restarts_with_doubling_delays_and_the_others_are_left_alone(monkeypatch, caplog):
    def start(child: supervisor.Child, now: float) -> None:
        code = "import sys; sys.exit(3)" if child.role == "worker" else "import time; time.sleep(30)"
        child.process = subprocess.Popen([sys.executable, "-c", code])
        child.started_at, child.restart_at = now, None

    monkeypatch.setattr(supervisor.Child, "start", start)
    caplog.set_level(logging.INFO, logger="blockserve.serve")
    roles = supervisor.Supervisor({role: {} for role in supervisor.ROLES_IN_START_ORDER})
    roles.start()
    others = [roles.children[role].process for role in ("scheduler", "api")]
    worker = roles.children["worker"]
    try:
        delays, now = [], 0.0
        for _ in range(4):
            worker.process.wait(10)
            roles.check(now)
            delays.append(worker.restart_at - now)
            roles.check(worker.restart_at - 0.01)  # not yet
            assert worker.restart_at is not None  # still waiting out its delay
            now = worker.restart_at
            roles.check(now)  # restarted
        assert delays == [1.0, 2.0, 4.0, 8.0]
        assert all(process.poll() is None for process in others)
        assert (
            caplog.text.count("the worker process") >= 4 and "exited with code 3; restarting it in 8 s" in caplog.text
        )
        assert caplog.text.count("restarted the worker process") == 4
    finally:
        roles.stop(drain_timeout_s=0)
    assert all(process.poll() is not None for process in others)
