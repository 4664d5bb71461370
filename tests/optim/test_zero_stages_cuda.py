"""ZeRO-2, ZeRO-3 and the offloaded optimizer on a GPU: side streams, storage that comes and
goes, pinned copies to the host and a worker thread. Two gloo ranks share the one GPU (as in
test_zero_cuda.py). Skipped without a GPU (CI has none); run on a GPU machine with
``python3 -m pytest -q tests/optim/test_zero_stages_cuda.py``.
"""

from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from parallax.optim.zero.offload import accumulators as accumulate
from parallax.testing import context, run_ranks
from tests.optim.test_zero_stages import TOL, _reference, _zero

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

# (optimizer, stage, accumulation, clip, sequence parallel, tower on every row, offloaded share
# [, share of that summed on the GPU, modes: "defer" the host's step under the next forward,
# "one-pass" its AdamW compiled for the CPU, in place of the sums and into staging])
CASES = [
    ("adamw-fused", 2, 2, 0.5, False, False, 0.0),
    ("adamw-fused", 3, 2, 0.5, False, True, 0.0),
    ("adamw", 2, 2, 0.5, False, False, 1.0),
    ("adamw", 3, 2, None, False, True, 1.0),  # offloaded, stepped during the backward
    ("adamw-fused", 3, 2, 0.5, False, True, 0.5),  # half offloaded
    ("adamw", 2, 3, 0.5, False, False, 1.0, 0.6),  # some sums on the GPU, brought down once
    ("adamw", 3, 3, 0.5, False, True, 1.0, 0.6, "defer"),  # ... and the step under the forward
    ("adamw", 2, 3, 0.5, False, False, 1.0, 0.6, "one-pass"),
    ("adamw", 3, 3, 0.5, False, True, 1.0, 0.6, "defer one-pass"),
    # half offloaded, every sum on the GPU (the uncapped OpenVLA-7B layout: its first upload
    # found no staging ring for its dtype)
    ("adamw", 2, 3, 0.5, False, False, 0.5, 1.0, "one-pass"),
    ("adamw", 3, 3, 0.5, False, True, 0.5, 1.0, "defer one-pass"),
]


def _on_gpu() -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    accumulate.IN_FLIGHT = 1  # every add waits for the one before: the bound's path, every time
    ctx = replace(context(), device=torch.device("cuda", 0))
    out = []
    for case in CASES:
        got = _zero(ctx, *case)
        got["weights"] = {n: w.cpu() for n, w in got["weights"].items()}
        out.append(got)
    return out


def test_stages_and_offload_on_one_gpu():
    results = run_ranks(_on_gpu, 2, timeout=300)
    for k, (name, stage, accum, clip, _, always, offload, *_more) in enumerate(CASES):
        ref_weights, ref_norms = _reference(name, accum, clip, always)
        case = f"{name} stage={stage} offload={offload}"
        for rank in results:
            got = rank[k]
            assert_close(torch.tensor(got["norms"]), torch.tensor(ref_norms), **TOL, msg=case)
            for n, want in ref_weights.items():
                assert_close(got["weights"][n], want, **TOL, msg=f"{case}: {n}")
            assert got["grads_left"] == 0 and got["late"] == 0, case
