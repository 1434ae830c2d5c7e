"""Rerank and score (vLLM's /v1/rerank and /v1/score, in Jina's and Cohere's shape) with
the served decoder-only model, as LLM rerankers do: the relevance of a document to a
query is the probability that the model answers "yes" rather than "no" after a fixed
relevance prompt.

The prompt puts the query before the document, so every document of one request shares
the prompt's head and the query in the prefix cache: the first document goes alone, and
the rest follow together once its blocks are cached."""

import asyncio
import math
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, field_validator

from router.api.frontend import EngineInput, FrontEnd
from router.api.protocol import Integer
from router.generation import APIError, as_own_request
from wire.messages import GenerateRequest
from wire.sampling_params import MAX_LOGPROBS, SamplingParams

_EXAMPLES = [
    ("What colour is grass?", "Grass is green because of chlorophyll.", "yes"),
    ("What colour is grass?", "The train leaves at noon.", "no"),
    ("Who painted the Mona Lisa?", "Cats sleep for most of the day.", "no"),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci painted the Mona Lisa.", "yes"),
    ("How tall is Mount Everest?", "Mount Everest is 8,849 metres high.", "yes"),
    ("How tall is Mount Everest?", "Soup is best served hot.", "no"),
]
# A few-shot completion prompt rather than a chat turn: small instruct models follow
# the pattern of worked examples far better than an instruction, and base models can too.
DEFAULT_RELEVANCE_PROMPT = (
    "Decide whether each document is relevant to its query.\n\n"
    + "".join(f"Query: {q}\nDocument: {d}\nRelevant: {a}\n\n" for q, d, a in _EXAMPLES)
    + "Query: {query}\nDocument: {document}\nRelevant:"
)
YES_WORDS = (" yes", " Yes")
NO_WORDS = (" no", " No")
MAX_DOCUMENTS = 1000


class Document(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str


class _ScoringRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    # Instead of DEFAULT_RELEVANCE_PROMPT: text with {query} and {document} in it.
    relevance_prompt: str | None = None

    @field_validator("relevance_prompt")
    @classmethod
    def _has_fields(cls, prompt: str | None) -> str | None:
        if prompt is not None and not ("{query}" in prompt and "{document}" in prompt):
            raise ValueError("relevance_prompt must contain {query} and {document}")
        return prompt


class RerankRequest(_ScoringRequest):
    query: str = Field(min_length=1)
    documents: list[str | Document] = Field(min_length=1, max_length=MAX_DOCUMENTS)
    top_n: Integer | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_ScoringRequest):
    """vLLM's /v1/score: text_1 against each of text_2 (one to many), or pair by pair."""

    text_1: str | list[str]
    text_2: str | list[str]

    def pairs(self) -> list[tuple[str, str]]:
        queries = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        documents = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not queries or not documents:
            raise APIError(400, "text_1 and text_2 must not be empty", "text_1")
        if len(queries) == 1:
            queries = queries * len(documents)
        if len(queries) != len(documents):
            raise APIError(400, "text_1 must be one text or as many texts as text_2", "text_1")
        if len(documents) > MAX_DOCUMENTS:
            raise APIError(400, f"at most {MAX_DOCUMENTS} pairs per request", "text_2")
        return list(zip(queries, documents, strict=True))


class RelevanceScorer:
    """Scores (query, document) pairs through the replicas, one single-token greedy
    request each, reading "yes" and "no" from the raw next-token logprobs."""

    def __init__(self, frontend: FrontEnd):
        self.frontend = frontend
        tokenizer = frontend.tokenizer
        self.yes_ids = _first_tokens(tokenizer, YES_WORDS)
        self.no_ids = _first_tokens(tokenizer, NO_WORDS)
        self.sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=MAX_LOGPROBS)

    async def score(self, pairs: list[tuple[str, str]], prompt: str | None) -> tuple[list[float], int]:
        """Each pair's relevance in [0, 1], and the prompt tokens read."""
        template = prompt or DEFAULT_RELEVANCE_PROMPT
        texts = [template.replace("{query}", q).replace("{document}", d) for q, d in pairs]
        ids = await self.frontend.in_tokenizer_thread(lambda: self.frontend.tokenizer(texts).input_ids)
        first = await asyncio.create_task(self._one(ids[0]))
        rest = await asyncio.gather(*(self._one(p) for p in ids[1:]))
        return [first, *rest], sum(len(p) for p in ids)

    async def _one(self, prompt: list[int]) -> float:
        """Runs as a task of its own, beside the request's other documents."""
        as_own_request()
        request = GenerateRequest(prompt, sampling=self.sampling)
        generation = await self.frontend.start(EngineInput(request, 1, True))
        entries = []
        try:
            async for chunk in generation.chunks():
                entries += chunk.logprobs or []
        finally:
            generation.cancel()
        top = {t.token_id: t.logprob for t in entries[0].top_logprobs}
        return self.relevance(top)

    def relevance(self, top: dict[int, float]) -> float:
        """P(yes) / (P(yes) + P(no)) over the yes and no spellings. A spelling outside
        the top logprobs counts as likely as the least likely of them: an upper bound."""
        floor = min(top.values())
        yes = sum(math.exp(top.get(t, floor)) for t in self.yes_ids)
        no = sum(math.exp(top.get(t, floor)) for t in self.no_ids)
        return yes / (yes + no)


def _first_tokens(tokenizer, words: tuple[str, ...]) -> list[int]:
    """Each word's first token, as the model would start the answer with it."""
    return sorted({tokenizer(w, add_special_tokens=False).input_ids[0] for w in words})


def rerank_response(model: str, body: RerankRequest, scores: list[float], num_tokens: int) -> dict:
    """The documents by relevance, most relevant first, as Jina, Cohere and vLLM answer."""
    texts = body.texts()
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {
        "id": "rerank-" + uuid.uuid4().hex,
        "model": model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        "results": results,
    }


def score_response(model: str, scores: list[float], num_tokens: int) -> dict:
    return {
        "id": "score-" + uuid.uuid4().hex,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
