"""RenderPool: the server's chat template rendering and (de)tokenization, in worker processes with a time limit.

Neither the event loop (every client's I/O and /health) nor the engine thread (every request's generation) may run
them: a request decides how long they take (a long prompt, a template that loops), and Python work holds the GIL,
so a thread could neither be stopped nor keep from slowing the others. Each worker is a process (render_worker.py)
with its own copy of the tokenizer; a job that runs past the time limit kills its worker, which is replaced. Jobs
take the next free worker in arrival order; each holds one of the pool's threads, which only wait on the pipes.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import queue
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger("qwen4exp")

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "render_worker.py")
_START_TIMEOUT_S = 120.0
# how much memory a worker may add to what its tokenizer uses: a template that builds a huge string fails instead
WORKER_MEMORY_BYTES = 2 << 30


class RenderError(ValueError):
    """The input could not be rendered or tokenized (the template failed, ran out of time or memory)."""


class RenderWorkerDied(RuntimeError):
    """A worker process exited during a job; it was replaced."""


class _Worker:
    def __init__(self, tokenizer_bytes: bytes, memory_bytes: int):
        self.tokenizer_bytes, self.memory_bytes = tokenizer_bytes, memory_bytes
        self.proc: subprocess.Popen | None = None
        self.conn = None

    def start(self) -> None:
        parent, child = multiprocessing.Pipe()
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            [sys.executable, "-P", _WORKER, str(child.fileno()), str(os.getpid()), str(self.memory_bytes)],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env)
        child.close()
        self.conn = parent
        parent.send_bytes(self.tokenizer_bytes)

    def wait_ready(self) -> None:
        if not self.conn.poll(_START_TIMEOUT_S) or self.conn.recv() != "ready":
            self.kill()
            raise RuntimeError(f"a render worker did not start within {_START_TIMEOUT_S:.0f} s")

    def ensure_started(self) -> None:
        if self.proc is None:
            self.start()
            self.wait_ready()

    def call(self, message: bytes, timeout_s: float) -> tuple:
        """Raises TimeoutError when the job outlives `timeout_s`, EOFError / OSError when the process died."""
        self.conn.send_bytes(message)
        if not self.conn.poll(timeout_s):
            raise TimeoutError
        return pickle.loads(self.conn.recv_bytes())

    def kill(self) -> None:
        proc, conn, self.proc, self.conn = self.proc, self.conn, None, None
        if proc is not None:
            proc.kill()
            proc.wait()
        if conn is not None:
            conn.close()


class RenderPool:
    def __init__(self, tokenizer, num_workers: int = 2, timeout_s: float = 30.0,
                 memory_bytes: int = WORKER_MEMORY_BYTES):
        if num_workers < 1:
            raise ValueError(f"renderer_num_workers: must be at least 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"renderer_timeout: must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        payload = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        self._workers = [_Worker(payload, memory_bytes) for _ in range(num_workers)]
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        try:
            for w in self._workers:  # started together, awaited together: start-up costs one worker's time
                w.start()
            for w in self._workers:
                w.wait_ready()
        except BaseException:
            self.kill()
            raise
        for w in self._workers:
            self._idle.put(w)
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="qwen4exp-render")
        self._closed = False

    # ----- jobs (awaited on the event loop) -----
    async def encode(self, texts: list[str], add_special_tokens: bool, max_tokens: int,
                     truncate: tuple[int, str] | None = None) -> list[list[int] | int]:
        """Each text's token ids, or its token count where that exceeds `max_tokens`; with `truncate` = (k, side)
        the last (left) or first (right) k ids instead."""
        return await self._run("encode", texts, add_special_tokens, max_tokens, truncate)

    async def render_chat(self, conversation: list[dict], add_generation_prompt: bool, template: str | None,
                          kwargs: dict, max_chars: int, max_tokens: int, tools: list[dict] | None = None,
                          add_special_tokens: bool = False, truncate: tuple[int, str] | None = None,
                          with_text: bool = False):
        """The chat template's token ids (or their count beyond `max_tokens`) for the conversation and `tools`, with
        the rendered text as (ids, text) when `with_text`; a rendered text longer than `max_chars` is a RenderError
        unless `truncate` (as `encode`) keeps only part of it."""
        return await self._run("render_chat", conversation, add_generation_prompt, template, kwargs, max_chars,
                               max_tokens, tools, add_special_tokens, truncate, with_text)

    async def decode(self, ids: list[int]) -> str:
        return await self._run("decode", ids)

    async def token_strs(self, ids: list[int]) -> list[str]:
        return await self._run("token_strs", ids)

    async def _run(self, op: str, *args):
        if self._closed:
            raise RuntimeError("the render pool is closed")
        status, value = await asyncio.get_running_loop().run_in_executor(self._threads, self._job, op, args)
        if status == "ok":
            return value
        if status == "died":
            raise RenderWorkerDied(value)
        raise RenderError(value)

    # ----- the pool's threads -----
    def _job(self, op: str, args: tuple) -> tuple[str, object]:
        worker = self._idle.get()
        try:
            worker.ensure_started()
            message = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)
            try:
                return worker.call(message, self.timeout_s)
            except TimeoutError:
                worker.kill()
                logger.warning("a %s job ran past the %g s time limit; its render worker was replaced", op,
                               self.timeout_s)
                return "error", f"took longer than the time limit of {self.timeout_s:g} s"
            except (EOFError, OSError) as e:
                worker.kill()
                logger.error("a render worker exited during a %s job (%s); it was replaced", op, e)
                return "died", "a render worker exited during the request"
        finally:
            if not self._closed:
                try:  # replace a killed worker now, so that its start-up delays no later job
                    worker.ensure_started()
                except Exception:  # noqa: BLE001 - retried by the next job that takes it
                    logger.exception("a render worker could not be restarted")
            self._idle.put(worker)

    # ----- lifecycle -----
    def close(self) -> None:
        """Stops the workers; jobs still running fail."""
        self._closed = True
        self.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def kill(self) -> None:
        for w in self._workers:
            try:
                w.kill()
            except OSError:
                pass
