"""Per-request edits of a step's logits before sampling: logit_bias, and the token masks
of structured outputs (llguidance).

A constrained request owns a grammar matcher. Each step its row of the logits keeps only
the tokens the grammar allows next, and the sampled token then advances the matcher.
Rows of requests without constraints are never touched, and a batch without any costs
one check per step."""

from collections import OrderedDict

import llguidance
import llguidance.hf
import torch

from replica.request import Request
from wire.sampling_params import StructuredOutputs

COMPILED_GRAMMARS_KEPT = 256
BIT_POSITIONS = torch.arange(32, dtype=torch.int32)


class GrammarCompiler:
    """Turns StructuredOutputs into matchers for one tokenizer. A grammar is checked and
    compiled once; requests with the same one get copies of the cached matcher."""

    def __init__(self, tokenizer):
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start; ValueError names what is wrong."""
        grammar = _grammar(spec)
        template = self._compiled.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"invalid structured output constraint: {template.get_error()}")
            self._compiled[grammar] = template
            if len(self._compiled) > COMPILED_GRAMMARS_KEPT:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return template.deep_copy()

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list[llguidance.LLMatcher]) -> None:
        """Keep only the allowed tokens in logits[rows] (in place); ids past the
        tokenizer's vocabulary (a model's padding rows) are never allowed.

        The matchers write one bit per token into 32-bit words, unpacked here with plain
        torch ops: llguidance.torch's own helper is a torch.compile'd function, whose
        import (torch._dynamo) slows every engine's start and whose first call compiles."""
        words = -(-self.tokenizer.vocab_size // 32)
        bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * bitmask.element_size())
        device = logits.device
        bits = (bitmask.to(device)[:, :, None] >> BIT_POSITIONS.to(device)) & 1
        allowed = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=device)
        covered = min(logits.shape[1], 32 * words)
        allowed[:, :covered] = bits.view(len(rows), -1)[:, :covered].bool()
        index = torch.tensor(rows, device=device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


@torch.inference_mode()  # the logits are inference tensors
def edit_logits(logits: torch.Tensor, requests: list[Request], grammars: GrammarCompiler | None) -> None:
    """Apply the requests' logit biases and grammar masks to their rows (row i: requests[i])."""
    biased = [(row, r.params.logit_bias) for row, r in enumerate(requests) if r.params.logit_bias]
    if biased:
        apply_logit_bias(logits, *map(list, zip(*biased, strict=True)))
    constrained = [(row, r.matcher) for row, r in enumerate(requests) if r.matcher is not None]
    if constrained:
        grammars.mask(logits, *map(list, zip(*constrained, strict=True)))


def apply_logit_bias(logits: torch.Tensor, rows: list[int], biases: list[dict[int, float]]) -> None:
    """Add each row's bias to its logits (in place)."""
    for row, bias in zip(rows, biases, strict=True):
        ids = torch.tensor(list(bias), device=logits.device)
        values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        logits[row, ids] += values


def _grammar(spec: StructuredOutputs) -> str:
    """llguidance's grammar text for the constraint."""
    matcher = llguidance.LLMatcher
    if spec.json is not None:
        return matcher.grammar_from_json_schema(spec.json, defaults={"whitespace_flexible": False})
    if spec.json_object:
        return matcher.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
    if spec.regex is not None:
        return matcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        alternatives = " | ".join(_lark_string(c) for c in spec.choice)
        return matcher.grammar_from_lark(f"start: {alternatives}")
    return matcher.grammar_from_lark(spec.grammar)


def _lark_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
