"""The streaming loader: robot datasets read in place (never converted), in one order that
depends on the seed alone, decoded and augmented in worker processes, resumable exactly.

The global stream of sample positions ``0, 1, 2, ...`` is laid out by
:mod:`parallax.data.order` (which dataset, which episode, which step) from the seed only. Step
``s`` is positions ``[s G, (s + 1) G)`` for the global batch size ``G``; data-parallel rank
``r`` of ``dp`` takes the ``r``-th contiguous ``G / dp`` of them, cut into microbatches. So
the global batch is the same at every dp and every worker count, each rank decodes only its
own share, and memory stays bounded: the order is indices, and each worker keeps open only its
share of the episodes the current chunk mixes (``cache_episodes``, by default enough that no
episode is read twice while its chunk lasts; ``episodes_per_chunk`` trades mixing for
memory). The position saved by :meth:`StreamLoader.state_dict` is the number of positions
consumed (plus the mixture's running counts): ``load_state_dict`` continues with the very
next sample under any dp, micro-batch size or worker count. Every sample carries its global
``position`` (what keys its augmentation, and a family's own per-sample draws).

A family may give its own sample layout (``sampler``, a module-level function run in the
workers in place of :meth:`Source.sample`; its images are its own business: no resize, no
size check) and LeRobot's chunk rule (``pad_chunks``: every step of an episode is a sample,
the sampler flags the chunk's steps past the end) in place of OFT's (only the steps whose
chunk fits).

Workers run ``prefetch`` steps ahead; :attr:`StreamLoader.last_wait_s` is how long the last
:meth:`next_batch` waited for them (what a training loop logs as its data wait).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from parallax.data.augment import AugmentConfig
from parallax.data.chunks import chunk_lengths
from parallax.data.loader import DPBatches
from parallax.data.mixture import Mixture, common_image_size, sources_and_weights
from parallax.data.order import MixtureOrder, SourceOrder
from parallax.data.source import Source
from parallax.data.stats import DatasetError, merge_statistics
from parallax.data.workers import Decoder, Recipe, WorkerPool

STATE_VERSION = 1


class StreamLoader(DPBatches):
    """Yields, per step, this dp rank's share of the global batch as a list of microbatches
    (each a list of raw samples with torch tensors). See the module doc."""

    def __init__(
        self,
        data: Mixture | Source | Sequence[Source],
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        weights: Sequence[float] | None = None,
        shuffle: bool = True,
        images: str = "none",
        augment: AugmentConfig | None = None,
        image_size: int | tuple[int, int] | None = None,
        cameras: Sequence[str] = ("primary",),
        state: bool = False,
        chunk: int = 1,
        workers: int = 0,
        prefetch: int = 2,
        episodes_per_chunk: int = 64,
        block_size: int = 1024,
        cache_episodes: int | None = None,
        start_method: str = "forkserver",
        sampler: Callable[..., dict[str, Any]] | None = None,
        pad_chunks: bool = False,
    ) -> None:
        super().__init__(global_batch_size, micro_batch_size, dp_rank, dp_size)
        sources, weights = sources_and_weights(data, weights, 1 if pad_chunks else chunk)
        self.sources, self.chunk, self.pad_chunks = sources, int(chunk), pad_chunks
        self.statistics = merge_statistics(*(s.statistics for s in sources))
        size = None if sampler is not None else common_image_size(image_size, sources)
        self.seed, self.shuffle = seed, shuffle
        self.recipe = Recipe(
            seed=seed,
            mode=images,
            augment=augment or AugmentConfig(),
            image_size=size,
            cameras=tuple(cameras),
            state=state,
            chunk=int(chunk),
            cache_episodes=cache_episodes
            or self.default_cache(len(sources), episodes_per_chunk, workers),
            sampler=sampler,
        )
        self._order_args = dict(episodes_per_chunk=episodes_per_chunk, shuffle=shuffle)
        self.mixture = MixtureOrder(weights, seed=seed, block_size=block_size)
        self.weights = self.mixture.weights.tolist()
        self.orders = [self._source_order(s) for s in sources]
        self.position = 0  # global sample positions consumed
        self.workers, self.prefetch = int(workers), max(int(prefetch), 0)
        self.start_method = start_method
        self.last_wait_s = 0.0
        self._pool: WorkerPool | None = None
        self._decoder: Decoder | None = None
        self._planned: dict[int, dict[str, Any]] = {}  # step position -> plan
        self._task_step: dict[int, int] = {}
        self._next_task = 0

    @staticmethod
    def default_cache(datasets: int, episodes_per_chunk: int, workers: int) -> int:
        """Open episodes per worker: its share of every dataset's current chunk, and a
        quarter more for the chunk that follows, so no episode is read twice in a chunk."""
        return -(-datasets * episodes_per_chunk * 5 // (4 * max(workers, 1))) + 2

    def _source_order(self, source: Source) -> SourceOrder:
        """The order of the source's samples: every step, or with chunks (and no
        ``pad_chunks``) only the steps whose chunk fits in the episode
        (:func:`~parallax.data.chunks.chunk_lengths`)."""
        key = f"data.{source.name}"
        lengths = chunk_lengths(source.lengths, 1 if self.pad_chunks else self.chunk)
        return SourceOrder(lengths, seed=self.seed, key=key, **self._order_args)

    # --- planning -----------------------------------------------------------------------------
    def locate(self, q: int) -> tuple[int, int, int, int]:
        """Global position ``q`` -> ``(dataset, epoch, episode, step)``."""
        d, n = self.mixture.locate(q)
        return (d, *self.orders[d].locate(n))

    def _tasks(self, start: int) -> tuple[list[int], list[tuple[int, int, list]]]:
        """This rank's positions of the step at ``start`` and their tasks by episode."""
        local = self.local_batch_size
        first = start + self.dp_rank * local
        positions = list(range(first, first + local))
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for q in positions:
            d, _, episode, step = self.locate(q)
            groups.setdefault((d, episode), []).append((q, step))
        return positions, [(d, e, items) for (d, e), items in groups.items()]

    def _plan(self, start: int) -> None:
        if start in self._planned:
            return
        positions, tasks = self._tasks(start)
        plan = {"positions": positions, "samples": {}, "pending": set(), "tasks": tasks}
        if self.workers > 0:
            pool = self._ensure_pool()
            for task in tasks:
                task_id, self._next_task = self._next_task, self._next_task + 1
                pool.submit((task[0] * 1_000_003 + task[1]) % self.workers, task_id, task)
                plan["pending"].add(task_id)
                self._task_step[task_id] = start
        self._planned[start] = plan

    def _ensure_pool(self) -> WorkerPool:
        if self._pool is None:
            self._pool = WorkerPool(self.workers, self.sources, self.recipe, self.start_method)
        return self._pool

    def _collect(self, plan: dict[str, Any]) -> None:
        if self.workers == 0:
            if self._decoder is None:
                self._decoder = Decoder(self.sources, self.recipe)
            for task in plan["tasks"]:
                plan["samples"].update(self._decoder.run(task))
            return
        while plan["pending"]:
            task_id, samples, error = self._pool.get()
            step = self._task_step.pop(task_id, None)
            if error is not None:
                is_data, message = error
                raise (DatasetError if is_data else RuntimeError)(message)
            if step is None or step not in self._planned:
                continue  # from before a load_state_dict
            other = self._planned[step]
            other["pending"].discard(task_id)
            other["samples"].update(samples)

    # --- the step -----------------------------------------------------------------------------
    def next_batch(self) -> list[list[dict[str, Any]]]:
        """This rank's ``num_microbatches`` microbatches of ``micro_batch_size`` samples."""
        start, g = self.position, self.global_batch_size
        ahead = self.prefetch if self.workers > 0 else 0
        for k in range(ahead + 1):
            self._plan(start + k * g)
        plan = self._planned[start]
        began = time.perf_counter()
        self._collect(plan)
        self.last_wait_s = time.perf_counter() - began
        del self._planned[start]
        samples = [self._tensors(plan["samples"][q], q) for q in plan["positions"]]
        if self.recipe.sampler is None:
            self._check_shapes(samples)
        self.position += g
        m = self.micro_batch_size
        return [samples[k : k + m] for k in range(0, len(samples), m)]

    @staticmethod
    def _tensors(raw: dict[str, Any], position: int) -> dict[str, Any]:
        out = dict(raw, position=position)
        for key in ("image", "wrist_image", "action", "state", "actions"):
            if key in out:
                out[key] = torch.from_numpy(np.ascontiguousarray(out[key]))
        return out

    @staticmethod
    def _check_shapes(samples: list[dict[str, Any]]) -> None:
        shapes = {(s["dataset"], tuple(s["image"].shape)) for s in samples}
        if len({shape for _, shape in shapes}) > 1:
            raise DatasetError(
                f"images of different sizes in one batch {sorted(shapes)}: pass an image_size"
            )

    # --- position -----------------------------------------------------------------------------
    def progress(self) -> dict[str, dict[str, float]]:
        """Per dataset: samples drawn so far and the epochs they make."""
        state = self.mixture.state_at(self.position)
        counts = np.asarray(state["counts"], dtype=np.int64)
        block_start = state["block"] * self.mixture.block_size
        for q in range(block_start, self.position):
            counts[self.mixture.locate(q)[0]] += 1
        return {
            s.name: {"samples": int(c), "epochs": float(c) / s.num_transitions}
            for s, c in zip(self.sources, counts)
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position; identical on every rank."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "position": self.position,
            "mixture": self.mixture.state_at(self.position),
            "datasets": [
                {"name": s.name, "num_transitions": s.num_transitions, "weight": w}
                for s, w in zip(self.sources, self.weights)
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved position (its seed wins, so the order is the saved one)."""
        if state.get("version") != STATE_VERSION:
            raise DatasetError(f"not a streaming-loader state (version {state.get('version')})")
        saved = [(d["name"], int(d["num_transitions"])) for d in state["datasets"]]
        mine = [(s.name, s.num_transitions) for s in self.sources]
        weights = [float(d["weight"]) for d in state["datasets"]]
        if saved != mine or not np.allclose(weights, self.weights):
            raise DatasetError(
                f"the saved data position is for datasets {saved} (weights {weights}), these "
                f"are {mine} (weights {self.weights}): resume with the same data"
            )
        if int(state["seed"]) != self.seed:
            self.close()  # the workers' augmentation seed changes with it
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self._order_args["shuffle"] = self.shuffle
        self.recipe = dataclasses.replace(self.recipe, seed=self.seed)
        self.mixture = MixtureOrder(
            self.weights, seed=self.seed, block_size=self.mixture.block_size
        )
        self.mixture.load_state(state["mixture"])
        self.orders = [self._source_order(s) for s in self.sources]
        self.position = int(state["position"])
        self._planned.clear()
        self._task_step.clear()  # results still in flight are dropped when they arrive

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None
        self._planned.clear()
        self._task_step.clear()

    def __enter__(self) -> StreamLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
