"""/v1/completions: text or token-id prompts (one or a batch), streamed or not."""

from __future__ import annotations

import time

from fastapi import Request

from ..engine.request import RequestOutput
from .async_engine import RequestStream
from .openai_format import choice_usage, usage
from .protocol import CompletionRequest
from .serving_engine import OpenAIServing, SSEResponse, merge, parse, run_until_disconnect, sse, sse_error, to_api_error

_FIELDS = set(CompletionRequest.model_fields)


class ServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        prompts = parse(_FIELDS, req.prompts)
        params = parse(_FIELDS, lambda: req.to_sampling_params(self.vocab_size, self.defaults))
        await self.compile_grammar(params, req.structured_outputs_field)
        truncate = parse(_FIELDS, lambda: req.truncation(self.max_model_len))
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                continue
            if truncate is not None and len(p) > truncate[0]:
                prompts[i] = p = p[len(p) - truncate[0]:] if truncate[1] == "left" else p[:truncate[0]]
            self.check_ids(p, "prompt")
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await self.encode(texts, req.add_special_tokens, "prompt", truncate))
        # a truncated text is no longer the prompt: its echo is the kept tokens' text
        inputs = [p if not isinstance(p, str) else {"prompt_token_ids": next(encoded)} if truncate is not None
                  else {"prompt": p, "prompt_token_ids": next(encoded)} for p in prompts]
        if params.bad_words:
            params.bad_words_token_ids = await self.bad_words_ids(params.bad_words)
        request_id, created = self.response_id("cmpl", raw, req.request_id), int(time.time())
        streams = await self.add_all(inputs, params, _FIELDS, req.cache_salt)
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.served_model_name}
        as_ids = req.tokens_as_ids(self.return_tokens_as_token_ids)
        if req.stream:
            return SSEResponse(self._stream(req, head, streams, as_ids), self.abort_all(streams))
        try:
            finals = await run_until_disconnect(raw, self.final_outputs(streams))
        except Exception as e:  # noqa: BLE001 - mapped to 4xx/5xx by to_api_error
            raise to_api_error(e) from None
        choices = [self.fmt.completion_choice(req, out, c, i * req.n + c.index, as_ids)
                   for i, out in enumerate(finals) for c in out.outputs]
        return {**head, "choices": choices, "usage": usage(finals, req.echo_only, self.enable_prompt_tokens_details)}

    async def _stream(self, req: CompletionRequest, head: dict, streams: list[RequestStream], as_ids: bool):
        state = self.fmt.new_stream_state()
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge([self.engine.stream_outputs(s) for s in streams]):
                finals[i] = out
                for c in out.outputs:
                    choice = self.fmt.completion_delta(req, out, c, i * req.n + c.index, state, as_ids)
                    if choice is not None:
                        extra = {}
                        if req.include_usage:  # with continuous_usage_stats, this choice's counts so far
                            extra["usage"] = choice_usage(out, c, req.echo_only) if req.continuous_usage else None
                        yield sse({**head, "choices": [choice], **extra})
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as vLLM does
            yield sse_error(e)
        else:
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": usage(list(finals.values()), req.echo_only,
                                                              self.enable_prompt_tokens_details)})
        yield "data: [DONE]\n\n"
