"""What the OpenAI routes share: the error envelope, SSE responses, and OpenAIServing, the base of each route
family (serving_completion.py, serving_chat.py, serving_tokenization.py), which turns prompts and messages into
token ids in the render pool and requests into engine streams.

Every client mistake is answered with a 4xx in the OpenAI error envelope {"error": {message, type, param, code}};
only an engine failure is a 5xx. Prompts are bounded before they are tokenized: a text longer than max_model_len
tokens can hold (the tokenizer's longest token, in characters, times max_model_len) is refused at once. A
structured-output request's grammar is compiled before the request reaches the engine, in a thread with a time
limit, so an invalid or runaway schema, regex or grammar is a 400 and never holds up the engine thread.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.request import (
    RequestOutput,
    SamplingParams,
    StructuredOutputsError,
    bad_word_variants,
    bad_words_token_ids,
)
from .async_engine import AsyncEngine, EngineDeadError, EngineStepError, QueueFullError, RequestStream
from .openai_format import Formatter
from .protocol import ChatMessage, param_of
from .render_pool import RenderError, RenderPool, RenderWorkerDied

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}
# seconds a client should wait before it retries a 503 (a full queue drains in about that time)
RETRY_AFTER_S = 1
# grammar compilation: xgrammar's compiler releases the GIL, so these threads leave the event loop free. A thread
# cannot be stopped: a compile past the time limit is answered with a 400 and finishes on its own
_GRAMMAR_THREADS = ThreadPoolExecutor(2, thread_name_prefix="qwen4exp-grammar")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "param": param, "code": status,
                      "type": ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def to_api_error(e: Exception, fields: set[str] = frozenset()) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, (QueueFullError, EngineDeadError)):
        return APIError(503, str(e))
    if isinstance(e, (EngineStepError, RenderWorkerDied)):
        return APIError(500, str(e))
    if isinstance(e, (ValueError, TypeError)):  # SamplingParams, the engine's add_request, our own checks
        return APIError(400, str(e), param_of(e, fields) if isinstance(e, ValueError) else None)
    return APIError(500, f"{type(e).__name__}: {e}")


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_error(e: Exception) -> str:
    err = to_api_error(e)
    return sse(error_body(err.status, err.message, err.param))


class SSEResponse(StreamingResponse):
    """Runs `on_close` however the stream ends. Starlette drops the body iterator un-closed when the client
    disconnects, and a request still waiting for its first token yields nothing that could notice; closing here
    is what aborts it."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self.body_iterator.aclose()


async def merge(iterators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of several requests; leaving early cancels (and so aborts) all of them."""
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[RequestOutput]):
        try:
            async for out in it:
                await q.put((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            await q.put((i, e))
        finally:
            await q.put((i, done))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def run_until_disconnect(raw: Request, coro):
    """Await `coro` unless the client goes away first; cancelling it aborts its requests."""
    work = asyncio.ensure_future(coro)

    async def disconnected():
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled():
        raise APIError(499, "client disconnected")
    return work.result()


def parse(fields: set[str], fn):
    try:
        return fn()
    except ValueError as e:
        raise to_api_error(e, fields) from None


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token can stand for: its vocabulary string's length (a byte-level token's string
    has one character per byte, and a byte is at most one character of text)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, pool: RenderPool | None, served_model_names: list[str],
                 max_model_len: int, chat_template: str | None = None, trust_request_chat_template: bool = False,
                 return_tokens_as_token_ids: bool = False, grammar_timeout_s: float = 30.0,
                 enable_prompt_tokens_details: bool = False):
        self.engine, self.pool = engine, pool
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.grammar_timeout_s = grammar_timeout_s
        # every name is accepted as `model`; responses carry the first (as vLLM)
        self.served_model_names, self.max_model_len = list(served_model_names), max_model_len
        self.served_model_name = self.served_model_names[0]
        self.chat_template, self.trust_request_chat_template = chat_template, trust_request_chat_template
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model_config.vocab_size
        self.defaults = engine.generation_defaults
        self.fmt = Formatter(self.tokenizer)
        per_token = max_chars_per_token(self.tokenizer) if self.tokenizer is not None else 0
        self.max_prompt_chars = max_model_len * per_token

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    @staticmethod
    def response_id(prefix: str, raw: Request, request_id: str | None) -> str:
        """The response's id: the X-Request-Id header's, else the request's `request_id`, else a random one, after
        `prefix` (vLLM's order). Engine requests get ids of their own, so clients may reuse theirs."""
        return f"{prefix}-{raw.headers.get('X-Request-Id') or request_id or uuid.uuid4().hex}"

    async def bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """The token ids of bad_words as the engine would read them (tokenized in the render pool)."""
        try:
            encoded = await self._pool("bad_words").encode(bad_word_variants(words), False, self.max_model_len)
        except RenderError as e:
            raise APIError(400, f"bad_words: could not be tokenized: {e}", "bad_words") from None
        if any(isinstance(ids, int) for ids in encoded):
            raise APIError(400, f"bad_words: a word is longer than max_model_len={self.max_model_len} tokens",
                           "bad_words")
        return parse({"bad_words"}, lambda: bad_words_token_ids(encoded))

    # ----- prompt length -----
    def too_long(self, num_tokens: int, field: str) -> APIError:
        return APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                             f"{field} has {num_tokens} tokens. Please reduce the length of the {field}.", field)

    def check_chars(self, num_chars: int, field: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, your {field} "
                     f"has {num_chars} characters, more than {self.max_model_len} tokens can hold (at most "
                     f"{self.max_prompt_chars} characters). Please reduce the length of the {field}.", field)

    def check_ids(self, ids: list[int], field: str) -> None:
        if len(ids) > self.max_model_len:
            raise self.too_long(len(ids), field)

    # ----- the render pool -----
    def _pool(self, field: str) -> RenderPool:
        if self.pool is None:
            raise APIError(400, f"{field}: the model has no tokenizer; send token ids", field)
        return self.pool

    async def encode(self, texts: list[str], add_special_tokens: bool, field: str,
                     truncate: tuple[int, str] | None = None) -> list[list[int]]:
        """Token ids of texts that fit max_model_len tokens; a longer one is a 400 naming `field`. With `truncate`
        = (k, side), each text keeps k tokens of that side, however long it was (vLLM's truncate_prompt_tokens)."""
        if not texts:
            return []
        if truncate is None:
            for text in texts:
                self.check_chars(len(text), field)
        else:  # no more characters than max_model_len tokens can hold go to the tokenizer, from the kept side
            cut = self.max_prompt_chars
            texts = [t if len(t) <= cut else t[-cut:] if truncate[1] == "left" else t[:cut] for t in texts]
        try:
            encoded = await self._pool(field).encode(texts, add_special_tokens, self.max_model_len, truncate)
        except RenderError as e:
            raise APIError(400, f"{field}: could not be tokenized: {e}", field) from None
        for ids in encoded:
            if isinstance(ids, int):
                raise self.too_long(ids, field)
        return encoded

    def template_for(self, template: str | None, kwargs: dict | None) -> str | None:
        """The chat template a request renders with: its own (only with --trust-request-chat-template), else the
        server's --chat-template, else (None) the tokenizer's."""
        given = [(name, t) for name, t in (("chat_template", template),
                                           ("chat_template_kwargs", (kwargs or {}).get("chat_template")))
                 if t is not None]
        if not given:
            return self.chat_template
        name, value = given[0]
        if not self.trust_request_chat_template:
            raise APIError(400, f"{name}: a chat template in the request is refused: the server runs the "
                                f"checkpoint's or --chat-template's only (start it with "
                                f"--trust-request-chat-template to allow request templates)", name)
        if not isinstance(value, str):
            raise APIError(400, f"{name}: the chat template must be a string", name)
        return value

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool, template: str | None,
                          kwargs: dict | None, *, tools: list[dict] | None = None,
                          add_special_tokens: bool = False, truncate: tuple[int, str] | None = None,
                          with_text: bool = False, images: bool = False, **template_vars):
        """The token ids of the conversation (and `tools`) as the chat template renders it (with the rendered text,
        as (ids, text), when `with_text`). `template_vars` (continue_final_message, documents) go to
        the template over the request's chat_template_kwargs. `images`: image_url parts become image placeholders
        (a model with a vision tower)."""
        template = self.template_for(template, kwargs)
        kwargs = {k: v for k, v in (kwargs or {}).items() if k != "chat_template"}
        kwargs.update({k: v for k, v in template_vars.items() if v is not None})
        conversation = parse({"messages"}, lambda: [m.for_template(images) for m in messages])
        try:
            rendered = await self._pool("messages").render_chat(
                conversation, add_generation_prompt, template, kwargs, self.max_prompt_chars, self.max_model_len,
                tools, add_special_tokens, truncate, with_text)
        except RenderError as e:
            raise APIError(400, f"messages: the chat template could not be applied: {e}", "messages") from None
        ids = rendered[0] if with_text else rendered
        if isinstance(ids, int):
            raise self.too_long(ids, "messages")
        return rendered

    # ----- structured output -----
    async def compile_grammar(self, params: SamplingParams, field: str) -> None:
        """Compiles the grammar of a structured-output request (the engine then finds it compiled); an invalid one,
        or one that takes longer than the time limit, is a 400 naming `field` (the request field the constraint
        comes from: structured_outputs, response_format, or tools)."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        work = asyncio.get_running_loop().run_in_executor(_GRAMMAR_THREADS, self.engine.structured_outputs.compile,
                                                          constraint)
        try:
            await asyncio.wait_for(work, self.grammar_timeout_s)
        except TimeoutError:
            raise APIError(400, f"{field}: compiling its grammar took longer than the time limit of "
                                f"{self.grammar_timeout_s:g} s", field) from None
        except StructuredOutputsError as e:
            if field != "structured_outputs":  # response_format's schema, or the tools' (a forced tool choice)
                raise APIError(400, f"{field}: {e.reason}", field) from None
            raise APIError(400, str(e), e.field) from None

    # ----- engine requests -----
    async def add_all(self, prompts: list, params, fields: set[str], cache_salt: str | None = None
                      ) -> list[RequestStream]:
        if cache_salt is not None:  # the engine reads it from the prompt, as vLLM's prompt dicts carry it
            prompts = [dict(p, cache_salt=cache_salt) if isinstance(p, dict)
                       else {"prompt_token_ids": p, "cache_salt": cache_salt} for p in prompts]
        seats, limit = self.engine.config.max_num_seqs, self.engine.max_queued_requests
        if limit is not None and len(prompts) > 1 and len(prompts) * params.n > seats + limit:
            # like a too large n (the engine's check): retrying cannot help, so a client error, not an overload
            raise APIError(400, f"prompt: {len(prompts)} prompts of {params.n} sequences each can never be admitted "
                                f"together (max_num_seqs={seats}, max_queued_requests={limit})", "prompt")
        streams = []
        base_id = uuid.uuid4().hex
        try:
            for i, prompt in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.engine.add_request(rid, prompt, params))
        except BaseException as e:  # a later prompt failed or the client left: drop the ones already added
            for s in streams:
                self.engine.abort(s.request_id)
            if isinstance(e, Exception):
                raise to_api_error(e, fields) from None
            raise
        return streams

    def abort_all(self, streams: list[RequestStream]) -> Callable[[], None]:
        return lambda: [self.engine.abort(s.request_id) for s in streams if not s.finished]

    async def final_outputs(self, streams: list[RequestStream]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merge([self.engine.stream_outputs(s) for s in streams]):
                finals[i] = out
        finally:  # cancelled (client gone) before every stream was even started: abort the rest here
            self.abort_all(streams)()
        return finals
