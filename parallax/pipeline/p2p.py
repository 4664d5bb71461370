"""What travels between pipeline stages: tensors and the metadata that sizes their buffers.

Every forward message is preceded by a fixed-size int64 metadata tensor describing each tensor
(dtype, whether it needs a gradient, shape), so shapes may change from one microbatch to the next
(variable sequence lengths) and a stage may pass several tensors. Gradients travel without
metadata: they have the shapes of the activations that went the other way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from parallax import comm

META_LEN = 64  # int64 slots: [count, (dtype, requires_grad, ndim, *shape) per tensor]

DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether a gradient flows back through this tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.requires_grad)

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def encode(metas: Sequence[TensorMeta], device: torch.device, what: str = "") -> torch.Tensor:
    """Pack ``metas`` into one ``(META_LEN,)`` int64 tensor on ``device``."""
    values = [len(metas)]
    for meta in metas:
        if meta.dtype not in _CODE:
            raise ValueError(
                f"{what}: cannot send a {meta.dtype} tensor between stages; "
                f"supported dtypes are {[str(d) for d in DTYPES]}"
            )
        values += [_CODE[meta.dtype], int(meta.requires_grad), len(meta.shape), *meta.shape]
    if len(values) > META_LEN:
        raise ValueError(
            f"{what}: the metadata of {len(metas)} tensors with shapes "
            f"{[m.shape for m in metas]} needs {len(values)} int64 slots, more than {META_LEN}; "
            "pass fewer or lower-dimensional tensors between stages"
        )
    values += [0] * (META_LEN - len(values))
    # built on the host and copied without waiting: torch.tensor(..., device=cuda) would
    # synchronise the stream on every message
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def decode(buffer: torch.Tensor) -> list[TensorMeta]:
    """Inverse of :func:`encode` (one device-to-host copy)."""
    values = buffer.tolist()
    metas, i = [], 1
    for _ in range(values[0]):
        code, requires_grad, ndim = values[i : i + 3]
        shape = tuple(values[i + 3 : i + 3 + ndim])
        metas.append(TensorMeta(shape, DTYPES[code], bool(requires_grad)))
        i += 3 + ndim
    return metas


def meta_buffer(device: torch.device) -> torch.Tensor:
    return torch.empty(META_LEN, dtype=torch.int64, device=device)


def as_tensors(value: object, what: str) -> tuple[torch.Tensor, ...]:
    """A stage output as a tuple of tensors (a single tensor becomes a 1-tuple)."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, tuple | list) and all(isinstance(v, torch.Tensor) for v in value):
        if not value:
            raise ValueError(f"{what} returned an empty {type(value).__name__}")
        return tuple(value)
    raise ValueError(
        f"{what} returned {type(value).__name__}; a stage that is not the last must return a "
        "tensor or a tuple of tensors (the next stage's positional arguments)"
    )


def send_tensors(tensors: Sequence[torch.Tensor], peer: int, group, what: str = "") -> None:
    """Send ``tensors`` to global rank ``peer`` over ``group``: their metadata, then each one
    (what :func:`recv_tensors` takes, outside any schedule: inference, exports)."""
    meta = encode([TensorMeta.of(t) for t in tensors], tensors[0].device, what)
    comm.batch_send_recv([(meta, peer)], [], group)
    comm.batch_send_recv([(t.contiguous(), peer) for t in tensors], [], group)


def recv_tensors(peer: int, group, device: torch.device) -> list[torch.Tensor]:
    """The tensors :func:`send_tensors` sent from global rank ``peer``."""
    meta = meta_buffer(device)
    comm.batch_send_recv([], [(meta, peer)], group)
    out = [m.empty(device) for m in decode(meta)]
    comm.batch_send_recv([], [(t, peer) for t in out], group)
    return out
