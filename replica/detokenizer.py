"""Incremental detokenization with stop strings that may span token boundaries.

Text is decoded over a small sliding window of ids, so each step costs O(window) and
multi-byte characters split across tokens are held back until complete. While a stop
string could still be forming at the end of the text, the tail that might belong to it
is withheld from the stream, so a client never sees part of a stop string.
"""

from dataclasses import dataclass, field

PROMPT_CONTEXT_TOKENS = 5


@dataclass
class DetokenizerUpdate:
    new_text: str
    stopped: bool  # a stop string matched; the text is cut just before it


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    prompt_token_ids: list[int]
    stop: list[str] = field(default_factory=list)
    text: str = ""  # decoded output so far (cut at a stop string)
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0
    _emitted: int = 0  # chars of `text` already handed out

    def __post_init__(self) -> None:
        # A little prompt context makes the first output token decode with its leading space.
        self._ids = list(self.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def add_token(self, token_id: int) -> DetokenizerUpdate:
        self._ids.append(token_id)
        before = self._decode(self._prefix_offset, self._read_offset)
        after = self._decode(self._prefix_offset, len(self._ids))
        if len(after) > len(before) and not after.endswith("\ufffd"):
            search_from = max(0, len(self.text) - self._holdback)
            self.text += after[len(before) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            cut = self._find_stop(search_from)
            if cut is not None:
                self.text = self.text[:cut]
                return DetokenizerUpdate(self._take(len(self.text)), stopped=True)
        return DetokenizerUpdate(self._take(len(self.text) - self._holdback), stopped=False)

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted]

    def flush(self) -> str:
        """Release the withheld tail once the request ends for another reason."""
        return self._take(len(self.text))

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=True)

    def _find_stop(self, search_from: int) -> int | None:
        positions = [p for s in self.stop if (p := self.text.find(s, search_from)) >= 0]
        return min(positions) if positions else None

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        piece = self.text[self._emitted : end]
        self._emitted = end
        return piece
