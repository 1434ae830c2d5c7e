"""The Hermes tool-call parser, whole and streamed, and chat templates that refuse."""

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replica.chat_template import chat_prompt_ids, load_chat_template
from router.api.tool_calls import ToolCallStream, parse

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_parse_splits_calls_from_content():
    content, calls = parse(f"Let me add.\n{CALL}\n{CALL}")
    assert content == "Let me add.\n\n" and [c.name for c in calls] == ["add", "add"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2} and calls[0].id != calls[1].id
    # Not a call (bad JSON, no name, never closed): it stays content, nothing is lost.
    for text in ("<tool_call>{nope}</tool_call>", '<tool_call>{"x": 1}</tool_call>', "<tool_call>{"):
        assert parse(text) == (text, [])


@given(st.text(alphabet="ab<>/_tolcl \n", max_size=30), st.lists(st.integers(1, 7), min_size=1, max_size=40))
def test_streamed_pieces_give_what_the_whole_text_gives(prefix, cuts):
    text = prefix + CALL + prefix
    stream, content, calls, start = ToolCallStream(), "", [], 0
    for cut in itertools.cycle(cuts):
        if start >= len(text):
            break
        piece, start = text[start : start + cut], start + cut
        more_content, more_calls = stream.feed(piece)
        content, calls = content + more_content, calls + more_calls
    content += stream.flush()
    whole_content, whole_calls = parse(text)
    assert content == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_a_template_that_refuses_the_messages_raises_value_error(tokenizer):
    strict = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="roles must alternate"):
        chat_prompt_ids(tokenizer, two_users, chat_template=strict)
    with pytest.raises(ValueError, match="does not render tools"):
        chat_prompt_ids(tokenizer, two_users, tools=[{"name": "f"}])
    tools = load_chat_template("chatml_tools")
    rendered = tokenizer.decode(
        chat_prompt_ids(tokenizer, two_users, tools=[{"name": "f"}], chat_template=tools)
    )
    assert '"name": "f"' in rendered and "<tool_call>" in rendered
    with pytest.raises(ValueError, match="chatml_tools"):
        load_chat_template("no-such-template")
