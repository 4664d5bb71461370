"""``--log-to tensorboard,wandb``: every metrics.jsonl and eval.jsonl value, read back from the
dashboards' own files (TensorBoard's event reader; W&B's offline run file, record by record)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from parallax.train.sinks import check, names, scalars
from tests.train.conftest import installed


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for name in ("metrics.jsonl", "eval.jsonl")
            for line in (out / name).read_text().splitlines()]  # fmt: skip
    assert any("eval_loss" in r for r in rows) and len(rows) == 6
    return rows


def _expected(out: Path) -> dict[str, dict[int, float]]:
    want: dict[str, dict[int, float]] = {}
    for row in _rows(out):
        for key, value in scalars(row).items():
            want.setdefault(key, {})[row["step"]] = value
    assert {"loss", "lr", "grad_norm", "action_accuracy", "eval_loss", "eval_l1"} <= set(want)
    return want


@pytest.mark.skipif(not installed("tensorboard"), reason="the tensorboard package is absent")
def test_tensorboard_gets_every_value(base):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(base / "tb"), size_guidance={"scalars": 0}).Reload()
    want = _expected(base)
    assert set(events.Tags()["scalars"]) == set(want)
    for key, by_step in want.items():
        got = {e.step: e.value for e in events.Scalars(key)}
        assert got == pytest.approx(by_step, rel=1e-6), key


def wandb_records(path: Path):
    """The records of a W&B run file (``run-ID.wandb``): a LevelDB-style log of 32 KiB blocks
    after a 7-byte header, each record split into chunks with 7-byte headers (checksum, length,
    kind: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", raw[:7]
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if kind == 0:
            break
        parts += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


@pytest.mark.skipif(not installed("wandb"), reason="the wandb package is absent")
def test_wandb_offline_run_has_every_value_a_name_and_the_config(base):
    (path,) = base.glob("wandb/offline-run-*/run-*.wandb")
    got: dict[str, dict[int, float]] = {}
    run = config = None
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config = {
                u.key or ".".join(u.nested_key): json.loads(u.value_json) for u in run.config.update
            }
        elif kind == "history":
            items = {
                i.key or ".".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            for key, value in items.items():
                if not key.startswith("_"):
                    got.setdefault(key, {})[items["_step"]] = value
    assert run is not None and run.display_name == "base"
    assert config["steps"] == 4 and config["lr"] == 1e-3 and config["model"] == "tiny"
    assert config["world_size"] == 1 and config["log_to"] == "tensorboard,wandb"
    want = _expected(base)
    assert set(got) == set(want)
    for key, by_step in want.items():
        assert got[key] == pytest.approx(by_step, rel=1e-6), key


def test_log_to_is_checked_before_any_work(monkeypatch):
    assert names(" TensorBoard,wandb,tensorboard") == ["tensorboard", "wandb"]
    with pytest.raises(ValueError, match="--log-to 'mlflow': use tensorboard, wandb or both"):
        check("mlflow")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "wandb" else real(n))
    with pytest.raises(ValueError, match=r"--log-to wandb needs the optional 'wandb' package"):
        check("wandb")
    assert scalars({"step": 3, "loss": 1.5, "mfu": None, "ok": True, "nan": float("nan")}) == {
        "loss": 1.5
    }
