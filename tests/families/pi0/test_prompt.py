"""pi0's prompt tokenizer: a folder's file read through the shared FileTokenizer with Gemma's
ids (BOS 2 added here), found by ``find_tokenizer``; the built-in bytes otherwise."""

import pytest

pytest.importorskip("tokenizers", reason="the optional tokenizers extra is absent")

from parallax.families.pi0.prompt import ByteTokenizer, PaliGemmaTokenizer, find_tokenizer  # noqa: E402
from tests.families.openvla.test_tokenizer import _write_llama_like  # noqa: E402


def test_a_folders_tokenizer_is_found_and_adds_gemmas_bos(tmp_path):
    vocab = _write_llama_like(tmp_path)
    tok = find_tokenizer(None, tmp_path)
    assert isinstance(tok, PaliGemmaTokenizer) and (tok.bos_id, tok.pad_id) == (2, 0)
    words = ["pick", "up", "the", "red", "cube?"]
    assert tok.encode("pick up the red cube?") == [2, *(vocab["▁" + w] for w in words)]
    assert tok.encode("the robot", add_bos=False) == [vocab["▁the"], vocab["▁robot"]]
    assert isinstance(find_tokenizer(None, tmp_path / "absent"), ByteTokenizer)
