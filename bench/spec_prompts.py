"""The repeat workload of bench.spec_decode: chat prompts whose answers repeat their
prompt, where n-gram speculation should shine. Numbered lists of 100-300 tokens to repeat
and add an item to, and code snippets to rewrite with a variable renamed."""

import random
from pathlib import Path

FRUITS = [
    "apple", "apricot", "avocado", "banana", "blackberry", "blueberry", "cantaloupe", "cherry",
    "clementine", "coconut", "cranberry", "date", "dragonfruit", "elderberry", "fig", "gooseberry",
    "grape", "grapefruit", "guava", "honeydew", "jackfruit", "kiwi", "kumquat", "lemon", "lime",
    "lychee", "mandarin", "mango", "mulberry", "nectarine", "orange", "papaya", "passionfruit",
    "peach", "pear", "persimmon", "pineapple", "plum", "pomegranate", "quince", "raspberry",
    "starfruit", "strawberry", "tangerine", "watermelon",
]  # fmt: skip
CITIES = [
    "Amsterdam", "Athens", "Bangkok", "Barcelona", "Berlin", "Bogota", "Boston", "Brussels",
    "Budapest", "Cairo", "Chicago", "Copenhagen", "Dublin", "Edinburgh", "Helsinki", "Istanbul",
    "Jakarta", "Kyoto", "Lagos", "Lima", "Lisbon", "London", "Madrid", "Manila", "Melbourne",
    "Montreal", "Mumbai", "Munich", "Nairobi", "Oslo", "Paris", "Prague", "Santiago", "Seoul",
    "Singapore", "Stockholm", "Sydney", "Taipei", "Tokyo", "Toronto", "Vancouver", "Vienna",
    "Warsaw", "Zurich",
]  # fmt: skip

CODE_SNIPPETS = [
    """def moving_average(values, window):
    x = 0.0
    averages = []
    for i, value in enumerate(values):
        x += value
        if i >= window:
            x -= values[i - window]
        if i >= window - 1:
            averages.append(x / window)
    return averages""",
    """def parse_config(lines):
    x = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        x[key.strip()] = value.strip()
    if "name" not in x:
        raise ValueError("the config has no name")
    return x""",
]


def repeat_prompts(model: Path, count: int, seed: int) -> list[dict]:
    """`count` prompts: numbered lists of 100-300 tokens (fruits or cities, deterministic
    from `seed`) to repeat, and the code snippets to rewrite, the last two of them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    rng = random.Random(seed)
    prompts = []
    for index in range(count - len(CODE_SNIPPETS)):
        words = FRUITS if index % 2 == 0 else CITIES
        target = rng.randint(100, 300)
        items: list[str] = []
        tokens, order = 0, []
        while tokens < target:
            # Every name once before any repeats: repeats would make "exactly" ambiguous.
            order = order or rng.sample(words, len(words))
            items.append(f"{len(items) + 1}. {order.pop().capitalize()}")
            tokens = len(tokenizer.encode("\n".join(items)).ids)
        text = "Repeat this list exactly, then add one item:\n" + "\n".join(items)
        prompts.append({"index": index, "kind": "list", "list_tokens": tokens, "items": items, "text": text})
    for snippet in CODE_SNIPPETS[: max(0, count - len(prompts))]:
        ask = "Here is a code snippet; rewrite it exactly with variable x renamed to y:"
        text = f"{ask}\n```python\n{snippet}\n```"
        prompts.append({"index": len(prompts), "kind": "code", "text": text})
    return prompts


def items_echoed(items: list[str], answer: str) -> float:
    """The share of a list's items the answer repeats, in order, before its first miss."""
    lines = [line.strip() for line in answer.strip().splitlines() if line.strip()]
    matched = 0
    for item, line in zip(items, lines, strict=False):
        if item != line:
            break
        matched += 1
    return matched / len(items)
