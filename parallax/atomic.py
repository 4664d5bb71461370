"""Small helpers for writing files so that a crash never leaves a half-written file in place.

The pattern everywhere in parallax: write under a temporary name, ``fsync`` the data, rename it
into place (atomic on POSIX within one filesystem), then ``fsync`` the parent directory so the
rename itself survives a power loss. Readers only ever see a complete file or the old one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (new names, renames) to disk; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
            os.fsync(fd)
    finally:
        os.close(fd)


def as_created(path: str | os.PathLike) -> None:
    """Give ``path`` the mode ``open()`` would have (0666 less the umask: usually 0644). Some
    writers (safetensors' ``save_file``, ``tempfile.mkstemp``) create files 0600, readable by
    their owner alone, unlike every other file of a run or a dataset."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (setting it to
    read it back would race with threads creating files)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_sibling(path: str | os.PathLike, tag: str = "tmp") -> Path:
    """A unique name next to ``path`` (same directory, so a rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{tag}-{uuid.uuid4().hex[:8]}")


def write_problem(folder: str | os.PathLike) -> str | None:
    """Why no file can be made in ``folder``, in words, or ``None``. Tried, not read from the
    mode bits: root passes every permission check, yet a read-only mount or ``/proc`` refuses."""
    probe = Path(folder) / f".parallax-probe-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as err:
        return err.strerror or type(err).__name__
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def folder_problems(what: str, folder: str | os.PathLike) -> list[str]:
    """Why ``what`` (the flag and its value) cannot write files in ``folder``, made first where
    it is missing: the nearest folder that exists must take new files."""
    folder = Path(folder)
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        return [f"{what}: {existing} is a file, so no folder can be made below it"]
    why = write_problem(existing)
    return [f"{what}: cannot write in {existing} ({why})"] if why else []


def file_problems(what: str, path: str | os.PathLike) -> list[str]:
    """Why ``what`` (the flag, ``--out``) cannot write the file ``path`` (its missing folders
    made): checked before the work that makes it, so nothing is measured or drawn to be lost."""
    path = Path(path)
    if path.is_dir():
        return [f"{what} {path} is a directory: name a file in it (e.g. {path / 'NAME'})"]
    return folder_problems(f"{what} {path}", path.parent)


def write_file(path: str | os.PathLike, data: bytes) -> None:
    """:func:`atomic_write_bytes`, its missing folders made first (as :func:`file_problems`
    allowed)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync the directory."""
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Serialise first (so an unserialisable object fails before anything is touched), then
    write atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename a fully written (and fsynced) directory ``tmp`` to ``final``.

    An existing ``final`` is first moved aside and deleted only once the new one is in place,
    so at every instant one complete copy exists on disk.
    """
    tmp, final = Path(tmp), Path(final)
    old = None
    if final.exists():
        old = temp_sibling(final, "old")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
