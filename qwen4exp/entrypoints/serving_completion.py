"""/v1/completions: text or token-id prompts (one or a batch), streamed or not."""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from ..engine.request import RequestOutput
from .async_engine import RequestStream
from .openai_format import usage
from .protocol import CompletionRequest
from .serving_engine import OpenAIServing, SSEResponse, merge, parse, run_until_disconnect, sse, sse_error, to_api_error

_FIELDS = set(CompletionRequest.model_fields)


class ServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        prompts = parse(_FIELDS, req.prompts)
        params = parse(_FIELDS, lambda: req.to_sampling_params(self.vocab_size))
        await self.compile_grammar(params, req.structured_outputs_field)
        for p in prompts:
            if not isinstance(p, str):
                self.check_ids(p, "prompt")
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await self.encode(texts, False, "prompt"))
        inputs = [{"prompt": p, "prompt_token_ids": next(encoded)} if isinstance(p, str) else p for p in prompts]
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await self.add_all(request_id, inputs, params, _FIELDS)
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.served_model_name}
        if req.stream:
            return SSEResponse(self._stream(req, head, streams), self.abort_all(streams))
        try:
            finals = await run_until_disconnect(raw, self.final_outputs(streams))
        except Exception as e:  # noqa: BLE001 - mapped to 4xx/5xx by to_api_error
            raise to_api_error(e) from None
        choices = [self.fmt.completion_choice(req, out, c, i * req.n + c.index)
                   for i, out in enumerate(finals) for c in out.outputs]
        return {**head, "choices": choices, "usage": usage(finals, req.echo_only)}

    async def _stream(self, req: CompletionRequest, head: dict, streams: list[RequestStream]):
        state = self.fmt.new_stream_state()
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge([self.engine.stream_outputs(s) for s in streams]):
                finals[i] = out
                for c in out.outputs:
                    choice = self.fmt.completion_delta(req, out, c, i * req.n + c.index, state)
                    if choice is not None:
                        yield sse({**head, "choices": [choice]} | ({"usage": None} if req.include_usage else {}))
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as vLLM does
            yield sse_error(e)
        else:
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": usage(list(finals.values()), req.echo_only)})
        yield "data: [DONE]\n\n"
