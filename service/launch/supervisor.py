"""`blockserve serve`: scheduler, worker and api as child processes of one, kept running.

A role that exits is started again after a backoff (1 s, doubling up to 30 s; back to 1 s once it
has run for a minute), and the log says so. The other roles keep running meanwhile; the api's
/ready answers 503 while the scheduler or the worker is away. On stop the api and the scheduler
drain at once, against one deadline (`drain_timeout_s`); the worker, which the drain needs, is
stopped after the scheduler has gone.

A role that exits with a configuration error (status 78, service/contract/configuration_exit.py) is not
restarted: no restart would mend it, so every role is stopped and `serve` ends with that role's line.
The line comes from a file per role (BLOCKSERVE_TERMINATION_MESSAGE_PATH, as Kubernetes reads a
container's /dev/termination-log), so the roles' stderr stays the terminal's, with no relay.

The internal sockets listen on loopback only, with CURVE keys made for this run: no other process
on the machine can reach the scheduler.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from service.contract import socket_auth
from service.contract.configuration_exit import CONFIGURATION_ERROR_STATUS, TERMINATION_MESSAGE_VARIABLE

log = logging.getLogger("blockserve.serve")

ROLES_IN_START_ORDER = ("scheduler", "worker", "api")
FIRST_RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
STABLE_AFTER_S = 60.0  # a role that ran this long restarts after the first delay again
STOP_MARGIN_S = 3.0  # past the drain deadline before a draining role is killed
WORKER_STOP_S = 5.0  # for the worker to go once the scheduler has


def loopback(addr: str) -> str:
    """`addr` on 127.0.0.1 (same port); addresses that are not TCP are kept."""
    parts = urlsplit(addr)
    if parts.scheme != "tcp" or parts.port is None:
        return addr
    return f"tcp://127.0.0.1:{parts.port}"


def role_environments(base: Mapping[str, str], scheduler_addr: str, worker_addr: str) -> dict[str, dict[str, str]]:
    """The environment of each role: `base`, loopback internal addresses, and this run's CURVE keys."""
    keys = socket_auth.key_settings({owner: socket_auth.new_key_pair() for owner in socket_auth.KEY_OWNERS})
    internal = {"BLOCKSERVE_SCHEDULER_ADDR": loopback(scheduler_addr), "BLOCKSERVE_WORKER_ADDR": loopback(worker_addr)}
    # Keys given to `serve` itself (environment or files) would mix with this run's: leave them out.
    inherited = {name: value for name, value in base.items() if not name.startswith("BLOCKSERVE_CURVE_")}
    inherited.pop("BLOCKSERVE_SECRETS_DIR", None)
    return {role: {**inherited, **internal, **keys[role]} for role in ROLES_IN_START_ORDER}


@dataclass
class Child:
    """One role's process and its restart bookkeeping."""

    role: str
    env: dict[str, str]
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_delay_s: float = FIRST_RESTART_DELAY_S
    restart_at: float | None = None

    def start(self, now: float) -> None:
        Path(self.env[TERMINATION_MESSAGE_VARIABLE]).write_text("")  # this run's line only
        # A session of its own: a terminal's Ctrl-C reaches `serve`, which stops the roles in order.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "service.launch.cli", self.role], env=self.env, start_new_session=True
        )
        self.started_at, self.restart_at = now, None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def configuration_error(self) -> str:
        """The line of the configuration error the process exited with."""
        line = Path(self.env[TERMINATION_MESSAGE_VARIABLE]).read_text().strip()
        return line or f"blockserve {self.role}: configuration error (exit status {CONFIGURATION_ERROR_STATUS})"


class Supervisor:
    """Starts the roles, restarts the ones that exit (`check`), stops them in drain order (`stop`)."""

    def __init__(self, environments: Mapping[str, dict[str, str]]):
        self._messages = tempfile.TemporaryDirectory(prefix="blockserve-serve-")  # each role's termination message
        messages = Path(self._messages.name)
        self.children = {
            role: Child(role, {**environments[role], TERMINATION_MESSAGE_VARIABLE: str(messages / role)})
            for role in ROLES_IN_START_ORDER
        }

    def start(self) -> None:
        now = time.monotonic()
        for child in self.children.values():
            child.start(now)
            log.info("started the %s process (pid %d)", child.role, child.process.pid)

    def check(self, now: float) -> str | None:
        """Schedule a restart for each role that exited; start those whose backoff is over. A role that exited with a
        configuration error is not restarted: its line is returned, for the caller to stop every role."""
        for child in self.children.values():
            if child.restart_at is None and not child.running:
                if child.process.returncode == CONFIGURATION_ERROR_STATUS:
                    log.error("the %s process (pid %d) cannot run as configured", child.role, child.process.pid)
                    return child.configuration_error()
                if now - child.started_at >= STABLE_AFTER_S:
                    child.restart_delay_s = FIRST_RESTART_DELAY_S
                child.restart_at = now + child.restart_delay_s
                log.error(
                    "the %s process (pid %d) exited with code %s; restarting it in %.0f s",
                    child.role,
                    child.process.pid,
                    child.process.returncode,
                    child.restart_delay_s,
                )
                child.restart_delay_s = min(2 * child.restart_delay_s, MAX_RESTART_DELAY_S)
            elif child.restart_at is not None and now >= child.restart_at:
                child.start(now)
                log.info("restarted the %s process (pid %d)", child.role, child.process.pid)
        return None

    def stop(self, drain_timeout_s: float) -> None:
        """The api and the scheduler drain together; the worker goes once the scheduler has."""
        draining = [self.children["api"], self.children["scheduler"]]
        for child in draining:
            _terminate(child)
        deadline = time.monotonic() + drain_timeout_s + STOP_MARGIN_S
        for child in draining:
            _wait_or_kill(child, deadline)
        worker = self.children["worker"]
        _terminate(worker)
        _wait_or_kill(worker, time.monotonic() + WORKER_STOP_S)
        self._messages.cleanup()


def _terminate(child: Child) -> None:
    if child.running:
        child.process.send_signal(signal.SIGTERM)


def _wait_or_kill(child: Child, deadline: float) -> None:
    if child.process is None:
        return
    try:
        child.process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        log.warning("the %s process did not stop in time; killing it", child.role)
        child.process.kill()
        child.process.wait()
