"""The engine's RequestDeltas as the wire's StreamChunks: what a replica streams to the
ingress. Logprob entries carry their tokens' strings, so that decoding has one owner,
the replica."""

from wire.messages import LogprobEntry, StreamChunk, TopLogprob
from wire.outputs import RequestDelta, TokenLogprob


def stream_chunks(deltas: list[RequestDelta], replica_id: str, tokenizer) -> list[StreamChunk]:
    """One request's deltas since its last send: one chunk per sample, in index order."""
    indices = sorted({d.index for d in deltas})
    return [merged([d for d in deltas if d.index == i], replica_id, tokenizer) for i in indices]


def merged(deltas: list[RequestDelta], replica_id: str, tokenizer) -> StreamChunk:
    """Several steps' deltas of one sample of a request as one chunk."""
    last = deltas[-1]
    logprobs = None
    if last.new_logprobs is not None:
        logprobs = [logprob_entry(lp, tokenizer) for d in deltas for lp in d.new_logprobs]
    # With prompt_logprobs, once: on the sample's first delta (None for the first token).
    prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return StreamChunk(
        request_id=last.request_id,
        replica_id=replica_id,
        index=last.index,
        text="".join(d.new_text for d in deltas),
        token_ids=[t for d in deltas for t in d.new_token_ids],
        logprobs=logprobs,
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
        prompt_logprobs=None if prompt is None else [logprob_entry(lp, tokenizer) for lp in prompt],
    )


def logprob_entry(lp: TokenLogprob | None, tokenizer) -> LogprobEntry | None:
    """None stays None: the first prompt token's entry."""
    if lp is None:
        return None

    def token(token_id: int) -> str:
        return tokenizer.convert_ids_to_tokens(token_id)

    return LogprobEntry(
        token_id=lp.token_id,
        token=token(lp.token_id),
        logprob=lp.logprob,
        top_logprobs=[TopLogprob(token_id=t, token=token(t), logprob=v) for t, v in lp.top_logprobs.items()],
        rank=lp.rank,
    )
