"""OpenAI-compatible HTTP server (vLLM's routes, request fields and response shapes) over an AsyncEngine.

Every client mistake is answered with a 4xx in the OpenAI error envelope {"error": {message, type, param, code}};
only an engine failure is a 5xx. A request whose client goes away is aborted, which frees its cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import EngineConfig, default_max_num_batched_tokens, resolve_device
from ..engine.request import RequestOutput
from .async_engine import AsyncEngine, EngineDeadError, EngineStepError, QueueFullError, RequestStream
from .openai_format import Formatter, usage
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    TokenizeRequest,
    param_of,
)

logger = logging.getLogger("qwen4exp")

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    err = {"message": message, "type": _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else
                                                           "InternalServerError"), "param": param, "code": status}
    return JSONResponse({"error": err}, status_code=status)


def to_api_error(e: Exception, fields: set[str] = frozenset()) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, (QueueFullError, EngineDeadError)):
        return APIError(503, str(e))
    if isinstance(e, EngineStepError):
        return APIError(500, str(e))
    if isinstance(e, (ValueError, TypeError)):  # SamplingParams, the engine's add_request, our own checks
        return APIError(400, str(e), param_of(e, fields) if isinstance(e, ValueError) else None)
    return APIError(500, f"{type(e).__name__}: {e}")


class _APIKeyMiddleware:
    """Bearer-token check on /v1 routes, as vLLM does. Pure ASGI so it runs before the body is parsed and leaves
    streaming and disconnect detection untouched."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                return await error_response(401, "Unauthorized: missing or wrong API key")(scope, receive, send)
        await self.app(scope, receive, send)


class _SSEResponse(StreamingResponse):
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


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _merge(iterators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def _run_until_disconnect(raw: Request, coro):
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


def build_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_model_len: int | None = None, model_path: str | None = None) -> FastAPI:
    engine = async_engine
    tokenizer = engine.tokenizer
    vocab_size = engine.model_config.vocab_size
    max_model_len = max_model_len or engine.config.max_model_len
    fmt = Formatter(tokenizer)
    app = FastAPI(title="qwen4exp OpenAI-compatible server")
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    v1 = APIRouter(prefix="/v1")

    # ----- errors -----
    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
        msg = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: {err.get('msg')}"
                        for err in errs[:5])
        return error_response(400, msg, loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):
        logger.exception("unhandled error in request")
        err = to_api_error(e)
        return error_response(err.status, err.message, err.param)

    # ----- helpers -----
    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def encode_messages(messages, add_generation_prompt: bool, kwargs: dict | None) -> list[int]:
        conv = [m.for_template() for m in messages]
        try:
            ids = tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                return_dict=False, **(kwargs or {}))
        except Exception as e:  # noqa: BLE001 - jinja errors (raise_exception in templates), clashing kwargs
            raise RequestError(f"messages: the chat template could not be applied: {e}", "messages") from None
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    async def add_all(base_id: str, prompts: list, params, fields: set[str]) -> list[RequestStream]:
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await engine.add_request(rid, prompt, params))
        except BaseException as e:  # a later prompt failed or the client left: drop the ones already added
            for s in streams:
                engine.abort(s.request_id)
            if isinstance(e, Exception):
                raise to_api_error(e, fields) from None
            raise
        return streams

    def abort_all(streams: list[RequestStream]) -> Callable[[], None]:
        return lambda: [engine.abort(s.request_id) for s in streams if not s.finished]

    async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in _merge([engine.stream_outputs(s) for s in streams]):
                finals[i] = out
        finally:  # cancelled (client gone) before every stream was even started: abort the rest here
            abort_all(streams)()
        return finals

    def parse(body_fields: set[str], fn):
        try:
            return fn()
        except ValueError as e:
            raise to_api_error(e, body_fields) from None

    # ----- OpenAI routes -----
    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "qwen4exp",
            "root": model_path or served_model_name, "parent": None, "max_model_len": max_model_len,
            "permission": [],
        }]}

    @v1.post("/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        fields = set(CompletionRequest.model_fields)
        prompts = parse(fields, req.prompts)
        params = parse(fields, lambda: req.to_sampling_params(vocab_size))
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await add_all(request_id, prompts, params, fields)
        head = {"id": request_id, "object": "text_completion", "created": created, "model": served_model_name}
        if req.stream:
            return _SSEResponse(completion_stream(req, head, streams), abort_all(streams))
        try:
            finals = await _run_until_disconnect(raw, final_outputs(streams))
        except Exception as e:  # noqa: BLE001 - mapped to 4xx/5xx by to_api_error
            raise to_api_error(e) from None
        choices = [fmt.completion_choice(req, out, c, i * req.n + c.index)
                   for i, out in enumerate(finals) for c in out.outputs]
        return {**head, "choices": choices, "usage": usage(finals, req.echo_only)}

    async def completion_stream(req: CompletionRequest, head: dict, streams: list[RequestStream]):
        state = fmt.new_stream_state()
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in _merge([engine.stream_outputs(s) for s in streams]):
                finals[i] = out
                for c in out.outputs:
                    choice = fmt.completion_delta(req, out, c, i * req.n + c.index, state)
                    if choice is not None:
                        yield _sse({**head, "choices": [choice]} | ({"usage": None} if req.include_usage else {}))
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as vLLM does
            err = to_api_error(e)
            yield _sse({"error": {"message": err.message, "type": _ERROR_TYPES.get(err.status),
                                  "param": err.param, "code": err.status}})
        else:
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": usage(list(finals.values()), req.echo_only)})
        yield "data: [DONE]\n\n"

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        fields = set(ChatCompletionRequest.model_fields)
        params = parse(fields, lambda: req.to_sampling_params(vocab_size))
        prompt_ids = parse(fields, lambda: encode_messages(
            req.messages, req.add_generation_prompt, req.chat_template_kwargs))
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await add_all(request_id, [prompt_ids], params, fields)
        head = {"id": request_id, "object": "chat.completion", "created": created, "model": served_model_name}
        echo = fmt.chat_echo(req)
        if req.stream:
            return _SSEResponse(chat_stream(req, {**head, "object": "chat.completion.chunk"}, streams[0], echo),
                                abort_all(streams))
        try:
            (out,) = await _run_until_disconnect(raw, final_outputs(streams))
        except Exception as e:  # noqa: BLE001 - mapped to 4xx/5xx by to_api_error
            raise to_api_error(e) from None
        return {**head, "choices": [fmt.chat_choice(req, out, c, echo) for c in out.outputs],
                "usage": usage([out]), "prompt_logprobs": fmt.prompt_logprobs(req, out)}

    async def chat_stream(req: ChatCompletionRequest, head: dict, stream: RequestStream, echo: str):
        state = fmt.new_stream_state()
        extra = {"usage": None} if req.include_usage else {}
        for i in range(req.n):  # the role comes first, as in OpenAI's and vLLM's streams
            delta = {"role": "assistant", "content": echo}
            yield _sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
                        **extra})
        last = None
        try:
            async for out in engine.stream_outputs(stream):
                last = out
                for c in out.outputs:
                    choice = fmt.chat_delta(req, c, state)
                    if choice is not None:
                        yield _sse({**head, "choices": [choice], **extra})
        except Exception as e:  # noqa: BLE001
            err = to_api_error(e)
            yield _sse({"error": {"message": err.message, "type": _ERROR_TYPES.get(err.status),
                                  "param": err.param, "code": err.status}})
        else:
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": usage([last])})
        yield "data: [DONE]\n\n"

    app.include_router(v1)

    # ----- vLLM's extra routes -----
    @app.get("/health")
    async def health():
        if not engine.is_healthy():
            return error_response(503, "the engine loop is not running")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        fields = set(TokenizeRequest.model_fields)
        if req.messages is not None:
            ids = parse(fields, lambda: encode_messages(
                req.messages, req.add_generation_prompt, req.chat_template_kwargs))
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tokenizer(req.prompt, add_special_tokens=add_special)["input_ids"]
        body = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}
        if req.return_token_strs:
            body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"tokens: {bad[:5]} are outside the vocabulary [0, {vocab_size})", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    return app


def engine_config_from_args(args) -> EngineConfig:
    """The EngineConfig of `qwen4exp serve`'s argparse `args`; the step budget defaults to the server's."""
    config = EngineConfig.from_cli_args(args)
    if config.max_num_batched_tokens is None:
        budget = default_max_num_batched_tokens(resolve_device(config.device), server=True)
        config = dataclasses.replace(config, max_num_batched_tokens=budget)
    return config


def run_server(args) -> None:
    """Load the model from argparse `args` (`qwen4exp serve`, entrypoints/cli.py) and serve until interrupted."""
    import uvicorn

    from ..engine.engine import LLMEngine
    from .default_model import resolve_model

    config = engine_config_from_args(args)
    model = resolve_model(args.model)
    llm_engine = LLMEngine(model, config)
    async_engine = AsyncEngine(llm_engine, max_queued_requests=args.max_queued_requests).start()
    name = (args.served_model_name or [model])[0]
    app = build_app(async_engine, name, api_key=args.api_key, max_model_len=config.max_model_len,
                    model_path=model)
    logger.info("serving %s as %r on http://%s:%d (OpenAI API under /v1)", model, name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    finally:
        async_engine.shutdown()
