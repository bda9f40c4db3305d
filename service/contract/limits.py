"""What the scheduler and the worker accept from a peer: sampling ranges, request ids, worker hellos.

The api checks the same ranges at HTTP (its pydantic bounds are these constants), so a request
the api let through is never refused here; these checks are for peers that bypass the api.
Each check returns what is wrong in a sentence, or None.
"""

from __future__ import annotations

import math

from service.contract import wire

MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_REPETITION_PENALTY = 2.0  # in (0, MAX_REPETITION_PENALTY]
MAX_TOP_K = 2**31 - 1
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as OpenAI's
MAX_SEED = 2**63 - 1
MAX_REQUEST_ID_CHARS = 256
MAX_ABS_PRIORITY = 2**31 - 1  # priorities lie in [-MAX_ABS_PRIORITY, MAX_ABS_PRIORITY]
MAX_BLOCK_SIZE = 1024
MAX_TENANT_CHARS = 256  # a tenant's name (an API key's tenant, OpenAI's `user`, a gateway's header)
MAX_TENANT_WEIGHT = 1e6
MAX_GRAMMAR_CHARS = 256 * 1024  # a constrained request's grammar (a JSON schema, regex, choices or Lark text)


def _in_range(value: float, low: float, high: float, low_open: bool) -> bool:
    """Finite and in [low, high] ((low, high] with `low_open`): NaN fails every comparison."""
    return math.isfinite(value) and (low < value if low_open else low <= value) and value <= high


def sampling_problem(sampling: wire.SamplingParams, vocab_size: int | None) -> str | None:
    """What is wrong with `sampling`, or None; token ids are checked against `vocab_size` if given."""
    checks = (
        ("temperature", sampling.temperature, 0.0, MAX_TEMPERATURE, False),
        ("top_p", sampling.top_p, 0.0, 1.0, True),
        ("min_p", sampling.min_p, 0.0, 1.0, False),
        ("presence_penalty", sampling.presence_penalty, -MAX_PENALTY, MAX_PENALTY, False),
        ("frequency_penalty", sampling.frequency_penalty, -MAX_PENALTY, MAX_PENALTY, False),
        ("repetition_penalty", sampling.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, True),
    )
    for name, value, low, high, low_open in checks:
        if not _in_range(value, low, high, low_open):
            bracket = "(" if low_open else "["
            return f"{name} must be a finite number in {bracket}{low:g}, {high:g}]; got {value!r}"
    if not 0 <= sampling.top_k <= MAX_TOP_K:
        return f"top_k must lie in [0, {MAX_TOP_K}] (0 = off); got {sampling.top_k}"
    if sampling.max_tokens < 1:
        return "max_tokens must be at least 1"
    if sampling.seed is not None and not 0 <= sampling.seed <= MAX_SEED:
        return f"seed must lie in [0, {MAX_SEED}]"
    if sampling.logprobs is not None and not 0 <= sampling.logprobs <= MAX_TOP_LOGPROBS:
        return f"logprobs must lie in [0, {MAX_TOP_LOGPROBS}]; got {sampling.logprobs}"
    if vocab_size is not None and not all(0 <= token_id < vocab_size for token_id in sampling.stop_token_ids):
        return f"stop token ids must lie in [0, {vocab_size})"
    if sampling.grammar is not None:
        if not 0 < len(sampling.grammar) <= MAX_GRAMMAR_CHARS:
            return f"a grammar has 1 to {MAX_GRAMMAR_CHARS} characters; got {len(sampling.grammar)}"
        if sampling.ignore_eos:
            return "ignore_eos cannot go with a grammar: the grammar decides where the output may end"
    for token_id, bias in sampling.logit_bias.items():
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            return f"logit_bias token ids must lie in [0, {vocab_size or 'the vocabulary size'}); got {token_id}"
        if not _in_range(bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, False):
            return (
                f"logit_bias values must be finite numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]; got {bias!r}"
            )
    return None


def request_id_problem(request_id: str) -> str | None:
    if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        return f"a request id has 1 to {MAX_REQUEST_ID_CHARS} characters"
    return None


def prompt_problem(prompt_token_ids: list[int], vocab_size: int | None, max_model_len: int) -> str | None:
    """What makes a prompt impossible to serve (empty, unknown tokens, no room for an output token), or None."""
    if not prompt_token_ids:
        return "the prompt is empty"
    if vocab_size is not None and not all(0 <= token_id < vocab_size for token_id in prompt_token_ids):
        return f"prompt token ids must lie in [0, {vocab_size})"
    if len(prompt_token_ids) >= max_model_len:
        return (
            f"the prompt has {len(prompt_token_ids)} tokens; the maximum context length "
            f"(max_model_len) is {max_model_len}, prompt plus at least one output token"
        )
    return None


def priority_problem(priority: int) -> str | None:
    if not -MAX_ABS_PRIORITY <= priority <= MAX_ABS_PRIORITY:
        return f"priority must lie in [{-MAX_ABS_PRIORITY}, {MAX_ABS_PRIORITY}]; got {priority}"
    return None


def tenant_problem(tenant: str, weight: float) -> str | None:
    if not 0 < len(tenant) <= MAX_TENANT_CHARS:
        return f"a tenant's name must have 1 to {MAX_TENANT_CHARS} characters; got {len(tenant)}"
    if not _in_range(weight, 0.0, MAX_TENANT_WEIGHT, low_open=True):
        return f"a tenant's weight must lie in (0, {MAX_TENANT_WEIGHT}]; got {weight}"
    return None


def hello_problem(hello: wire.WorkerHello) -> str | None:
    """What makes a worker's hello nonsense (a table no request fits in, a model without tokens), or None."""
    if hello.num_kv_blocks < 1:
        return f"num_kv_blocks {hello.num_kv_blocks}: a worker needs at least one KV-cache block"
    if not 1 <= hello.block_size <= MAX_BLOCK_SIZE:
        return f"block_size {hello.block_size} is not in [1, {MAX_BLOCK_SIZE}]"
    model = hello.model
    if model.vocab_size < 1 or model.max_model_len < 2:
        return f"model {model.name!r}: vocab_size {model.vocab_size}, max_model_len {model.max_model_len}"
    if not all(0 <= token_id < model.vocab_size for token_id in model.eos_token_ids):
        return f"model {model.name!r}: EOS token ids outside the vocabulary"
    return None
