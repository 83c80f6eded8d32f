"""vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize."""

from __future__ import annotations

from .protocol import DetokenizeRequest, TokenizeRequest
from .render_pool import RenderError
from .serving_engine import APIError, OpenAIServing


class ServingTokenization(OpenAIServing):
    async def tokenize(self, req: TokenizeRequest) -> dict:
        self.check_model(req.model)
        if req.messages is not None:
            ids = await self.render_chat(req.messages, req.add_generation_prompt, req.chat_template,
                                         req.chat_template_kwargs,
                                         tools=[t.for_template() for t in req.tools or []] or None)
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            (ids,) = await self.encode([req.prompt], add_special, "prompt")
        body = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}
        if req.return_token_strs:
            body["token_strs"] = await self._run(self._pool("prompt").token_strs, ids)
        return body

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        self.check_ids(req.tokens, "tokens")
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"tokens: {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", "tokens")
        return {"prompt": await self._run(self._pool("tokens").decode, req.tokens)}

    @staticmethod
    async def _run(job, ids: list[int]):
        try:
            return await job(ids)
        except RenderError as e:
            raise APIError(400, f"tokens: could not be decoded: {e}", "tokens") from None
