"""CURVE on the internal sockets, over real processes: scheduler, model-free worker and api with
keys; peers without a listed key get nothing through either socket."""

from __future__ import annotations

import re
import socket
import time
from urllib.parse import urlsplit

import httpx
import msgspec
import pytest
import zmq

from service.contract import socket_auth, wire
from service.contract.configuration_exit import CONFIGURATION_ERROR_STATUS
from tests.support.api_peer import ApiPeer
from tests.support.processes import FakeStack, free_port, loopback_env, scrape, start, stop_all, wait_ready
from tests.support.tiny_model import tiny_model_info

NUM_KV_BLOCKS = 24
SILENCE_S = 1.5  # how long a refused peer waits for any answer


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """scheduler, worker and api, each with its own keys; the worker reads its keys from files."""
    logs = tmp_path_factory.mktemp("curve")
    pairs = {owner: socket_auth.new_key_pair() for owner in socket_auth.KEY_OWNERS}
    role_keys = socket_auth.key_settings(pairs)
    worker_secrets = logs / "worker-secrets"  # a Kubernetes Secret mounted as files looks like this
    worker_secrets.mkdir()
    for name, value in role_keys["worker"].items():
        (worker_secrets / name).write_text(value + "\n")
    env = loopback_env(BLOCKSERVE_NUM_KV_BLOCKS=str(NUM_KV_BLOCKS), BLOCKSERVE_BLOCK_SIZE="4")
    processes = [
        start(["-m", "service.launch.cli", "scheduler"], {**env, **role_keys["scheduler"]}, logs / "scheduler.log"),
        start(
            ["-m", "tests.support.fake_worker_process"],
            {**env, "BLOCKSERVE_SECRETS_DIR": str(worker_secrets)},
            logs / "worker.log",
        ),
        start(["-m", "service.launch.cli", "api"], {**env, **role_keys["api"]}, logs / "api.log"),
    ]
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    try:
        wait_ready(url, timeout_s=60)
    except TimeoutError:
        stop_all(processes)
        raise
    yield env, pairs, url
    stop_all(processes)


def peer(addr: str, own: socket_auth.KeyPair | None, server_key: bytes) -> tuple[zmq.Context, zmq.Socket]:
    """A DEALER at `addr`: plain without `own`, else a CURVE client with that key pair."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    if own is not None:
        socket_auth.secure_client(socket, socket_auth.ClientKeys(server_key, own))
    socket.connect(addr)
    return context, socket


def answers(addr: str, own: socket_auth.KeyPair | None, server_key: bytes, *messages: wire.Message) -> list:
    """Every message the scheduler sends back within SILENCE_S after `messages`."""
    context, socket = peer(addr, own, server_key)
    try:
        for message in messages:
            socket.send(wire.encode(message))
        received = []
        deadline = time.monotonic() + SILENCE_S
        while (left_ms := int(1000 * (deadline - time.monotonic()))) > 0:
            if socket.poll(left_ms):
                received.append(wire.decode(socket.recv()))
        return received
    finally:
        context.destroy(linger=0)


def auth_failures(env: dict[str, str], socket: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{env['BLOCKSERVE_METRICS_PORT']}/metrics", timeout=5).text
    match = re.search(rf'^blockserve_auth_failures_total{{socket="{socket}"}} (\S+)$', text, re.M)
    assert match, "blockserve_auth_failures_total is not exported"
    return float(match.group(1))


def complete(url: str) -> dict:
    model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_authorised_api_and_worker_serve_over_curve(stack):
    env, pairs, url = stack
    assert complete(url)["usage"]["completion_tokens"] == 4
    # The api's key on a raw socket is answered: the silence of the refused peers below is the keys'.
    (status,) = answers(env["BLOCKSERVE_SCHEDULER_ADDR"], pairs["api"], pairs["server"].public_key, wire.StatusQuery())
    assert isinstance(status, wire.SchedulerStatus) and status.num_workers == 1


def test_api_peers_without_an_api_key_get_no_answer_and_are_counted(stack):
    env, pairs, url = stack
    before = auth_failures(env, "api")
    prompt_tokens_before = scrape(env["BLOCKSERVE_METRICS_PORT"])["blockserve_prompt_tokens_total"]
    request = wire.GenerateRequest(request_id="intruder", prompt_token_ids=[1, 2, 3], sampling=wire.SamplingParams())
    messages = (wire.StatusQuery(), wire.ApiHello(replica_id="intruder"), request)
    server_key = pairs["server"].public_key
    addr = env["BLOCKSERVE_SCHEDULER_ADDR"]

    assert answers(addr, None, server_key, *messages) == []  # plain: the handshake fails
    assert answers(addr, socket_auth.new_key_pair(), server_key, *messages) == []  # an unknown key
    assert answers(addr, pairs["worker"], server_key, *messages) == []  # a worker's key is not an api's

    assert auth_failures(env, "api") >= before + 2
    assert scrape(env["BLOCKSERVE_METRICS_PORT"])["blockserve_prompt_tokens_total"] == prompt_tokens_before
    served = complete(url)  # and the api with its key is still served
    assert served["usage"]["completion_tokens"] == 4 and served["choices"][0]["finish_reason"] == "length"


def test_worker_peers_without_a_worker_key_cannot_register(stack):
    env, pairs, url = stack
    before = auth_failures(env, "worker")
    evil_model = msgspec.structs.replace(tiny_model_info(), name="EVIL")
    evil = wire.WorkerHello(worker_id="evil", num_kv_blocks=4, block_size=4, model=evil_model)
    server_key = pairs["server"].public_key
    addr = env["BLOCKSERVE_WORKER_ADDR"]

    assert answers(addr, None, server_key, evil, wire.Pong()) == []
    assert answers(addr, socket_auth.new_key_pair(), server_key, evil, wire.Pong()) == []
    assert answers(addr, pairs["api"], server_key, evil, wire.Pong()) == []

    assert auth_failures(env, "worker") >= before + 2
    assert scrape(env["BLOCKSERVE_METRICS_PORT"])["blockserve_kv_blocks_capacity"] == NUM_KV_BLOCKS
    assert httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"] != "EVIL"
    assert httpx.get(f"{url}/ready", timeout=5).status_code == 200  # the honest worker stayed registered
    assert complete(url)["usage"]["completion_tokens"] == 4


def test_a_refused_worker_peer_leaves_the_registered_worker_serving(stack):
    env, pairs, url = stack
    # A refused handshake ends in a disconnect on the worker socket: not the registered worker's.
    answers(env["BLOCKSERVE_WORKER_ADDR"], None, pairs["server"].public_key, wire.Pong())
    assert httpx.get(f"{url}/ready", timeout=5).status_code == 200


def test_plain_peers_fail_the_handshake_and_are_counted_on_both_sockets(stack):
    env, pairs, _ = stack
    for socket_name, addr in (("api", env["BLOCKSERVE_SCHEDULER_ADDR"]), ("worker", env["BLOCKSERVE_WORKER_ADDR"])):
        before = auth_failures(env, socket_name)
        assert answers(addr, None, pairs["server"].public_key, wire.StatusQuery()) == []
        assert auth_failures(env, socket_name) > before, socket_name  # refused inside libzmq, before ZAP


# ---------------------------------------------------------------------------- protected mode


def plain_scheduler_env(**overrides: str) -> dict[str, str]:
    """A scheduler's environment with `overrides` and no CURVE key or opt-out inherited from the test's own."""
    env = loopback_env()
    for name in [name for name in env if name.startswith("BLOCKSERVE_CURVE_")]:
        del env[name]
    env.pop("BLOCKSERVE_ALLOW_UNAUTHENTICATED", None)
    env.pop("BLOCKSERVE_SECRETS_DIR", None)
    return {**env, **overrides}


@pytest.mark.parametrize("setting", ["BLOCKSERVE_SCHEDULER_ADDR", "BLOCKSERVE_WORKER_ADDR"])
def test_a_scheduler_beyond_loopback_without_curve_refuses_to_start_and_says_what_to_set(tmp_path, setting):
    env = plain_scheduler_env(**{setting: f"tcp://0.0.0.0:{free_port()}"})
    scheduler = start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log")
    try:
        assert scheduler.wait(60) == CONFIGURATION_ERROR_STATUS
    finally:
        stop_all([scheduler])
    log = (tmp_path / "scheduler.log").read_text()
    assert f"{setting}=tcp://0.0.0.0:" in log
    for hint in ("blockserve keys", "BLOCKSERVE_CURVE_SERVER_SECRET_KEY", "BLOCKSERVE_ALLOW_UNAUTHENTICATED=1"):
        assert hint in log, hint
    with pytest.raises(httpx.ConnectError):  # nothing was left listening
        httpx.get(f"http://127.0.0.1:{env['BLOCKSERVE_METRICS_PORT']}/metrics", timeout=5)


def test_the_opt_out_runs_plain_beyond_loopback_with_a_warning(tmp_path):
    port = free_port()
    env = plain_scheduler_env(BLOCKSERVE_SCHEDULER_ADDR=f"tcp://0.0.0.0:{port}", BLOCKSERVE_ALLOW_UNAUTHENTICATED="1")
    scheduler = start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log")
    peer = ApiPeer(f"tcp://127.0.0.1:{port}")
    try:
        assert peer.status(timeout_s=60).num_workers == 0  # a plain peer is answered, as the opt-out says
        assert re.search(
            r"WARNING .*UNAUTHENTICATED: BLOCKSERVE_SCHEDULER_ADDR=tcp://0\.0\.0\.0:\d+ is not a loopback",
            (tmp_path / "scheduler.log").read_text(),
        )
    finally:
        peer.close()
        stop_all([scheduler])


def test_with_curve_the_scheduler_listens_beyond_loopback_without_a_warning(tmp_path):
    pairs = {owner: socket_auth.new_key_pair() for owner in socket_auth.KEY_OWNERS}
    port = free_port()
    env = {
        **plain_scheduler_env(BLOCKSERVE_SCHEDULER_ADDR=f"tcp://0.0.0.0:{port}"),
        **socket_auth.key_settings(pairs)["scheduler"],
    }
    scheduler = start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log")
    try:
        deadline = time.monotonic() + 60
        while not (
            status := answers(f"tcp://127.0.0.1:{port}", pairs["api"], pairs["server"].public_key, wire.StatusQuery())
        ):
            assert time.monotonic() < deadline and scheduler.poll() is None, "the scheduler never answered"
        assert isinstance(status[0], wire.SchedulerStatus)
        assert "WARNING" not in (tmp_path / "scheduler.log").read_text()
    finally:
        stop_all([scheduler])


def test_every_listening_port_honours_the_bind_address_settings(tmp_path):
    # 127.0.0.2 is this machine too: a socket bound to 0.0.0.0 answers there, one bound to 127.0.0.1 does not.
    with FakeStack(tmp_path, BLOCKSERVE_HOST="127.0.0.1") as stack:
        env = stack.env
        ports = {
            "api": int(env["BLOCKSERVE_PORT"]),
            "scheduler metrics": int(env["BLOCKSERVE_METRICS_PORT"]),
            "scheduler api socket": urlsplit(env["BLOCKSERVE_SCHEDULER_ADDR"]).port,
            "scheduler worker socket": urlsplit(env["BLOCKSERVE_WORKER_ADDR"]).port,
        }
        for name, port in ports.items():
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.2", port), timeout=5).close()
                pytest.fail(f"the {name} port {port} listens beyond BLOCKSERVE_HOST")
