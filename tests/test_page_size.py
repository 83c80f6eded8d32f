"""The KV cache page size follows the model unless given: 16 tokens rounded up to a multiple of the QSA block
(indexer_compress_ratio), since a block never straddles a page; a given size that cannot hold whole blocks is an
error naming page_size."""

import pytest

from qwen4exp import LLM, SamplingParams
from qwen4exp.config import ConfigError
from qwen4exp.weights.random_checkpoint import make_random


@pytest.fixture(scope="module")
def blocks_of_3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("c3"))
    make_random(path, "tiny", dtype="float32", overrides=dict(indexer_compress_ratio=3, indexer_budget=9))
    return path


def test_default_page_size_follows_the_model(blocks_of_3):
    """A checkpoint whose QSA block (3) does not divide 16 runs with default settings, on pages of 18 tokens, and
    generates what pages of 6 tokens generate (the prompt outgrows the QSA budget, so selected blocks span pages)."""
    kw = dict(device="cpu", max_model_len=256, num_pages=64)
    llm = LLM(blocks_of_3, **kw)
    assert llm.llm_engine.config.page_size == llm.llm_engine.cache.page_size == 18
    prompt = ["The quick brown fox jumps over the lazy dog. " * 3]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    small = LLM(blocks_of_3, page_size=6, **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 30 and out == small


def test_a_page_size_that_splits_blocks_is_an_error_naming_it(blocks_of_3, tmp_path):
    with pytest.raises(ConfigError, match="page_size: 16 is not a multiple of the model's indexer_compress_ratio=3"):
        LLM(blocks_of_3, device="cpu", max_model_len=256, num_pages=64, page_size=16)
    make_random(str(tmp_path), "tiny", dtype="float32")  # blocks of 4: 16 works, and is the default
    assert LLM(str(tmp_path), device="cpu", max_model_len=256, num_pages=64).llm_engine.cache.page_size == 16
