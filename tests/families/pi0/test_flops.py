"""The FLOP formula against torch's FLOP counter on the tiny models (one sample, forward):
every matmul and convolution of both streams, the tower and the heads. The counter does not
count CPU attention, so the formula's attention part is taken out (and checked by hand)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from parallax.families.pi0.flops import attention_flops, forward_flops
from parallax.families.pi0.objective import flow_terms
from tests.families.pi0.helpers import inputs, tiny_model


@pytest.mark.parametrize("variant", ["pi0", "pi05"])
def test_forward_flops_match_the_counter(variant):
    model = tiny_model(variant)
    c = model.config
    x = {k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in inputs(c).items()}
    terms = flow_terms(x["actions"], x["noise"], x["time"])
    prefix = [x[k] for k in ("images", "image_masks", "tokens", "token_mask", "state")]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.velocity(*prefix, terms.x_t, terms.time)
    matmuls = sum(forward_flops(c).values()) - attention_flops(c)
    assert counter.get_total_flops() == matmuls
    n_p, n_s, q = c.prefix_length, c.suffix_length, c.prefix.heads * c.prefix.head_dim
    v = c.vision
    by_hand = 2 * 2 * 4 * v.num_patches**2 * v.width + 4 * n_p * n_p * q
    assert attention_flops(c) == by_hand + 2 * 4 * n_s * (n_p + n_s) * q
