"""``--host-masters split``: an offloaded bf16 parameter's fp32 master kept on the host as its
low 16 bits only; the high 16 bits are the bf16 weight the model already holds.

A bf16 weight is its fp32 master rounded to the nearest even top half, so the master's bit
pattern is the weight's shifted up 16, plus the master's low 16 bits read as a signed number:
below half an ulp the master was rounded down (the weight is its top half, the low bits add a
positive remainder), above it rounded up (the weight is one past its top half, and the signed
low bits take the excess back). One case has no room: a tie (low bits 0x8000) that rounded
down to an even top half reads back 2^16 too low. There the master is moved one fp32 ulp
towards the weight (low bits 0x7fff) as it is split: its weight stays the same, and it reads
back exactly from then on. Every other master goes to the host and back unchanged.

All of it is integer work on the bit patterns: a shorter form that finds the weight's bits by
rounding the master to bf16 and back is exact eagerly, but compiled for the CPU it lost the low
halves (torch's compiler may keep such a round trip in fp32 and drop the rounding; on one H100
host the clip norm of a tiny model drifted 1e-3 in three steps: tests/optim/test_split_masters.py).

The host then holds 2 bytes of master an element instead of 4 (OpenVLA-7B: 14 GiB less), and
each step brings the weights down (2 bytes an element over the link, beside the uploads going
the other way) to join them with their low halves: :mod:`~parallax.optim.zero.offload.weights_down`.
"""

from __future__ import annotations

import torch

TIE = -(1 << 15)  # 0x8000 as int16: the low bits of a master halfway between two weights
BELOW_TIE = (1 << 15) - 1  # 0x7fff: one fp32 ulp nearer the weight


def join(weight: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 masters of bf16 ``weight`` and int16 ``low`` (their low halves), (n,) each."""
    high = weight.view(torch.int16).to(torch.int32) << 16  # (n,) int32: the top half's bits
    return (high + low.to(torch.int32)).view(torch.float32)  # (n,) fp32


def low_half(master: torch.Tensor) -> torch.Tensor:
    """The int16 low halves of fp32 ``master`` (n,) that :func:`join` reads back with the bf16
    weights ``master`` rounds to; at a tie that rounded down, one ulp nearer the weight."""
    bits = master.view(torch.int32)  # (n,) int32
    low = ((bits & 0xFFFF) ^ 0x8000) - 0x8000  # (n,) int32: the low 16 bits, signed
    down = (low == TIE) & ((bits & (1 << 16)) == 0)  # a tie rounded to an even top half
    # (in int16's range: the conversion is exact, whether a vector unit wraps or saturates)
    return torch.where(down, BELOW_TIE, low).to(torch.int16)


def can_split(dtype: torch.dtype) -> bool:
    """Whether a bucket of weights in ``dtype`` can keep only its masters' low halves: bf16
    alone is the top half of an fp32."""
    return dtype == torch.bfloat16
