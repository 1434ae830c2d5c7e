"""/v1/rerank and /v1/score on the bundled model, through a real Serve app: ranking
sanity on hand-made queries the relevance prompt was not tuned on, the response shapes,
prefix sharing among one request's documents, and clear errors."""

import httpx
import pytest
from conftest import AGENT_APP
from ray import serve

from router.api.rerank import DEFAULT_RELEVANCE_PROMPT
from wire.messages import ReplicaReport

MODEL = "SmolLM2-135M-Instruct"
# (query, a relevant document, an unrelated one)
CASES = [
    (
        "When did the first person walk on the Moon?",
        "Neil Armstrong walked on the Moon in July 1969.",
        "Tomatoes need plenty of sun and regular watering.",
    ),
    (
        "What is the chemical symbol for gold?",
        "The chemical symbol for gold is Au, from the Latin aurum.",
        "The football match ended in a draw after extra time.",
    ),
    (
        "How many days are in a leap year?",
        "A leap year has 366 days, one more than a common year.",
        "Owls hunt mostly at night.",
    ),
    (
        "Which planet is known as the Red Planet?",
        "Mars is called the Red Planet because of the iron oxide on its surface.",
        "Baking soda can be used to clean kitchen surfaces.",
    ),
    (
        "Who invented the telephone?",
        "Alexander Graham Bell is credited with inventing the telephone in 1876.",
        "The river flows slowly through the green valley.",
    ),
    (
        "What is the fastest land animal?",
        "The cheetah is the fastest land animal, reaching about 110 km/h.",
        "Jazz music originated in New Orleans.",
    ),
    (
        "How do vaccines work?",
        "Vaccines train the immune system to recognise a germ without causing the disease.",
        "The museum is closed on Mondays.",
    ),
    (
        "What is the freezing point of water in Fahrenheit?",
        "Water freezes at 32 degrees Fahrenheit.",
        "She bought a new pair of running shoes.",
    ),
    (
        "What is the tallest animal?",
        "Giraffes are the tallest animals, growing up to 5.5 metres.",
        "Email lets people send messages over the internet.",
    ),
    (
        "Where is the Great Barrier Reef?",
        "The Great Barrier Reef lies off the coast of Queensland, Australia.",
        "The violin is a string instrument played with a bow.",
    ),
]


@pytest.fixture(scope="module")
def http(agent_app):
    with httpx.Client(base_url=agent_app, timeout=120) as client:
        yield client


def replica_stats() -> ReplicaReport:
    return serve.get_deployment_handle("LLMServer", app_name=AGENT_APP).stats.remote().result()


def test_relevant_documents_rank_first(http):
    """docs/serving.md's figure: all 10 of 10. In fp32 the scores differ between machines
    only by rounding; the closest pair (the freezing point, 0.102 against 0.097 on the
    Zen 4 EPYC) is 0.005 apart, far more than rounding moves a score."""
    missed = []
    for query, relevant, unrelated in CASES:
        r = http.post("/v1/rerank", json={"model": MODEL, "query": query, "documents": [unrelated, relevant]})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert sorted(x["index"] for x in results) == [0, 1]
        assert results[0]["relevance_score"] >= results[1]["relevance_score"]
        assert all(0.0 <= x["relevance_score"] <= 1.0 for x in results)
        if results[0]["index"] != 1:
            missed.append((query, [(x["index"], round(x["relevance_score"], 4)) for x in results]))
    assert not missed, f"the relevant document (index 1) did not rank first for {len(missed)} of 10: {missed}"


def test_shapes_top_n_and_score_agree_with_rerank(http):
    query, *_ = CASES[0]
    documents = [case[1] for case in CASES[:3]] + [{"text": CASES[3][2]}]
    r = http.post("/v1/rerank", json={"query": query, "documents": documents, "top_n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == MODEL and body["id"].startswith("rerank-")
    assert len(body["results"]) == 2 and body["usage"]["total_tokens"] > 0
    assert body["results"][0]["document"]["text"] == CASES[body["results"][0]["index"]][1]
    everything = http.post(
        "/v1/rerank", json={"query": query, "documents": documents, "return_documents": False}
    ).json()["results"]
    assert [x["index"] for x in everything[:2]] == [x["index"] for x in body["results"]]
    assert all("document" not in x for x in everything)
    by_index = {x["index"]: x["relevance_score"] for x in everything}

    texts = [d if isinstance(d, str) else d["text"] for d in documents]
    scored = http.post("/v1/score", json={"model": MODEL, "text_1": query, "text_2": texts})
    assert scored.status_code == 200, scored.text
    data = scored.json()["data"]
    assert [d["index"] for d in data] == list(range(4)) and all(d["object"] == "score" for d in data)
    # The same greedy single-token requests: the same scores, whatever the batch.
    assert [d["score"] for d in data] == pytest.approx([by_index[i] for i in range(4)], abs=1e-4)

    pairs = http.post("/v1/score", json={"text_1": [query, query], "text_2": texts[:2]}).json()["data"]
    assert [d["score"] for d in pairs] == pytest.approx([by_index[0], by_index[1]], abs=1e-4)


def test_documents_share_the_prompt_and_query_in_the_prefix_cache(http, tokenizer):
    query = "Which metal is liquid at room temperature?"
    documents = [f"Note {i}: mercury is a metal that is liquid at room temperature." for i in range(4)]
    prompts = [
        tokenizer(DEFAULT_RELEVANCE_PROMPT.replace("{query}", query).replace("{document}", d)).input_ids
        for d in documents
    ]
    shared = next(i for i, ts in enumerate(zip(*prompts, strict=False)) if len(set(ts)) > 1)
    before = replica_stats()
    r = http.post("/v1/rerank", json={"query": query, "documents": documents})
    assert r.status_code == 200, r.text
    after = replica_stats()
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    # Every document after the first finds at least the shared head's full blocks cached.
    assert hits >= (len(documents) - 1) * (shared // after.block_size)


@pytest.mark.parametrize(
    "path, body, status, says",
    [
        ("/v1/rerank", {"query": "q", "documents": []}, 400, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["d"], "relevance_prompt": "no fields"}, 400, "{query}"),
        ("/v1/rerank", {"model": "other", "query": "q", "documents": ["d"]}, 404, "does not exist"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": []}, 400, "empty"),
    ],
)
def test_bad_requests_get_clear_errors(http, path, body, status, says):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]


def test_a_request_may_bring_its_own_relevance_prompt(http):
    prompt = "Query: {query}\nPassage: {document}\nDoes the passage answer the query? Answer:"
    query, relevant, unrelated = CASES[2]
    r = http.post(
        "/v1/score", json={"text_1": query, "text_2": [relevant, unrelated], "relevance_prompt": prompt}
    )
    assert r.status_code == 200, r.text
    default = http.post("/v1/score", json={"text_1": query, "text_2": [relevant, unrelated]})
    # A different prompt asks a different question: the scores differ from the default's.
    assert [d["score"] for d in r.json()["data"]] != [d["score"] for d in default.json()["data"]]
