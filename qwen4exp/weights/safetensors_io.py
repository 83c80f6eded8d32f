"""Streaming safetensors writing: the header is computed from shapes, then tensors are produced and written one at
a time, so a checkpoint larger than memory can be generated."""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..distributed import Shard

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
           torch.int32: "I32", torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.tensor([], dtype=dtype).element_size()


def write_safetensors(
    path: str, specs: list[tuple[str, tuple[int, ...], torch.dtype]], produce: Callable[[str], torch.Tensor]
) -> None:
    """Write `specs` (name, shape, dtype) to `path`, calling produce(name) for each tensor just before writing it."""
    header, offset = {}, 0
    for name, shape, dtype in specs:
        size = _nbytes(shape, dtype)
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype in specs:
            t = produce(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: produced {tuple(t.shape)} {t.dtype}, declared {shape} {dtype}")
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def write_sharded(
    out_dir: str,
    specs: list[tuple[str, tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    max_shard_bytes: int = 4 << 30,
) -> list[str]:
    """Split specs into files of at most max_shard_bytes (a larger single tensor gets its own file) with an index."""
    groups: list[list] = [[]]
    size = 0
    for spec in specs:
        nb = _nbytes(spec[1], spec[2])
        if groups[-1] and size + nb > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += nb
    if len(groups) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for fname, group in zip(names, groups):
        write_safetensors(os.path.join(out_dir, fname), group, produce)
        for name, shape, dtype in group:
            weight_map[name] = fname
            total += _nbytes(shape, dtype)
    if len(names) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return names


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, f) for f in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors files in {model_dir!r}")
    return [os.path.join(model_dir, f) for f in found]


def _header(f) -> tuple[dict, int]:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


_BY_NAME = {v: k for k, v in _DTYPES.items()} | {"BOOL": torch.bool, "F64": torch.float64}


def read_infos(files: list[str]) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Every tensor's (shape, dtype) from the file headers, without reading data."""
    infos = {}
    for path in files:
        with open(path, "rb") as f:
            header, _ = _header(f)
        infos.update({k: (tuple(v["shape"]), _BY_NAME.get(v["dtype"])) for k, v in header.items()})
    return infos


def _read_buffer(nbytes: int) -> torch.Tensor:
    """A buffer for one tensor's bytes. Large ones get their own anonymous mapping, which goes back to the OS as
    soon as the tensor is freed; from malloc, a freed multi-MB block can stay in the process's heap (glibc raises
    its mmap threshold after such frees), so a loader streaming shards would keep several of them resident."""
    if nbytes < 1 << 20:
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)


def iterate_files(files: list[str], only: Callable[[str], bool] | None = None,
                  parts: Callable[[str, tuple[int, ...]], Shard | None | bool] | None = None,
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs in file order, one tensor in memory at a time (those `only` accepts, if given).

    parts(name, shape): which part of each tensor to read, for a process that holds a part of the model
    (`distributed.Shard`: only those bytes are read and the part is yielded; None: all of it; False: skip it).

    Plain reads rather than mmap: a mapped file's pages count as resident memory of the process until it is
    unmapped, which would make a loading process look (and, under memory limits, behave) like it holds the
    checkpoint twice. A part is copied out of a mapping of its tensor that is closed right after, so only the pages
    holding the part are read and none stay mapped.
    """
    for path in files:
        with open(path, "rb") as f:
            header, base = _header(f)
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                if only is not None and not only(name):
                    continue
                start, end = info["data_offsets"]
                shape, dtype = tuple(info["shape"]), _BY_NAME[info["dtype"]]
                shard = parts(name, shape) if parts is not None else None
                if shard is False:
                    continue
                if shard is not None and shard is not True:
                    yield name, _read_part(f, base + start, end - start, shape, dtype, shard)
                    continue
                buf = _read_buffer(end - start)
                f.seek(base + start)
                f.readinto(memoryview(buf.numpy()))
                yield name, buf.view(dtype).reshape(shape)


def _read_part(f, offset: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype, shard) -> torch.Tensor:
    from ..distributed import take

    if nbytes == 0:
        return take(torch.empty(shape, dtype=dtype), shard)
    aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(f.fileno(), nbytes + offset - aligned, offset=aligned, access=mmap.ACCESS_READ)
    try:
        with warnings.catch_warnings():  # the mapping is read-only, and only read
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(mapped, dtype=torch.uint8, offset=offset - aligned, count=nbytes)
        part = take(raw.view(dtype).reshape(shape), shard).clone()
        del raw
    finally:
        mapped.close()
    return part
