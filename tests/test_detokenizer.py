import pytest

from replica.detokenizer import IncrementalDetokenizer


def _stream(tokenizer, prompt_ids, output_ids, stop=()):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, list(stop))
    pieces, stopped_at = [], None
    for i, token in enumerate(output_ids):
        update = detok.add_token(token)
        pieces.append(update.new_text)
        if update.stopped:
            stopped_at = i
            break
    else:
        pieces.append(detok.flush())
    return "".join(pieces), stopped_at, detok


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, this is a test.",
        "Ünïcödé — 日本語のテキスト 🚀🚀 emoji",
        "  leading spaces\nand\ttabs  ",
    ],
)
def test_streamed_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer("Prompt:").input_ids
    output = tokenizer(text, add_special_tokens=False).input_ids
    streamed, stopped_at, _ = _stream(tokenizer, prompt, output)
    assert stopped_at is None
    assert streamed == tokenizer.decode(output, skip_special_tokens=True)


def test_multibyte_characters_are_not_split(tokenizer):
    output = tokenizer("🚀", add_special_tokens=False).input_ids
    assert len(output) > 1  # one emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer, [], [])
    pieces = [detok.add_token(t).new_text for t in output]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "🚀"


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tokenizer):
    text = "The answer is forty-two. END OF STORY and more text"
    output = tokenizer(text, add_special_tokens=False).input_ids
    stop = "END OF STORY"
    # The stop string must span several tokens for this test to mean anything.
    assert not any(stop in tokenizer.decode([t]) for t in output)
    streamed, stopped_at, detok = _stream(tokenizer, [], output, [stop])
    assert stopped_at is not None
    assert streamed == "The answer is forty-two. "
    assert detok.text == streamed


def test_held_back_tail_is_released_when_no_stop_matches(tokenizer):
    output = tokenizer("abc ST", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [], ["STOP"])
    streamed = "".join(detok.add_token(t).new_text for t in output)
    assert not streamed.endswith("ST")  # could still become "STOP"
    assert streamed + detok.flush() == "abc ST"
