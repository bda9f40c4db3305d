"""The api as OpenAI's own client sees it, in front of a scripted scheduler."""

import msgspec
import openai
import pytest

from service.api.detokenizer import REPLACEMENT_CHAR
from tests.support.fake_scheduler import ApiServer, FakeScheduler, wait_until
from tests.support.tiny_model import CHAT_TEMPLATE, MAX_MODEL_LEN, MODEL_NAME, tiny_model_info, tiny_tokenizer

CHAT = [{"role": "user", "content": "Say hello"}]


@pytest.fixture
def fake(stack):
    fake, _ = stack
    fake.reply_text = "Hello world"
    return fake


@pytest.fixture
def client(stack):
    _, api = stack
    return openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_completion_returns_the_scheduler_tokens_as_text_with_usage(fake, client):
    completion = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=10)

    assert completion.choices[0].text == "Hello world"
    assert completion.choices[0].finish_reason == "stop"
    prompt_ids = tiny_tokenizer().encode("Once upon", add_special_tokens=False).ids
    assert fake.generated[-1].prompt_token_ids == prompt_ids
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert completion.usage.completion_tokens == len(fake.reply_tokens()) + 1  # and the EOS token
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_completion_defaults_to_16_tokens_and_finishes_with_length(fake, client):
    fake.reply_text = "Once upon a time a small model served tokens to many clients, one block at a time."
    completion = client.completions.create(model=MODEL_NAME, prompt="Go")
    assert fake.generated[-1].sampling.max_tokens == 16
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 16


def test_completion_accepts_token_ids_and_batches_of_prompts(fake, client):
    completion = client.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=3)
    assert [choice.index for choice in completion.choices] == [0, 1, 2, 3]
    assert [request.prompt_token_ids for request in fake.generated[-4:]] == [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    assert completion.usage.prompt_tokens == 5


def test_echo_puts_the_prompt_before_the_completion(client):
    completion = client.completions.create(model=MODEL_NAME, prompt="Say: ", max_tokens=5, echo=True)
    assert completion.choices[0].text == "Say: Hello world"


def test_sampling_parameters_reach_the_scheduler(fake, client):
    client.completions.create(
        model=MODEL_NAME,
        prompt="Hi",
        max_tokens=4,
        n=2,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [42], "ignore_eos": True},
    )
    first, second = (request.sampling for request in fake.generated[-2:])
    assert (first.temperature, first.top_p, first.top_k, first.min_p) == (0.5, 0.9, 20, 0.05)
    assert (first.presence_penalty, first.frequency_penalty, first.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (first.stop_token_ids, first.ignore_eos, first.max_tokens) == ([42], True, 4)
    assert (first.seed, second.seed) == (7, 8)  # n choices are independent samples, each reproducible


def test_chat_renders_the_template_and_defaults_max_tokens_to_the_rest_of_the_context(fake, client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT)

    prompt = "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\n"
    expected_ids = tiny_tokenizer().encode(prompt, add_special_tokens=False).ids
    assert fake.generated[-1].prompt_token_ids == expected_ids
    assert fake.generated[-1].sampling.max_tokens == MAX_MODEL_LEN - len(expected_ids)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == "Hello world"
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.prompt_tokens == len(expected_ids)


def test_chat_max_completion_tokens_limits_the_reply(fake, client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=2)
    assert fake.generated[-1].sampling.max_tokens == 2
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 2


def test_n_choices_are_separate_scheduler_requests_with_their_own_index(fake, client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, n=2)
    assert sorted(choice.index for choice in chat.choices) == [0, 1]
    assert all(choice.message.content == "Hello world" for choice in chat.choices)
    request_ids = [request.request_id for request in fake.generated[-2:]]
    assert len(set(request_ids)) == 2


def test_streamed_chat_sends_role_then_text_then_finish_then_usage(fake, client):
    fake.reply_text = "naïve 日本語 🙂"
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, stream=True, stream_options={"include_usage": True}
        )
    )

    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    assert "".join(texts) == "naïve 日本語 🙂"
    assert not any(REPLACEMENT_CHAR in text for text in texts)
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(fake.reply_tokens()) + 1


def test_streamed_completion_with_two_choices_interleaves_them_by_index(fake, client, monkeypatch):
    monkeypatch.setattr(fake, "token_delay_s", 0.1)  # both choices' tokens come a step apart, side by side
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=8, n=2, stream=True))
    indexes = [chunk.choices[0].index for chunk in chunks]
    assert len(indexes) == 2 * (len(fake.reply_tokens()) + 1)  # a chunk per token and choice, and the EOS
    steps = [set(indexes[i : i + 2]) for i in range(0, len(indexes), 2)]
    assert steps == [{0, 1}] * len(steps), indexes  # each step's pieces as they come, not one choice after the other
    for index in (0, 1):
        mine = [chunk.choices[0] for chunk in chunks if chunk.choices[0].index == index]
        assert "".join(choice.text for choice in mine) == "Hello world"
        assert mine[-1].finish_reason == "stop"
    assert all(chunk.usage is None for chunk in chunks)


def test_a_stop_string_split_across_tokens_ends_the_stream_without_leaking_any_of_it(fake, client):
    fake.reply_text = "Hello there, world"
    pieces = [tiny_tokenizer().decode([token]) for token in fake.reply_tokens()]
    stop = "lo th"
    assert not any(stop in piece for piece in pieces), "the stop string must span tokens"

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, stop=[stop, "never"], stream=True))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)

    assert text == "Hel"
    assert chunks[-1].choices[0].finish_reason == "stop"
    request_id = fake.generated[-1].request_id
    wait_until(lambda: request_id in fake.aborted)  # the scheduler was told to stop generating


def test_a_stop_string_cuts_a_whole_completion(fake, client):
    completion = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=10, stop=" wor")
    assert completion.choices[0].text == "Hello"
    assert completion.choices[0].finish_reason == "stop"


def test_chat_logprobs_have_openai_shape(fake, client):
    fake.reply_text = "café"
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, logprobs=True, top_logprobs=2)

    assert fake.generated[-1].sampling.logprobs == 2
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert content[0].logprob == pytest.approx(-0.25)
    # A token holding half of "é" reports its exact bytes; all bytes together spell the text.
    assert bytes(b for entry in content for b in entry.bytes).decode("utf-8").startswith("café")


def test_completion_logprobs_have_openai_shape(fake, client):
    completion = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3, logprobs=1)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 3
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset == [0, len(logprobs.tokens[0]), len(logprobs.tokens[0]) + len(logprobs.tokens[1])]
    assert all(token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs))


def test_models_lists_the_served_model(client):
    assert [model.id for model in client.models.list()] == [MODEL_NAME]


def test_models_retrieve_finds_the_served_model_by_name_and_alias(client):
    model = client.models.retrieve(MODEL_NAME)
    assert (model.id, model.object, model.owned_by) == (MODEL_NAME, "model", "blockserve")
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"


def test_logit_bias_reaches_the_scheduler_as_token_ids(fake, client):
    client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, logit_bias={"5": 100, "17": -42.5})
    assert fake.generated[-1].sampling.logit_bias == {5: 100.0, 17: -42.5}
    client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, logit_bias={"0": -100})
    assert fake.generated[-1].sampling.logit_bias == {0: -100.0}


def test_whole_numbers_written_as_floats_are_integers(fake, client):
    # JSON has one number type: 3.0 is the integer 3 (JSON Schema says so too); 2.5 is refused elsewhere.
    client.completions.create(
        model=MODEL_NAME,
        prompt=[5.0, 6.0],
        max_tokens=3.0,
        n=1.0,
        extra_body={"seed": 7.0, "stop_token_ids": [9.0], "priority": -2.0},
    )
    sent = fake.generated[-1]
    assert sent.prompt_token_ids == [5, 6] and (sent.sampling.max_tokens, sent.sampling.seed) == (3, 7)
    assert sent.priority == -2
    assert sent.sampling.stop_token_ids == [9]


TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in ("weather", "now")
]
# (BLOCKSERVE_TOOL_CALL_PARSER, the reply the scheduler scripts, its content)
TOOL_CALL_REPLIES = {
    "hermes": (
        "auto",  # the tiny template shows no calls: Hermes
        'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": [1, 2]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        "Let me check.",
    ),
    "llama3_json": (
        "llama3_json",
        '{"name": "weather", "parameters": {"city": "Oslo", "days": [1, 2]}}; {"name": "now", "parameters": {}}',
        "",
    ),
}


@pytest.fixture(scope="module", params=sorted(TOOL_CALL_REPLIES))
def tools_stack(request):
    """A model whose chat template renders tools itself (no preamble: a short prompt), with room for a reply of
    calls in the tiny tokenizer's many tokens, and its scripted reply of calls in the format of the parser set."""
    parser, reply, content = TOOL_CALL_REPLIES[request.param]
    template = CHAT_TEMPLATE + "{% if tools %}{% endif %}"
    info = msgspec.structs.replace(tiny_model_info(), chat_template=template, max_model_len=512)
    with FakeScheduler(model=info) as fake, ApiServer(fake.addr, tool_call_parser=parser) as api:
        api.wait_ready()
        fake.reply_text = reply
        yield openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0, timeout=10), content


def test_streamed_tool_calls_come_as_openai_sends_them_one_token_a_delta(tools_stack):
    client, expected_content = tools_stack
    request = dict(model=MODEL_NAME, messages=CHAT, tools=TOOLS)
    whole = client.chat.completions.create(**request).choices[0]
    content, pieces, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        pieces += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert [(call.function.name, call.function.arguments) for call in whole.message.tool_calls] == [
        ("weather", '{"city": "Oslo", "days": [1, 2]}'),
        ("now", "{}"),
    ]
    assert (whole.message.content or "") == content == expected_content
    assert whole.finish_reason == finish == "tool_calls"
    firsts = [piece for piece in pieces if piece.id is not None]
    assert [(piece.index, piece.type, piece.function.name) for piece in firsts] == [
        (0, "function", "weather"),
        (1, "function", "now"),
    ]
    assert all(piece.function.name is None and piece.type is None for piece in pieces if piece.id is None)
    for index, call in enumerate(whole.message.tool_calls):
        arguments = "".join(piece.function.arguments or "" for piece in pieces if piece.index == index)
        assert arguments == call.function.arguments
    assert len([piece for piece in pieces if piece.index == 0]) > 3  # the arguments came in pieces
