"""CURVE on the internal sockets, over real processes: scheduler, model-free worker and api with
keys; peers without a listed key get nothing through either socket."""

from __future__ import annotations

import re
import time

import httpx
import msgspec
import pytest
import zmq

from service import socket_auth, wire
from tests.support.processes import loopback_env, scrape, start, stop_all, wait_ready
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
        start(["-m", "service.cli", "scheduler"], {**env, **role_keys["scheduler"]}, logs / "scheduler.log"),
        start(
            ["-m", "tests.support.fake_worker_process"],
            {**env, "BLOCKSERVE_SECRETS_DIR": str(worker_secrets)},
            logs / "worker.log",
        ),
        start(["-m", "service.cli", "api"], {**env, **role_keys["api"]}, logs / "api.log"),
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
