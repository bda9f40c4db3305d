import pytest

from service.api.chat_template import ChatTemplateError, render_chat

ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def test_messages_render_with_the_generation_prompt_and_special_tokens():
    text = render_chat(ALTERNATING, [{"role": "user", "content": "hi"}], bos_token="<s>")
    assert text == "<s>[user] hi\n[assistant] "


def test_raise_exception_in_a_template_becomes_a_chat_template_error():
    with pytest.raises(ChatTemplateError, match="must alternate"):
        render_chat(ALTERNATING, [{"role": "assistant", "content": "hi"}])


def test_tojson_keeps_non_ascii_text():
    assert render_chat("{{ messages[0] | tojson }}", [{"content": "café"}]) == '{"content": "café"}'


def test_the_template_runs_in_a_sandbox():
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", [])


def test_a_template_that_does_not_compile_is_a_chat_template_error():
    with pytest.raises(ChatTemplateError):
        render_chat("{% for %}", [])
