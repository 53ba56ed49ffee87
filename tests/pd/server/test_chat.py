"""Chat templates: each family's template renders and tokenizes exactly as transformers'
`apply_chat_template` does on the same checkpoint."""

from __future__ import annotations

import json

import pytest

from pd.server.chat import ChatTemplate, ChatTemplateError
from pd.tokenizer import Tokenizer
from tests.support.server_harness import ARCHS

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me about the sea, 中文 and émoji 🎉."}],
]


@pytest.fixture(scope="module")
def hf_tokenizers(tiny_models):
    from transformers import AutoTokenizer

    return {arch: AutoTokenizer.from_pretrained(tiny_models[arch]) for arch in ARCHS}


def template_for(model_dir) -> tuple[ChatTemplate, Tokenizer]:
    tokenizer = Tokenizer(model_dir)
    return ChatTemplate.from_model_dir(model_dir, tokenizer.config), tokenizer


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_and_tokenizes_like_transformers(tiny_models, hf_tokenizers, arch: str,
                                                 add_generation_prompt: bool) -> None:
    template, tokenizer = template_for(tiny_models[arch])
    hf = hf_tokenizers[arch]
    for messages in CONVERSATIONS:
        expected_text = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        expected_ids = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                              tokenize=True)["input_ids"]
        assert template.render(messages, add_generation_prompt) == expected_text
        assert template.encode(tokenizer, messages, add_generation_prompt) == list(expected_ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_prompt_opens_the_assistant_turn(tiny_models, arch: str) -> None:
    template, _ = template_for(tiny_models[arch])
    messages = CONVERSATIONS[0]
    with_prompt = template.render(messages, add_generation_prompt=True)
    without = template.render(messages, add_generation_prompt=False)
    assert with_prompt.startswith(without) and len(with_prompt) > len(without)
    opening = with_prompt[len(without):]
    assert ("model" if arch == "gemma3" else "assistant") in opening


def test_bos_token_comes_from_the_tokenizer_config(tiny_models) -> None:
    template, tokenizer = template_for(tiny_models["bamba"])
    ids = template.encode(tokenizer, CONVERSATIONS[0])
    assert ids[0] == tokenizer.token_id("<|begin_of_text|>")
    assert ids.count(ids[0]) == 1  # not added a second time by the tokenizer


def test_raise_exception_in_a_template_is_a_chat_template_error(tiny_models) -> None:
    template, _ = template_for(tiny_models["gemma3"])
    with pytest.raises(ChatTemplateError, match="alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_model_without_a_template_refuses_chat() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate(None, {}).render([{"role": "user", "content": "x"}])


def test_named_templates_and_dict_tokens(tmp_path) -> None:
    config = {"chat_template": [{"name": "tool_use", "template": "TOOLS"},
                                {"name": "default", "template": "{{ bos_token }}{{ messages[0].content | tojson }}"}],
              "bos_token": {"content": "<s>", "lstrip": False}}
    template = ChatTemplate.from_model_dir(tmp_path, config)
    assert template.render([{"role": "user", "content": "é<"}]) == '<s>"é<"'  # tojson: no escaping


def test_chat_template_jinja_file_wins_over_the_config(tmp_path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    template = ChatTemplate.from_model_dir(tmp_path, {"chat_template": "ignored"})
    assert template.render([{"role": "user", "content": "x"}]) == "[user]"


def test_loop_controls_and_sandbox(tmp_path) -> None:
    source = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    assert ChatTemplate(source, {}).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"
    evil = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(ChatTemplateError):
        evil.render([{"role": "user", "content": "x"}])
    assert json.loads(ChatTemplate("{{ messages | tojson }}", {}).render([{"role": "user", "content": "x"}]))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
    {"role": "tool", "content": "9 C", "tool_call_id": "c2"},
]


def test_the_qwen3_template_shows_tools_calls_and_results_like_transformers(tiny_models, hf_tokenizers) -> None:
    template, tokenizer = template_for(tiny_models["qwen3"])
    assert template.renders_tools
    hf = hf_tokenizers["qwen3"]
    for messages in (CONVERSATIONS[1], TOOL_CONVERSATION):
        expected = hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        text = template.render(messages, True, tools=TOOLS)
        assert text == expected
        assert "<tools>\n" + json.dumps(TOOLS[0]) in text and "<tool_call>" in text
    text = template.render(TOOL_CONVERSATION, True, tools=TOOLS)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert text.count("<tool_response>") == 2 and text.count("<|im_start|>user") == 2  # results share a turn
    assert template.render(CONVERSATIONS[1], True) == \
        hf.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True, tokenize=False)


def test_a_template_that_never_reads_tools_says_so(tiny_models) -> None:
    assert not template_for(tiny_models["gemma3"])[0].renders_tools
