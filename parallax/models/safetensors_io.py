"""Streaming safetensors writing and atomic file replacement.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once; a 5 GB shard
would then cost 5 GB on the writing rank. The header of a safetensors file only needs names,
dtypes and shapes, so :class:`SafetensorsWriter` writes it first and then streams the tensors
one by one, in the header's order. Files appear under their final name only when complete
(temporary name, fsync, rename, fsync of the directory).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from parallax.atomic import atomic_write_bytes, atomic_write_json, fsync_dir, temp_sibling

DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64"}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB" / "500MiB" (GB = 10**9, GiB = 2**30)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", size.upper().replace("IB", "iB"))
    if not m:
        raise ValueError(f"cannot parse size {size!r}; use bytes or e.g. '5GB'")
    power = " KMGT".index(m.group(2) or " ")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base**power)


# The model's files and the training checkpoints share one atomic-write discipline.
write_bytes_atomic = atomic_write_bytes
write_json_atomic = atomic_write_json


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor, in the order of ``entries``.

    ``entries`` is ``[(name, shape, dtype), ...]``. Use as a context manager: on an exception the
    temporary file is removed and nothing replaces ``path``.
    """

    def __init__(self, path: str | Path, entries, metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.tmp = temp_sibling(self.path)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.order, offset = [], 0
        for name, shape, dtype in entries:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self.order.append((name, tuple(shape), dtype))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed by close() / abort()
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, shape, dtype = self.order[self.next]
        if name != want_name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise RuntimeError(
                f"{self.path.name}: expected {want_name} {shape} {dtype}, got {name} "
                f"{tuple(tensor.shape)} {tensor.dtype}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)  # 0-d too
        self.file.write(memoryview(data.numpy()))
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            raise RuntimeError(f"{self.path.name}: {len(self.order) - self.next} tensors unwritten")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        self.file.close()
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


Group = list[tuple[str, tuple[int, ...]]]  # the checkpoint tensors one parameter becomes


def stream_file(
    path: Path,
    groups: list[Group],
    parts_of: Callable[[Group], list[torch.Tensor] | None],
    dtype: torch.dtype,
    writing: bool,
) -> None:
    """One shard file of a checkpoint export, a parameter at a time: ``parts_of(group)`` gives
    the group's tensors (each rank calls it: it may gather over tp) or ``None`` (nothing of it
    on this rank); where ``writing``, they are cast to ``dtype`` and streamed into ``path``
    (atomically: an error leaves no file). At most one parameter's gathered value is held."""
    entries = [(n, s, dtype) for g in groups for n, s in g]
    writer = SafetensorsWriter(path, entries) if writing else None
    try:
        for group in groups:
            parts = parts_of(group)
            if writer is not None and parts is not None:
                for (name, shape), t in zip(group, parts):
                    writer.write(name, t.reshape(shape).to(dtype))
            parts = None  # before the next parameter is gathered
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close()
