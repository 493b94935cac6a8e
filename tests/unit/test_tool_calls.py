"""Tool calls in chat completions, the pure parts: the demo model's chat template (tools, an assistant's tool
calls, tool results; unchanged without them), the messages as the template takes them (arguments parsed,
bad ones a 400 naming the message), vLLM's tool parser looked up by name (an unknown one a config error)
and applied to sampled text. Through a real gateway: tests/generator/test_serve_api.py."""

from __future__ import annotations

import json

import pytest

from asyncrl.config import ConfigError
from asyncrl.demo_model import CHAT_TEMPLATE
from asyncrl.generator.gateway_core import HTTPError, plain_message

# The demo template before tools existed: chats without tools must render exactly as with it.
OLD_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}


@pytest.fixture(scope="module")
def tok(demo_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_model_path))


def _render(tok, messages, **kw):
    return tok.apply_chat_template(messages, chat_template=kw.pop("template", CHAT_TEMPLATE), tokenize=False, **kw)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is 1+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+2?"},
     {"role": "assistant", "content": "3"}, {"role": "user", "content": "And 4 more?"}],
    [{"role": "user", "content": ""}],
])
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_the_demo_template_renders_chats_without_tools_as_before(tok, messages, gen_prompt):
    assert _render(tok, messages, add_generation_prompt=gen_prompt) == _render(
        tok, messages, template=OLD_TEMPLATE, add_generation_prompt=gen_prompt)


def test_the_demo_template_renders_tools_calls_and_results(tok):
    messages = [plain_message(m, i) for i, m in enumerate([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ])]
    text = _render(tok, messages, tools=[ADD], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")  # the system message joins the tools' turn
    assert text.count("Be brief.") == 1
    assert "\n" + json.dumps(ADD) + "\n</tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_messages_keep_tool_calls_with_parsed_arguments_and_tool_call_ids():
    m = plain_message({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}}]}, 2)
    assert m == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}},
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}}]}
    assert plain_message({"role": "tool", "tool_call_id": "c1", "content": "3"}) == {"role": "tool", "content": "3", "tool_call_id": "c1"}
    assert plain_message({"role": "user", "content": "hi"}) == {"role": "user", "content": "hi"}


@pytest.mark.parametrize("message, fragment", [
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{a: 1"}}]},
     "messages[3].tool_calls[0].function.arguments is not JSON"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]},
     "messages[3].tool_calls[0] must be"),
    ({"role": "user", "content": "hi", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add"}}]},
     "only an assistant message has tool_calls"),
])
def test_malformed_tool_calls_are_400_naming_the_message(message, fragment):
    with pytest.raises(HTTPError) as err:
        plain_message(message, 3)
    assert err.value.status == 400 and fragment in err.value.message


def test_tool_parsers_are_vllms_by_name_and_an_unknown_name_is_a_config_error():
    from asyncrl.generator.vllm_engine import tool_parser_class

    assert tool_parser_class("hermes").__name__ == "Hermes2ProToolParser"
    with pytest.raises(ConfigError, match=r"generator.tool_parser: 'nope' is not one of vLLM's tool parsers \(.*hermes"):
        tool_parser_class("nope")


def test_sampled_text_becomes_tool_calls_by_the_parser(tok):
    from asyncrl.generator.openai_api import parse_tool_calls
    from asyncrl.generator.vllm_engine import openai_protocol, tool_parser_class

    chat = openai_protocol()[0]
    req = chat.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "What is 1+2?"}], tools=[ADD])
    assert req.tool_choice == "auto"  # vLLM's default once tools are given
    hermes = tool_parser_class("hermes")
    content, calls = parse_tool_calls(hermes, tok, 'Adding.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', req)
    assert content == "Adding."
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [("function", "add", {"a": 1, "b": 2})]
    assert all(c.id for c in calls)
    assert parse_tool_calls(hermes, tok, "3", req) == ("3", [])
    assert parse_tool_calls(hermes, tok, "<tool_call>{not json</tool_call>", req) == ("<tool_call>{not json</tool_call>", [])


def test_tool_requests_the_gateway_cannot_honour_are_400():
    from asyncrl.generator.openai_api import chat_tools
    from asyncrl.generator.vllm_engine import openai_protocol, tool_parser_class

    chat = openai_protocol()[0]
    hermes = tool_parser_class("hermes")
    msgs = [{"role": "user", "content": "What is 1+2?"}]

    def req(**kw):
        return chat.ChatCompletionRequest(model="m", messages=msgs, **kw)

    assert chat_tools(req(), None) is None and chat_tools(req(), hermes) is None  # no tools: nothing to check
    assert chat_tools(req(tools=[ADD]), hermes) == [ADD]
    assert chat_tools(req(tools=[ADD], tool_choice="none"), hermes) == [ADD]  # rendered, not parsed
    for kw, fragment, parser in [
        ({"tools": [ADD]}, "tools need generator.tool_parser", None),
        ({"tools": [ADD], "tool_choice": "required"}, "tool_choice=required: only auto and none", hermes),
        ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice=a named function", hermes),
        ({"tools": [ADD], "stream": True}, "tools with stream=true are not supported", hermes),
    ]:
        with pytest.raises(HTTPError) as err:
            chat_tools(req(**kw), parser)
        assert err.value.status == 400 and fragment in err.value.message, kw
