"""Make a Kubernetes Secret once, from inside a pod: the Helm chart's keys Job runs `blockserve keys
--kubernetes-secret NAME` so that CURVE is on with no step an operator must remember.

It talks to the API server as the pod's service account (its token, CA and namespace are mounted at
SERVICE_ACCOUNT_DIR; the server's address is in KUBERNETES_SERVICE_HOST and _PORT), with the
standard library only. A Secret that exists already is left as it is: the Job runs before every
install and upgrade, and the keys must survive both.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 30


class KubernetesError(RuntimeError):
    """The API server refused or could not be reached; the message says which and why."""


def create_secret_once(
    name: str, entries: dict[str, str], labels: dict[str, str], account_dir: Path | None = None
) -> bool:
    """Create Secret `name` in the pod's namespace with `entries` unless it exists; True if created."""
    account_dir = account_dir or SERVICE_ACCOUNT_DIR
    namespace = (account_dir / "namespace").read_text().strip()
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    secrets_url = f"https://{host}:{port}/api/v1/namespaces/{namespace}/secrets"
    token = (account_dir / "token").read_text().strip()
    context = ssl.create_default_context(cafile=str(account_dir / "ca.crt"))

    def call(method: str, url: str, body: dict | None = None) -> int:
        request = urllib.request.Request(
            url,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            if exc.code in (404, 409):  # absent; created meanwhile by another run
                return exc.code
            raise KubernetesError(f"{method} {url}: {exc.code} {exc.read().decode(errors='replace')}") from None
        except OSError as exc:
            raise KubernetesError(f"{method} {url}: {exc}") from None

    if call("GET", f"{secrets_url}/{name}") != 404:
        return False
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "type": "Opaque",
        "stringData": entries,
    }
    return call("POST", secrets_url, secret) != 409
