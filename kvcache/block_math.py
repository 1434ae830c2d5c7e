"""Block arithmetic: how many blocks hold a number of tokens.

The KV manager, the scheduler and the KV router all count blocks this way; the router
imports it from here rather than from the KV manager, whose block tables it has no use
for (docs/architecture.md: router/placement/ may import kvcache's hashing and block
arithmetic)."""


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: the blocks of b tokens that hold a tokens."""
    return -(-a // b)
