"""Tool calls in the Hermes format (Hermes, Qwen2.5, SmolLM and others):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the model's text.

The parser turns such blocks into OpenAI tool calls, whole or as the text streams in.
`required_grammar` constrains the output to such calls (tool_choice "required" or a
named function), so they always parse."""

import json
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def parse(text: str) -> tuple[str, list[ParsedCall]]:
    """(the text outside tool-call blocks, the calls). A block that is not a valid
    call stays in the text, so nothing the model said is lost."""
    stream = ToolCallStream()
    content, calls = stream.feed(text)
    return content + stream.flush(), calls


class ToolCallStream:
    """Splits streamed text into content and complete tool calls, holding back only
    what may still become a call."""

    def __init__(self):
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        content, calls = [], []
        while True:
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = _partial_tag_length(self._buffer)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            end = self._buffer.find(CLOSE, start)
            if end < 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                break
            block = self._buffer[start : end + len(CLOSE)]
            call = _call(block[len(OPEN) : -len(CLOSE)])
            content.append(self._buffer[:start] if call else self._buffer[: end + len(CLOSE)])
            calls += [call] if call else []
            self._buffer = self._buffer[end + len(CLOSE) :]
        return "".join(content), calls

    def flush(self) -> str:
        """At the end of the output: what is held back is content after all."""
        rest, self._buffer = self._buffer, ""
        return rest


def _call(body: str) -> ParsedCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ParsedCall(value["name"], json.dumps(arguments))


def _partial_tag_length(text: str) -> int:
    """How many trailing characters of text could begin OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def required_grammar(tools: list[dict], name: str | None = None, parallel: bool = False) -> str:
    """A Lark grammar (llguidance's dialect) for a call of one of the given tools, or
    of the named one only, or with `parallel` for one or more calls; each call's
    arguments follow the tool's JSON schema, and name only the parameters it declares
    (as OpenAI's strict mode asks). One call by default: small models given the choice
    repeat a call, or invent parameters, until max_tokens cuts it in half."""
    chosen = [t for t in tools if name is None or t["name"] == name]
    alternatives = []
    for tool in chosen:
        parameters = dict(tool.get("parameters") or {"type": "object", "properties": {}})
        if parameters.get("type") == "object":
            parameters.setdefault("additionalProperties", False)
        schema = {
            "type": "object",
            "properties": {"name": {"const": tool["name"]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False},
        }
        alternatives.append(f"%json {json.dumps(schema)}")
    calls = " | ".join(alternatives)
    more = '("\\n" call)*' if parallel else ""
    return f'start: call {more}\ncall: "{OPEN}\\n" ({calls}) "\\n{CLOSE}"\n'
