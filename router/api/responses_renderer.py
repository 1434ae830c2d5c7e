"""The Responses API's renderer, whose answers router/api/respond.py sends. A completed
response goes to the store, for `previous_response_id` and GET /v1/responses/{id}."""

import copy
import time
import uuid

from router.api.frontend import Choices
from router.api.response_store import ResponseStore
from router.api.responses import Turn, items_to_messages
from router.api.tool_calls import ParsedCall
from router.generation import APIError
from wire.messages import StreamChunk


class ResponsesRenderer:
    """Builds a Response from the replica's chunks, item by item, and says each step as
    Responses stream events. Text opens a message item, and each tool call closes it and
    adds a function_call item; whitespace-only text next to calls (the newlines around
    `<tool_call>` blocks) opens no item of its own."""

    named_events = True
    ends_with_done = False

    def __init__(self, turn: Turn, model: str, choices: Choices, store: ResponseStore):
        """store: where a completed response is kept, unless the request says store: false."""
        self.turn, self.model, self.choices, self.store = turn, model, choices, store
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.status = "in_progress"
        self.output: list[dict] = []
        self.error: dict | None = None
        self._message: dict | None = None  # the message item text goes to
        self._pending = ""  # whitespace not yet placed in an item
        self._sequence = 0

    def opening(self) -> list[dict]:
        return [self._event("response.created"), self._event("response.in_progress")]

    def add(self, chunk: StreamChunk) -> None:
        """The streamed path with its events dropped, so that both paths agree exactly."""
        self.feed(chunk)

    def feed(self, chunk: StreamChunk) -> list[dict]:
        delta = self.choices.add(chunk)
        events = self._add_text(delta.text) if delta.text else []
        for call in delta.calls:
            events += self._close_message() + self._add_call(call)
        if delta.finish_reason is not None:
            events += self._finish(delta.finish_reason)
        return events

    def fail(self, error: APIError) -> list[dict]:
        self.status = "failed"
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        self.error = {"code": code, "message": error.message}
        alert = self._event("error", code=error.kind, message=error.message, param=error.param)
        return [alert, self._event("response.failed")]

    async def closing(self) -> list[dict]:
        self._store()
        return []

    async def whole(self) -> dict:
        self._store()
        return self.response()

    def _store(self) -> None:
        if self.turn.body.store is not False and self.status in ("completed", "incomplete"):
            self.store.put(self.id, self.response(), self.conversation())

    def response(self) -> dict:
        """The Response object as it stands."""
        body = self.turn.body
        form = body.text.format if body.text is not None and body.text.format is not None else None
        text_format = form.model_dump(by_alias=True, exclude_none=True) if form else {"type": "text"}
        usage = None
        if self.status != "in_progress":
            used = self.choices.usage()
            usage = {
                "input_tokens": used["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": used["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": used["total_tokens"],
            }
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        choice = body.tool_choice
        if isinstance(choice, dict):
            choice = {"type": "function", "name": choice["name"]}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "incomplete_details": incomplete,
            "error": self.error,
            "model": self.model,
            "output": copy.deepcopy(self.output),
            "usage": usage,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            # What the request runs with: its own values, else the model's defaults.
            "temperature": self.choices.input.request.sampling.temperature,
            "top_p": self.choices.input.request.sampling.top_p,
            "tools": self.turn.tools,
            "tool_choice": choice or "auto",
            "text": {"format": text_format},
            "previous_response_id": body.previous_response_id,
            "store": body.store is not False,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "metadata": body.metadata or {},
            "user": body.user,
        }

    def conversation(self) -> list[dict]:
        """The chat messages after this response, for a follow-up to continue."""
        return self.turn.history + items_to_messages(self.output, "output")

    def _event(self, kind: str, **fields) -> dict:
        if kind.startswith("response.") and not fields:
            fields = {"response": self.response()}
        event = {"type": kind, "sequence_number": self._sequence, **copy.deepcopy(fields)}
        self._sequence += 1
        return event

    def _add_text(self, text: str, force: bool = False) -> list[dict]:
        """force: open a message even for whitespace, which then is the whole answer."""
        events = []
        if self._message is None:
            self._pending += text
            if not self._pending.strip() and not force:
                return []
            text, self._pending = self._pending, ""
            events = self._open_message()
            if not text:
                return events
        part = self._message["content"][0]
        part["text"] += text
        where = {"item_id": self._message["id"], "output_index": len(self.output) - 1, "content_index": 0}
        return events + [self._event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def _open_message(self) -> list[dict]:
        item = {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "in_progress",
                "role": "assistant", "content": []}  # fmt: skip
        self.output.append(item)
        self._message = item
        part = {"type": "output_text", "text": "", "annotations": []}
        item["content"].append(part)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        return [
            self._event(
                "response.output_item.added", output_index=where["output_index"], item={**item, "content": []}
            ),
            self._event("response.content_part.added", **where, content_index=0, part=part),
        ]

    def _close_message(self, status: str = "completed") -> list[dict]:
        item, self._message, self._pending = self._message, None, ""
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": self.output.index(item)}
        return [
            self._event(
                "response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]
            ),
            self._event("response.content_part.done", **where, content_index=0, part=part),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def _add_call(self, call: ParsedCall) -> list[dict]:
        item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call.id,
                "name": call.name, "arguments": "", "status": "in_progress"}  # fmt: skip
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        events = [self._event("response.output_item.added", output_index=where["output_index"], item=item)]
        item["arguments"], item["status"] = call.arguments, "completed"
        return events + [
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event("response.function_call_arguments.done", **where, arguments=call.arguments),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def _finish(self, finish_reason: str) -> list[dict]:
        cut = finish_reason == "length"
        events = []
        if not self.output:  # no text and no call: still one (perhaps empty) message
            events += self._add_text("", force=True)
        events += self._close_message("incomplete" if cut else "completed")
        self.status = "incomplete" if cut else "completed"
        return events + [self._event("response.incomplete" if cut else "response.completed")]
