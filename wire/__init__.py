"""The typed contracts that cross the router/replica boundary: sampling parameters,
adapter requests, the stream and report messages, and the engine's outputs.

Nothing here imports torch, Ray or the engine: the ingress imports it, and so does every
replica."""
