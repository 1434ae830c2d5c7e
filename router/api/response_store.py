"""The Responses API's store: what `previous_response_id` continues and what
`GET /v1/responses/{id}` returns.

It lives in the ingress replica's memory, so it is lost on restart and not shared
between ingress replicas: a follow-up routed to another replica gets a 404, as an
expired one does. Bounds keep a busy server's memory flat: at most `max_responses`
entries, each kept at most `max_age_s` after it was stored; past the count, the entry
stored longest ago goes first (reads do not refresh it, so the lifetime promise holds).
"""

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# 1,000 responses for one hour: enough for agent loops, whose follow-ups come within
# seconds to minutes, while a full store of long conversations stays in the tens of MB.
DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_AGE_S = 3600.0


@dataclass
class StoredResponse:
    response: dict  # the rendered Response object, as GET returns it
    # The conversation up to and including this response's output, as chat messages;
    # the request's `instructions` are left out, since OpenAI does not carry them over.
    messages: list[dict]
    stored_at: float


class ResponseStore:
    """A bounded map from response id to StoredResponse. Used from one event loop only,
    so it needs no lock."""

    def __init__(
        self,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_responses < 1 or max_age_s <= 0:
            raise ValueError("max_responses and max_age_s must be positive")
        self.max_responses, self.max_age_s, self._clock = max_responses, max_age_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, response: dict, messages: list[dict]) -> None:
        self._expire()
        self._entries.pop(response_id, None)
        self._entries[response_id] = StoredResponse(response, messages, self._clock())
        while len(self._entries) > self.max_responses:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def _expire(self) -> None:
        # Entries are in the order they were stored, so the expired ones are a prefix.
        deadline = self._clock() - self.max_age_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at > deadline:
                break
            self._entries.popitem(last=False)
