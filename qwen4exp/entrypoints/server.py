"""OpenAI-compatible HTTP server (vLLM's routes, request fields and response shapes) over an AsyncEngine.

The routes live in serving_completion.py, serving_chat.py and serving_tokenization.py; this module builds the app
around them: the API key and body size checks (pure ASGI, before a body is read), the error envelopes, the OpenAPI
document (every status and media type a route can answer), and `qwen4exp serve`'s process with its bounded shutdown.

No request may stall the others: the event loop only parses bodies (at most --max-request-body-bytes) and moves
streams; templates and tokenization run in the render pool's processes, with a time limit; the engine thread gets
token ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import secrets
import signal
import socket
import time
import uuid

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import distributed
from ..config import ConfigError, EngineConfig, default_max_num_batched_tokens, resolve_device
from ..engine.workers import WorkerDiedError
from .async_engine import AsyncEngine
from .protocol import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    RequestError,
    TokenizeRequest,
    TokenizeResponse,
)
from .reasoning import REASONING_PARSERS
from .render_pool import RenderPool
from .serving_chat import ServingChat
from .serving_completion import ServingCompletion
from .serving_engine import APIError, error_response, to_api_error
from .serving_tokenization import ServingTokenization
from .tool_parsers import TOOL_PARSERS

logger = logging.getLogger("qwen4exp")

# routes anyone may call: probes and the API's own description, as in vLLM
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class _APIKeyMiddleware:
    """`Authorization: Bearer KEY` on every route that does work (all but OPEN_PATHS). Pure ASGI, so it answers
    before a body is read. Digests of equal length are compared in constant time, so the time taken tells nothing
    about the key."""

    def __init__(self, app, api_key: str):
        self.app, self.digest = app, hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if not (secrets.compare_digest(hashlib.sha256(token.strip()).digest(), self.digest)
                    & (scheme.lower() == b"bearer")):
                return await error_response(401, "Unauthorized: missing or wrong API key")(scope, receive, send)
        await self.app(scope, receive, send)


class _RequestIdHeaderMiddleware:
    """--enable-request-id-headers: every response carries X-Request-Id, the request's own or a new random one (as
    vLLM's middleware)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _BodyLimitMiddleware:
    """413 for a body over `limit` bytes: at once when Content-Length says so, else as soon as that many bytes
    arrived. The body is read here and replayed to the app as it came, so the app never holds more."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            return await self._too_large(scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                messages.clear()
                return await self._too_large(scope, receive, send)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        response = error_response(413, f"The request body is larger than the server's limit of {self.limit} bytes "
                                       f"(--max-request-body-bytes).")
        response.headers["Connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


def _error_docs(*codes: int) -> dict:
    why = {400: "Invalid input (the message names the field in `param`)", 401: "Missing or wrong API key",
           404: "Unknown model name", 413: "Request body over --max-request-body-bytes",
           500: "The engine failed while serving the request",
           503: "The engine takes no requests now (a full queue, a shutdown, a stopped loop); retry after "
                "`Retry-After` seconds"}
    docs = {code: {"model": ErrorResponse, "description": why[code]} for code in codes}
    if 503 in docs:
        docs[503]["headers"] = {"Retry-After": {"description": "seconds to wait before retrying",
                                                "schema": {"type": "integer"}}}
    return docs


# One server-sent event of a streamed reply (before OpenAPI 3.2 a stream's `schema` describes each event): its data
# is a JSON chunk, or `[DONE]` last
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"anyOf": [{"const": "[DONE]"},
                                               {"type": "string", "contentMediaType": "application/json"}]}}}


def _streamed(model, what: str) -> dict:
    return {200: {"model": model, "description": f"{what}; with `stream: true`, server-sent events (`data: "
                                                 f"{{chunk}}` lines, then `data: [DONE]`)",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


def build_app(async_engine: AsyncEngine, served_model_name: str | list[str], api_key: str | None = None,
              max_model_len: int | None = None, model_path: str | None = None, *, chat_template: str | None = None,
              trust_request_chat_template: bool = False,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, renderer_num_workers: int = 2,
              renderer_timeout: float = 30.0, return_tokens_as_token_ids: bool = False,
              enable_request_id_headers: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, enable_auto_tool_choice: bool = False,
              exclude_tools_when_tool_choice_none: bool = False,
              enable_prompt_tokens_details: bool = False) -> FastAPI:
    """The app over a started AsyncEngine. Every name of `served_model_name` is accepted as `model`, and the first
    is the one responses carry and the metrics' model_name label: an engine started under another name gets fresh
    metrics (build the app before serving). Its render pool's processes start here and stop with the app's lifespan
    (uvicorn's shutdown, or leaving a TestClient)."""
    check_parser_options(tool_call_parser, reasoning_parser, enable_auto_tool_choice)
    engine = async_engine
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if engine.engine.served_model_name != names[0]:
        engine.engine.reset_metrics(names[0])
    max_model_len = max_model_len or engine.config.max_model_len
    pool = RenderPool(engine.tokenizer, renderer_num_workers, renderer_timeout) if engine.tokenizer else None
    args = (engine, pool, names, max_model_len, chat_template, trust_request_chat_template,
            return_tokens_as_token_ids, renderer_timeout)
    completion = ServingCompletion(*args, enable_prompt_tokens_details=enable_prompt_tokens_details)
    tokenization = ServingTokenization(*args)
    chat = ServingChat(*args, enable_prompt_tokens_details=enable_prompt_tokens_details,
                       tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                       enable_auto_tool_choice=enable_auto_tool_choice,
                       exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        try:
            yield
        finally:
            if pool is not None:
                pool.close()

    app = FastAPI(title="qwen4exp OpenAI-compatible server", lifespan=lifespan)
    app.state.render_pool = pool
    app.add_middleware(_BodyLimitMiddleware, limit=max_request_body_bytes)
    if enable_request_id_headers:
        app.add_middleware(_RequestIdHeaderMiddleware)
    if api_key:  # added last, so it runs first: no body is read for a request without the key
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    work = 401 if api_key else None
    v1 = APIRouter(prefix="/v1")

    def errors(*codes: int) -> dict:
        return _error_docs(*sorted(c for c in (*codes, work) if c is not None))

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
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, RequestError):  # a rule between fields (protocol.py): its own message and field
            return error_response(400, str(cause), cause.param)
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

    # ----- OpenAI routes -----
    @v1.get("/models", responses={200: {"model": ModelList}, **errors()})
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "qwen4exp",
            "root": model_path or names[0], "parent": None, "max_model_len": max_model_len, "permission": [],
        } for name in names]}

    @v1.post("/completions", responses={**_streamed(CompletionResponse, "The completion"),
                                        **errors(400, 404, 413, 500, 503)})
    async def completions(req: CompletionRequest, raw: Request):
        return await completion.create_completion(req, raw)

    @v1.post("/chat/completions", responses={**_streamed(ChatCompletionResponse, "The chat completion"),
                                             **errors(400, 404, 413, 500, 503)})
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await chat.create_chat_completion(req, raw)

    app.include_router(v1)

    # ----- vLLM's extra routes -----
    @app.get("/health", response_class=Response,
             responses={200: {"description": "The engine loop is running (empty body)", "content": {}},
                        **_error_docs(503)})
    async def health():
        problem = engine.health_problem()
        if problem is not None:
            return error_response(503, problem)
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        return Response(generate_latest(engine.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **errors(400, 404, 413, 500)})
    async def tokenize(req: TokenizeRequest):
        return await tokenization.tokenize(req)

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **errors(400, 404, 413, 500)})
    async def detokenize(req: DetokenizeRequest):
        return await tokenization.detokenize(req)

    def openapi() -> dict:
        """FastAPI's document, less the 422 it adds to every route with a body: validation errors are 400s."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema["paths"].values():
                for op in operations.values():
                    op["responses"].pop("422", None)
                    if api_key and "401" in op["responses"]:
                        op["security"] = [{"apiKey": []}]
            components = schema.setdefault("components", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.get("schemas", {}).pop(name, None)
            if api_key:
                components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


def check_parser_options(tool_call_parser: str | None, reasoning_parser: str | None,
                         enable_auto_tool_choice: bool) -> None:
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {tool_call_parser!r} (one of {sorted(TOOL_PARSERS)})")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: unknown parser {reasoning_parser!r} (one of {sorted(REASONING_PARSERS)})")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice: --enable-auto-tool-choice needs --tool-call-parser")


def engine_config_from_args(args) -> EngineConfig:
    """The EngineConfig of `qwen4exp serve`'s argparse `args`; the step budget defaults to the server's."""
    config = EngineConfig.from_cli_args(args)
    if config.max_num_batched_tokens is None:
        budget = default_max_num_batched_tokens(resolve_device(config.device), server=True)
        config = dataclasses.replace(config, max_num_batched_tokens=budget)
    return config


def load_chat_template(value: str | None) -> str | None:
    """--chat-template's template: the file it names, else the value itself when it reads as a template."""
    if value is None:
        return None
    try:
        with open(value) as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"chat_template: {value!r} looks like a file path but cannot be read: {e}") from None
        return value


class _Server(uvicorn.Server):
    """uvicorn's server without its own signal handling: `serve` drains the engine first, and uvicorn would
    re-raise the signal after its shutdown (the process would die by it, skipping ours)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def log_stats_interval() -> float:
    """Seconds between the stats lines: $QWEN4EXP_LOG_STATS_INTERVAL (vLLM's VLLM_LOG_STATS_INTERVAL), default 10."""
    value = os.environ.get("QWEN4EXP_LOG_STATS_INTERVAL", "10")
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ConfigError("QWEN4EXP_LOG_STATS_INTERVAL", f"must be a positive number of seconds, got {value!r}")
    return seconds


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound as uvicorn binds it. `serve` binds it before the model loads, so that a port in
    use fails at once, naming --port, instead of after minutes of loading."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError("--port", f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port "
                                    f"(or --host), or stop the process that holds it") from None
    return sock


async def serve(app: FastAPI, async_engine: AsyncEngine, sock: socket.socket, shutdown_timeout: float,
                log_level: str = "info") -> None:
    """Serves on `sock` (bind_socket's) until SIGTERM or SIGINT, then shuts down within `shutdown_timeout` seconds
    (+ a grace of 2 s for the last responses to go out): stop accepting, let the running requests finish until the
    timeout, end the rest with finish_reason "abort". A second signal exits at once (status 128 + the signal)."""
    # the grace lets the responses of the requests aborted at the timeout reach their clients
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout + 2)
    server = _Server(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: int) -> None:
        name = signal.Signals(sig).name
        if stop.is_set():
            logger.warning("%s again: exiting now", name)
            if app.state.render_pool is not None:
                app.state.render_pool.kill()
            os._exit(128 + sig)
        logger.info("%s: shutting down (in-flight requests get up to %g s)", name, shutdown_timeout)
        stop.set()

    async def watch_workers() -> None:  # a model rank that stopped ends the server (its requests already failed)
        while (fatal := async_engine.fatal_error()) is None:
            await asyncio.sleep(0.5)
        logger.error("%s: shutting down", fatal)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    watcher = asyncio.ensure_future(watch_workers())
    try:
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not serving.done():
            async_engine.drain()
            server.should_exit = True  # uvicorn stops accepting and waits for the open responses
            await _finish_or_abort(async_engine, shutdown_timeout)
        await serving
    finally:
        watcher.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _finish_or_abort(async_engine: AsyncEngine, timeout: float) -> None:
    running = async_engine.num_unfinished
    deadline = time.monotonic() + timeout
    while async_engine.num_unfinished and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    aborted = await async_engine.abort_all() if async_engine.num_unfinished else 0
    logger.info("%d of %d in-flight requests finished, %d aborted", running - aborted, running, aborted)


def run_server(args) -> None:
    """Load the model from argparse `args` (`qwen4exp serve`, entrypoints/cli.py) and serve until SIGTERM or
    SIGINT; returns once the engine is stopped. A worker process of the model that stops ends the server with a
    WorkerDiedError. On a node other than node 0 of a run over several nodes (NODE_RANK > 0), runs this node's ranks
    of the model until node 0 stops them."""
    from ..engine.engine import LLMEngine
    from .default_model import resolve_model

    # wrong flags, a wrong template path and a port in use fail before the model loads
    config = engine_config_from_args(args)
    env = distributed.rendezvous_from_env(config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
    if env is not None and env[2] > 0:
        from ..engine.workers import run_node_workers
        from .default_model import resolve_model

        code = run_node_workers(config, resolve_model(args.model))
        if code:
            raise WorkerDiedError(f"a rank of node {env[2]} exited with code {code}")
        return
    chat_template = load_chat_template(args.chat_template)
    check_parser_options(args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice)
    stats_interval = log_stats_interval()
    sock = bind_socket(args.host, args.port)
    try:
        model = resolve_model(args.model)
        names = args.served_model_name or [model]
        llm_engine = LLMEngine(model, config, served_model_name=names[0])
        async_engine = AsyncEngine(llm_engine, max_queued_requests=args.max_queued_requests,
                                   log_stats=not args.disable_log_stats,
                                   log_stats_interval=stats_interval).start()
        try:
            app = build_app(async_engine, names, api_key=args.api_key,
                            max_model_len=llm_engine.config.max_model_len, model_path=model,
                            chat_template=chat_template, trust_request_chat_template=args.trust_request_chat_template,
                            max_request_body_bytes=args.max_request_body_bytes,
                            renderer_num_workers=args.renderer_num_workers, renderer_timeout=args.renderer_timeout,
                            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                            enable_request_id_headers=args.enable_request_id_headers,
                            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                            enable_auto_tool_choice=args.enable_auto_tool_choice,
                            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                            enable_prompt_tokens_details=args.enable_prompt_tokens_details)
            logger.info("serving %s as %s on http://%s:%d (OpenAI API under /v1)", model,
                        ", ".join(map(repr, names)), args.host, args.port)
            asyncio.run(serve(app, async_engine, sock, args.shutdown_timeout, args.uvicorn_log_level))
        finally:
            async_engine.shutdown()
            llm_engine.shutdown()
        if (fatal := async_engine.fatal_error()) is not None:
            raise WorkerDiedError(fatal)
    finally:
        sock.close()
    logger.info("engine stopped")

