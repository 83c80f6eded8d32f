"""/v1/chat/completions: messages rendered by the chat template, streamed or not."""

from __future__ import annotations

import dataclasses
import time

from fastapi import Request

from .async_engine import RequestStream
from .openai_format import usage
from .protocol import ChatCompletionRequest
from .serving_engine import OpenAIServing, SSEResponse, parse, run_until_disconnect, sse, sse_error, to_api_error

_FIELDS = set(ChatCompletionRequest.model_fields)


class ServingChat(OpenAIServing):
    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        params = parse(_FIELDS, lambda: req.to_sampling_params(self.vocab_size, self.defaults))
        truncate = parse(_FIELDS, lambda: req.truncation(self.max_model_len))
        rendered = await self.render_chat(
            req.messages, req.generation_prompt, req.chat_template, req.chat_template_kwargs,
            add_special_tokens=req.add_special_tokens, truncate=truncate, with_text=bool(req.return_prompt_text),
            continue_final_message=req.continue_final_message or None, documents=req.documents)
        prompt_ids, prompt_text = rendered if req.return_prompt_text else (rendered, None)
        if params.max_tokens is None and "max_tokens" in self.defaults:
            # the generation config's max_new_tokens bounds what the context leaves (vLLM's get_max_tokens)
            room = self.max_model_len - len(prompt_ids)
            if room > 0:
                params = dataclasses.replace(params, max_tokens=min(self.defaults["max_tokens"], room))
        if params.bad_words:
            params.bad_words_token_ids = await self.bad_words_ids(params.bad_words)
        request_id, created = self.response_id("chatcmpl", raw, req.request_id), int(time.time())
        streams = await self.add_all([prompt_ids], params, _FIELDS)
        head = {"id": request_id, "object": "chat.completion", "created": created, "model": self.served_model_name}
        echo = self.fmt.chat_echo(req)
        as_ids = req.tokens_as_ids(self.return_tokens_as_token_ids)
        if req.stream:
            first = {"prompt_token_ids": prompt_ids} if req.return_token_ids else {}
            if prompt_text is not None:
                first["prompt_text"] = prompt_text
            return SSEResponse(self._stream(req, {**head, "object": "chat.completion.chunk"}, streams[0], echo,
                                            as_ids, first, len(prompt_ids)), self.abort_all(streams))
        try:
            (out,) = await run_until_disconnect(raw, self.final_outputs(streams))
        except Exception as e:  # noqa: BLE001 - mapped to 4xx/5xx by to_api_error
            raise to_api_error(e) from None
        body = {**head, "choices": [self.fmt.chat_choice(req, out, c, echo, as_ids) for c in out.outputs],
                "usage": usage([out]), "prompt_logprobs": self.fmt.prompt_logprobs(req, out)}
        if req.return_token_ids:
            body["prompt_token_ids"] = out.prompt_token_ids
        if prompt_text is not None:
            body["prompt_text"] = prompt_text
        return body

    async def _stream(self, req: ChatCompletionRequest, head: dict, stream: RequestStream, echo: str, as_ids: bool,
                      first: dict, num_prompt_tokens: int):
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
                    choice = self.fmt.chat_delta(req, c, state, as_ids)
                    if choice is not None:
                        yield sse({**head, "choices": [choice], **extra(len(c.token_ids))})
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as vLLM does
            yield sse_error(e)
        else:
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": usage([last])})
        yield "data: [DONE]\n\n"
