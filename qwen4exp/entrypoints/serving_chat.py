"""/v1/chat/completions: messages rendered by the chat template, streamed or not."""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from .async_engine import RequestStream
from .openai_format import usage
from .protocol import ChatCompletionRequest
from .serving_engine import OpenAIServing, SSEResponse, parse, run_until_disconnect, sse, sse_error, to_api_error

_FIELDS = set(ChatCompletionRequest.model_fields)


class ServingChat(OpenAIServing):
    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        params = parse(_FIELDS, lambda: req.to_sampling_params(self.vocab_size))
        await self.compile_grammar(params, req.structured_outputs_field)
        prompt_ids = await self.render_chat(req.messages, req.add_generation_prompt, req.chat_template,
                                            req.chat_template_kwargs)
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await self.add_all(request_id, [prompt_ids], params, _FIELDS)
        head = {"id": request_id, "object": "chat.completion", "created": created, "model": self.served_model_name}
        echo = self.fmt.chat_echo(req)
        if req.stream:
            return SSEResponse(self._stream(req, {**head, "object": "chat.completion.chunk"}, streams[0], echo),
                               self.abort_all(streams))
        try:
            (out,) = await run_until_disconnect(raw, self.final_outputs(streams))
        except Exception as e:  # noqa: BLE001 - mapped to 4xx/5xx by to_api_error
            raise to_api_error(e) from None
        return {**head, "choices": [self.fmt.chat_choice(req, out, c, echo) for c in out.outputs],
                "usage": usage([out]), "prompt_logprobs": self.fmt.prompt_logprobs(req, out)}

    async def _stream(self, req: ChatCompletionRequest, head: dict, stream: RequestStream, echo: str):
        state = self.fmt.new_stream_state()
        extra = {"usage": None} if req.include_usage else {}
        for i in range(req.n):  # the role comes first, as in OpenAI's and vLLM's streams
            delta = {"role": "assistant", "content": echo}
            yield sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
                       **extra})
        last = None
        try:
            async for out in self.engine.stream_outputs(stream):
                last = out
                for c in out.outputs:
                    choice = self.fmt.chat_delta(req, c, state)
                    if choice is not None:
                        yield sse({**head, "choices": [choice], **extra})
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as vLLM does
            yield sse_error(e)
        else:
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": usage([last])})
        yield "data: [DONE]\n\n"
