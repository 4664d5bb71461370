"""Page-locked host memory of exactly the size asked for.

``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds
every block up to a power of two: a 12 GiB accumulator takes 16 GiB of locked (resident) host
memory, 4 GiB above what it holds (the offloaded rows' host RSS sat 5-6 GiB above the planner's
count, ``benchmarks/RESULTS.md``). Here the memory is an ordinary allocation, page-aligned,
registered with the CUDA driver (``cudaHostRegister``, as torch's own checkpoint stager does)
for as long as its :class:`PinnedBuffer` lives; where registering fails, torch's pinned
allocation stands in. Unregistering while a view of the memory is still in use is safe: copies
from it are then synchronous, nothing is freed.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

PAGE = 4096  # bytes: the registered range starts and ends on a page


class PinnedBuffer:
    """``numel`` elements of ``dtype`` in host memory, page-locked when a GPU is there
    (``tensor``); ``registered`` says whether this buffer did it (else torch's allocator or no
    pinning at all)."""

    def __init__(self, numel: int, dtype: torch.dtype, zero: bool = False) -> None:
        self.registered = False
        nbytes = numel * dtype.itemsize
        if not torch.cuda.is_available() or nbytes == 0:
            self.tensor = torch.empty(numel, dtype=dtype)
        else:
            self.tensor = self._register(numel, dtype, nbytes)
        if zero:
            self.tensor.zero_()

    def _register(self, numel: int, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // PAGE) * PAGE
        raw = torch.empty(size + PAGE, dtype=torch.uint8)  # (bytes,) room to align
        start = -raw.data_ptr() % PAGE
        ptr = raw.data_ptr() + start
        try:
            code = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
        except (AttributeError, RuntimeError, AssertionError):
            code = -1
        if code != 0:  # (torch's allocator: rounded up, but pinned)
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        self.registered, self._raw = True, raw
        self._release = weakref.finalize(self, _unregister, ptr)
        return raw[start : start + nbytes].view(dtype)  # (numel,)


def _unregister(ptr: int) -> None:
    with contextlib.suppress(AttributeError, RuntimeError):  # (at exit the runtime may be gone)
        torch.cuda.cudart().cudaHostUnregister(ptr)


def pinned(numel: int, dtype: torch.dtype, owner: list, zero: bool = False) -> torch.Tensor:
    """A :class:`PinnedBuffer`'s tensor, the buffer kept in ``owner`` (the registration lasts
    as long as the list's holder keeps it)."""
    buffer = PinnedBuffer(numel, dtype, zero)
    owner.append(buffer)
    return buffer.tensor
