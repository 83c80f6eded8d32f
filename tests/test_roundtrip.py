"""`make-random` round-trips: transformers' from_pretrained reads the checkpoint and gives the same logits as
qwen4exp (`--preset small`), and reads the same weights from its fp8 layout."""

import subprocess
import sys

import pytest
import torch

from qwen4exp import LLM, SamplingParams


def test_small_preset_loads_in_transformers_with_equal_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = str(tmp_path / "small")
    subprocess.run([sys.executable, "-m", "qwen4exp.entrypoints.cli", "make-random", d, "--preset", "small",
                    "--dtype", "float32", "--seed", "5"], check=True, capture_output=True)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(d)
    text = "The capital of France is Paris. <|endoftext|> def fibonacci(n): return n " * 5
    ids = tok(text)["input_ids"]
    assert len(ids) > 67  # past the small preset's QSA budget (64) + tail: selection is active
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    llm = LLM(d, dtype="float32", device="cpu", max_model_len=512, num_pages=64, page_size=16)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    ours = torch.tensor([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:])])
    torch.testing.assert_close(ours, ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4, rtol=0)
    # the top-5 alternatives agree too (ids and values)
    for pos in (10, len(ids) - 2):
        top = ref[pos].topk(5)
        entry = out.prompt_logprobs[pos + 1]
        for lp, tid in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(entry[tid].logprob - lp) < 1e-4


def test_fp8_checkpoint_reads_the_same_in_transformers(tmp_path):
    """`make-random --quantization fp8` writes the format transformers reads (FineGrainedFP8, which on a CPU
    dequantizes on load): every quantized weight, the stacked experts included, has the real values of our fp8
    model's weights and scales. (transformers needs accelerate for fp8 checkpoints.)"""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    from qwen4exp.config import load_model_config
    from qwen4exp.model.merged_linear import named_checkpoint_tensors, quantizable_weights
    from qwen4exp.ops.fp8 import dequantize_weight
    from qwen4exp.weights.loader import load_model
    from qwen4exp.weights.random_checkpoint import make_random

    d = make_random(str(tmp_path / "fp8"), "tiny", dtype="float32", seed=5, quantization="fp8")
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).state_dict()
    ours = load_model(load_model_config(d), d, torch.float32, "cpu")
    tensors = {t.name: t.tensor for t in named_checkpoint_tensors(ours)}
    inter = ours.config.moe_intermediate_size
    for name in quantizable_weights(ours):
        real = dequantize_weight(tensors[name], tensors[name + "_scale_inv"])
        if name.endswith("gate_up_proj"):  # gate rows, then up rows, each padded to 128 rows here
            half = real.shape[1] // 2
            real = torch.cat([real[:, :inter], real[:, half:half + inter]], dim=1)
        assert torch.equal(real, hf[name]), name
