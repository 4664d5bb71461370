"""WebDataset-style tar shards of image-text pairs, read with the standard library's ``tarfile``.

The layout img2dataset writes: ``00000.tar``, ``00001.tar``... each holding, per sample, files
that share a key and differ in extension (``000000012.jpg``, ``000000012.txt``,
``000000012.json``; the key is the member path up to the first dot of its file name). A sample
needs one image (jpg, jpeg, png, webp, bmp or npy) and a ``txt`` caption; others are skipped
and counted. Each shard is indexed once from its headers (``tarfile`` seeks past the data), so
a rank then reads exactly the bytes of its own samples. Sidecar files img2dataset also writes
(``00000.parquet``, ``00000_stats.json``) are ignored.
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

from parallax.data.pairs import IMAGE_EXTENSIONS, PairSample, decode_image
from parallax.data.stats import DatasetError

log = logging.getLogger(__name__)


def _split(name: str) -> tuple[str, str]:
    """``dir/000012.seg.jpg`` -> (``dir/000012``, ``seg.jpg``): WebDataset's key rule."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), (ext.lower() if dot else "")


class _Shard:
    """The member index of one tar file: per sample its image and caption byte ranges."""

    def __init__(self, path: Path) -> None:
        self.path = path
        members: dict[str, dict[str, tuple[int, int]]] = OrderedDict()
        try:
            with tarfile.open(path, "r:") as tar:
                for m in tar:
                    if m.isfile():
                        key, ext = _split(m.name)
                        members.setdefault(key, {})[ext] = (m.offset_data, m.size)
        except (tarfile.TarError, OSError) as err:
            raise DatasetError(f"cannot read tar shard {path}: {err}") from err
        self.samples: list[tuple[str, str, dict[str, tuple[int, int]]]] = []
        skipped = 0
        for key, files in members.items():
            image = next((e for e in IMAGE_EXTENSIONS if e in files), None)
            if image is None or "txt" not in files:
                skipped += 1
                continue
            self.samples.append((key, image, files))
        self.skipped = skipped
        if skipped:
            log.warning("%s: skipped %d keys without both an image and a .txt", path, skipped)


class TarShards:
    """A pair source over tar shards: a directory of ``*.tar`` files or a list of paths.

    The member indices of the ``max_indexed`` shards used last stay in memory (a few hundred
    bytes per sample), so a pass over millions of pairs holds only a few windows' worth.
    """

    def __init__(self, shards: str | Path | list, max_open: int = 8, max_indexed: int = 64) -> None:
        if isinstance(shards, (str, Path)):
            root = Path(shards)
            paths = sorted(root.glob("*.tar")) if root.is_dir() else [root] * root.is_file()
            self.name = root.name
        else:
            paths = [Path(p) for p in shards]
            self.name = paths[0].parent.name if paths else "shards"
        missing = [str(p) for p in paths if not p.is_file()]
        if not paths or missing:
            what = f"missing shards: {missing[:4]}" if paths else f"no tar shards found at {shards}"
            raise DatasetError(what)
        self.paths = paths
        self._index: OrderedDict[int, _Shard] = OrderedDict()
        self.max_indexed = max_indexed
        self._files: OrderedDict = OrderedDict()
        self.max_open = max_open

    def num_shards(self) -> int:
        return len(self.paths)

    def shard(self, i: int) -> _Shard:
        shard = self._index.pop(i, None) or _Shard(self.paths[i])
        self._index[i] = shard  # most recently used last
        while len(self._index) > self.max_indexed:
            self._index.popitem(last=False)
        return shard

    def shard_length(self, shard: int) -> int:
        return len(self.shard(shard).samples)

    def _bytes(self, shard: int, span: tuple[int, int]) -> bytes:
        f = self._files.pop(shard, None) or self.paths[shard].open("rb")
        self._files[shard] = f
        while len(self._files) > self.max_open:
            self._files.popitem(last=False)[1].close()
        f.seek(span[0])
        return f.read(span[1])

    def read(self, shard: int, index: int) -> PairSample:
        key, image_ext, files = self.shard(shard).samples[index]
        what = f"{self.paths[shard].name}:{key}.{image_ext}"
        sample = {
            "image": decode_image(self._bytes(shard, files[image_ext]), image_ext, what),
            "caption": self._bytes(shard, files["txt"]).decode("utf-8").strip(),
            "key": key,
        }
        if "json" in files:
            try:
                sample["meta"] = json.loads(self._bytes(shard, files["json"]))
            except json.JSONDecodeError:
                sample["meta"] = None
        return sample

    def close(self) -> None:
        while self._files:
            self._files.popitem()[1].close()


def write_tar_shards(root: str | Path, pairs: list[PairSample], per_shard: int) -> list[Path]:
    """Write pairs as img2dataset-style shards (images as .npy): for tests and conversions."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(0, len(pairs), per_shard):
        path = root / f"{s // per_shard:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for i, p in enumerate(pairs[s : s + per_shard], start=s):
                key = p.get("key") or f"{i:09d}"
                buf = io.BytesIO()
                np.save(buf, np.asarray(p["image"], dtype=np.uint8))
                meta = json.dumps({"key": key}).encode()
                for ext, data in (
                    ("npy", buf.getvalue()),
                    ("txt", p["caption"].encode()),
                    ("json", meta),
                ):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths
