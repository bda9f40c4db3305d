"""The OpenAPI document says what the server does: its error answers, content types and request shapes."""

import httpx
import msgspec
import pytest

from service.api.errors import ApiError
from service.api.protocol import ChatCompletionChunk, ChatCompletionRequest
from service.api.served_model import ServedModel
from tests.support.fake_scheduler import ApiServer, FakeScheduler
from tests.support.tiny_model import MODEL_NAME, tiny_model_info

from .test_api_errors import assert_openai_error

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}


@pytest.fixture(scope="module")
def http(stack):
    _, api = stack
    with httpx.Client(base_url=api.base_url, timeout=10) as client:
        yield client


@pytest.fixture(scope="module")
def spec(http):
    return http.get("/openapi.json").json()


def test_no_route_documents_fastapis_422(spec):
    statuses = {
        status for operations in spec["paths"].values() for op in operations.values() for status in op["responses"]
    }
    assert "422" not in statuses
    assert "HTTPValidationError" not in spec["components"]["schemas"]


@pytest.mark.parametrize("path", GENERATION_ROUTES)
def test_generation_routes_document_400_error_bodies_and_streamed_events(spec, path):
    responses = spec["paths"][path]["post"]["responses"]
    assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert {"413", "404", "503"} <= set(responses)
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}


def test_the_error_schema_is_the_shape_the_server_answers(spec, http):
    detail = spec["components"]["schemas"]["ErrorDetail"]
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": ""}), 400)
    assert set(detail["properties"]) == set(error) == set(detail["required"])


def test_metrics_are_documented_as_text(spec, http):
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


def test_a_stream_answers_with_the_documented_event_stream_type(http):
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")


def test_the_documented_event_payloads_are_the_chunks_the_server_streams(spec, http):
    event = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    done, payload = event["properties"]["data"]["anyOf"]
    chunk_ref = payload["contentSchema"]["anyOf"][0]["$ref"]
    assert chunk_ref == "#/components/schemas/ChatCompletionChunk"
    assert "ChatCompletionChunk" in spec["components"]["schemas"]

    messages = [{"role": "user", "content": "hi"}]
    response = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "stream": True})
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert data[-1] == done["const"]
    assert all(ChatCompletionChunk.model_validate_json(item).object == "chat.completion.chunk" for item in data[:-1])


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/v1/completions"), ("DELETE", "/v1/models"), ("POST", "/health")]
)
def test_a_405_names_the_allowed_methods(http, method, path):
    response = http.request(method, path)
    assert_openai_error(response, 405)
    allowed = {method.strip() for method in response.headers["allow"].split(",")}
    assert allowed == {method.upper() for method in spec_methods(http, path)}


def spec_methods(http, path):
    return http.get("/openapi.json").json()["paths"][path]


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], ["ok", ""]])
def test_empty_prompts_are_schema_errors(http, prompt):
    assert_openai_error(http.post("/v1/completions", json={"prompt": prompt}), 400)


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "12 degrees"}, "messages.1.tool_call_id"),
        ({"role": "tool", "tool_call_id": "call_1"}, "messages.1.content"),
        ({"role": "assistant"}, "messages.1"),
        ({"role": "assistant", "content": None}, "messages.1"),
        ({"role": "user"}, "messages.1.content"),
        ({"role": "system", "content": None}, "messages.1.content"),
        ({"role": "assistant", "tool_calls": [{"id": "x", "type": "function"}]}, "messages.1.tool_calls.0.function"),
    ],
)
def test_messages_have_the_shape_openai_defines_for_their_role(http, message, param):
    messages = [{"role": "user", "content": "Weather in Oslo?"}, message]
    assert_openai_error(http.post("/v1/chat/completions", json={"messages": messages}), 400, param)


def test_an_assistant_message_may_carry_tool_calls_without_content(http):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "12 degrees", "tool_call_id": "call_1"},
    ]
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_the_request_models_encode_the_role_shapes(spec):
    schemas = spec["components"]["schemas"]
    assert set(schemas["ToolMessageParam"]["required"]) == {"role", "content", "tool_call_id"}
    assert "content" not in schemas["AssistantMessageParam"].get("required", [])
    prompt_forms = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert all(form.get("minLength", form.get("minItems")) == 1 for form in prompt_forms)


def test_a_chat_template_failure_is_a_400_that_names_the_message():
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('tools are not supported') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    model = ServedModel(msgspec.structs.replace(tiny_model_info(), chat_template=template))
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": "12", "tool_call_id": "call_1"},
    ]
    with pytest.raises(ApiError) as raised:
        model.encode_chat(messages)
    assert raised.value.status_code == 400
    assert raised.value.param == "messages.2"
    assert "messages[2] (role 'tool')" in raised.value.message
    assert "tools are not supported" in raised.value.message


def test_the_gguf_file_name_is_accepted_as_an_alias_of_the_model():
    info = msgspec.structs.replace(tiny_model_info(), aliases=["tiny-test-model.Q4_1"])
    model = ServedModel(info)
    model.check_name("tiny-test-model.Q4_1")
    model.check_name(MODEL_NAME)
    with pytest.raises(ApiError):
        model.check_name("tiny-test-model.Q8_0")


def test_with_an_api_key_the_docs_and_the_spec_stay_open_on_purpose():
    with FakeScheduler() as fake, ApiServer(fake.addr, api_key="sekrit") as api:
        api.wait_ready()
        with httpx.Client(base_url=api.base_url, timeout=10) as http:
            assert [http.get(path).status_code for path in ("/docs", "/redoc", "/openapi.json")] == [200, 200, 200]
            assert_openai_error(http.get("/v1/models"), 401)


def request_validator(spec: dict, schema_name: str):
    """A JSON Schema validator of the document's request body `schema_name` (its refs resolved in the document)."""
    import jsonschema

    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{schema_name}", **spec})


@pytest.mark.parametrize(
    ("path", "schema_name", "body"),
    [
        ("/v1/chat/completions", "ChatCompletionRequest", {"top_logprobs": 2}),
        ("/v1/chat/completions", "ChatCompletionRequest", {"top_logprobs": 0, "logprobs": False}),
        ("/v1/chat/completions", "ChatCompletionRequest", {"top_logprobs": 2, "logprobs": True}),
        ("/v1/chat/completions", "ChatCompletionRequest", {"top_logprobs": None, "logprobs": False}),
        ("/v1/completions", "CompletionRequest", {"echo": True, "logprobs": 0}),
        ("/v1/completions", "CompletionRequest", {"echo": True, "logprobs": None}),
        ("/v1/completions", "CompletionRequest", {"echo": False, "logprobs": 2}),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [{"role": "assistant"}]}),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [{"role": "assistant", "content": None}]}),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [{"role": "assistant", "content": "hi"}]}),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {"messages": [{"role": "assistant", "tool_calls": [TOOL_CALL]}, {"role": "user", "content": "and?"}]},
        ),
    ],
)
def test_the_documents_cross_field_rules_are_the_servers(spec, http, path, schema_name, body):
    body = {
        "model": MODEL_NAME,
        "prompt": "hi",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **body,
    }
    documented_valid = request_validator(spec, schema_name).is_valid(body)
    response = http.post(path, json=body)
    assert response.status_code == (200 if documented_valid else 400), (documented_valid, response.text)


def test_the_document_bounds_token_ids_by_the_served_vocabulary(spec, http):
    vocab_size = tiny_model_info().vocab_size
    validator = request_validator(spec, "CompletionRequest")
    for token_id, fits in ((0, True), (vocab_size - 1, True), (vocab_size, False), (10**9, False)):
        for body in (
            {"prompt": [token_id]},
            {"prompt": [[1], [token_id]]},
            {"prompt": "hi", "stop_token_ids": [token_id]},
            {"prompt": "hi", "logit_bias": {str(token_id): 1}},
        ):
            assert validator.is_valid({**body, "max_tokens": 1}) is fits, (body, fits)
            assert http.post("/v1/completions", json={**body, "max_tokens": 1}).status_code == (200 if fits else 400)
    assert not validator.is_valid({"prompt": "hi", "logit_bias": {"007": 1}})
    assert not validator.is_valid({"prompt": "hi", "logit_bias": {"5": 100.5}})


def test_the_document_lists_the_model_route(spec):
    operation = spec["paths"]["/v1/models/{model_id}"]["get"]
    assert {"200", "404"} <= set(operation["responses"])
    assert [parameter["name"] for parameter in operation["parameters"]] == ["model_id"]


def test_an_assistant_message_of_tool_calls_alone_reaches_the_template_with_empty_content():
    # SmolLM2's template adds message['content'] to text, as many do; vLLM gives such a message "" too.
    template = "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}"
    model = ServedModel(msgspec.structs.replace(tiny_model_info(), chat_template=template))
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [TOOL_CALL]}]}
    )
    prompt = model.encode_chat([message.template_dict() for message in body.messages])
    assert model.decode(prompt) == "<user>Weather?<assistant>"
