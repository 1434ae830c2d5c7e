"""The offline workloads, as token-id prompts and the number of tokens each request asks
for (EOS ignored, so every system generates exactly those):
- Anyscale's, after their continuous-batching study: fixed-length random prompts, output
  lengths drawn from an exponential and capped. Higher caps raise the variance of the
  output lengths, which is what static batching pays for.
- mixed: prompts of varied length, capped-exponential outputs, all submitted at once."""

import random


def make_workload(n: int, prompt_len: int, mean: float, cap: int, vocab: int, seed: int):
    """Fixed-length prompts; the same output-length draws for every cap."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(prompt_len)] for _ in range(n)]
    return prompts, output_lengths(n, mean, cap, seed + 1)


def warm_up_workload(prompt_len: int, vocab: int, seed: int):
    """The few short requests every system runs once before it is timed."""
    return make_workload(4, prompt_len, 4, 4, vocab, seed + 99)


def make_mixed_workload(n: int, prompt_lens: tuple[int, int], mean: float, cap: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(*prompt_lens))] for _ in range(n)]
    return prompts, output_lengths(n, mean, cap, seed + 1)


def output_lengths(n: int, mean: float, cap: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(cap, max(1, round(rng.expovariate(1 / mean)))) for _ in range(n)]
