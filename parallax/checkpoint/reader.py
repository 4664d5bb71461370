"""Open a checkpoint lazily, validate it up front, and read full tensors or slices of them.

Opening checks everything that can be checked without reading tensor data: the directory,
``index.json`` and ``meta.json``, that every file the index names exists, and that each file's
safetensors header matches its size and the index (catching truncated and corrupt shards). So
a bad checkpoint fails with one :class:`CheckpointError` naming the file or tensor before
training starts. Reads are memory-mapped, and a slice reads only its bytes, which is how a
rank of another layout takes just its tp/dp share.

Every read also verifies the data it returns: the CRC-32 of each tile of the tensor that the
read overlaps (:mod:`parallax.checkpoint.checksum`), each tile once per ``Checkpoint``, before
the values are handed out. A full read checks the whole tensor, a tp/dp slice along dim 0 or
1 only the tiles it touches (``bytes_verified`` counts what was hashed); damaged bytes raise a
:class:`CheckpointError` naming the file, the tensor and where in it. Checkpoints of format
version 1 carry no checksums: they still load, unverified, and opening one says so (once).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from parallax.checkpoint.checksum import (
    Index,
    as_matrix,
    tile_bounds,
    tile_bytes,
    tile_count,
    tiles_touched,
)
from parallax.checkpoint.store import FORMAT, INDEX, META
from parallax.checkpoint.stream import DTYPE_NAMES, CheckpointError, read_header

log = logging.getLogger(__name__)


def read_json(path: Path, error: type[Exception], missing: str, corrupt: str) -> Any:
    """A JSON file's contents, or ``error`` naming it: ``<folder> has no <name><missing>`` when
    it is not there, ``<path>: <corrupt> (why)`` when it cannot be read."""
    if not path.is_file():
        raise error(f"{path.parent} has no {path.name}{missing}")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error(f"{path}: {corrupt} ({err})") from None


def _load_json(path: Path, what: str) -> Any:
    return read_json(path, CheckpointError, f" ({what}); incomplete checkpoint", "corrupt")


class Checkpoint:
    """A complete checkpoint directory, opened read-only (see module doc)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        index = _load_json(self.path / INDEX, "the tensor index")
        self.meta: dict[str, Any] = _load_json(self.path / META, "the metadata")
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise CheckpointError(f"{self.path / INDEX}: not a {FORMAT!r} index")
        try:
            self.weight_map: dict[str, str] = dict(index["weight_map"])
            self.tensors: dict[str, dict[str, Any]] = dict(index["tensors"])
            files: dict[str, int] = dict(index["files"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{self.path / INDEX}: corrupt ({err!r})") from None
        self.step = int(self.meta.get("step", index.get("step", -1)))
        self.checksums = index.get("version", 1) >= 2
        self._offsets: dict[str, int] = {}  # tensor name -> byte offset of its data in its file
        by_file: dict[str, list[str]] = {file: [] for file in files}
        for name, file in self.weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in sorted(by_file.items()):
            self._check_file(file, files.get(file), names)
        self._handles: dict[str, Any] = {}
        self._maps: dict[str, np.memmap] = {}
        self._verified: set[tuple[str, int]] = set()
        self.bytes_verified = 0  # bytes hashed by reads so far
        if not self.checksums:
            log.info("%s has no checksums (format version 1): its data is not verified", self.path)

    def _check_file(self, file: str, size: int | None, names: list[str]) -> None:
        path = self.path / file
        if not path.is_file():
            raise CheckpointError(f"{path}: shard file named by {INDEX} is missing")
        header = read_header(path)
        if size is not None and path.stat().st_size != size:
            raise CheckpointError(
                f"{path}: {path.stat().st_size} bytes, the index says {size} (truncated?)"
            )
        for name in names:
            info, want = header.get(name), self.tensors.get(name)
            if (
                info is None
                or want is None
                or [info["dtype"], info["shape"]]
                != [
                    want["dtype"],
                    want["shape"],
                ]
            ):
                raise CheckpointError(
                    f"{path}: tensor {name!r} is missing or differs from {INDEX} "
                    f"(file: {info and [info['dtype'], info['shape']]}, index: {want})"
                )
            if self.checksums:
                self._check_checksums(name, want)
        end = max(
            (h["data_offsets"][1] for k, h in header.items() if k != "__metadata__"), default=0
        )
        start = path.stat().st_size - end  # read_header checked that the data fills the rest
        for name in names:
            self._offsets[name] = start + int(header[name]["data_offsets"][0])

    def _check_checksums(self, name: str, info: dict[str, Any]) -> None:
        try:
            rows, cols = (int(v) for v in info["chunks"])
            crcs = [int(v) for v in info["crc32"]]
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(
                f"{self.path / INDEX}: tensor {name!r} has no valid checksums ({err!r})"
            ) from None
        if min(rows, cols) < 1 or len(crcs) != tile_count(info["shape"], rows, cols):
            raise CheckpointError(
                f"{self.path / INDEX}: tensor {name!r} has {len(crcs)} checksums for "
                f"{rows} x {cols} tiles of shape {info['shape']}"
            )

    # -- what is inside -------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPE_NAMES[self._info(name)["dtype"]]

    def _info(self, name: str) -> dict[str, Any]:
        if name not in self.weight_map:
            close = difflib.get_close_matches(name, self.weight_map, n=3)
            hint = f"; close names: {close}" if close else ""
            raise CheckpointError(
                f"tensor {name!r} is not in checkpoint {self.path} "
                f"({len(self.weight_map)} tensors{hint})"
            )
        return self.tensors[name]

    def require(self, names: Iterable[str]) -> None:
        """Fail before training if any of ``names`` is absent (all missing ones are listed)."""
        missing = [n for n in names if n not in self.weight_map]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:10])
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise CheckpointError(
                f"checkpoint {self.path} lacks {len(missing)} tensors: {shown}{more}"
            )

    # -- reading --------------------------------------------------------------------------
    def get(self, name: str, index: Index | None = None) -> torch.Tensor:
        """The full tensor ``name``, or ``tensor[index]`` (basic slicing) reading only that part."""
        self._info(name)
        self._verify(name, index)
        handle = self._handle(self.weight_map[name])
        if index is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[index]

    def shard(self, name: str, dim: int, rank: int, world: int) -> torch.Tensor:
        """Rank ``rank``'s equal chunk of ``name`` along ``dim`` (for tp/dp re-sharding)."""
        shape = self.shape(name)
        dim = dim % len(shape)
        if shape[dim] % world:
            raise CheckpointError(
                f"tensor {name!r}: dim {dim} of size {shape[dim]} does not split into {world}"
            )
        size = shape[dim] // world
        index = (slice(None),) * dim + (slice(rank * size, (rank + 1) * size),)
        return self.get(name, index)

    def _verify(self, name: str, index: Index | None) -> None:
        """Check the CRC-32 of every tile of ``name`` that ``tensor[index]`` touches and that
        no earlier read checked."""
        info = self.tensors[name]
        if not self.checksums:
            return
        shape, (rows, cols) = info["shape"], info["chunks"]
        todo = [
            k for k in tiles_touched(shape, index, rows, cols) if (name, k) not in self._verified
        ]
        if not todo:
            return
        file = self.weight_map[name]
        itemsize = DTYPE_NAMES[info["dtype"]].itemsize
        offset, nbytes = self._offsets[name], math.prod(shape) * itemsize
        matrix = as_matrix(self._map(file)[offset : offset + nbytes], shape, itemsize)
        for k in todo:
            bounds = tile_bounds(shape, rows, cols, k)
            data = tile_bytes(matrix, bounds, itemsize)
            self.bytes_verified += data.nbytes
            got, want = zlib.crc32(data), info["crc32"][k]
            if got != want:
                r0, r1, c0, c1 = bounds
                raise CheckpointError(
                    f"{self.path / file}: tensor {name!r} is corrupt: the checksum of its "
                    f"rows {r0}:{r1}, columns {c0}:{c1} (chunk {k}) is {got:08x}, {INDEX} "
                    f"says {want:08x}. The file changed after it was written (disk, copy or "
                    "transfer damage): restore it, or move this step directory away to "
                    "resume from an earlier one"
                )
            self._verified.add((name, k))

    def _map(self, file: str) -> np.ndarray:
        if file not in self._maps:
            mapped = np.memmap(self.path / file, dtype=np.uint8, mode="r")
            self._maps[file] = mapped.view(np.ndarray)  # slices of it: plain views, cheap
        return self._maps[file]

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file]

    def close(self) -> None:
        self._handles.clear()
        self._maps.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, step={self.step}, tensors={len(self.weight_map)})"
