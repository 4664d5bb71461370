"""The streaming safetensors writer: files safetensors reads, one tensor in memory at a time."""

import os
import weakref

import pytest
import torch
from safetensors import safe_open

from parallax.checkpoint import (
    CheckpointError,
    TensorSource,
    read_header,
    sources,
    write_safetensors,
)

TENSORS = {
    "w.f32": torch.randn(3, 5),
    "w.bf16": torch.randn(4, 2).to(torch.bfloat16),
    "w.f16": torch.randn(7).to(torch.float16),
    "step.i64": torch.tensor([1, -2, 2**40]),
    "img.u8": torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4),
    "mask.bool": torch.tensor([True, False, True]),
    "empty": torch.empty(0, 4),
    "scalar": torch.tensor(2.5, dtype=torch.float64),
}


def test_round_trip_through_safe_open(tmp_path):
    path = tmp_path / "x.safetensors"
    size = write_safetensors(path, sources(TENSORS), metadata={"step": 3})
    assert size == os.path.getsize(path)
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(TENSORS) and f.metadata() == {"step": "3"}
        for name, value in TENSORS.items():
            got = f.get_tensor(name)
            assert got.dtype == value.dtype and torch.equal(got, value), name
    header = read_header(path)
    assert header["w.bf16"]["dtype"] == "BF16" and header["empty"]["shape"] == [0, 4]


def test_tensors_are_produced_one_at_a_time(tmp_path):
    """Producers run in order, once each, after the file is opened (the header is known), and
    when one runs every earlier tensor has already been released: never two in memory."""
    path = tmp_path / "x.safetensors"
    seen, refs = [], []
    names = list(TENSORS)

    def producer(name):
        def make():
            assert path.exists() and all(r() is None for r in refs), name
            seen.append(name)
            tensor = TENSORS[name].clone()
            refs.append(weakref.ref(tensor))
            return tensor

        return make

    srcs = [TensorSource(n, tuple(t.shape), t.dtype, producer(n)) for n, t in TENSORS.items()]
    write_safetensors(path, srcs)
    assert seen == names
    with safe_open(str(path), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(n), TENSORS[n]) for n in names)
    # write=False sources are produced in their turn but not stored
    srcs[1] = TensorSource(names[1], (4, 2), torch.bfloat16, producer(names[1]), write=False)
    seen.clear()
    refs.clear()
    write_safetensors(path, srcs)
    assert seen == names and names[1] not in read_header(path)


def test_producer_mismatch_and_bad_names_raise(tmp_path):
    bad = TensorSource("w", (2, 2), torch.float32, lambda: torch.zeros(2, 3))
    with pytest.raises(CheckpointError, match=r"tensor 'w': producer returned \(2, 3\)"):
        write_safetensors(tmp_path / "a.safetensors", [bad])
    twice = sources({"w": torch.zeros(1)}) * 2
    with pytest.raises(CheckpointError, match="'w' appears twice"):
        write_safetensors(tmp_path / "b.safetensors", twice)
    with pytest.raises(CheckpointError, match="complex64 cannot be stored"):
        write_safetensors(
            tmp_path / "c.safetensors", sources({"z": torch.zeros(1, dtype=torch.complex64)})
        )


def test_truncated_and_corrupt_files_are_named(tmp_path):
    good = tmp_path / "good.safetensors"
    write_safetensors(good, sources(TENSORS))
    blob = good.read_bytes()
    cases = {
        "truncated": blob[:-3],
        "trailing bytes": blob + b"\0",
        "no header": blob[:5],
        "corrupt or truncated header": blob[:8] + blob[8:40],
        "corrupt header": blob[:8] + b"{" + b"x" * (len(blob) - 9),
    }
    for expected, data in cases.items():
        path = tmp_path / f"{expected.replace(' ', '_')}.safetensors"
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=expected) as err:
            read_header(path)
        assert path.name in str(err.value)
    with pytest.raises(CheckpointError, match="missing"):
        read_header(tmp_path / "nothing.safetensors")
