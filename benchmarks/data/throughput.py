"""How many samples a second does the streaming loader deliver from real robot-data formats?

Read + decode + OpenVLA's augmentation + the training batch (OpenVLA-7B's: tokenised prompt
and action, both towers' normalised pixels; ``--collate plain`` stacks only), for 224x224
RLDS (JPEG frames in TFRecord shards) and LeRobot v3.0 (MP4 video, encoded as LeRobot does:
yuv420p, crf 30, a keyframe every 2 frames; AV1 when PyAV has an AV1 encoder, as LeRobot's
default, else H.264), both generated on the fly, by worker count. One H200 trains
full-fine-tuned OpenVLA-7B at about 36 samples/s, so the loader should deliver >= 1.5x that
(54/s) with the default worker count (what ``parallax.train`` picks on this host for one
rank when ``--workers`` is left out; marked in the table).

    python -m benchmarks.data.throughput --write            # workers 0, 1, 2, 4, ... <= cores
    python -m benchmarks.data.throughput --workers 0 2 8 16
    python -m benchmarks.data.throughput --formats lerobot --workers 8 16
    python -m benchmarks.data.throughput --smoke            # CPU test: tiny, prints only

Only ``--write`` (never with ``--smoke``) appends to RESULTS.md / results.jsonl.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.data.lerobot_writer import write_lerobot
from benchmarks.data.writers import make_episodes, write_rlds
from benchmarks.tools.common import append_results, env_info, print_table
from parallax.data import collate
from parallax.data.mixture import open_source
from parallax.data.stream import StreamLoader
from parallax.data.workers import auto_workers

FORMATS = ("rlds", "lerobot")
H200_FULL_FT = 36.0  # samples/s of full fine-tuning on one H200 (the yardstick)


def _episodes(n: int, length: int, size: int, seed: int):
    """Smooth colour fields plus sensor-like noise: JPEG / video sizes near real frames."""
    episodes = make_episodes(n, size=size, seed=seed, lengths=[length] * n)
    rng = np.random.default_rng(seed)
    for ep in episodes:
        for name in ("images", "wrist"):
            frames = getattr(ep, name).astype(np.int16)
            noise = rng.normal(0, 6, frames.shape).astype(np.int16)
            setattr(ep, name, np.clip(frames + noise, 0, 255).astype(np.uint8))
    return episodes


def _codec() -> str:
    import av

    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1: errors only
    return "libsvtav1" if "libsvtav1" in av.codecs_available else "libx264"


def generate(
    root: Path, episodes: int, length: int, size: int, formats=FORMATS
) -> dict[str, tuple[Path, str]]:
    out = {}
    if "rlds" in formats:
        eps = _episodes(episodes, length, size, 0)
        out["rlds (jpeg)"] = (write_rlds(root, "bench_rlds", eps, "jpeg", shards=4), "jpeg")
    if "lerobot" in formats:
        codec = _codec()
        lerobot = write_lerobot(
            root / "bench_lerobot",
            _episodes(episodes, length, size, 1),
            version="v3.0",
            fps=10,
            per_file=max(episodes // 4, 1),
            codec=codec,
            lossy=True,
        )
        out["lerobot v3.0 (mp4)"] = (lerobot, codec)
    return out


def openvla_collate(source):
    """What the trainer's main process does to each microbatch (OpenVLA-7B's BatchBuilder,
    with the built-in tokenizer: the prompt's cost, not a checkpoint's vocabulary)."""
    from parallax.families.openvla.batches import BatchBuilder
    from parallax.families.openvla.config import OpenVLAConfig
    from parallax.families.openvla.prompt import TinyTokenizer

    return BatchBuilder(OpenVLAConfig.preset("openvla-7b"), source.statistics, TinyTokenizer())


def measure(
    source, workers: int, batch: int, steps: int, size: int, build=collate
) -> dict[str, float]:
    loader = StreamLoader(
        source,
        global_batch_size=batch,
        micro_batch_size=max(batch // 4, 1),
        images="train",
        image_size=size,
        workers=workers,
        prefetch=4,
        seed=0,
    )
    try:
        for _ in range(2):  # warm-up: worker start, first episodes opened
            [build(mb) for mb in loader.next_batch()]
        waited, began = 0.0, time.perf_counter()
        for _ in range(steps):
            [build(mb) for mb in loader.next_batch()]
            waited += loader.last_wait_s
        seconds = time.perf_counter() - began
    finally:
        loader.close()
    rate = steps * batch / seconds
    return {"samples_per_s": rate, "wait_ms_per_step": 1e3 * waited / steps}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=None)
    parser.add_argument(
        "--formats", default=",".join(FORMATS), help="comma list of: " + ", ".join(FORMATS)
    )
    parser.add_argument("--batch", type=int, default=32, help="global batch (one rank)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--episodes", type=int, default=24)
    parser.add_argument("--length", type=int, default=40, help="steps per episode")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument(
        "--collate", choices=("openvla", "plain"), default="openvla", help="the batch built"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run; writes no results")
    parser.add_argument("--write", action="store_true", help="append to RESULTS.md")
    parser.add_argument(
        "--keep",
        metavar="DIR",
        help="generate the datasets into DIR and keep them (for a training run on them: "
        "--data rlds:DIR/bench_rlds or DIR/bench_lerobot)",
    )
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    if not formats or any(f not in FORMATS for f in formats):
        parser.error(f"--formats {args.formats}: choose from {', '.join(FORMATS)}")
    if args.smoke:
        args.batch, args.steps, args.episodes, args.length, args.size = 4, 2, 4, 4, 32
        args.workers = args.workers or [0, 1]
    cores = os.cpu_count() or 1
    default = auto_workers()
    workers = args.workers or sorted({0, default} | {w for w in (1, 2, 4, 8, 16, 32) if w <= cores})
    info = env_info()
    rows: list[list] = []
    records: list[dict] = []
    generated = float("nan")
    # A time limit's SIGTERM ends the run through the finally below: the rows measured so far
    # are still printed and written, marked as cut short.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    complete = False
    try:
        with tempfile.TemporaryDirectory() as tmp:
            began = time.perf_counter()
            root = Path(args.keep or tmp)
            datasets = generate(root, args.episodes, args.length, args.size, formats)
            generated = time.perf_counter() - began
            print(f"datasets generated in {generated:.1f}s", flush=True)  # progress, flushed
            for label, (path, codec) in datasets.items():
                _measure_format(args, label, path, codec, workers, default, rows, records)
        complete = True
    finally:
        _report(args, cores, rows, records, info, generated, complete)
    return records


def _measure_format(args, label, path, codec, workers, default, rows, records) -> None:
    """One dataset at each worker count: a row and a record each, printed as measured."""
    began = time.perf_counter()
    source = open_source(str(path))
    scan = time.perf_counter() - began
    build = openvla_collate(source) if args.collate == "openvla" else collate
    for w in workers:
        result = measure(source, w, args.batch, args.steps, args.size, build)
        rate = result["samples_per_s"]
        shown = f"{w} (default)" if w == default else str(w)
        row = [label, codec, shown, rate, rate / H200_FULL_FT, result["wait_ms_per_step"]]
        rows.append(row + [scan])
        print(f"{label} ({codec}), workers {w}: {rate:.1f} samples/s", flush=True)
        records.append(
            {
                "benchmark": "data_throughput",
                "format": label,
                "codec": codec,
                "workers": w,
                "default_workers": w == default,
                "collate": args.collate,
                "batch": args.batch,
                "image_size": args.size,
                "samples_per_s": rate,
                "x_h200_full_ft": rate / H200_FULL_FT,
                "wait_ms_per_step": result["wait_ms_per_step"],
                "scan_s": scan,
            }
        )


def _report(args, cores, rows, records, info, generated, complete) -> None:
    """The table of the rows measured (all, or those before a time limit cut the run)."""
    if not rows:
        return
    columns = [
        "format",
        "codec",
        "workers",
        "samples/s",
        "x H200 full FT",
        "wait ms/step",
        "scan s",
    ]
    title = (
        f"Loader throughput: read+decode+augment+{args.collate} batch, {args.size}px, batch "
        f"{args.batch}, {cores} cores"
    )
    print_table(title, columns, rows)
    print(f"(datasets generated in {generated:.1f}s; H200 full fine-tuning ~{H200_FULL_FT}/s)")
    if args.write and not args.smoke:
        notes = (
            f"{args.episodes} episodes x {args.length} steps per format; OpenVLA's train "
            "augmentation; 'x H200 full FT' = samples/s / 36"
        )
        if not complete:
            notes += f"; cut short after {len(rows)} rows (time limit or error)"
        append_results(title, columns, rows, notes=notes, records=records, info=info)


if __name__ == "__main__":
    main()
