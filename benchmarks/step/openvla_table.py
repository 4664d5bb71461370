"""The table of ``benchmarks.step.openvla``: its columns, one row and JSON record per
configuration, and the notes under it (ratios to the best native, gains over parallax
``base``, dp weak scaling, and whether every row started from the same first-step loss)."""

from __future__ import annotations

import math

from benchmarks.step.openvla_runs import NATIVE
from benchmarks.tools.common import append_results, print_table
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
    "loss 1",
    "loss 1 rel diff",
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
              merged.get("bubble_simulated", math.nan), merged.get("first_loss", math.nan),
              math.nan, merged.get("loss", math.nan),
              status if len(status) <= 60 else status[:57] + "..."]  # fmt: skip
    row = dict(zip(COLUMNS, values))
    record = {
        "benchmark": "openvla_step",
        "gpus": gpus,
        "framework": framework,
        "layout": layout.name,
        "global_batch": gb,
        "step_time_s": step,
        "tokens_per_s_per_gpu": tokens,
        "mfu": mfu,
        "peak_mem_gib": merged.get("peak", math.nan),
        "variant": variant,  # beyond the keys: which options ran
        "first_loss": merged.get("first_loss", math.nan),  # the same start in every row
        "micro_batch": merged.get("micro"),  # with the two below: the row's configuration
        "activation_checkpointing": bool(args.activation_checkpointing),
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
    forms = dict.fromkeys(r["variant"] for r in rows if r["framework"] in NATIVE)
    pairs += [(fw, "torch-single", v) for fw in ("torch-fsdp2", "torch-ddp-zero") for v in forms]
    for fw, one, variant in pairs:

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


def reference_row(rows: list[dict], batch: int) -> dict | None:
    """The row whose first-step loss the others of global batch ``batch`` are held to: parallax
    at 1gpu (its lead variant, the first run), else the first parallax row, else the first."""
    ok = [r for r in rows if r["batch"] == batch and math.isfinite(r["loss 1"])]
    for pick in (
        lambda r: r["framework"] == "parallax" and r["layout"] == "1gpu",
        lambda r: r["framework"] == "parallax",
        lambda r: True,
    ):
        found = [r for r in ok if pick(r)]
        if found:
            return found[0]
    return None


def check_first_losses(rows: list[dict], tolerance: float) -> str:
    """Fill ``loss 1 rel diff`` (|first-step loss - the reference's| / the reference's, over
    rows of the same global batch) and mark each row beyond ``tolerance`` in its status: every
    row builds the same layout-free weights and takes the same batch, so their first losses
    differ only by rounding. Returns the note that says so."""
    notes, off = [], []
    for batch in dict.fromkeys(r["batch"] for r in rows):
        ref = reference_row(rows, batch)
        if ref is None:
            continue
        name = f"{ref['layout']} {ref['framework']} {ref['variant']}".strip()
        notes.append(f"first-step loss of batch {batch}: {ref['loss 1']:.6g} ({name})")
        for r in rows:
            if r["batch"] != batch or not math.isfinite(r["loss 1"]):
                continue
            diff = abs(r["loss 1"] - ref["loss 1"]) / abs(ref["loss 1"])
            r["loss 1 rel diff"] = diff
            if not diff <= tolerance:  # NaN is off too
                r["status"] = f"{r['status']}; loss 1 off by {diff:.2g}"
                off.append(f"{r['layout']} {r['framework']} {r['variant']}".strip())
    if not notes:
        return ""
    verdict = (
        f"rows beyond {tolerance:.3g} relative: {', '.join(off)}"
        if off
        else f"every row within {tolerance:.3g} relative"
    )
    return "; ".join(notes) + f"; {verdict}"


def report(b, rows: list[dict]) -> None:
    """Print the table of a run (``b``: its ``openvla_step.Bench``) with its notes and, unless
    ``--no-write``, append it to RESULTS.md."""
    args = b.args
    same = check_first_losses(rows, args.loss_tolerance)
    notes = "; ".join(filter(None, [ratio_notes(rows), same]))
    precision = "fp32 (smoke)" if args.smoke else "bf16 compute, fp32 master + AdamW"
    single = f" ({args.single_batch} on one GPU)" if args.single_batch else ""
    title = (
        f"openvla_step: {args.model}, global batch {args.global_batch}{single}, sequence {b.seq} "
        f"(BOS + "
        f"{b.config.num_patches} patches + {args.text_tokens} text), loss on last "
        f"{args.labelled}, {precision}, {b.flops_step / 1e12:.4g} TFLOP per step "
        f"({b.flops_labelled / 1e12:.4g} with the lm_head on the labelled positions only)"
    )
    table = [[r[c] for c in COLUMNS] for r in rows]
    print_table(title, COLUMNS, table, width=260)
    if notes:
        print(notes)
    if not args.no_write:
        how = (
            "MFU = model FLOPs as each row runs them (parallax.families.openvla.flops: 6 x params "
            "x "
            "tokens per component plus attention; lm_head on the labelled positions for parallax "
            "opt, "
            f"on all for the others) / (step x GPUs x {PEAK_TFLOPS:g} TFLOP/s); natives "
            "'compile': each ViT block and decoder layer torch.compile'd, fused AdamW, FSDP2 "
            "one reduce-scatter per step, DTensor TP loss-parallel, pipelining bf16 stage "
            "activations; loss 1 = first step's loss (same weights and batch in every row), "
            "rel diff against the reference row of the same batch"
        )
        smoke = "CPU smoke run, sizes scaled down" if args.smoke else ""
        notes = "; ".join(filter(None, [smoke, how, notes]))
        append_results(title, COLUMNS, table, notes=notes, info=b.info)  # the start's commit
