"""Frames of a video file at given timestamps, decoded with PyAV (FFmpeg).

LeRobot stores each camera as an MP4 (H.264, or AV1 by default since its v3.0 format) and names
a frame by its timestamp in seconds. A request is served by seeking to the keyframe before it
and decoding forward to the frame whose presentation time is nearest; requests that move
forward a little (the next steps of the same episode) continue decoding without a new seek.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from parallax.data.extras import require
from parallax.data.stats import DatasetError

RESEEK_AFTER_S = 1.0  # a forward jump longer than this seeks instead of decoding through


class VideoReader:
    """One open video file's first video stream."""

    def __init__(self, path: str | Path) -> None:
        av = require("av", "lerobot", "decoding LeRobot videos")
        self.path = Path(path)
        if not self.path.is_file():
            raise DatasetError(f"video {self.path} does not exist")
        try:
            self.container = av.open(str(self.path))
            self.stream = self.container.streams.video[0]
        except (av.error.FFmpegError, IndexError) as err:
            raise DatasetError(f"{self.path}: not a readable video ({err})") from None
        self.time_base = float(self.stream.time_base)
        self._frames = None  # the decoding iterator after the last seek
        self._last: tuple[float, np.ndarray] | None = None  # last frame decoded

    def _seek(self, timestamp: float) -> None:
        target = max(int(timestamp / self.time_base), 0)
        self.container.seek(target, stream=self.stream, backward=True, any_frame=False)
        self._frames = self.container.decode(self.stream)
        self._last = None

    def frame_at(self, timestamp: float, tolerance: float) -> np.ndarray:
        """The frame nearest ``timestamp`` (seconds) as (H, W, 3) uint8 RGB; an error if the
        nearest one is further than ``tolerance`` from it."""
        last = self._last
        if (
            self._frames is None
            or last is None
            or not (last[0] - tolerance <= timestamp <= last[0] + RESEEK_AFTER_S)
        ):
            self._seek(timestamp)
        best = self._last
        try:
            while best is None or best[0] < timestamp - tolerance:
                frame = next(self._frames)
                if frame.pts is None:
                    continue
                current = (float(frame.pts * self.time_base), frame.to_ndarray(format="rgb24"))
                if best is not None and abs(current[0] - timestamp) > abs(best[0] - timestamp):
                    self._frames = None  # moving away again: seek next time
                    break
                best = current
                self._last = current
        except StopIteration:
            pass
        except Exception as err:  # FFmpeg decode errors
            raise DatasetError(
                f"{self.path}: frame at {timestamp:.4f}s does not decode ({err})"
            ) from None
        if best is None or abs(best[0] - timestamp) > tolerance:
            got = "nothing" if best is None else f"the nearest frame at {best[0]:.4f}s"
            raise DatasetError(
                f"{self.path}: no frame within {tolerance:.4f}s of {timestamp:.4f}s ({got})"
            )
        return best[1]

    def close(self) -> None:
        self.container.close()
