"""Speculative decoding: proposers (n-gram lookup, a draft model) and the verification
of their proposals by the target model, inside the engine's continuous batching."""
