"""Streaming safetensors: write a file one tensor at a time, and check a file's header and size.

The safetensors layout is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
padded with spaces to a multiple of 8), then the tensors' bytes back to back. Because the
header only needs names, shapes and dtypes, it can be written first and each tensor produced
(gathered from its shards, say) just before its bytes are written, so a writer never holds more
than one full tensor. The files are read back by ``safetensors.safe_open``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parallax.checkpoint.checksum import DEFAULT_CHUNKING, Chunking, as_matrix
from parallax.checkpoint.checksum import checksums as tile_checksums

log = logging.getLogger(__name__)

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


class CheckpointError(RuntimeError):
    """A checkpoint (or safetensors file) that is missing, incomplete, corrupt or inconsistent."""


@dataclass(frozen=True)
class TensorSource:
    """A tensor to be written: its name, shape and dtype now, its values only when asked.

    ``produce()`` is called exactly once, in list order, right before its bytes are written.
    It may run a collective (gather a sharded parameter) that peers join: they list the same
    source with ``write=False``, so its producer runs in the same order on every rank of the
    collective while only one rank stores the result.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]
    write: bool = True

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSource:
        """A source for a tensor already in memory."""
        return cls(name, tuple(tensor.shape), tensor.dtype, lambda: tensor)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def sources(tensors: dict[str, torch.Tensor]) -> list[TensorSource]:
    """Sources for a dict of in-memory tensors, in the dict's order."""
    return [TensorSource.of(name, t) for name, t in tensors.items()]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_dtype(name: str, dtype: torch.dtype) -> str:
    if dtype not in DTYPES:
        raise CheckpointError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
    return DTYPES[dtype]


def write_safetensors(
    path: str | os.PathLike,
    tensors: Sequence[TensorSource],
    metadata: dict[str, str] | None = None,
    *,
    checksums: dict[str, dict[str, Any]] | None = None,
    chunking: Chunking = DEFAULT_CHUNKING,
) -> int:
    """Write ``tensors`` to ``path`` one at a time (data fsynced); return the file size.

    Sources with ``write=False`` are produced in their turn and dropped (see ``TensorSource``).
    The caller decides where ``path`` lives; inside a checkpoint it is a staging directory that
    is renamed into place only when complete, so the file itself needs no temp name. When
    ``checksums`` is a dict, it receives ``{name: {"chunks": [rows, cols], "crc32": [...]}}``
    for every written tensor, computed from the bytes written
    (:mod:`parallax.checkpoint.checksum`).
    """
    if sys.byteorder != "little":
        raise CheckpointError("safetensors is little-endian; big-endian hosts are not supported")
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for src in tensors:
        if not src.write:
            continue
        if src.name in header or src.name == "__metadata__":
            raise CheckpointError(f"tensor name {src.name!r} appears twice in {path}")
        end = offset + src.nbytes
        header[src.name] = {
            "dtype": _check_dtype(src.name, src.dtype),
            "shape": list(src.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    started = 0
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for src in tensors:
                started += 1
                _write_one(f, src, checksums, chunking)
            f.flush()
            os.fsync(f.fileno())
    except Exception:
        drain(tensors[started:])
        raise
    return 8 + len(blob) + offset


def drain(tensors: Sequence[TensorSource]) -> None:
    """Run the remaining producers and drop their results (and errors).

    After a local failure (a full disk, say) this keeps the collectives inside producers
    matched with the peers that are still writing, so the failure is reported at the next
    agreement point instead of leaving them blocked in a gather.
    """
    for src in tensors:
        try:
            src.produce()
        except Exception:  # noqa: BLE001 - the first error is the one reported
            log.debug("ignoring a failure while draining %s", src.name, exc_info=True)


def _write_one(
    f, src: TensorSource, checksums: dict[str, dict[str, Any]] | None, chunking: Chunking
) -> None:
    """Produce one tensor and write its bytes (and checksum them); nothing of it outlives
    this call."""
    tensor = src.produce()
    if tuple(tensor.shape) != tuple(src.shape) or tensor.dtype != src.dtype:
        raise CheckpointError(
            f"tensor {src.name!r}: producer returned {tuple(tensor.shape)} {tensor.dtype}, "
            f"declared {tuple(src.shape)} {src.dtype}"
        )
    if not src.write:
        return
    data = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()  # (nbytes,)
    if tensor.numel():
        f.write(memoryview(data))
    if checksums is not None:
        itemsize = tensor.element_size()
        rows, cols = chunking.geometry(src.shape, itemsize)
        matrix = as_matrix(data, src.shape, itemsize)
        crcs = tile_checksums(matrix, src.shape, itemsize, rows, cols)
        checksums[src.name] = {"chunks": [rows, cols], "crc32": crcs}


def read_header(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Parse and validate a safetensors file's header against its size, without reading data.

    Returns ``{name: {"dtype", "shape", "data_offsets"}}`` plus ``"__metadata__"`` if present.
    A truncated file, a corrupt header, overlapping or missing byte ranges, or a size that
    does not match raise :class:`CheckpointError` naming the file.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(MAX_HEADER, size - 8):
                raise CheckpointError(
                    f"{path}: corrupt or truncated header (claims {n} bytes, file has {size})"
                )
            header = json.loads(f.read(n).decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: corrupt header ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt header (not a JSON object)")
    _check_ranges(path, header, size - 8 - n)
    return header


def _check_ranges(path: Path, header: dict[str, Any], data_size: int) -> None:
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(v) for v in info["data_offsets"])
            numel = math.prod(int(d) for d in info["shape"])
            itemsize = _itemsize(DTYPE_NAMES[info["dtype"]])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: corrupt header entry for {name!r} ({err!r})") from None
        if end - begin != numel * itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} has {end - begin} bytes for its shape")
        ranges.append((begin, end, name))
    expected = 0
    for begin, end, name in sorted(ranges):
        if begin != expected:
            raise CheckpointError(f"{path}: tensor {name!r} does not follow the previous one")
        expected = end
    if expected != data_size:
        state = "truncated" if data_size < expected else "has trailing bytes"
        raise CheckpointError(
            f"{path}: {state}: header describes {expected} data bytes, file holds {data_size}"
        )


def iter_sources(tensors: Iterable[TensorSource] | dict[str, torch.Tensor]) -> list[TensorSource]:
    """Accept either a list of sources or a plain ``{name: tensor}`` dict."""
    return sources(tensors) if isinstance(tensors, dict) else list(tensors)
