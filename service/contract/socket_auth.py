"""CURVE on the internal ZMQ sockets: who may talk to the scheduler.

The scheduler's two ROUTERs are CURVE servers with one secret key. Each accepts only the public
keys listed for it: api replicas on the api socket, workers on the worker socket, so a key that
may send requests cannot register a worker. A ZAP handler (pyzmq's ThreadAuthenticator) checks
every handshake; a refused one is logged and counted. A peer without CURVE fails the handshake
itself (mechanism mismatch) and gets nothing through either.

Keys are Z85 text, from settings (environment or BLOCKSERVE_SECRETS_DIR files); `blockserve keys`
makes a set. With no server key configured the sockets stay plain, and then (protected mode, as
Redis has it) the scheduler listens on loopback only: an address any other machine could reach
needs CURVE, or BLOCKSERVE_ALLOW_UNAUTHENTICATED=1 where something else (a NetworkPolicy) keeps
other peers out, which is logged as a warning at every start.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from service.contract.config import Settings, SettingsError

log = logging.getLogger(__name__)

# The ROUTER bound at each address setting, and the setting listing the client keys it accepts.
API_SOCKET, WORKER_SOCKET = "api", "worker"
CLIENT_KEY_SETTINGS = {
    API_SOCKET: "BLOCKSERVE_CURVE_API_CLIENT_KEYS",
    WORKER_SOCKET: "BLOCKSERVE_CURVE_WORKER_CLIENT_KEYS",
}
# Roles with their own key pair, in the order `blockserve keys` prints them.
KEY_OWNERS = ("server", "api", "worker")
ADDR_SETTINGS = {API_SOCKET: "BLOCKSERVE_SCHEDULER_ADDR", WORKER_SOCKET: "BLOCKSERVE_WORKER_ADDR"}
MACHINE_LOCAL_TRANSPORTS = ("ipc", "inproc")  # a socket file or the process itself: no network


def is_loopback(addr: str) -> bool:
    """Whether only this machine can reach a ZMQ bind address (tcp on a loopback address, ipc, inproc)."""
    parts = urlsplit(addr)
    if parts.scheme in MACHINE_LOCAL_TRANSPORTS:
        return True
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # `*`, an interface name or a host name: reachable from elsewhere
        return False


@dataclass(frozen=True)
class KeyPair:
    public_key: bytes
    secret_key: bytes


def new_key_pair() -> KeyPair:
    public_key, secret_key = zmq.curve_keypair()
    return KeyPair(public_key, secret_key)


def key_pair_from_secret(secret_key: str, setting: str) -> KeyPair:
    """The pair of a Z85 secret key (its public key is derived from it)."""
    try:
        return KeyPair(zmq.curve_public(secret_key.encode()), secret_key.encode())
    except (ValueError, zmq.ZMQError) as exc:
        raise SettingsError(f"{setting}: not a Z85 CURVE secret key ({exc})") from None


def public_keys(text: str, setting: str) -> frozenset[bytes]:
    """Comma-separated Z85 public keys, checked."""
    keys = frozenset(key.strip().encode() for key in text.split(",") if key.strip())
    for key in keys:
        if len(key) != 40:
            raise SettingsError(f"{setting}: {key.decode()!r} is not a 40-character Z85 CURVE key")
        try:
            z85.decode(key)
        except (ValueError, KeyError):
            raise SettingsError(f"{setting}: {key.decode()!r} is not Z85") from None
    return keys


@dataclass(frozen=True)
class ClientKeys:
    """What an api replica or a worker needs to reach a CURVE scheduler."""

    server_public_key: bytes
    own: KeyPair


def client_keys(settings: Settings) -> ClientKeys | None:
    """This client's keys, or None when the scheduler's public key is not configured (plain sockets)."""
    if not settings.curve_server_key:
        return None
    if settings.curve_client_secret_key is None:
        raise SettingsError("BLOCKSERVE_CURVE_CLIENT_SECRET_KEY: required when BLOCKSERVE_CURVE_SERVER_KEY is set")
    (server_key,) = public_keys(settings.curve_server_key, "BLOCKSERVE_CURVE_SERVER_KEY")
    own = key_pair_from_secret(
        settings.curve_client_secret_key.get_secret_value(), "BLOCKSERVE_CURVE_CLIENT_SECRET_KEY"
    )
    return ClientKeys(server_key, own)


def secure_client(socket: zmq.Socket, keys: ClientKeys | None) -> None:
    """Make `socket` a CURVE client (before connect); nothing without keys."""
    if keys is None:
        return
    socket.curve_serverkey = keys.server_public_key
    socket.curve_publickey = keys.own.public_key
    socket.curve_secretkey = keys.own.secret_key


class _AllowedKeys:
    """ZAP credentials of one socket (its ZAP domain): listed keys pass; others are logged and counted."""

    def __init__(self, keys: frozenset[bytes], on_denied: Callable[[str], None]):
        self.keys = keys
        self.on_denied = on_denied

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key in self.keys:
            return True
        log.warning("refused a CURVE handshake on the %s socket: unknown client key %s", domain, client_key.decode())
        self.on_denied(domain)
        return False


class CurveServer:
    """The scheduler's side: `secure(socket, addr)` before bind, `stop()` before the context goes."""

    def __init__(self, settings: Settings, context: zmq.Context, on_denied: Callable[[str], None]):
        self._addrs = {settings.scheduler_addr: API_SOCKET, settings.worker_addr: WORKER_SOCKET}
        self._own: KeyPair | None = None
        self._authenticator: ThreadAuthenticator | None = None
        if settings.curve_server_secret_key is None:
            _check_plain_sockets(settings)
            return
        self._own = key_pair_from_secret(
            settings.curve_server_secret_key.get_secret_value(), "BLOCKSERVE_CURVE_SERVER_SECRET_KEY"
        )
        allowed = {
            API_SOCKET: public_keys(settings.curve_api_client_keys, CLIENT_KEY_SETTINGS[API_SOCKET]),
            WORKER_SOCKET: public_keys(settings.curve_worker_client_keys, CLIENT_KEY_SETTINGS[WORKER_SOCKET]),
        }
        for socket_name, keys in allowed.items():
            if not keys:
                raise SettingsError(
                    f"{CLIENT_KEY_SETTINGS[socket_name]}: required when BLOCKSERVE_CURVE_SERVER_SECRET_KEY is set"
                )
        self._authenticator = ThreadAuthenticator(context, log=logging.getLogger(f"{__name__}.zap"))
        self._authenticator.start()
        for socket_name, keys in allowed.items():
            self._authenticator.configure_curve_callback(socket_name, _AllowedKeys(keys, on_denied))

    @property
    def enabled(self) -> bool:
        return self._own is not None

    def secure(self, socket: zmq.Socket, addr: str) -> None:
        """Make the ROUTER bound at `addr` a CURVE server for its clients (before bind)."""
        if self._own is None:
            return
        socket.zap_domain = self._addrs[addr].encode()
        socket.curve_secretkey = self._own.secret_key
        socket.curve_publickey = self._own.public_key
        socket.curve_server = True

    def stop(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


def _check_plain_sockets(settings: Settings) -> None:
    """Protected mode: plain sockets listen on loopback only, unless the operator says otherwise."""
    addrs = {API_SOCKET: settings.scheduler_addr, WORKER_SOCKET: settings.worker_addr}
    exposed = [f"{ADDR_SETTINGS[name]}={addr}" for name, addr in addrs.items() if not is_loopback(addr)]
    if not exposed:
        log.info("internal sockets without CURVE, on loopback only")
        return
    if not settings.allow_unauthenticated:
        raise SettingsError(
            f"protected mode: {', '.join(exposed)} is not a loopback address and CURVE is off, so any peer that "
            "reaches it could send requests or register a worker. Set BLOCKSERVE_CURVE_SERVER_SECRET_KEY, BLOCKSERVE_CURVE_API_CLIENT_KEYS "
            "and BLOCKSERVE_CURVE_WORKER_CLIENT_KEYS (`blockserve keys` makes a set), listen on 127.0.0.1, or set "
            "BLOCKSERVE_ALLOW_UNAUTHENTICATED=1 where something else (a NetworkPolicy) keeps other peers out"
        )
    log.warning(
        "UNAUTHENTICATED: %s is not a loopback address and CURVE is off (BLOCKSERVE_ALLOW_UNAUTHENTICATED=1): any "
        "peer that reaches it can send requests or register a worker; only the network (a NetworkPolicy) keeps them out",
        ", ".join(exposed),
    )


def key_settings(pairs: dict[str, KeyPair]) -> dict[str, dict[str, str]]:
    """The CURVE settings of each role (scheduler, api, worker) for a set of key pairs."""
    server, api, worker = (pairs[owner] for owner in KEY_OWNERS)
    return {
        "scheduler": {
            "BLOCKSERVE_CURVE_SERVER_SECRET_KEY": server.secret_key.decode(),
            "BLOCKSERVE_CURVE_API_CLIENT_KEYS": api.public_key.decode(),
            "BLOCKSERVE_CURVE_WORKER_CLIENT_KEYS": worker.public_key.decode(),
        },
        "api": {
            "BLOCKSERVE_CURVE_SERVER_KEY": server.public_key.decode(),
            "BLOCKSERVE_CURVE_CLIENT_SECRET_KEY": api.secret_key.decode(),
        },
        "worker": {
            "BLOCKSERVE_CURVE_SERVER_KEY": server.public_key.decode(),
            "BLOCKSERVE_CURVE_CLIENT_SECRET_KEY": worker.secret_key.decode(),
        },
    }


def secret_entries(pairs: dict[str, KeyPair]) -> dict[str, str]:
    """The keys Secret of the Helm chart: `<owner>-public-key` and `<owner>-secret-key` for each owner."""
    return {
        f"{owner}-{kind}-key": key.decode()
        for owner in KEY_OWNERS
        for kind, key in (("public", pairs[owner].public_key), ("secret", pairs[owner].secret_key))
    }
