"""One producer thread running a fixed number of items ahead of its consumer.

The training loop asks for the next step's batch only when the step before has ended; reading,
collating, tokenising, pinning and copying that batch then sits on the critical path.
:class:`Prefetcher` calls ``produce(0), produce(1), ...`` (``count`` times, in that order, from
one thread, so the data order is the one a plain loop gives) in a background thread and keeps
up to ``depth`` results in a bounded queue; ``depth=0`` calls ``produce`` in the caller's
thread instead, the same calls in the same order.

An exception in ``produce`` is raised by :meth:`Prefetcher.get` in the consumer, the same
object with its original traceback and a note naming the item. A producer that ends without
delivering (it cannot, short of a bug in this file) is an error, not a wait: :meth:`get` polls
its thread. :meth:`close` stops the thread between items and waits for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class PrefetchError(RuntimeError):
    """The producer thread ended without the item the consumer waits for."""


class Serialized:
    """``fn`` behind a lock: a collator that the prefetch thread and the training thread (the
    evaluation) both call runs one call at a time (tokenizers are not all thread-safe)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self._lock = fn, threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self.fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)


class Prefetcher(Generic[T]):
    """``produce(i)`` for ``i < count``, up to ``depth`` items ahead; see the module doc.
    ``describe(i)`` names item ``i`` in errors (``"the batch of step 7"``)."""

    def __init__(
        self,
        produce: Callable[[int], T],
        count: int,
        depth: int = 1,
        describe: Callable[[int], str] | None = None,
        name: str = "parallax-prefetch",
        poll_s: float = 1.0,
    ) -> None:
        if depth < 0 or count < 0:
            raise ValueError(f"prefetch depth {depth} and count {count} must be >= 0")
        self.produce, self.count, self.depth = produce, count, depth
        self.describe = describe or (lambda i: f"item {i}")
        self.poll_s = poll_s
        self.taken = 0  # items handed to the consumer
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None
        if depth > 0 and count > 0:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    # -- the producer thread -------------------------------------------------------------------
    def _run(self) -> None:
        i = 0
        try:
            for i in range(self.count):
                if self._stop.is_set():
                    return
                if not self._put(("item", self.produce(i))):
                    return
        except BaseException as err:  # noqa: BLE001 - every failure goes to the consumer
            err.add_note(
                f"(raised in the data prefetch thread while making {self.describe(i)}; "
                "--prefetch 0 makes each batch in the training thread)"
            )
            self._put(("error", err))

    def _put(self, entry: tuple[str, Any]) -> bool:
        """Queue ``entry`` (waiting while the queue is full); ``False`` once closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=self.poll_s)
                return True
            except queue.Full:
                continue
        return False

    # -- the consumer ---------------------------------------------------------------------------
    def get(self) -> T:
        """The next item (``StopIteration`` after ``count``); raises what ``produce`` raised."""
        if self.taken >= self.count:
            raise StopIteration
        if self._stop.is_set():
            what = self.describe(self.taken)
            raise PrefetchError(f"the prefetcher is closed; {what} is not made")
        index, self.taken = self.taken, self.taken + 1
        if self._thread is None:
            return self.produce(index)
        kind, value = self._take(index)
        if kind == "error":
            self._stop.set()  # nothing after a failed item is made
            raise value
        return value

    def _take(self, index: int) -> tuple[str, Any]:
        while True:
            try:
                return self._queue.get(timeout=self.poll_s)
            except queue.Empty:
                # a dead thread puts nothing more: empty after it ended is empty for good
                if not self._thread.is_alive() and self._queue.empty():
                    raise PrefetchError(
                        f"the data prefetch thread ended without {self.describe(index)}"
                    ) from None

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        return self.get()

    def close(self, timeout_s: float = 60.0) -> bool:
        """Stop making items and wait for the thread (it finishes the item it is making);
        whether it ended within ``timeout_s``."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        deadline = time.monotonic() + timeout_s
        while thread.is_alive() and time.monotonic() < deadline:
            self._drain()
            thread.join(timeout=min(self.poll_s, max(deadline - time.monotonic(), 0.0)))
        self._drain()
        if thread.is_alive():
            log.warning("the data prefetch thread did not end within %.0f s", timeout_s)
            return False
        return True

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
