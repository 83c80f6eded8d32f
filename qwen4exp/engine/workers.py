"""Workers: one process per rank of a model split over several devices (`--tensor-parallel-size`).

Rank 0 is the engine's own process: it schedules, samples and serves. Before each step it broadcasts the step's
chunks to the other ranks as one compact int64 buffer over the gloo control group (`StepChannel`), then the previous
step's sampled ids when chunks read them from the device; every rank then runs the same forward on its shard of the
model, and the shards meet in the model's collectives (`qwen4exp.distributed`). Workers keep no scheduler, sampler
or tokenizer: they take rank 0's engine and model configs when they join, then run `ModelRunner.execute` on what
rank 0 sends, until it sends the stop message.

The engine starts the workers of its node (torch.multiprocessing, spawn) and watches them: a worker that exits ends
the engine's steps with a `WorkerDiedError` naming it (a step waiting in a collective on a dead rank fails when
gloo sees the connection close, or at the latest when the collective times out, `distributed.COLLECTIVE_TIMEOUT_S`).
Workers exit when rank 0's process does. Over several nodes (torchrun's MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK)
node k runs ranks k * ranks_per_node onwards: node 0 the engine and its workers, every other node only workers
(`run_node_workers`).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import os
import socket
import threading
import time

import torch

from .. import distributed
from ..config import EngineConfig, ModelConfig
from .runner import ModelRunner
from .step_builder import RequestChunk

logger = logging.getLogger("qwen4exp")

_STOP = -1
_HEADER = 4  # mixed_graphs, return_streams, pending ids, chunks
_FIELDS = 7  # per chunk: tokens, context_len, history, pages, state_slot, logits_from, pending_row


class WorkerDiedError(RuntimeError):
    """A rank of the model stopped; the engine cannot run another step."""


def encode_step(chunks: list[RequestChunk], num_pending: int, mixed_graphs: bool, return_streams: bool) -> list[int]:
    out = [int(mixed_graphs), int(return_streams), num_pending, len(chunks)]
    for c in chunks:
        out += [len(c.token_ids), c.context_len, len(c.history), len(c.pages), c.state_slot, c.logits_from,
                c.pending_row]
    for c in chunks:
        out += c.token_ids
        out += c.history
        out += c.pages
    return out


def decode_step(buf: list[int]) -> tuple[list[RequestChunk], int, bool, bool]:
    mixed, streams, num_pending, n = buf[:_HEADER]
    pos = _HEADER + _FIELDS * n
    chunks = []
    for i in range(n):
        ntok, context_len, nhist, npages, slot, logits_from, pending_row = buf[_HEADER + _FIELDS * i:
                                                                               _HEADER + _FIELDS * (i + 1)]
        tokens = buf[pos:pos + ntok]
        history = buf[pos + ntok:pos + ntok + nhist]
        pages = buf[pos + ntok + nhist:pos + ntok + nhist + npages]
        pos += ntok + nhist + npages
        chunks.append(RequestChunk(tokens, context_len, history, pages, slot, logits_from, pending_row))
    return chunks, num_pending, bool(mixed), bool(streams)


class StepChannel:
    """The step each rank runs, from rank 0: a length, then the buffer (two gloo broadcasts of host tensors)."""

    def __init__(self):
        self.control = distributed.state().control

    def _broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(t, src=0, group=self.control)

    def send(self, values: list[int]) -> None:
        self._broadcast(torch.tensor([len(values)], dtype=torch.long))
        self._broadcast(torch.tensor(values, dtype=torch.long))

    def send_stop(self) -> None:
        self._broadcast(torch.tensor([_STOP], dtype=torch.long))

    def receive(self) -> list[int] | None:
        size = torch.empty(1, dtype=torch.long)
        self._broadcast(size)
        if size.item() == _STOP:
            return None
        buf = torch.empty(int(size.item()), dtype=torch.long)
        self._broadcast(buf)
        return buf.tolist()


def _share_configs(configs: list) -> list:
    """Rank 0's [EngineConfig, ModelConfig] on every rank (the workers of other nodes were started with their own)."""
    import torch.distributed as dist

    dist.broadcast_object_list(configs, src=0, group=distributed.state().control)
    return configs


def _broadcast_pending(pending_ids: torch.Tensor) -> None:
    import torch.distributed as dist

    dist.broadcast(pending_ids, src=0, group=distributed.state().group)


class DriverRunner(ModelRunner):
    """Rank 0's runner: sends each step to the workers, then runs its own shard."""

    def __init__(self, *args, workers: Workers, **kwargs):
        super().__init__(*args, **kwargs)
        self.workers = workers
        self.channel = StepChannel()

    def execute(self, chunks: list[RequestChunk], pending_ids: torch.Tensor | None = None,
                mixed_graphs: bool = True, return_streams: bool = False, multimodal: bool = False):
        # the step's encoding carries token ids only: the engine refuses images with several ranks
        assert not multimodal, "image features do not reach the workers"
        self.workers.check()
        reads_pending = pending_ids is not None and any(c.pending_row >= 0 for c in chunks)
        try:
            self.channel.send(encode_step(chunks, pending_ids.shape[0] if reads_pending else 0, mixed_graphs,
                                          return_streams))
            if reads_pending:
                _broadcast_pending(pending_ids if pending_ids.dtype == torch.long else pending_ids.long())
            return super().execute(chunks, pending_ids, mixed_graphs, return_streams)
        except RuntimeError as e:  # a collective failed: a rank is gone
            if isinstance(e, WorkerDiedError):
                raise
            raise WorkerDiedError(self.workers.failure(wait_s=5.0) or f"a collective failed: {e}") from e


class Workers:
    """The worker processes of this node, started by the engine; `failure()` says which one exited, if any."""

    def __init__(self, processes: list[tuple[int, multiprocessing.Process]]):
        self.processes = processes
        self._failure: str | None = None
        self._stopping = False
        self._event = threading.Event()
        self.threads: int | None = None  # this process's compute threads before the ranks shared the cores
        if processes:
            threading.Thread(target=self._watch, name="qwen4exp-worker-watch", daemon=True).start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in self.processes}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping:
            return
        rank, p = sentinels[ready[0]]
        p.join(1.0)
        self._failure = f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        logger.error("%s: the engine cannot run another step", self._failure)
        self._event.set()
        try:
            distributed.abort_collectives()
        except Exception:  # the failure is recorded; the collective times out instead
            logger.exception("aborting the collectives failed")

    def failure(self, wait_s: float = 0.0) -> str | None:
        if self._failure is None and wait_s:
            self._event.wait(wait_s)
        return self._failure

    def check(self) -> None:
        if self._failure is not None:
            raise WorkerDiedError(self._failure)

    def stop(self, channel: StepChannel | None, timeout_s: float = 10.0) -> None:
        self._stopping = True
        if channel is not None and self._failure is None:
            try:
                channel.send_stop()
            except RuntimeError:
                pass
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        deadline = time.monotonic() + timeout_s
        for _, p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(config: EngineConfig, device: torch.device, local_rank: int) -> torch.device:
    """Local rank r runs on cuda:r (after the configured device's index) or on the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_rank)


def _layout(config: EngineConfig) -> tuple[str, int, int, int]:
    """(init_method, ranks per node, this node's first rank, nodes)."""
    size = config.tensor_parallel_size
    env = distributed.rendezvous_from_env(size)
    if env is None:
        return f"tcp://127.0.0.1:{_free_port()}", size, 0, 1
    init_method, nnodes, node_rank = env
    per_node = size // nnodes
    return init_method, per_node, node_rank * per_node, nnodes


def start_workers(config: EngineConfig, model_config: ModelConfig, model_dir: str | None,
          device: torch.device) -> Workers:
    """Starts this node's other ranks and joins the rendezvous as rank 0 (node 0)."""
    init_method, per_node, first, nnodes = _layout(config)
    if first != 0:
        raise RuntimeError("start_workers: node 0 runs the engine; other nodes run run_node_workers")
    ctx = torch.multiprocessing.get_context("spawn")
    processes = []
    for local in range(1, per_node):
        p = ctx.Process(target=_worker_main, name=f"qwen4exp-rank{local}", daemon=True,
                        args=(local, local, init_method, config, model_dir, os.getpid(), per_node))
        p.start()
        processes.append((local, p))
    logger.info("tensor parallel %d%s over %d node(s), ranks 0-%d here; n-gram tables %s", config.tensor_parallel_size,
                " with expert parallel" if config.enable_expert_parallel else "", nnodes, per_node - 1,
                "split by rows" if config.ple_table_parallel == "rows" else "replicated")
    workers = Workers(processes)
    try:
        distributed.init(0, config.tensor_parallel_size, init_method, rank_device(config, device, 0),
                         config.enable_expert_parallel, config.ple_table_parallel == "rows")
        _share_configs([config, model_config])
        workers.threads = share_cpu_threads(device, per_node)
    except Exception:
        workers.stop(None, timeout_s=1.0)
        raise
    return workers


def run_node_workers(config: EngineConfig, model_dir: str | None) -> int:
    """A node other than node 0: runs its ranks until rank 0 stops them (they run with rank 0's configs; `config`
    gives the ranks and the device); returns the first non-zero exit code."""
    init_method, per_node, first, nnodes = _layout(config)
    if first == 0:
        raise RuntimeError("run_node_workers: node 0 runs the engine (NODE_RANK=0)")
    logger.info("node %d of %d: ranks %d-%d join %s", first // per_node, nnodes, first, first + per_node - 1,
                init_method)
    if per_node == 1:  # the node's one rank runs in this process
        _worker_main(first, 0, init_method, config, model_dir, os.getppid(), per_node)
        return 0
    ctx = torch.multiprocessing.get_context("spawn")
    processes = []
    for local in range(per_node):
        p = ctx.Process(target=_worker_main, name=f"qwen4exp-rank{first + local}",
                        args=(first + local, local, init_method, config, model_dir, os.getpid(), per_node))
        p.start()
        processes.append(p)
    codes = []
    for p in processes:
        p.join()
        codes.append(p.exitcode)
    return next((c for c in codes if c), 0)


def _exit_with_parent(parent_pid: int) -> None:
    """A worker whose starting process is gone has no one to serve."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def share_cpu_threads(device: torch.device, ranks_here: int) -> int:
    """On the CPU, the ranks of one machine share its cores: more compute threads than cores, each waiting for the
    others at every parallel region, would make a step many times slower. Returns the previous thread count."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    return threads


def _worker_main(rank: int, local_rank: int, init_method: str, config: EngineConfig, model_dir: str | None,
                 parent_pid: int, per_node: int) -> None:
    from ..config import resolve_device
    from .engine import build_model_and_cache, resolve_dtype

    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    device = rank_device(config, resolve_device(config.device), local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    distributed.init(rank, config.tensor_parallel_size, init_method, device)
    config, model_config = _share_configs([None, None])
    distributed.set_state(dataclasses.replace(distributed.state(), expert_parallel=config.enable_expert_parallel,
                                              ple_table_rows=config.ple_table_parallel == "rows"))
    share_cpu_threads(device, per_node)
    torch.manual_seed(config.seed)
    dtype = resolve_dtype(config.dtype, model_config, device)
    config, _, cache_tensors, graphs, _, model = build_model_and_cache(model_dir, config, model_config, dtype, device)
    runner = ModelRunner(model, cache_tensors, config.page_size, device, graphs)
    channel = StepChannel()
    try:
        while (buf := channel.receive()) is not None:
            chunks, num_pending, mixed_graphs, return_streams = decode_step(buf)
            pending = None
            if num_pending:
                pending = torch.empty(num_pending, dtype=torch.long, device=device)
                _broadcast_pending(pending)
            runner.execute(chunks, pending, mixed_graphs, return_streams)
    except RuntimeError as e:  # rank 0 is gone, or another worker
        logger.error("rank %d: %s; exiting", rank, str(e).splitlines()[0] if str(e) else type(e).__name__)
        os._exit(1)
    distributed.shutdown()
