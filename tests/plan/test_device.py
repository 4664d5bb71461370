"""The planner plans for the card it runs on: on a GPU (here a CPU pretending, through the
injected ``detect``, to be "an NVIDIA H200") ``python -m parallax.plan`` and ``--layout auto``
take the device's own profile (calibrated and cached, else shipped for its CUDA name) with the
cap as its memory, and say which and why; a card the user names (``--machine``) stays theirs;
without a GPU the explicit names plan as before."""

from __future__ import annotations

import io
import logging

import pytest
from rich.console import Console

from parallax.plan import auto, calibrate, cli
from parallax.plan.device import Device, cache_path, device_profile, shipped_for
from parallax.plan.machine import H200, RTX4090, load, save
from parallax.plan.search import search
from parallax.plan.workload import Workload
from parallax.recipe import resolve
from parallax.recipe.flags import parse_args

RUN = ["--model", "openvla-7b", "--global-batch-size", "256", "--compile", "--precision", "bf16"]


def h200(index: int = 0) -> Device:
    return Device("NVIDIA H200", 139.8)


def no_gpu(index: int = 0) -> None:
    return None


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Every test's own profile cache (none cached unless the test writes one)."""
    monkeypatch.delenv("PARALLAX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.parametrize(
    "name, shipped",
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA GeForce RTX 5090", "rtx5090"),
        ("NVIDIA A100-SXM4-80GB", None),
    ],
)
def test_a_device_is_matched_to_its_shipped_profile_by_its_cuda_name(name, shipped):
    assert shipped_for(name) == shipped


def test_the_profile_is_the_cached_one_else_the_shipped_one_else_the_nearest(tmp_path):
    shipped = device_profile(h200())
    assert shipped.machine == H200 and "matched by its CUDA name 'NVIDIA H200'" in shipped.why
    assert str(cache_path("NVIDIA H200")) in shipped.why  # where calibrate would cache it
    other = device_profile(Device("NVIDIA A100-SXM4-80GB", 79.2))
    assert other.machine.gpu_memory_gib == 79.2 and "no shipped or cached profile" in other.why
    measured = H200.with_(name="measured (GPU NVIDIA H200)", gemm_tflops=612.0, measured=True)
    save(measured, cache_path("NVIDIA H200"))
    cached = device_profile(h200())
    assert cached.machine.gemm_tflops == 612.0 and "measured on this NVIDIA H200" in cached.why
    assert cache_path("NVIDIA H200").parent == tmp_path / "cache" / "parallax" / "machines"


def _plan(argv: list[str], detect) -> tuple[object, str]:
    out = io.StringIO()
    result, _ = cli.plan([*argv, "--host-memory", "125"], Console(file=out, width=400), detect)
    return result, " ".join(out.getvalue().split())


def _h200_first(cap: float) -> float:
    """The first choice's step on the H200's own profile, capped as a run caps it."""
    model = Workload(resolve(parse_args(RUN)))
    machine = H200.with_(gpus_per_node=1, gpu_memory_gib=cap, cuda_context_gib=0.0)
    return search(model, machine, 1, top=1).ranked[0].time.seconds


@pytest.mark.parametrize("cap", [24, 32])
def test_the_planner_under_a_cap_on_an_h200_plans_with_the_h200s_profile(cap):
    result, said = _plan(["--gpus", "1", "--top", "1", *RUN, "--gpu-memory-limit", str(cap)], h200)
    assert "profile h200-node (default)" in said and f"{cap} GiB a GPU" in said, said
    assert "matched by its CUDA name 'NVIDIA H200'" in said
    assert f"--gpu-memory-limit {cap} GiB as its memory" in said
    assert result.ranked[0].time.seconds == pytest.approx(_h200_first(cap))


def test_layout_auto_under_a_cap_on_an_h200_says_it_plans_with_the_h200s_profile(caplog):
    run = resolve(parse_args(["--layout", "auto", *RUN, "--host-memory", "125"]))
    times = {}
    for cap in (24, 32):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="parallax.train"):
            auto.choose(run.replace(gpu_memory_limit=float(cap)), h200)
        said = caplog.text
        assert "planning with the profile h200-node (default)" in said, said
        assert f"--gpu-memory-limit {cap} GiB as its memory" in said
        times[cap] = float(said.split(" s a step")[0].rsplit(" ", 1)[1])
    assert times[32] <= times[24]
    assert times[24] == pytest.approx(_h200_first(24), abs=1e-3)


def test_a_card_the_user_names_stays_theirs_on_any_gpu():
    result, said = _plan(["--gpus", "1", "--top", "1", *RUN, "--machine", "rtx4090"], h200)
    assert "profile rtx4090 (default)" in said and "--machine rtx4090 (a shipped profile" in said
    assert "23.6 GiB a GPU" in said
    run = resolve(parse_args(["--layout", "auto", *RUN, "--machine", "rtx4090"]))
    machine, why = auto.machine_of(run.replace(gpu_memory_limit=24.0), 1, 1, h200)
    assert machine.name == RTX4090.name and machine.gpu_memory_gib == 24.0, why


def test_without_a_gpu_the_names_given_plan_as_before():
    _, said = _plan(["--gpus", "1", "--top", "1", *RUN, "--gpu-memory", "24"], no_gpu)
    assert "profile rtx4090 (default)" in said and "no GPU here" in said
    run = resolve(parse_args(["--layout", "auto", *RUN]))
    with pytest.raises(ValueError, match="without GPUs needs --gpu-memory GIB .or --machine"):
        auto.machine_of(run, 1, 1, no_gpu)


def test_calibrate_on_a_gpu_caches_the_profile_the_planner_then_takes(tmp_path):
    assert calibrate.main(["--precision", "fp32"], h200) == 0  # no --out: the cache only
    cached = load(cache_path("NVIDIA H200"))
    assert cached.measured
    _, said = _plan(["--gpus", "1", "--top", "1", "--gpu-memory-limit", "4"], h200)
    assert "measured on this NVIDIA H200 by python -m parallax.plan calibrate" in said, said
    assert "4 GiB a GPU" in said
    assert calibrate.main(["--precision", "fp32"], no_gpu) == 2  # no GPU: --out is needed


def test_a_broken_cache_is_named_with_how_to_mend_it():
    path = cache_path("NVIDIA H200")
    path.parent.mkdir(parents=True)
    path.write_text("{}")
    with pytest.raises(ValueError, match="the cached profile of this GPU, .*nvidia-h200.json"):
        device_profile(h200())
