"""The offload's staging ring: pieces handed out first in, first out, never overlapping a live
piece, waiting (not failing) while the ring is full."""

import random
import threading
import time

import pytest
import torch

from parallax.optim.zero.offload import upload_ring as staging
from parallax.plan import host_memory as plan_memory


def test_pieces_wrap_around_and_wait_for_the_oldest():
    ring = staging.Ring(10, torch.float32, pin=False)
    a, ta = ring.take(4)
    b, tb = ring.take(4)
    assert (ta[0], tb[0]) == (0, 4)
    got = {}
    taker = threading.Thread(target=lambda: got.update(piece=ring.take(3)))
    taker.start()
    time.sleep(0.2)
    assert taker.is_alive()  # 8 + 3 > 10 and [0, 4) is still live: it waits
    ring.give(ta)
    taker.join(timeout=10)
    assert not taker.is_alive() and got["piece"][1][0] == 0  # wrapped to the freed start
    with pytest.raises(ValueError, match="does not fit"):
        ring.take(11)


def test_a_consumer_thread_sees_every_piece_intact():
    """The producer writes a pattern into each piece; a consumer reads them in order and hands
    them back: no piece is ever handed out while it overlaps one still live."""
    ring = staging.Ring(1000, torch.float32, pin=False)
    rng = random.Random(0)
    queue, seen = [], []
    cond = threading.Condition()

    def consume():
        for _ in range(300):
            with cond:
                cond.wait_for(lambda: queue)
                k, piece, ticket = queue.pop(0)
            seen.append(bool((piece == k).all()))
            ring.give(ticket)

    consumer = threading.Thread(target=consume)
    consumer.start()
    for k in range(300):
        piece, ticket = ring.take(rng.choice([0, 1, 7, 120, 333, 1000]))
        piece.fill_(k)
        with cond:
            queue.append((k, piece, ticket))
            cond.notify()
    consumer.join(timeout=30)
    assert len(seen) == 300 and all(seen)


def test_the_planner_counts_the_same_ring():
    assert plan_memory.STAGING_BYTES is staging.STAGING_BYTES  # imported, not copied
