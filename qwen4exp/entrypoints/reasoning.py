"""Reasoning parsers: a chat choice's generated text -> reasoning and content, as vLLM's --reasoning-parser.

`qwen3`: the reasoning is what comes before </think>; the answer starts in it unless the prompt already closed it
(Qwen3's templates write <think> into the prompt, or <think></think> when `enable_thinking` is false), and an
answer with no </think> at all is all reasoning. A <think> inside it is markup, and <tool_call> ends it too: the
call is content, for the tool parser. With `chat_template_kwargs: {"enable_thinking": false}` nothing is reasoning.

Fed the text in pieces split anywhere, the parser returns what has become certain, so a streamed answer adds up to
the non-streamed one exactly.
"""

from __future__ import annotations

from .tool_parsers import first_tag, partial_tag


class Qwen3ReasoningParser:
    name = "qwen3"
    START, END = "<think>", "</think>"
    CALL = "<tool_call>"  # a call ends the reasoning and is content
    # a prompt turn starts after these: a </think> before them closed an earlier answer's reasoning
    TURN_MARKERS = ("<|im_start|>", "<|im_end|>")
    _TAGS = (START, END, CALL)

    def __init__(self, in_reasoning: bool = True):
        self.in_reasoning = in_reasoning
        self._buf = ""

    @staticmethod
    def thinking(chat_template_kwargs: dict | None) -> bool:
        return bool((chat_template_kwargs or {}).get("enable_thinking", True))

    @classmethod
    def starts_in_reasoning(cls, prompt_token_ids: list[int], vocab: dict[str, int]) -> bool:
        """Whether an answer to this prompt starts inside the reasoning: unless the prompt's last turn closed it
        with </think>. `vocab` maps the markers to their token ids."""
        end, start = vocab.get(cls.END), vocab.get(cls.START)
        turn = {vocab[m] for m in cls.TURN_MARKERS if m in vocab}
        for t in reversed(prompt_token_ids):
            if t == end:
                return False
            if t == start or t in turn:
                return True
        return True

    @classmethod
    def reasoning_tokens(cls, token_ids: list[int], vocab: dict[str, int]) -> int:
        """How many of an answer's tokens (one that starts in the reasoning) are reasoning: those before its end,
        the markers not counted."""
        start, ends = vocab.get(cls.START), {vocab[m] for m in (cls.END, cls.CALL) if m in vocab}
        n = 0
        for t in token_ids:
            if t in ends:
                break
            n += t != start
        return n

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of the next piece of text."""
        if not self.in_reasoning:
            return "", text
        buf = self._buf + text
        reasoning = []
        while True:
            pos, tag = first_tag(buf, self._TAGS)
            if tag is None:
                keep = partial_tag(buf, self._TAGS)
                reasoning.append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return "".join(reasoning), ""
            reasoning.append(buf[:pos])
            if tag == self.START:
                buf = buf[pos + len(tag):]
                continue
            self.in_reasoning = False
            self._buf = ""
            return "".join(reasoning), buf[pos + len(tag):] if tag == self.END else buf[pos:]

    def finish(self) -> tuple[str, str]:
        """The text held back at the end: a partial tag is what it was in."""
        rest, self._buf = self._buf, ""
        return (rest, "") if self.in_reasoning else ("", rest)


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {Qwen3ReasoningParser.name: Qwen3ReasoningParser}
