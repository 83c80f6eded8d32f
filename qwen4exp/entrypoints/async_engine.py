"""AsyncEngine: drives one LLMEngine from a background thread and streams its outputs to asyncio callers.

The engine is not thread-safe, so every call into it happens on the engine thread: the event loop only enqueues
add/abort commands and reads per-request asyncio queues that the engine thread fills through
`loop.call_soon_threadsafe`. A model step never blocks the event loop, and the event loop never races a step.
Prompts arrive tokenized (the server tokenizes in its render pool), so the engine thread does no per-request work
that a client can make long.

Shutdown: `drain()` refuses new requests while the running ones go on; `abort_all()` ends those still running, each
with a last output whose unfinished sequences have finish_reason "abort"; `shutdown()` stops the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..engine.engine import LLMEngine
from ..engine.metrics import StatsLogger
from ..engine.request import CompletionOutput, RequestOutput, SamplingParams
from ..engine.workers import WorkerDiedError

logger = logging.getLogger("qwen4exp")


def _heap_trimmer():
    """glibc's malloc_trim, or None elsewhere. Freed request memory (tokenized prompts, outputs, step tensors) stays
    in glibc's per-thread arenas, so a server's RSS creeps up under load even though nothing leaks (about 25 MiB
    over 2,000 requests of the soak benchmark); trimming when the engine goes idle hands it back."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


class QueueFullError(RuntimeError):
    """More requests would wait than max_queued_requests allows (the server answers 503)."""


class EngineStepError(RuntimeError):
    """engine.step() raised while this request was in flight; the request was aborted."""


class EngineDeadError(RuntimeError):
    """The engine thread is not running, so the request can never be served."""


class RequestStream:
    """Outputs of one request. Filled from the engine thread, read on the event loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self.last: RequestOutput | None = None  # the latest output put (engine thread only)
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            self.last = item
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int] | dict
    params: SamplingParams
    stream: RequestStream
    arrival_time: float
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None, health_timeout_s: float = 60.0,
                 idle_wait_s: float = 0.5, log_stats: bool = False, log_stats_interval: float = 10.0):
        """log_stats: log vLLM's stats line (throughput, running and waiting requests, cache usage) every
        `log_stats_interval` seconds from the engine loop."""
        self.engine = engine
        self._stats = StatsLogger(engine, log_stats_interval) if log_stats else None
        self.max_queued_requests = max_queued_requests
        # a step longer than this (a huge prefill on a slow device) would read as a hung loop
        self.health_timeout_s = health_timeout_s
        self.idle_wait_s = idle_wait_s
        self.heartbeat = 0.0
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._draining = False
        self._thread: threading.Thread | None = None
        self._fatal: str | None = None  # why the engine can never step again (a rank of the model stopped)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def config(self):
        return self.engine.config

    @property
    def generation_defaults(self) -> dict:
        return self.engine.generation_defaults

    @property
    def structured_outputs(self):
        """The engine's grammar compiler (StructuredOutputs); its `compile` may be called from any thread."""
        return self.engine.structured_outputs

    # ----- lifecycle -----
    def start(self) -> AsyncEngine:
        if self._thread is None or not self._thread.is_alive():
            self._stopping = self._draining = False
            self.heartbeat = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="qwen4exp-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def is_healthy(self) -> bool:
        return self.health_problem() is None

    def health_problem(self) -> str | None:
        """Why the engine cannot serve requests now, or None."""
        if (fatal := self.fatal_error()) is not None:
            return fatal
        if self._thread is None or not self._thread.is_alive():
            return "the engine loop is not running"
        if self._stopping or self._draining:
            return "the server is shutting down"
        silent = time.monotonic() - self.heartbeat
        if silent >= self.health_timeout_s:
            return f"the engine loop has not come back from a step for {silent:.0f} s"
        return None

    def fatal_error(self) -> str | None:
        """Why the engine can never step again (a worker process of the model is gone), or None."""
        return self._fatal or self.engine.worker_failure()

    def drain(self) -> None:
        """Refuse new requests from now on; those already added go on."""
        self._draining = True

    @property
    def num_unfinished(self) -> int:
        """Requests added (or being added) and not finished yet."""
        return len(self._streams) + (not self._commands.empty())

    async def abort_all(self) -> int:
        """Ends every running request now: each gets a last output with finish_reason "abort" on its unfinished
        sequences. Returns how many there were."""
        if self._thread is None or not self._thread.is_alive():
            return 0
        cmd = _AbortAll()
        self._commands.put(cmd)
        self._wake.set()
        return await asyncio.wrap_future(cmd.done)

    # ----- requests (event loop side) -----
    async def add_request(self, request_id: str, prompt: str | list[int] | dict,
                          params: SamplingParams) -> RequestStream:
        """Queue a request and wait until the engine accepted it. Raises the engine's ValueError for bad input
        and QueueFullError when too many requests wait."""
        # not is_healthy(): a long step makes the heartbeat stale, yet the request will be served after it
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")
        if self._stopping or self._draining:
            raise EngineDeadError("the server is shutting down")
        stream = RequestStream(request_id, asyncio.get_running_loop())
        cmd = _Add(request_id, prompt, params, stream, time.monotonic())
        self._commands.put(cmd)
        self._wake.set()
        try:
            await asyncio.wrap_future(cmd.done)
        except asyncio.CancelledError:
            # the add may still land after we stop waiting; commands run in order, so this abort follows it
            self.abort(request_id)
            raise
        return stream

    async def stream_outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of an added request until finished. Leaving early aborts the request, so a client
        that goes away gives its cache pages and state slot back."""
        try:
            while True:
                out = await stream.get()
                yield out
                if out.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    async def generate(self, prompt: str | list[int] | dict, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params)
        # aclosing: a consumer that closes us mid-way must close (and so abort) the inner stream now, not at GC
        async with contextlib.aclosing(self.stream_outputs(stream)) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent; unknown or finished ids are ignored."""
        self._commands.put(_Abort(request_id))
        self._wake.set()

    # ----- the engine thread -----
    def _run(self) -> None:
        logger.info("engine loop started")
        trim, worked = _heap_trimmer(), False
        while not self._stopping:
            self.heartbeat = now = time.monotonic()
            try:
                if self._stats is not None:
                    self._stats.maybe_log(now)
                self._drain_commands()
                if self.engine.has_unfinished_requests():
                    self._step()
                    worked = True
                    continue
            except Exception:  # bookkeeping bugs must not end the loop: log and keep serving
                logger.exception("engine loop error")
            woken = self._wake.wait(self.idle_wait_s)
            self._wake.clear()
            if not woken and worked and trim is not None:
                trim(0)  # idle for idle_wait_s after work: the few ms it takes delay no request
                worked = False
        dead = EngineDeadError("the engine is shutting down")
        self._fail_all(dead)
        while True:  # adds that arrived too late would otherwise wait forever
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, (_Add, _AbortAll)):
                cmd.done.set_exception(dead)
        logger.info("engine loop stopped")

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _AbortAll):
                cmd.done.set_result(self._abort_all())
            else:
                self._streams.pop(cmd.request_id, None)
                self.engine.abort_request(cmd.request_id)

    def _abort_all(self) -> int:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            last = stream.last
            if last is None:  # nothing generated yet: empty sequences, the prompt as the engine holds it
                parent = self.engine.output_processor.parents.get(request_id)
                last = RequestOutput(request_id, parent.prompt if parent else None,
                                     parent.prompt_token_ids if parent else [], None,
                                     [CompletionOutput(i, "", [], None, None) for i in range(
                                         len(parent.children) if parent else 1)], False)
            outputs = [c if c.finish_reason is not None else dataclasses.replace(c, finish_reason="abort")
                       for c in last.outputs]
            self.engine.abort_request(request_id)
            stream.put(dataclasses.replace(last, outputs=outputs, finished=True))
        return len(streams)

    def _add(self, cmd: _Add) -> None:
        try:
            self._check_queue(cmd.params.n)
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time)
        except Exception as e:  # noqa: BLE001 - the caller decides how to report it
            cmd.done.set_exception(e)
            return
        self._streams[cmd.request_id] = cmd.stream
        cmd.done.set_result(None)

    def _check_queue(self, num_seqs: int) -> None:
        limit = self.max_queued_requests
        if limit is None:
            return
        seats = self.engine.config.max_num_seqs
        if num_seqs > seats + limit:  # retrying cannot help: a client error, not an overload
            raise ValueError(f"n: {num_seqs} sequences can never be admitted (max_num_seqs={seats}, "
                             f"max_queued_requests={limit})")
        sched = self.engine.scheduler
        # sequences that get a seat in the running batch at the next step are not queued
        free_seats = max(0, seats - len(sched.running))
        queued = len(sched.waiting) + num_seqs - free_seats
        if queued > limit:
            raise QueueFullError(
                f"The server is overloaded: {len(sched.waiting)} requests are waiting and max_queued_requests is "
                f"{limit}. Retry later."
            )

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except WorkerDiedError as e:  # no later step can run: fail everything and stop the loop
            logger.error("%s: the engine stops", e)
            self._fatal = str(e)
            self._fail_all(EngineDeadError(f"the engine stopped: {e}"))
            self._stopping = True
            return
        except Exception as e:
            # we cannot tell which request broke the batch, and a half-applied step leaves every scheduled request
            # in an unknown state: fail all in-flight requests so the engine is clean for the next ones
            logger.exception("engine step failed; aborting %d in-flight requests", len(self._streams))
            self._fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted while the step ran
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            stream.put(error)
        self._streams.clear()
