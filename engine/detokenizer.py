"""Incremental detokenisation and stop strings.

Text is produced as deltas (TGI's prefix/read-offset scheme): a token's text is decoded together
with a few tokens before it so that tokenizers which drop leading spaces at the start of a decode
still produce the right text, and a delta ending in U+FFFD (an incomplete UTF-8 sequence split
across tokens) is held back until the next token completes it. The full text is by construction
the concatenation of the deltas, so a streamed response equals the non-streamed one.
"""

from __future__ import annotations

# How many prompt tokens seed the decode window: enough context for leading-space handling.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop or []
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all text decoded so far (up to a stop string, once found)
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended generation

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token_id: int) -> None:
        """Feed one generated token; sets `stopped` when a stop string appears."""
        if self.stopped:
            return
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._append(new)

    def _append(self, new: str) -> None:
        start = max(0, len(self.text) - self._hold)
        self.text += new
        if self.stop:
            hits = [(p, s) for p, s in ((self.text.find(s, start), s) for s in self.stop) if p >= 0]
            if hits:
                pos, self.stop_string = min(hits)
                self.text = self.text[:pos]  # stop strings are not part of the output
                self.stopped = True

    def flush(self) -> None:
        """End of generation: emit whatever is still undecoded, even an incomplete character."""
        if self.stopped or self.read_offset >= len(self.ids):
            return
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.read_offset = len(self.ids)
        if len(full) > len(prefix):
            self._append(full[len(prefix):])

    def take_delta(self, final: bool) -> str:
        """New text since the last call; while running, hold back a tail that could still turn out
        to be the start of a stop string."""
        limit = len(self.text) if (final or self.stopped) else max(self.emitted, len(self.text) - self._hold)
        delta = self.text[self.emitted:limit]
        self.emitted = limit
        return delta
