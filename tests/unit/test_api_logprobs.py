import math

from service.api.choice import SampledLogprobs
from service.api.logprobs import MIN_LOGPROB, chat_logprobs, completion_logprobs
from service.api.served_model import ServedModel
from service.contract.wire import TokenLogprob
from tests.support.tiny_model import tiny_model_info

MODEL = ServedModel(tiny_model_info())


def sampled(text: str) -> list[SampledLogprobs]:
    token_ids = MODEL.tokenizer.encode(text, add_special_tokens=False).ids
    return [SampledLogprobs(token_id, -1.0, [TokenLogprob(token_id, -1.0)]) for token_id in token_ids]


def test_chat_logprobs_give_the_exact_bytes_of_tokens_that_hold_part_of_a_character():
    content = chat_logprobs(MODEL, sampled("🚀")).content
    assert len(content) > 1  # the rocket spans tokens
    assert bytes(b for entry in content for b in entry.bytes) == "🚀".encode()


def test_an_impossible_token_gets_a_finite_logprob_because_json_has_no_infinity():
    token_id = MODEL.tokenizer.token_to_id("<|im_end|>")
    entry = SampledLogprobs(token_id, -math.inf, [TokenLogprob(token_id, -math.inf)])
    assert chat_logprobs(MODEL, [entry]).content[0].logprob == MIN_LOGPROB
    assert completion_logprobs(MODEL, [entry], 0).token_logprobs == [MIN_LOGPROB]


def test_completion_logprobs_list_tokens_with_their_text_offsets():
    logprobs = completion_logprobs(MODEL, sampled("Hello world"), text_offset=3)
    assert "".join(logprobs.tokens) == "Hello world"
    assert logprobs.text_offset[0] == 3
    assert logprobs.text_offset[-1] == 3 + len("Hello world") - len(logprobs.tokens[-1])
    assert all(top == {token: -1.0} for token, top in zip(logprobs.tokens, logprobs.top_logprobs))
