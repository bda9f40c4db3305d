"""Constrained decoding on the real model (SmolLM2-135M) through the whole service, with OpenAI's client: answers
that parse and validate, choices and regexes that match, the constraint alongside seeds, n, logprobs, stop strings,
max_tokens, streaming and preemptions, and bad constraints refused with a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.support.processes import ROOT, loopback_env, scrape, start, stop_all, wait_ready

README = ROOT / "README.md"

NUM_KV_BLOCKS = 48  # 16 tokens each: several constrained requests at once
TEMPERATURE = 0.8
SEEDS = (1, 2, 3)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 20}]},
        "version": {"const": 2},
    },
    "required": ["status", "items", "note", "version"],
    "additionalProperties": False,
}
READING = {
    "type": "object",
    "properties": {
        "sensor": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "celsius": {"type": "integer", "minimum": -40, "maximum": 60},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["indoor", "outdoor", "test"]}, "minItems": 2, "maxItems": 2},
    },
    "required": ["sensor", "celsius", "ok", "tags"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER, "reading": READING}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("structured")
    # float32: a seeded request repeats as far as its logits do, and a prefix-cache hit changes bfloat16's a little.
    env = loopback_env(
        BLOCKSERVE_NUM_KV_BLOCKS=str(NUM_KV_BLOCKS), BLOCKSERVE_MAX_NUM_SEQS="32", BLOCKSERVE_DTYPE="float32"
    )
    processes = [
        start(["-m", "service.launch.cli", "scheduler"], env, logs / "scheduler.log"),
        start(["-m", "service.launch.cli", "worker"], env, logs / "worker.log"),
        start(["-m", "service.launch.cli", "api"], env, logs / "api.log"),
    ]
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    try:
        wait_ready(url, timeout_s=240)
        yield env, url
    finally:
        stop_all(processes)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    _, url = stack
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Give me an example {name} record as JSON."}]


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_answers_always_parse_and_validate(client, model, name):
    with ThreadPoolExecutor(len(SEEDS)) as pool:  # served in one batch, as a loaded server serves them
        replies = list(
            pool.map(
                lambda seed: client.chat.completions.create(
                    model=model,
                    messages=ask(name),
                    response_format=schema_format(name),
                    temperature=TEMPERATURE,
                    seed=seed,
                    max_tokens=150,
                ),
                SEEDS,
            )
        )
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_choice_and_regex_always_match(client, model):
    for seed in SEEDS:
        picked = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Is the sky green?"}],
            temperature=TEMPERATURE,
            seed=seed,
            max_tokens=10,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "not sure"]}},
        )
        assert picked.choices[0].message.content in {"yes", "no", "not sure"}
        dated = client.completions.create(
            model=model,
            prompt="The date today is ",
            temperature=TEMPERATURE,
            seed=seed,
            max_tokens=20,
            extra_body={"guided_regex": "20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"},
        )
        assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", dated.choices[0].text)
        assert dated.choices[0].finish_reason == "stop"


def test_json_object_and_a_lark_grammar(client, model):
    anything = client.chat.completions.create(
        model=model, messages=ask("user"), response_format={"type": "json_object"}, temperature=0, max_tokens=60
    )
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:  # a free-form object may run to max_tokens: its text is still a prefix of an object
        assert anything.choices[0].message.content.startswith("{")
    sql = client.completions.create(
        model=model,
        prompt="SQL to list the users: ",
        temperature=TEMPERATURE,
        seed=4,
        max_tokens=30,
        extra_body={
            "guided_grammar": 'start: "SELECT " COLS " FROM " TABLE ";"\nCOLS: "*" | "name" | "id, name"\nTABLE: "users" | "orders"'
        },
    )
    assert re.fullmatch(r"SELECT (\*|name|id, name) FROM (users|orders);", sql.choices[0].text)


def test_a_seeded_constrained_request_repeats_and_n_choices_each_validate(client, model):
    def run():
        return client.chat.completions.create(
            model=model,
            messages=ask("order"),
            response_format=schema_format("order"),
            temperature=TEMPERATURE,
            seed=11,
            n=2,
            max_tokens=150,
        )

    first, again = run(), run()
    texts = [choice.message.content for choice in first.choices]
    assert texts == [choice.message.content for choice in again.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), ORDER)


def test_streamed_constrained_deltas_join_into_valid_json(client, model):
    chunks = client.chat.completions.create(
        model=model,
        messages=ask("reading"),
        response_format=schema_format("reading"),
        temperature=TEMPERATURE,
        seed=5,
        max_tokens=150,
        stream=True,
    )
    text, finish = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), READING)


def test_max_tokens_cuts_a_constrained_answer_with_length(client, model):
    reply = client.chat.completions.create(
        model=model, messages=ask("person"), response_format=schema_format("person"), temperature=0, max_tokens=5
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5
    with pytest.raises(json.JSONDecodeError):  # cut, as OpenAI's are: the text is where the grammar had got to
        json.loads(reply.choices[0].message.content)
    assert reply.choices[0].message.content.startswith('{"')


def test_a_stop_string_cuts_the_constrained_text(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=ask("person"),
        response_format=schema_format("person"),
        temperature=0,
        stop=[", "],
        max_tokens=100,
    )
    assert reply.choices[0].finish_reason == "stop"
    content = reply.choices[0].message.content
    assert content.startswith('{"') and ", " not in content


def test_logprobs_come_with_the_constrained_tokens(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is water wet?"}],
        temperature=0,
        max_tokens=10,
        logprobs=True,
        top_logprobs=3,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    content = reply.choices[0].message.content
    assert content in {"yes", "no"}
    tokens = reply.choices[0].logprobs.content
    assert "".join(token.token for token in tokens[:-1]) == content
    assert tokens[-1].token == "<|im_end|>"  # the EOS the grammar allowed once complete
    assert all(token.logprob <= 0 and len(token.top_logprobs) == 3 for token in tokens)


def test_constrained_requests_at_once_share_steps_and_all_validate(stack, model):
    """(Preemption and recompute under a grammar: test_structured_outputs_worker.py, on the runner in-process.)"""
    env, url = stack
    before = scrape(env["BLOCKSERVE_METRICS_PORT"])

    async def one(index: int) -> dict:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        name = sorted(SCHEMAS)[index % len(SCHEMAS)]
        reply = await client.chat.completions.create(
            model=model,
            messages=ask(name),
            response_format=schema_format(name),
            temperature=TEMPERATURE,
            seed=100 + index,
            max_tokens=150,  # above these schemas' longest texts; the scheduler reserves room for a share of it
        )
        return name, reply.choices[0]

    async def all_requests():
        return await asyncio.gather(*(one(i) for i in range(8)))

    for name, choice in asyncio.run(all_requests()):
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    after = scrape(env["BLOCKSERVE_METRICS_PORT"])
    assert after["blockserve_grammar_mask_seconds_count"] > before["blockserve_grammar_mask_seconds_count"]
    assert after["blockserve_kv_blocks_free"] == NUM_KV_BLOCKS


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex"),
        ({"extra_body": {"guided_grammar": "start: nowhere"}}, "guided_grammar"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}}, "guided_choice"),
        ({"extra_body": {"guided_regex": "a+", "ignore_eos": True}}, "ignore_eos"),
    ],
)
def test_bad_constraints_get_a_400_naming_the_field(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=ask("person"), max_tokens=5, **extra)
    assert caught.value.body["param"] == param


def test_constrained_requests_are_counted_by_kind(stack, client, model):
    env, url = stack
    import httpx

    def constrained(kind: str) -> float:
        text = httpx.get(f"{url}/metrics").text
        line = re.search(rf'^blockserve_api_constrained_requests_total{{kind="{kind}"}} (\S+)$', text, re.M)
        return float(line.group(1))

    before = constrained("regex")
    client.completions.create(model=model, prompt="x", max_tokens=3, extra_body={"guided_regex": "[ab]{2}"})
    assert constrained("regex") == before + 1


def test_the_readme_structured_outputs_example_runs_as_written(stack):
    _, url = stack
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (example,) = [block for block in blocks if "structured_outputs" in block]
    assert "localhost:8000" in example, "the README example no longer talks to localhost:8000"
    example = example.replace("localhost:8000", url.removeprefix("http://"))
    result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    person, choice, date, sql, again = result.stdout.splitlines()
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    jsonschema.validate(json.loads(person), schema)
    jsonschema.validate(json.loads(again), schema)
    assert choice in {"yes", "no"}
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date)
    assert sql in {"SELECT name FROM users;", "SELECT * FROM users;"}


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(call, tools) -> None:
    (tool,) = [tool for tool in tools if tool["function"]["name"] == call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"


def test_required_tool_choice_gives_calls_with_valid_arguments(client, model):
    for seed in SEEDS:
        reply = client.chat.completions.create(
            model=model,
            messages=WEATHER_QUESTION,
            tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=TEMPERATURE,
            seed=seed,
            max_tokens=100,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0], [WEATHER_TOOL, TIME_TOOL])


def streamed_reply(client, **request) -> tuple[str, dict[int, list], str | None]:
    """A streamed reply's content, each call's deltas by index, and its finish_reason."""
    content, deltas, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            deltas.setdefault(call.index, []).append(call)
        finish = choice.finish_reason or finish
    return content, deltas, finish


def joined(deltas: dict[int, list]) -> list[tuple[str, str]]:
    """The calls a client joins from their deltas: each call's first delta has its id and name, the rest only
    pieces of its arguments."""
    calls = []
    for index, pieces in sorted(deltas.items()):
        first, rest = pieces[0], pieces[1:]
        assert first.id.startswith("call_") and first.type == "function" and first.function.name
        assert all(piece.id is None and piece.function.name is None for piece in rest)
        calls.append((first.function.name, "".join(piece.function.arguments or "" for piece in pieces)))
    assert list(sorted(deltas)) == list(range(len(deltas)))
    return calls


def test_a_named_tool_choice_calls_that_function_streamed_as_openai_does(client, model):
    _, deltas, finish = streamed_reply(
        client,
        model=model,
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=TEMPERATURE,
        seed=9,
        max_tokens=100,
    )
    assert finish == "tool_calls"
    calls = joined(deltas)
    assert [name for name, _ in calls] == ["get_time"] * len(calls) and calls
    for _, arguments in calls:
        jsonschema.validate(json.loads(arguments), TIME_TOOL["function"]["parameters"])


OPEN_CALL_TOKEN_IDS = (44, 19324, 79, 4350, 46)  # SmolLM2's "<", "tool", "_", "call", ">"


@pytest.mark.parametrize(
    "choice",
    [
        {"tool_choice": "required", "logit_bias": {"2": -100}},  # no EOS: calls until max_tokens, the last one cut
        # SmolLM2 never calls a tool of its own accord: pushed to begin one, the grammar of auto makes it a valid call.
        {"tool_choice": "auto", "logit_bias": {str(token_id): 10 for token_id in OPEN_CALL_TOKEN_IDS}},
    ],
    ids=["parallel required calls", "auto, a call begun"],
)
def test_streamed_tool_calls_join_into_the_calls_of_the_same_reply_unstreamed(client, model, choice):
    request = dict(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        # Greedy: the second request finds more of its prompt in the prefix cache, and a float32 logit a few ulps
        # off can flip a sampled token (seen here); the greedy choice flips only at an exact tie.
        temperature=0,
        max_tokens=70,  # a call takes about 30 tokens
        **choice,
    )
    whole = client.chat.completions.create(**request).choices[0]
    content, deltas, finish = streamed_reply(client, **request)
    calls = [(call.function.name, call.function.arguments) for call in whole.message.tool_calls or []]
    assert joined(deltas) == calls
    assert content == (whole.message.content or "") and finish == whole.finish_reason
    assert "<tool_call>" not in content
    assert len(calls) >= (2 if choice["tool_choice"] == "required" else 1)
    for name, arguments in calls[:-1] if finish == "length" else calls:  # max_tokens may cut the last one
        (tool,) = [tool for tool in (WEATHER_TOOL, TIME_TOOL) if tool["function"]["name"] == name]
        jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


def test_a_tool_choice_naming_an_unknown_function_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model,
            messages=WEATHER_QUESTION,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "launch_rockets"}},
            max_tokens=5,
        )
    assert caught.value.body["param"] == "tool_choice"
