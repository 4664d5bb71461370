"""Checkpoints written by an earlier parallax still resume.

``tests/fixtures/main_fa5a4ca/`` holds one tiny run of each family, made by commit fa5a4ca
(before the families moved into ``parallax/families/``): a 4-step run with a checkpoint at
step 2 (weights, AdamW state, data position, lr schedule, RNG) and that run's own
``metrics.jsonl`` for all four steps. Resuming from step 2 with today's code must give steps 3
and 4 as that run logged them: same weights, same optimizer state, same data order. Made with::

    python -m parallax.train --steps 4 --save-interval 2 --global-batch-size 4 \
        --micro-batch-size 2 --out openvla-tiny
    python -m parallax.train --model llava-tiny (the same flags) --out llava-tiny
    python -m parallax.train --model siglip-tiny --steps 4 --save-interval 2 \
        --global-batch-size 8 --micro-batch-size 4 --out siglip-tiny

then the step-4 checkpoint removed. One process, float32: the numbers agree to rounding (1e-5
relative; bitwise on the torch that wrote them).
"""

import json
import tarfile
from pathlib import Path

import pytest

from parallax.train import main

FIXTURES = Path(__file__).parents[1] / "fixtures" / "main_fa5a4ca"
# Python >= 3.10.12 and 3.11.4 check the members (no links out, no absolute paths)
SAFE = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
SMALL = ["--global-batch-size", "4", "--micro-batch-size", "2"]
FLAGS = {
    "openvla-tiny": SMALL,
    "llava-tiny": ["--model", "llava-tiny", *SMALL],
    "siglip-tiny": [
        "--model",
        "siglip-tiny",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "4",
    ],
}


def _metrics(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_a_checkpoint_of_an_earlier_main_resumes_where_it_left_off(name, tmp_path, monkeypatch):
    with tarfile.open(FIXTURES / f"{name}.tar.xz") as tar:
        tar.extractall(tmp_path, **SAFE)
    out = tmp_path / name
    logged = _metrics(out / "metrics.jsonl")
    monkeypatch.chdir(tmp_path)
    args = [*FLAGS[name], "--steps", "4", "--save-interval", "2", "--out", name, "--resume"]
    assert main(args) == 0
    resumed = _metrics(out / "metrics.jsonl")
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("loss", "grad_norm", "lr"):
            assert resumed[step][key] == pytest.approx(logged[step][key], rel=1e-5), (step, key)
