"""/v1/chat/completions: messages (and tools) rendered by the chat template, streamed or not; the answer's text
parsed into reasoning, content and tool calls by the server's --reasoning-parser and --tool-call-parser.

Tool calls are parsed as in vLLM: with tool_choice "auto" when the server runs with --enable-auto-tool-choice,
and always with "required" or a named function. Those two need --tool-call-parser; "auto" without
--enable-auto-tool-choice is refused unless a --tool-call-parser is set (then the calls stay in the content).
"required" and a named function generate under a JSON schema built from the tools (tool_schema.py, in place of
the request's structured_outputs and response_format, as vLLM): the answer is valid calls whose arguments follow
the tools' parameter schemas (unless max_tokens cuts it), read from that JSON rather than by the tool-call parser.
Such an answer has no reasoning: the grammar holds from its first token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import Request

from ..multimodal import ImageError
from .async_engine import RequestStream
from .openai_format import ChatParsing, usage
from .protocol import ChatCompletionRequest, image_urls
from .reasoning import REASONING_PARSERS
from .serving_engine import (
    APIError,
    OpenAIServing,
    SSEResponse,
    parse,
    run_until_disconnect,
    sse,
    sse_error,
    to_api_error,
)
from .tool_parsers import TOOL_PARSERS
from .tool_schema import tool_call_constraint

_FIELDS = set(ChatCompletionRequest.model_fields)


class ServingChat(OpenAIServing):
    def __init__(self, *args, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 enable_auto_tool_choice: bool = False, exclude_tools_when_tool_choice_none: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_parser = TOOL_PARSERS[tool_call_parser] if tool_call_parser else None
        self.reasoning_parser = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        self.reasoning_vocab: dict[str, int] = {}
        if self.reasoning_parser is not None and self.tokenizer is not None:
            vocab = self.tokenizer.get_vocab()
            parser = self.reasoning_parser
            markers = (parser.START, parser.END, parser.CALL, *parser.TURN_MARKERS)
            self.reasoning_vocab = {m: vocab[m] for m in markers if m in vocab}

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        parse(_FIELDS, req.check_tool_use)
        self._check_tool_choice(req)
        params = parse(_FIELDS, lambda: req.to_sampling_params(self.vocab_size, self.defaults))
        truncate = parse(_FIELDS, lambda: req.truncation(self.max_model_len))
        parsing = self._parsing(req)
        if parsing is not None and parsing.forced:
            params.structured_outputs = parse(_FIELDS, lambda: tool_call_constraint(
                req.tools, req.tool_choice, req.parallel_tool_calls))
            await self.compile_grammar(params, "tools")
        else:
            await self.compile_grammar(params, req.structured_outputs_field)
        if parsing is not None or (self.tool_parser is not None and req.tools and req.tool_choice != "none"):
            # the parsers read tags that some tokenizers mark special (vLLM's parsers keep them too)
            params.skip_special_tokens = False
        mm_processor = self.engine.engine.mm_processor
        images = parse(_FIELDS, lambda: image_urls(req.messages)) if mm_processor is not None else []
        tools = req.tools
        if req.tool_choice == "none" and self.exclude_tools_when_tool_choice_none:
            tools = None
        rendered = await self.render_chat(
            req.messages, req.generation_prompt, req.chat_template, req.chat_template_kwargs,
            tools=[t.for_template() for t in tools or []] or None,
            add_special_tokens=req.add_special_tokens, truncate=truncate, with_text=bool(req.return_prompt_text),
            continue_final_message=req.continue_final_message or None, documents=req.documents,
            images=mm_processor is not None)
        prompt_ids, prompt_text = rendered if req.return_prompt_text else (rendered, None)
        prompt = prompt_ids
        if images:
            prompt_ids, state = await self._with_images(mm_processor, prompt_ids, images)
            prompt = {"prompt_token_ids": prompt_ids, "multi_modal_state": state}
        if parsing is not None and parsing.reasoning is not None:
            parsing.in_reasoning = (parsing.reasoning.thinking(req.chat_template_kwargs)
                                    and parsing.reasoning.starts_in_reasoning(prompt_ids, self.reasoning_vocab))
        if params.max_tokens is None and "max_tokens" in self.defaults:
            # the generation config's max_new_tokens bounds what the context leaves (vLLM's get_max_tokens)
            room = self.max_model_len - len(prompt_ids)
            if room > 0:
                params = dataclasses.replace(params, max_tokens=min(self.defaults["max_tokens"], room))
        if params.bad_words:
            params.bad_words_token_ids = await self.bad_words_ids(params.bad_words)
        request_id, created = self.response_id("chatcmpl", raw, req.request_id), int(time.time())
        streams = await self.add_all([prompt], params, _FIELDS, req.cache_salt)
        head = {"id": request_id, "object": "chat.completion", "created": created, "model": self.served_model_name}
        echo = self.fmt.chat_echo(req)
        as_ids = req.tokens_as_ids(self.return_tokens_as_token_ids)
        if req.stream:
            first = {"prompt_token_ids": prompt_ids} if req.return_token_ids else {}
            if prompt_text is not None:
                first["prompt_text"] = prompt_text
            return SSEResponse(self._stream(req, {**head, "object": "chat.completion.chunk"}, streams[0], echo,
                                            as_ids, parsing, first, len(prompt_ids)), self.abort_all(streams))
        try:
            (out,) = await run_until_disconnect(raw, self.final_outputs(streams))
        except Exception as e:  # noqa: BLE001 - mapped to 4xx/5xx by to_api_error
            raise to_api_error(e) from None
        body = {**head, "choices": [self.fmt.chat_choice(req, out, c, echo, as_ids, parsing) for c in out.outputs],
                "usage": self._usage(out, parsing), "prompt_logprobs": self.fmt.prompt_logprobs(req, out)}
        if req.return_token_ids:
            body["prompt_token_ids"] = out.prompt_token_ids
        if prompt_text is not None:
            body["prompt_text"] = prompt_text
        return body

    @staticmethod
    async def _with_images(mm_processor, prompt_ids: list[int], images: list[tuple[str, str]]):
        """(expanded ids, MultiModalState) of the rendered prompt: the images loaded and preprocessed in a thread
        (off the event loop); a bad image is a 400 naming its content part."""
        try:
            return await asyncio.to_thread(mm_processor.prepare, prompt_ids, [url for url, _ in images], "messages",
                                           [f for _, f in images])
        except ImageError as e:
            raise APIError(400, str(e), e.field) from None

    def _usage(self, out, parsing: ChatParsing | None) -> dict:
        """vLLM's usage; with --reasoning-parser also the count of reasoning tokens."""
        body = usage([out], cached_tokens=self.enable_prompt_tokens_details)
        if self.reasoning_parser is not None:
            counted = parsing is not None and parsing.in_reasoning
            body["completion_tokens_details"] = {"reasoning_tokens": sum(
                self.reasoning_parser.reasoning_tokens(c.token_ids, self.reasoning_vocab) for c in out.outputs
            ) if counted else 0}
        return body

    def _check_tool_choice(self, req: ChatCompletionRequest) -> None:
        """vLLM's rule: a tool choice other than "none" needs a tool-call parser, "auto" also allows
        --enable-auto-tool-choice."""
        choice = req.tool_choice
        if self.tool_parser is not None or choice in (None, "none"):
            return
        if choice == "auto":
            raise APIError(400, 'tool_choice: "auto" needs the server started with --enable-auto-tool-choice and '
                                '--tool-call-parser', "tool_choice")
        what = f'function "{req.named_function}"' if req.named_function else f'"{choice}"'
        raise APIError(400, f"tool_choice: {what} needs the server started with --tool-call-parser", "tool_choice")

    def _parsing(self, req: ChatCompletionRequest) -> ChatParsing | None:
        """What parses this request's answers; None when it is plain text."""
        named = req.named_function
        forced = named is not None or req.tool_choice == "required"
        calls = self.tool_parser is not None and bool(req.tools) and (
            forced or (req.tool_choice == "auto" and self.enable_auto_tool_choice))
        if not calls and self.reasoning_parser is None:
            return None
        parsing = ChatParsing(reasoning=self.reasoning_parser, include_reasoning=req.include_reasoning)
        if calls:
            parsing.tool_parser = self.tool_parser
            parsing.tools = [t.for_template() for t in req.tools]
            parsing.forced, parsing.named = forced, named
            parsing.max_calls = 1 if named is not None or req.parallel_tool_calls is False else None
            if forced:  # the answer is the constraint's JSON from its first token
                parsing.reasoning, parsing.in_reasoning = None, False
        return parsing

    async def _stream(self, req: ChatCompletionRequest, head: dict, stream: RequestStream, echo: str, as_ids: bool,
                      parsing: ChatParsing | None, first: dict, num_prompt_tokens: int):
        """`first`: what the first chunk carries besides the role (prompt_token_ids, prompt_text)."""
        state = self.fmt.new_stream_state()

        def extra(completion_tokens: int | None = None) -> dict:
            if not req.include_usage:
                return {}
            if not req.continuous_usage or completion_tokens is None:
                return {"usage": None}
            return {"usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": num_prompt_tokens + completion_tokens}}

        for i in range(req.n):  # the role comes first, as in OpenAI's and vLLM's streams
            delta = {"role": "assistant", "content": echo}
            yield sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
                       **(first if i == 0 else {}), **extra(0)})
        last = None
        try:
            async for out in self.engine.stream_outputs(stream):
                last = out
                for c in out.outputs:
                    choice = self.fmt.chat_delta(req, c, state, as_ids, parsing)
                    if choice is not None:
                        yield sse({**head, "choices": [choice], **extra(len(c.token_ids))})
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as vLLM does
            yield sse_error(e)
        else:
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": self._usage(last, parsing)})
        yield "data: [DONE]\n\n"
