"""RequestOutput -> OpenAI response pieces: completion and chat choices, streaming deltas, logprobs and usage.

RequestOutputs are cumulative; streams remember per choice how much text and how many tokens were sent. A chat
choice's text goes through the server's reasoning and tool-call parsers (ChatParsing) when the request uses them:
streamed, each chunk's text is parsed as it comes, and the deltas add up to the non-streamed message.
The logprob lists in an output are the engine's live lists (the engine thread may append to them while we read),
so they are always sliced to the token ids the output carries.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..engine.request import CompletionOutput, Logprob, RequestOutput
from .protocol import ChatCompletionRequest, CompletionRequest
from .reasoning import Qwen3ReasoningParser
from .tool_parsers import ForcedCallParser, ToolCallDelta, ToolParser, merge_deltas


def _lp(x: float) -> float:
    # JSON has no -inf or NaN; vLLM clamps to -9999 the same way
    return x if not math.isnan(x) and x > -9999.0 else -9999.0


def usage(outputs: list[RequestOutput], echo_only: bool = False, cached_tokens: bool = False) -> dict:
    """vLLM's usage; with `cached_tokens` (--enable-prompt-tokens-details) also the prompt tokens found in the prefix
    cache, where there are some."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = 0 if echo_only else sum(len(c.token_ids) for o in outputs for c in o.outputs)
    body = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    cached = sum(o.num_cached_tokens for o in outputs) if cached_tokens else 0
    if cached:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    return body


def choice_usage(out: RequestOutput, c: CompletionOutput, echo_only: bool = False) -> dict:
    """One choice's counts so far (stream_options.continuous_usage_stats)."""
    prompt, completion = len(out.prompt_token_ids), 0 if echo_only else len(c.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_id_string(token_id: int) -> str:
    """A token as return_tokens_as_token_ids writes it."""
    return f"token_id:{token_id}"


@dataclass
class ChatParsing:
    """How one chat request's choices are parsed: which parsers, and what the request asked of the calls."""

    reasoning: type[Qwen3ReasoningParser] | None = None
    in_reasoning: bool = True  # the answer starts inside the reasoning
    include_reasoning: bool = True
    tool_parser: type[ToolParser] | None = None
    tools: list[dict] | None = None
    max_calls: int | None = None  # 1 for parallel_tool_calls false or a named function
    # tool_choice "required" or a named function: the answer is the JSON of tool_call_constraint, read by
    # ForcedCallParser instead of the tool parser, and its content is "" rather than null
    forced: bool = False
    named: str | None = None  # the named function: finish_reason stays "stop", as OpenAI's

    def new_parser(self) -> ChoiceParser:
        return ChoiceParser(self)

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        """"tool_calls" for a choice with calls that stopped on its own (a cut at "length" stays visible)."""
        return "tool_calls" if called and engine_reason == "stop" and self.named is None else engine_reason


class ChoiceParser:
    """One choice's text -> reasoning, content and tool calls, fed as it is generated."""

    def __init__(self, parsing: ChatParsing):
        self.parsing = parsing
        self.reasoning = parsing.reasoning(parsing.in_reasoning) if parsing.reasoning else None
        self.tools = (ForcedCallParser(parsing.named) if parsing.forced
                      else parsing.tool_parser(parsing.tools) if parsing.tool_parser else None)
        self.calls: dict[int, dict] = {}

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        """(reasoning, content, tool-call deltas) of the next piece of text; `final` at its end."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            r, c = self.reasoning.finish()
            reasoning, content = reasoning + r, content + c
        deltas: list[ToolCallDelta] = []
        if self.tools:
            content, deltas = self.tools.feed(content)
            if final:
                c, d = self.tools.finish()
                content, deltas = content + c, merge_deltas(deltas + d)
        limit = self.parsing.max_calls
        out = []
        for d in deltas:
            if limit is not None and d.index >= limit:
                continue
            if d.id is not None:
                self.calls[d.index] = {"id": d.id, "type": "function",
                                       "function": {"name": d.name, "arguments": d.arguments}}
                out.append({"index": d.index, "id": d.id, "type": "function",
                            "function": {"name": d.name, "arguments": d.arguments}})
            else:
                self.calls[d.index]["function"]["arguments"] += d.arguments
                out.append({"index": d.index, "function": {"arguments": d.arguments}})
        if not self.parsing.include_reasoning:
            reasoning = ""
        return reasoning, content, out

    def tool_calls(self) -> list[dict]:
        return [self.calls[i] for i in sorted(self.calls)]


@dataclass
class _Sent:
    text: int = 0  # characters of generated text sent
    tokens: int = 0  # generated tokens whose logprobs were sent
    text_offset: int = 0  # completions logprobs: offset of the next token
    started: bool = False
    done: bool = False
    parser: Any = field(default=None)  # chat: the choice's ChoiceParser


class Formatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @staticmethod
    def new_stream_state() -> dict[int, _Sent]:
        return defaultdict(_Sent)

    def piece(self, token_id: int, entry: dict[int, Logprob] | None = None, as_id: bool = False) -> str:
        """The token's text, or with `as_id` its return_tokens_as_token_ids form."""
        if as_id:
            return token_id_string(token_id)
        lp = entry.get(token_id) if entry else None
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])

    def prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    @staticmethod
    def _generated(req: CompletionRequest, c: CompletionOutput):
        if req.echo_only:  # the one token the engine had to generate is not part of the answer
            return "", [], []
        ids = c.token_ids
        return c.text, ids, (c.logprobs[: len(ids)] if c.logprobs is not None else [None] * len(ids))

    @staticmethod
    def _prompt_part(out: RequestOutput):
        ids = out.prompt_token_ids
        entries = out.prompt_logprobs[: len(ids)] if out.prompt_logprobs is not None else [None] * len(ids)
        return ids, entries

    # ----- completions -----
    def completion_logprobs(self, ids: list[int], entries: list, offset: int = 0,
                            as_ids: bool = False) -> tuple[dict, int]:
        """OpenAI's legacy format; the first prompt token has no logprob (None), as in vLLM. Offsets count the
        tokens' text, also when `as_ids` writes them as ids."""
        tokens, token_lps, top, offsets = [], [], [], []
        for tid, entry in zip(ids, entries):
            piece = self.piece(tid, entry)
            tokens.append(token_id_string(tid) if as_ids else piece)
            offsets.append(offset)
            offset += len(piece)
            if entry is None:
                token_lps.append(None)
                top.append(None)
            else:
                token_lps.append(_lp(entry[tid].logprob))
                top.append({self.piece(t, entry, as_ids): _lp(e.logprob) for t, e in entry.items()})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top, "text_offset": offsets}, offset

    def completion_choice(self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, index: int,
                          as_ids: bool = False) -> dict:
        text, ids, entries = self._generated(req, c)
        generated = ids
        if req.echo:
            p_ids, p_entries = self._prompt_part(out)
            text, ids, entries = self.prompt_text(out) + text, p_ids + ids, p_entries + entries
        logprobs = self.completion_logprobs(ids, entries, as_ids=as_ids)[0] if req.logprobs is not None else None
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason, "prompt_logprobs": self.prompt_logprobs(req, out)}
        if req.return_token_ids:
            choice.update(prompt_token_ids=out.prompt_token_ids, token_ids=list(generated))
        return choice

    @staticmethod
    def _held_for_interval(req, s: _Sent, num_tokens: int, finished: bool) -> bool:
        """stream_interval: after the first chunk, a choice's tokens go out in groups of that many (and at the
        end)."""
        interval = req.stream_interval
        return bool(interval and s.started and not finished and num_tokens - s.tokens < interval)

    def completion_delta(self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, index: int,
                         state: dict[int, _Sent], as_ids: bool = False) -> dict | None:
        s = state[index]
        if s.done:
            return None
        finished = c.finish_reason is not None
        text, ids, entries = self._generated(req, c)
        if self._held_for_interval(req, s, len(ids), finished):
            return None
        prefix, p_ids, p_entries = "", [], []
        if not s.started and req.echo:
            scored = len(out.prompt_logprobs or ()) >= len(out.prompt_token_ids)
            if req.logprobs is not None and not scored and not finished:
                return None  # prompt logprobs arrive chunk by chunk during prefill: echo them once complete
            prefix = self.prompt_text(out)
            p_ids, p_entries = self._prompt_part(out)
        new_text = text[s.text:]
        if not (prefix or new_text or finished):
            return None  # tokens without text yet (held back, partial character) go out with the next chunk
        first = not s.started
        s.started, s.done = True, finished
        logprobs = None
        if req.logprobs is not None:
            logprobs, s.text_offset = self.completion_logprobs(
                p_ids + ids[s.tokens:], p_entries + entries[s.tokens:], s.text_offset, as_ids)
        choice = {"index": index, "text": prefix + new_text, "logprobs": logprobs,
                  "finish_reason": c.finish_reason if finished else None,
                  "stop_reason": c.stop_reason if finished else None}
        if req.return_token_ids:  # the prompt's with the choice's first chunk, then each chunk's new tokens
            if first:
                choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = list(ids[s.tokens:])
        s.text, s.tokens = max(s.text, len(text)), len(ids)
        return choice

    def prompt_logprobs(self, req, out: RequestOutput) -> list | None:
        """vLLM's `prompt_logprobs` field: per prompt token None or {id: {logprob, rank, decoded_token}}."""
        if req.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        return [None if e is None else {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                                 "decoded_token": self.piece(t, e)} for t, lp in e.items()}
                for e in out.prompt_logprobs[: len(out.prompt_token_ids)]]

    # ----- chat -----
    @staticmethod
    def chat_echo(req: ChatCompletionRequest) -> str:
        last = req.messages[-1]
        if not req.echo or last.role != "assistant":
            return ""
        return last.for_template(images=True).get("content") or ""  # a text-only model refused images earlier

    def chat_logprobs(self, ids: list[int], entries: list, k: int, as_ids: bool = False) -> dict:
        """`bytes` are the token's UTF-8 bytes, also when `as_ids` writes the token as its id."""
        content = []
        for tid, entry in zip(ids, entries):
            if entry is None:
                continue
            top = sorted((e.rank, t, e) for t, e in entry.items() if e.rank is not None and e.rank <= k)[:k]
            content.append({
                "token": self.piece(tid, entry, as_ids), "logprob": _lp(entry[tid].logprob),
                "bytes": list(self.piece(tid, entry).encode("utf-8")),
                "top_logprobs": [{"token": self.piece(t, entry, as_ids), "logprob": _lp(e.logprob),
                                  "bytes": list(self.piece(t, entry).encode("utf-8"))} for _, t, e in top],
            })
        return {"content": content}

    def _chat_logprobs_of(self, req: ChatCompletionRequest, c: CompletionOutput, start: int,
                          as_ids: bool = False, parsing: ChatParsing | None = None) -> dict | None:
        if not req.logprobs or c.logprobs is None:
            return None
        if parsing is not None and parsing.reasoning is not None and not parsing.include_reasoning:
            return None  # the tokens would show the reasoning left out (vLLM leaves them out too)
        ids = c.token_ids
        return self.chat_logprobs(ids[start:], c.logprobs[start: len(ids)], req.top_logprobs or 0, as_ids)

    def chat_choice(self, req: ChatCompletionRequest, out: RequestOutput, c: CompletionOutput, echo: str,
                    as_ids: bool = False, parsing: ChatParsing | None = None) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": echo + c.text, "reasoning": None, "tool_calls": []}
        finish_reason = c.finish_reason
        if parsing is not None:
            parser = parsing.new_parser()
            reasoning, content, _ = parser.feed(c.text, final=True)
            calls = parser.tool_calls()
            content = content or ("" if parsing.forced else None)
            message.update(content=echo + (content or "") if echo else content, reasoning=reasoning or None,
                           tool_calls=calls)
            finish_reason = parsing.finish_reason(finish_reason, bool(calls))
        choice = {"index": c.index, "message": message, "logprobs": self._chat_logprobs_of(req, c, 0, as_ids, parsing),
                  "finish_reason": finish_reason, "stop_reason": c.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice

    def chat_delta(self, req: ChatCompletionRequest, c: CompletionOutput, state: dict[int, _Sent],
                   as_ids: bool = False, parsing: ChatParsing | None = None) -> dict | None:
        s = state[c.index]
        if s.done:
            return None
        finished = c.finish_reason is not None
        new_text = c.text[s.text:]
        if not (new_text or finished) or self._held_for_interval(req, s, len(c.token_ids), finished):
            return None
        finish_reason = c.finish_reason
        if parsing is None:
            delta: dict[str, Any] = {"content": new_text} if new_text else {}
        else:
            if s.parser is None:
                s.parser = parsing.new_parser()
            reasoning, content, calls = s.parser.feed(new_text, final=finished)
            s.text = max(s.text, len(c.text))  # the parser holds what it did not send yet
            delta = {}
            if reasoning:
                delta["reasoning"] = reasoning
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            if finished:
                finish_reason = parsing.finish_reason(finish_reason, bool(s.parser.calls))
        if not (delta or finished):
            return None  # nothing to send yet: the tokens (ids, logprobs) go out with the next chunk
        logprobs = self._chat_logprobs_of(req, c, s.tokens, as_ids, parsing)
        choice = {"index": c.index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason if finished else None,
                  "stop_reason": c.stop_reason if finished else None}
        if req.return_token_ids:
            choice["token_ids"] = list(c.token_ids[s.tokens:])
        s.started = True
        s.text, s.tokens, s.done = max(s.text, len(c.text)), len(c.token_ids), finished
        return choice
