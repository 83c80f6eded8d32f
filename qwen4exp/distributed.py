"""Tensor and expert parallelism over torch.distributed: this process's place among the ranks, the collectives the
model runs, and how a weight is split.

One process per device. Every rank holds its shard of each weight and runs the same step; the ranks' partial
results meet in one all-reduce per block (`all_reduce`) and in the logits (`all_gather`). A single process has world
size 1 and every function here returns at once, so the one-device path does no extra work.

Two process groups: `group` carries the model's collectives (NCCL on CUDA, gloo on the CPU); `control` (gloo, host
tensors) carries the step each rank runs, broadcast from rank 0 (engine/workers.py).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from .config import ConfigError

# (dim, ((start, stop), ...)): the checkpoint tensor's slices along `dim` that a rank holds, concatenated in order
Shard = tuple[int, tuple[tuple[int, int], ...]]

# a model collective waiting longer than this means a rank is gone: the ranks run the same step, so none waits long
# for another between two collectives (longer on CUDA, where ranks may compile or tune kernels at different speeds)
COLLECTIVE_TIMEOUT_S = {"gloo": 20.0, "nccl": 120.0}


@dataclass(frozen=True)
class ParallelState:
    world_size: int = 1
    rank: int = 0
    expert_parallel: bool = False
    ple_table_rows: bool = False  # each rank holds a range of every n-gram table's rows
    group: object = None
    control: object = None

    @property
    def parallel(self) -> bool:
        return self.world_size > 1


_state = ParallelState()


def state() -> ParallelState:
    return _state


def world_size() -> int:
    return _state.world_size


def rank() -> int:
    return _state.rank


def set_state(new: ParallelState) -> None:
    """Replace this process's state (for building one rank's model in tests, and by `init`)."""
    global _state
    _state = new


def init(rank: int, world_size: int, init_method: str, device: torch.device, expert_parallel: bool = False,
         ple_table_rows: bool = False) -> ParallelState:
    """Joins the rendezvous at `init_method` (tcp://host:port) as `rank` of `world_size` and makes this process's
    state. The model group times out after COLLECTIVE_TIMEOUT_S (a dead rank then raises instead of hanging); the
    control group waits as long as the engine stays idle."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S[backend]), **kwargs)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    set_state(ParallelState(world_size, rank, expert_parallel, ple_table_rows, dist.group.WORLD, control))
    return _state


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    set_state(ParallelState())


def abort_collectives() -> None:
    """Ends the model group's collectives now, on NCCL (a rank is gone): one waiting on the dead rank would hold its
    stream until the timeout. Gloo's fail by themselves when the peer's connection closes."""
    import torch.distributed as dist

    if _state.world_size == 1 or dist.get_backend(_state.group) != "nccl":
        return
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group(_state.group)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's `x`, in place (x itself with one rank)."""
    if _state.world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(x, group=_state.group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` (of one shape), concatenated along `dim` in rank order."""
    if _state.world_size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.group)
    return torch.cat(parts, dim=dim)


def min_over_ranks(values: list[int]) -> list[int]:
    """Each value's minimum over the ranks (sizes every rank must agree on, e.g. cache pages)."""
    if _state.world_size == 1:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_state.control)
    return t.tolist()


def split(n: int, what: str, field: str) -> tuple[int, int]:
    """This rank's equal part [start, stop) of n items; a ConfigError naming `field` unless the ranks divide n."""
    size = _state.world_size
    if n % size:
        raise ConfigError("tensor_parallel_size", f"{size} does not divide {field} ({n} {what})")
    part = n // size
    return _state.rank * part, (_state.rank + 1) * part


def rows(*ranges: tuple[int, int]) -> Shard:
    return 0, tuple(ranges)


def columns(start: int, stop: int, dim: int = 1) -> Shard:
    return dim, ((start, stop),)


def take(tensor: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """The part of checkpoint tensor `tensor` a shard names (the tensor itself for None)."""
    if shard is None:
        return tensor
    dim, ranges = shard
    parts = [tensor.narrow(dim, a, b - a) for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def scale_shard(shard: Shard | None, block: int, scale_shape: tuple[int, ...]) -> Shard | None:
    """The part of a weight's block scales (`scale_shape`) that goes with the weight's part `shard`: whole blocks
    only, so a ConfigError unless each range starts on a block and ends on one or at the weight's end."""
    if shard is None:
        return None
    dim, ranges = shard
    if dim < len(scale_shape) - 2:  # a leading (expert) dimension: scales are indexed like the weights
        return shard
    out = []
    for a, b in ranges:
        stop = -(-b // block)
        if a % block or (b % block and stop != scale_shape[dim]):
            raise ConfigError("tensor_parallel_size", f"a rank's part [{a}, {b}) of an fp8 weight along dim {dim} "
                                                  f"splits its {block}-wide scale blocks (expert parallel keeps "
                                                  f"experts whole)")
        out.append((a // block, stop))
    return dim, tuple(out)


def rendezvous_from_env(world_size: int) -> tuple[str, int, int] | None:
    """torchrun's variables: (tcp://MASTER_ADDR:MASTER_PORT, NNODES, NODE_RANK) when NNODES is over 1, else None.
    The ranks of node k are k * (world_size / NNODES) onwards."""
    nnodes = int(os.environ.get("NNODES", "1"))
    if nnodes <= 1:
        return None
    if world_size % nnodes:
        raise ConfigError("tensor_parallel_size", f"{world_size} ranks do not divide over NNODES={nnodes} nodes")
    node_rank = int(os.environ.get("NODE_RANK", "0"))
    if not 0 <= node_rank < nnodes:
        raise ConfigError("NODE_RANK", f"must be in [0, {nnodes}), got {node_rank}")
    try:
        addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    except KeyError as e:
        raise ConfigError(e.args[0], "must be set for a run over several nodes (NNODES > 1)") from None
    return f"tcp://{addr}:{port}", nnodes, node_rank
