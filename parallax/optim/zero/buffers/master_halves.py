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

The low halves are held as two planes of bytes (the low byte, the high one), both read and
written as int8 in the kernels: int16 loads and stores keep the compiled CPU loop scalar, and
torch 2.11's vector library narrows int32 to int8 in vector registers but to uint8 one element
at a time (on the GPU host that store halved the loop's speed a thread:
``benchmarks/zero/split_probe.py``). The storage is uint8; the kernels see its bits as int8
(:func:`planes`) and take the low byte back with a mask. The split is integer work
on the master's bits: a shorter form that found the weight's bits by rounding the master to
bf16 and back was exact eagerly, but compiled for the CPU it lost the low halves (torch's
compiler may keep such a round trip in fp32 and drop the rounding; on one H100 host the clip
norm of a tiny model drifted 1e-3 in three steps: tests/optim/test_split_masters.py). Reading
the weight's bits through its upcast to fp32 is exact (a load, not a rounding).

The host then holds 2 bytes of master an element instead of 4 (OpenVLA-7B: 14 GiB less), and
each step brings the weights down (2 bytes an element over the link, beside the uploads going
the other way) to join them with their low halves: :mod:`~parallax.optim.zero.offload.weights_down`.
"""

from __future__ import annotations

import torch

TIE = -(1 << 15)  # the low bits 0x8000, signed: a master halfway between two weights
BELOW_TIE = (1 << 15) - 1  # 0x7fff: one fp32 ulp nearer the weight


def planes(low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two byte planes of ``low`` (2, n) uint8 as the kernels take them: int8 views (n,)
    of the low byte and the high one."""
    bytes_ = low.view(torch.int8)  # (2, n) the same bits
    return bytes_[0], bytes_[1]


def join(weight: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 masters of bf16 ``weight`` (n,) and ``low`` (2, n) uint8, their low halves
    (:func:`low_half`)."""
    return join_planes(weight, *planes(low))


def join_planes(weight: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """:func:`join` from the low halves' two byte planes ``lo`` and ``hi``, int8 (n,) each
    (:func:`planes`)."""
    high = weight.float().view(torch.int32)  # (n,) int32: the weight's bits shifted up 16
    low_byte = lo.to(torch.int32) & 0xFF  # (n,) int32: the low byte, 0..255
    signed = hi.to(torch.int32) * 256 + low_byte  # (n,) int32: the low bits, signed
    return (high + signed).view(torch.float32)  # (n,) fp32


def signed_low(master: torch.Tensor) -> torch.Tensor:
    """The low 16 bits of fp32 ``master`` (n,) as a signed int32 that :func:`join` adds to its
    weight's; at a tie that rounded down, one ulp nearer the weight."""
    bits = master.view(torch.int32)  # (n,) int32
    low = ((bits & 0xFFFF) ^ 0x8000) - 0x8000  # (n,) int32: the low 16 bits, signed
    down = (low == TIE) & ((bits & (1 << 16)) == 0)  # a tie rounded to an even top half
    return torch.where(down, BELOW_TIE, low)


def split_into(master: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """Write fp32 ``master``'s low half (:func:`signed_low`) into its byte planes ``lo`` and
    ``hi``, int8 (n,) each (:func:`planes`); the conversions are exact (in range)."""
    low = signed_low(master)
    lo.copy_((((low & 0xFF) ^ 0x80) - 0x80).to(torch.int8))  # the low byte's bits, signed
    hi.copy_((low >> 8).to(torch.int8))


def low_half(master: torch.Tensor) -> torch.Tensor:
    """The low halves of fp32 ``master`` (n,): (2, n) uint8, the low byte over the high one
    (two planes of bytes: a compiled CPU loop vectorizes them, not int16)."""
    out = torch.empty((2, master.numel()), dtype=torch.uint8)  # (2, n)
    split_into(master, *planes(out))
    return out


def can_split(dtype: torch.dtype) -> bool:
    """Whether a bucket of weights in ``dtype`` can keep only its masters' low halves: bf16
    alone is the top half of an fp32."""
    return dtype == torch.bfloat16
