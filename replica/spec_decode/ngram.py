"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier
occurrence of the request's own last n tokens, n from prompt_lookup_max down to
prompt_lookup_min. Answers that copy their prompt (edits, lists, quotes, code) are
proposed almost whole at no model cost; text with no repeats gets no proposal at all."""

from array import array

from replica.request import Request
from replica.spec_decode.config import SpeculativeConfig
from replica.spec_decode.proposal import Proposal

_ITEM = 4  # bytes per token in the searched buffer


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens after the latest earlier match of the longest suffix that has one.
    The search is bytes.rfind over the tokens as 4-byte integers (C speed, so a long
    context costs microseconds), keeping only matches aligned to a token boundary."""
    if k < 1 or len(token_ids) < min_n + 1:
        return []
    data = array("i", token_ids).tobytes()
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        pattern = data[-n * _ITEM :]
        end = len(data) - _ITEM  # a match must end before the last token (the suffix itself)
        while True:
            pos = data.rfind(pattern, 0, end)
            if pos < 0:
                break
            if pos % _ITEM == 0:
                start = pos // _ITEM + n
                return token_ids[start : start + k]
            end = pos + len(pattern) - 1  # misaligned: look further left
    return []


class NgramProposer:
    """The proposer interface of draft_model.DraftModelProposer, with no model and no KV."""

    def __init__(self, spec: SpeculativeConfig):
        self.spec = spec

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Proposal]:
        spec = self.spec
        return [
            Proposal(propose_ngram(r.token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max), None)
            for r, k in zip(requests, num_tokens, strict=True)
        ]

    def has_lead(self, request: Request) -> bool:
        """Whether its tokens known so far (not those still in flight) end in a match: a
        proposal made from its newest token is then likely."""
        known = request.token_ids[: request.num_tokens - request.num_pending]
        spec = self.spec
        return bool(propose_ngram(known, 1, spec.prompt_lookup_min, spec.prompt_lookup_max))

    def rollback(self, request_id: str, num_valid_tokens: int) -> None:
        pass

    def drop(self, request_id: str) -> None:
        pass

    def use_cores(self, plan) -> None:
        pass
