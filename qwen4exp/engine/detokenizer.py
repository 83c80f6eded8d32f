"""Incremental detokenization and stop-string handling for one sequence.

Text is decoded over a sliding window of tokens so that a multi-byte character split across tokens is emitted only
once complete (a trailing U+FFFD means "wait for more bytes"). Stop strings end the text; text that might be the
start of a stop string is held back from streaming until it is resolved.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.tokens = list(prompt_token_ids[-6:])  # context so the first output token decodes with its spacing
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.stop_reason: str | None = None
        self.sent = 0  # characters of text already returned by `delta`

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def add(self, token_id: int) -> bool:
        """Append one token; returns True when a stop string was hit (text is then final)."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
            self.text += new
            return self._check_stop(start)
        return False

    def _check_stop(self, start: int) -> bool:
        for s in self.stop:
            at = self.text.find(s, start)
            if at >= 0:
                self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
                self.stop_reason = s
                return True
        return False

    def flush(self) -> str:
        """Final text including a dangling partial character, when generation stops for another reason."""
        if self.stop_reason is None and self.read_offset < len(self.tokens):
            prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.tokens[self.prefix_offset:])[len(prefix):]
            self.read_offset = len(self.tokens)
        return self.text

    def held_back(self) -> int:
        """Length of the text suffix that could still become a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def delta(self, finished: bool) -> str:
        """New text since the last call that is safe to stream."""
        end = len(self.text) if finished else len(self.text) - self.held_back()
        end = max(end, self.sent)
        out = self.text[self.sent:end]
        self.sent = end
        return out
