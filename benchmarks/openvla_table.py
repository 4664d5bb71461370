"""The table of ``benchmarks.openvla_step``: its columns, one row and JSON record per
configuration, and the notes under it (ratios to the best native, gains over parallax
``base``, dp weak scaling)."""

from __future__ import annotations

import math

from benchmarks.openvla_runs import NATIVE
from parallax.train.flops import PEAK_TFLOPS

COLUMNS = [
    "layout",
    "framework",
    "variant",
    "GPUs",
    "micro",
    "batch",
    "step s",
    "tokens/s/GPU",
    "samples/s",
    "TFLOP/s/GPU",
    "MFU",
    "peak GiB",
    "x best native",
    "bubble measured",
    "bubble simulated",
    "loss",
    "status",
]


def summarise(
    layout, framework, merged, args, flops_step, seq, variant=None, global_batch=None
) -> tuple[dict, dict]:
    """The table row and the JSON record of one configuration (``variant``: parallax's;
    ``global_batch``: its samples per step, default ``args.global_batch``)."""
    step, gpus = merged.get("step", math.nan), layout.gpus
    gb = global_batch or args.global_batch
    tokens = gb * seq / step / gpus if "step" in merged else math.nan
    tflops = flops_step / step / gpus / 1e12 if "step" in merged else math.nan
    mfu = tflops / PEAK_TFLOPS
    status = merged.get("error", "ok")
    values = [layout.name, framework, variant or "", gpus, merged.get("micro"), gb, step, tokens,
              gb / step, tflops,
              mfu, merged.get("peak", math.nan), math.nan, merged.get("bubble_measured", math.nan),
              merged.get("bubble_simulated", math.nan), merged.get("loss", math.nan),
              status if len(status) <= 60 else status[:57] + "..."]  # fmt: skip
    row = dict(zip(COLUMNS, values))
    record = {
        "gpus": gpus,
        "framework": framework,
        "layout": layout.name,
        "global_batch": gb,
        "step_time_s": step,
        "tokens_per_s_per_gpu": tokens,
        "mfu": mfu,
        "peak_mem_gib": merged.get("peak", math.nan),
        "variant": variant,  # beyond the keys: which parallax options ran
    }
    finite = {k: v for k, v in record.items() if not isinstance(v, float) or math.isfinite(v)}
    return row, {k: finite.get(k) for k in record}  # NaN (no measurement) -> null


def ratio_notes(rows: list[dict]) -> str:
    """Fill ``x best native`` (tokens/s per GPU over the best native row with as many GPUs) and
    say how parallax's best multi-GPU row compares, what each variant gains over ``base`` on
    the same layout, and how dp scales against 1gpu: weak scaling when the dp row's samples per
    GPU equal the one-GPU row's (``--single-batch``), strong scaling when the global batches
    are equal."""

    def tokens(r: dict) -> float:
        return r["tokens/s/GPU"] if math.isfinite(r["tokens/s/GPU"]) else 0.0

    best: dict[int, float] = {}
    for r in rows:
        if r["framework"] in NATIVE and tokens(r) > 0:
            best[r["GPUs"]] = max(best.get(r["GPUs"], 0.0), tokens(r))
    for r in rows:
        r["x best native"] = tokens(r) / best[r["GPUs"]] if best.get(r["GPUs"]) else math.nan
    notes = []
    ours = [r for r in rows if r["framework"] == "parallax" and tokens(r) > 0]
    multi = [r for r in ours if r["GPUs"] > 1]
    if multi:
        top = max(multi, key=tokens)
        if best.get(top["GPUs"]):
            notes.append(
                f"parallax's best {top['GPUs']}-GPU row ({top['layout']} {top['variant']}) at "
                f"{top['x best native']:.2f}x the best native"
            )
    base = {r["layout"]: tokens(r) for r in ours if r["variant"] == "base"}
    gains = [
        f"{r['layout']} {r['variant']} {tokens(r) / base[r['layout']]:.3f}x"
        for r in ours
        if r["variant"] != "base" and base.get(r["layout"])
    ]
    if gains:
        notes.append("tokens/s over parallax base: " + ", ".join(gains))
    pairs = [("parallax", "parallax", v) for v in dict.fromkeys(r["variant"] for r in ours)]
    for fw, one, variant in [*pairs, ("torch-ddp-zero", "torch-single", "")]:

        def of(framework: str, dp: bool, variant: str = variant) -> list[dict]:
            return [
                r
                for r in rows
                if r["framework"] == framework
                and r["variant"] == variant
                and tokens(r) > 0
                and (r["layout"].startswith("dp") if dp else r["layout"] == "1gpu")
            ]

        dp, single = of(fw, True), of(one, False)
        if dp and single:
            d, s = dp[0], single[0]
            if d["batch"] == s["batch"] * d["GPUs"]:
                kind = f"weak scaling, {s['batch']} samples per GPU"
            elif d["batch"] == s["batch"]:
                kind = f"strong scaling, global batch {s['batch']}"
            else:
                kind = f"scaling, global batch {d['batch']} vs {s['batch']}"
            name = f"{fw} {variant}".strip()
            notes.append(
                f"{name} dp {kind} (tokens/s per GPU vs 1gpu): {tokens(d) / tokens(s):.1%}"
            )
    return "; ".join(notes)
