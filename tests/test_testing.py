"""parallax.testing.assert_adam_close: what it lets through and what it stops."""

import pytest
import torch

from parallax.testing import assert_adam_close

LR = 3e-3


def test_one_element_moved_by_a_rounding_level_gradient_passes():
    want = torch.randn(4096)
    got = want.clone()
    got[7] += 0.01 * LR  # one element's update moved by 1 % of lr
    assert_adam_close(got, want, LR)


def test_many_elements_a_little_off_fail():
    want = torch.randn(4096)
    got = want.clone()
    got[:20] += 5e-5  # more than one in a thousand past 1e-5 (and 1e-5 of |want|)
    with pytest.raises(AssertionError, match="20 of 4096"):
        assert_adam_close(got, want, LR)


def test_one_element_off_by_the_order_of_lr_fails():
    want = torch.randn(4096)
    got = want.clone()
    got[7] += LR
    with pytest.raises(AssertionError, match="5 % of lr"):
        assert_adam_close(got, want, LR, msg="w")


def test_another_shape_fails():
    with pytest.raises(AssertionError, match="shape"):
        assert_adam_close(torch.zeros(4, 2), torch.zeros(8), LR)
