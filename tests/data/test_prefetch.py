"""The prefetch thread: the same items in the same order, bounded, errors raised in the consumer
with their traceback, no wait on a dead producer, a prompt close."""

import threading
import time
import traceback

import pytest

from parallax.data.prefetch import Prefetcher, PrefetchError, Serialized


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_the_items_and_their_order_are_a_plain_loop_s(depth):
    threads = set()

    def produce(i):
        threads.add(threading.current_thread().name)
        return i * i

    p = Prefetcher(produce, 5, depth)
    assert list(p) == [0, 1, 4, 9, 16]
    with pytest.raises(StopIteration):
        p.get()
    p.close()
    main = threading.current_thread().name
    assert threads == ({main} if depth == 0 else {"parallax-prefetch"})


def test_it_runs_at_most_depth_items_ahead():
    made = []
    p = Prefetcher(lambda i: made.append(i) or i, 10, depth=2, poll_s=0.01)
    assert p.get() == 0
    time.sleep(0.2)  # the thread fills the queue, then blocks on the next put
    assert len(made) <= 1 + 2 + 1, made  # taken, queued, the one waiting to be queued
    assert p.close()


def _producer_that_fails(i):
    if i == 2:
        raise ValueError(f"bad sample in item {i}")
    return i


def test_an_error_in_the_producer_is_raised_in_the_consumer_with_its_traceback():
    p = Prefetcher(
        _producer_that_fails, 5, depth=1, describe=lambda i: f"the batch of step {i + 1}"
    )
    assert [p.get(), p.get()] == [0, 1]
    with pytest.raises(ValueError, match="bad sample in item 2") as info:
        p.get()
    text = "".join(traceback.format_exception(info.value))
    assert "_producer_that_fails" in text  # the producer's own frame
    assert "prefetch thread while making the batch of step 3" in text
    assert "--prefetch 0" in text
    with pytest.raises(PrefetchError):  # nothing after a failed item
        p.get()
    assert p.close()


def test_a_producer_that_dies_silently_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(Prefetcher, "_put", lambda self, entry: False)  # delivers nothing
    p = Prefetcher(lambda i: i, 3, depth=1, poll_s=0.01)
    t0 = time.monotonic()
    with pytest.raises(PrefetchError, match="ended without item 0"):
        p.get()
    assert time.monotonic() - t0 < 5


def test_close_stops_a_producer_blocked_on_a_full_queue():
    p = Prefetcher(lambda i: i, 1000, depth=1, poll_s=0.01)
    assert p.get() == 0
    time.sleep(0.05)
    t0 = time.monotonic()
    assert p.close(timeout_s=5)
    assert time.monotonic() - t0 < 2
    with pytest.raises(PrefetchError, match="closed"):
        p.get()


def test_close_waits_for_the_item_being_made():
    started, release = threading.Event(), threading.Event()

    def slow(i):
        started.set()
        release.wait(5)
        return i

    p = Prefetcher(slow, 3, depth=1, poll_s=0.01)
    started.wait(5)
    assert not p.close(timeout_s=0.05)  # still making item 0: reported, not killed
    release.set()


def test_serialized_calls_one_at_a_time_and_keeps_attributes():
    class Collate:
        told = True
        busy = peak = 0

        def __call__(self, x):
            self.busy += 1
            self.peak = max(self.peak, self.busy)
            time.sleep(0.001)
            self.busy -= 1
            return x

    fn = Serialized(Collate())
    threads = [threading.Thread(target=lambda: [fn(i) for i in range(20)]) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fn.told and fn(7) == 7
    assert fn.peak == 1  # never two calls at once
