"""Decoding and augmentation, in the loader's process or in worker processes.

A task is one episode's share of one step: ``(source index, episode, [(global position,
step), ...])``. Tasks of an episode always go to the same worker (chosen from the source and
episode numbers), so each worker keeps only its own episodes open and an episode is read once
while the order visits it. What a sample becomes depends only on the source, the step and its
global position (the augmentation seed), never on which worker made it: any worker count gives
the same batches. Results travel back as numpy arrays (pickled; no shared-memory handles).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from parallax.data.augment import (
    AugmentConfig,
    augment,
    center_crop,
    draw,
    resize,
    sample_generator,
)
from parallax.data.source import OpenEpisode, Source
from parallax.data.stats import DatasetError

log = logging.getLogger(__name__)
Task = tuple[int, int, list[tuple[int, int]]]
IMAGE_KEYS = {"primary": "image", "wrist": "wrist_image"}
MAX_AUTO_WORKERS = 8


@dataclass(frozen=True)
class Recipe:
    """What a worker does to a raw sample."""

    seed: int = 0
    mode: str = "none"  # "train": OpenVLA's augmentation; "eval": its centre crop; "none"
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    image_size: tuple[int, int] | None = None
    cameras: tuple[str, ...] = ("primary",)
    state: bool = False
    cache_episodes: int = 16
    chunk: int = 1  # > 1: each sample also carries its next `chunk` actions ("actions")
    # a family's own sample layout: a module-level function (it pickles by name)
    # (source, opened episode, step, chunk) -> raw sample, in place of Source.sample
    sampler: Callable[..., dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("train", "eval", "none"):
            raise ValueError(f"image mode must be 'train', 'eval' or 'none', got {self.mode!r}")


class Decoder:
    """Serves tasks, keeping the most recently used episodes open."""

    def __init__(self, sources: Sequence[Source], recipe: Recipe) -> None:
        self.sources, self.recipe = list(sources), recipe
        self._open: OrderedDict[tuple[int, int], OpenEpisode] = OrderedDict()

    def _episode(self, source: int, episode: int) -> OpenEpisode:
        key = (source, episode)
        opened = self._open.pop(key, None) or self.sources[source].open_episode(episode)
        self._open[key] = opened
        while len(self._open) > self.recipe.cache_episodes:
            self._open.popitem(last=False)[1].close()
        return opened

    def run(self, task: Task) -> list[tuple[int, dict[str, Any]]]:
        source, episode, items = task
        opened = self._episode(source, episode)
        return [(q, self.sample(source, opened, step, q)) for q, step in items]

    def sample(self, source: int, opened: OpenEpisode, step: int, position: int) -> dict:
        r = self.recipe
        if r.sampler is not None:
            out = r.sampler(self.sources[source], opened, step, r.chunk)
        else:
            out = self.sources[source].sample(
                opened, step, cameras=r.cameras, state=r.state, chunk=r.chunk
            )
        for camera, key in IMAGE_KEYS.items():
            if key not in out:
                continue
            image = out[key]
            if r.image_size is not None:
                image = resize(image, r.image_size)
            if r.mode == "train":
                image = augment(image, draw(sample_generator(r.seed, position, camera), r.augment))
            elif r.mode == "eval":
                image = center_crop(image, r.augment.crop_scale[0])
            out[key] = image if image.flags.writeable else image.copy()
        if "action" in out:
            out["action"] = np.asarray(out["action"], dtype=np.float32)
        return out

    def close(self) -> None:
        for opened in self._open.values():
            opened.close()
        self._open.clear()


def _worker_main(sources, recipe: Recipe, tasks, results) -> None:
    # a scheduler that preempts a job signals all its processes: the training process decides
    # when to stop (after saving, parallax.train.failures) and closes its workers itself; a
    # worker whose parent is gone (a crash, a kill) leaves by itself within a second
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    torch.set_num_threads(1)
    decoder = Decoder(sources, recipe)
    while True:
        try:
            item = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                break
            continue
        if item is None:
            break
        task_id, task = item
        try:
            results.put((task_id, decoder.run(task), None))
        except Exception as err:
            results.put((task_id, None, (isinstance(err, DatasetError), f"{err}")))
    decoder.close()
    results.cancel_join_thread()  # results nobody reads any more must not hold the exit


class WorkerPool:
    """``n`` worker processes, each with its own task queue, sharing one result queue."""

    def __init__(
        self, n: int, sources: Sequence[Source], recipe: Recipe, start_method: str = "forkserver"
    ) -> None:
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":  # workers fork from a server that has torch loaded
            ctx.set_forkserver_preload(["parallax.data.workers"])
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(n)]
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(list(sources), recipe, self.tasks[i], self.results),
                daemon=True,
                name=f"parallax-data-{i}",
            )
            for i in range(n)
        ]
        for proc in self.procs:
            proc.start()

    def submit(self, worker: int, task_id: int, task: Task) -> None:
        self.tasks[worker].put((task_id, task))

    def get(self, poll_s: float = 1.0):
        """The next finished ``(task_id, samples, error)``; a dead worker is an error."""
        while True:
            try:
                return self.results.get(timeout=poll_s)
            except queue.Empty:
                dead = [(p.name, p.exitcode) for p in self.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"data worker(s) died: {dead} (name, exit code)") from None

    def close(self) -> None:
        for q in self.tasks:
            with contextlib.suppress(ValueError, OSError):
                q.put(None)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():  # stuck: SIGKILL, since workers ignore SIGTERM (see above)
                proc.kill()
                proc.join(timeout=5)
        for q in (*self.tasks, self.results):
            q.close()
            q.cancel_join_thread()


def auto_workers() -> int:
    """Decoding processes per rank when ``--workers`` is not given: the cores of this host
    shared among its ranks, one left to each rank itself, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(0, min(MAX_AUTO_WORKERS, cores // ranks - 1))
