"""`blockserve bench`'s client: what each request sends, and the streamed tokens it times."""

from __future__ import annotations

import asyncio
import json

import httpx

from service.tools.bench.client import RequestTiming, _one
from service.tools.workload import TraceRequest


def stream_of(texts: list[str]) -> bytes:
    chunks = [{"choices": [{"text": text}]} for text in texts] + [{"usage": {"completion_tokens": len(texts)}}]
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks).encode() + b"data: [DONE]\n\n"


def send(sampling: dict | None) -> tuple[dict, RequestTiming]:
    sent = {}

    def handler(request: httpx.Request) -> httpx.Response:
        sent.update(json.loads(request.content))
        return httpx.Response(200, content=stream_of(["a", "b", "c"]))

    request = TraceRequest("r0", 0.0, [5, 6, 7], max_tokens=3)
    timing = RequestTiming("r0", 3, 3)

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            extra = {} if sampling is None else {"sampling": sampling}
            await _one(http, "http://server", "m", request, True, timing, **extra)

    asyncio.run(run())
    return sent, timing


def test_requests_decode_greedily_unless_given_sampling_fields():
    greedy, timing = send(None)
    sampled, _ = send({"temperature": 0.7, "top_p": 0.9, "top_k": 40})

    assert greedy["temperature"] == 0.0 and "top_p" not in greedy and "top_k" not in greedy
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (0.7, 0.9, 40)
    assert sampled["prompt"] == [5, 6, 7] and sampled["max_tokens"] == 3 and sampled["stream"] is True
    assert timing.ok and timing.completion_tokens == 3 and len(timing.token_times_s) == 3


def test_a_json_schema_goes_with_every_request_as_response_format_and_lets_eos_end_it(tmp_path):
    import argparse

    from service.tools.bench.command import add_arguments, ignores_eos, sampling_fields

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for given in (json.dumps(schema), f"@{tmp_path / 'schema.json'}"):
        args = parser.parse_args(["--json-schema", given])
        fields = sampling_fields(args)
        assert fields["response_format"]["type"] == "json_schema"
        assert fields["response_format"]["json_schema"]["schema"] == schema
        assert not ignores_eos(args)
    plain = parser.parse_args([])
    assert "response_format" not in sampling_fields(plain) and ignores_eos(plain)
