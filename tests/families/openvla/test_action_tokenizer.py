"""Action tokenizer, normalisation, tiny tokenizer and prompt layout vs hand-computed values."""

import numpy as np
import pytest
import torch

from parallax.families.openvla.action_tokenizer import (
    ActionTokenizer,
    normalize_actions,
    unnormalize_actions,
)
from parallax.families.openvla.prompt import TinyTokenizer, prompt_ids, training_example

C = 1 / 255  # half a bin: the bins are 2/255 wide on [-1, 1]


def test_encode_edges_gripper_and_clipping_llama_vocab():
    tok = ActionTokenizer(32000)
    assert tok.action_token_begin_idx == 31743
    # -1 is the first edge (bin 1), +1 the last (bin 256); 0 falls in bin 128
    assert tok.encode([-1.0, 1.0, 0.0]).tolist() == [31999, 31744, 31872]
    # the gripper is not normalised: closed 0 and open 1 tokenize as they are
    assert tok.encode([0.0, 1.0]).tolist() == [31872, 31744]
    # out of range values clip to the end bins
    assert tok.encode([-7.0, 1.5, np.inf]).tolist() == [31999, 31744, 31744]
    # just below / above a bin edge: edges are -1 + 2k/255
    edge = tok.bins[200]
    assert abs(edge - (-1 + 2 * 200 / 255)) < 1e-12
    assert tok.encode([edge - 1e-9, edge]).tolist() == [32000 - 200, 32000 - 201]


def test_decode_bin_centres_llama_vocab():
    tok = ActionTokenizer(32000)
    got = tok.decode([31744, 31745, 31999, 31872, 31873, 5])
    # ids 31744 and 31745 both map to the last centre; a non-action id clips to an end bin
    want = [1 - C, 1 - C, -1 + C, 0.0, -2 * C, 1 - C]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    ids = torch.tensor([31744, 31999, 31872])
    np.testing.assert_allclose(tok.decode_torch(ids).numpy(), [1 - C, -1 + C, 0.0], atol=1e-7)
    assert tok.is_action(torch.tensor([31743, 31744, 2])).tolist() == [False, True, False]


def test_tiny_vocab_uses_the_same_scheme():
    tok = ActionTokenizer(512)
    assert tok.encode([-1.0, 1.0, 0.0, 1.0]).tolist() == [511, 256, 384, 256]
    assert tok.action_token_begin_idx == 255
    np.testing.assert_allclose(tok.decode([256, 511, 384]), [1 - C, -1 + C, 0.0], atol=1e-12)
    # round trip lands on the bin centre, within half a bin
    a = np.linspace(-0.99, 0.99, 50)
    assert np.abs(tok.decode(tok.encode(a)) - a).max() <= C + 1e-12


STATS = {
    "q01": [-2.0, 0.0, 1.0],
    "q99": [2.0, 4.0, 1.0],
    "min": [-3.0, -1.0, 1.0],
    "max": [3.0, 5.0, 1.0],
    "mask": [True, True, False],
}


def test_normalize_with_bounds_mask_and_constant_dims():
    a = normalize_actions([[0.0, 4.0, 1.0], [5.0, -3.0, 1.0], [-2.0, 1.0, 7.0]], STATS)
    # dim 0: 2 (a + 2) / 4 - 1; dim 1 clipped; dim 2 unmasked but constant (min == max) -> 0
    np.testing.assert_allclose(a, [[0.0, 1.0, 0.0], [1.0, -1.0, 0.0], [-1.0, -0.5, 0.0]], atol=1e-7)
    # without min/max the unmasked gripper passes through
    b = normalize_actions([0.5, 2.0, 1.0], {k: STATS[k] for k in ("q01", "q99", "mask")})
    np.testing.assert_allclose(b, [0.25, 0.0, 1.0], atol=1e-7)


def test_unnormalize_inverts_masked_dims_only():
    a = unnormalize_actions([[-1.0, 1.0, 0.7], [0.0, 0.5, 1.0]], STATS)
    np.testing.assert_allclose(a, [[-2.0, 4.0, 0.7], [0.0, 3.0, 1.0]])
    np.testing.assert_allclose(
        unnormalize_actions([1.0, -1.0], {"q01": [0, 1], "q99": [2, 3]}), [2, 1]
    )
    with pytest.raises(ValueError, match="3 q01"):
        unnormalize_actions([1.0, 2.0], STATS)


def test_tiny_tokenizer_prompt_and_labels():
    tok = TinyTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.action_space_id) == (
        512,
        1,
        2,
        512,
        3,
    )
    ids = prompt_ids(tok, "go")
    text = "In: What action should the robot take to go?\nOut:"
    assert ids == [1] + [ord(c) for c in text] + [3]
    assert tok.decode(ids) == text + " "
    act = ActionTokenizer(512)
    x, y = training_example(tok, act, "Go", [-1.0, 0.0, 1.0])
    assert x == [1] + [ord(c) for c in text] + [3, 511, 384, 256, 2]  # instruction lower-cased
    assert y == [-100] * (len(x) - 4) + [511, 384, 256, 2]  # the actions and EOS only
    assert all(i < 256 for i in tok.encode("any printable text\n~"))
