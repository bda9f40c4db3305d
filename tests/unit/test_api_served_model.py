import msgspec
import pytest

from service.api.errors import ApiError
from service.api.served_model import ServedModel
from tests.support.tiny_model import MAX_MODEL_LEN, tiny_model_info

BOS = 0  # <|endoftext|> in the tiny tokenizer


def model_with_bos(chat_template: str) -> ServedModel:
    info = msgspec.structs.replace(tiny_model_info(), bos_token_id=BOS, add_bos_token=True, chat_template=chat_template)
    return ServedModel(info)


def test_a_model_that_wants_bos_gets_it_once_whether_or_not_the_template_adds_it():
    plain = model_with_bos("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with_bos_in_template = model_with_bos("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "Hello"}]

    assert plain.encode("Hello")[0] == BOS
    assert plain.encode_chat(messages) == with_bos_in_template.encode_chat(messages)
    assert with_bos_in_template.encode_chat(messages).count(BOS) == 1


def test_without_max_tokens_a_request_gets_the_rest_of_the_context():
    model = ServedModel(tiny_model_info())
    assert model.check_fits(100, None) == MAX_MODEL_LEN - 100
    assert model.check_fits(100, 28) == 28


@pytest.mark.parametrize(("num_prompt_tokens", "max_tokens"), [(MAX_MODEL_LEN, None), (100, 29), (0, 5)])
def test_requests_that_cannot_fit_are_400(num_prompt_tokens, max_tokens):
    with pytest.raises(ApiError) as excinfo:
        ServedModel(tiny_model_info()).check_fits(num_prompt_tokens, max_tokens)
    assert excinfo.value.status_code == 400
