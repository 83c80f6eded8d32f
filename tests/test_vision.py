"""Images in, text out: the engine equals transformers' Qwen4ExpForConditionalGeneration (full forward, no cache)
on the same random weights, and images reach it through the offline API and the OpenAI server."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import hf_config, random_prompt

from qwen4exp import SamplingParams
from qwen4exp.config import ModelConfig, VisionConfig
from qwen4exp.multimodal import ImageError, load_image, mrope_positions
from qwen4exp.weights.init import fill_

IMAGE, VIDEO, START, END = 290, 291, 292, 293
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16)
PROCESSOR = dict(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=64, max_pixels=64 * 64,
                 image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3])


def image(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**PROCESSOR)


@pytest.fixture(scope="module")
def hf():
    return vl_model()


def vl_model(**text_overrides):
    """transformers' Qwen4ExpForConditionalGeneration with the tiny vision tower, random weights."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
            "mrope_interleaved": True}
    text = hf_config(rope_parameters=rope, **text_overrides)
    config = Qwen4ExpConfig(text_config=text.to_dict(), vision_config=VISION, image_token_id=IMAGE,
                            video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    model = Qwen4ExpForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            fill_(name, p.data, g)
    return model


def our_config(hf) -> ModelConfig:
    vision = VisionConfig.from_dict(VISION, hf.config.to_dict())
    return dataclasses.replace(ModelConfig.from_hf(hf.config.text_config), vision=vision)


@pytest.fixture(scope="module")
def llm(hf):
    from qwen4exp import LLM

    return LLM(None, model_config=our_config(hf), weights=hf.state_dict().items(), image_processor=processor(),
               max_model_len=512, num_pages=256, page_size=8, device="cpu", dtype="float32",
               max_num_batched_tokens=24)


def hf_forward_logprobs(hf, ids: list[int], images: list) -> torch.Tensor:
    """transformers' full forward over `ids` (placeholders expanded) with the images: log-softmax [len, vocab]."""
    tokens = torch.tensor([ids])
    kw = {}
    if images:
        out = processor()(images=images, return_tensors="pt")
        kw = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    with torch.no_grad():
        logits = hf(tokens, mm_token_type_ids=(tokens == IMAGE).int(), **kw).logits[0]
    return torch.log_softmax(logits.float(), -1)


def with_placeholders(gen, pieces: list[int], vocab: int) -> list[int]:
    """Random text of the given lengths with one image placeholder between consecutive pieces (a length of 0: an
    image at that end)."""
    ids = []
    for i, n in enumerate(pieces):
        if i:
            ids += [START, IMAGE, END]
        ids += random_prompt(gen, n, 280, eos_every=9) if n else []
    return ids


def test_vision_tower_and_positions_equal_transformers(hf):
    from qwen4exp.model.vision import VisionModel

    config = our_config(hf)
    ours = VisionModel(config.vision).eval()
    prefix = "model.visual."
    ours.load_state_dict({k[len(prefix):]: v for k, v in hf.state_dict().items() if k.startswith(prefix)})
    grids = torch.tensor([[1, 4, 6], [1, 8, 2], [2, 2, 2]])
    pixels = torch.randn(int(grids.prod(-1).sum()), config.vision.patch_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(pixels, grids).pooler_output)
        got = ours(pixels, grids.tolist())
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)

    ids = [5, START] + [IMAGE] * 6 + [END, 7, START] + [IMAGE] * 4 + [END, START] + [IMAGE] * 2 + [END, 9, 10]
    tokens = torch.tensor([ids])
    ref_pos, ref_delta = hf.model.get_rope_index(tokens, (tokens == IMAGE).int(), image_grid_thw=grids)
    pos, delta = mrope_positions(ids, grids.tolist(), IMAGE, 2)
    assert np.array_equal(pos, ref_pos[:, 0].numpy()) and delta == int(ref_delta)


CASES = {  # text lengths around the images, the images' sizes (w, h)
    "text only": ([37], []),
    "one image in the middle": ([9, 14], [(16, 32)]),
    "three images, start, middle and end": ([0, 5, 11, 0], [(24, 16), (8, 40), (32, 32)]),
}


def test_prompt_logprobs_and_greedy_tokens_match(hf, llm):
    """0, 1 and 3 images of different sizes at the start, middle and end, in one batch with a text-only request;
    a 24-token budget cuts the prefill inside images (each has 6 to 24 image tokens)."""
    gen = torch.Generator().manual_seed(5)
    prompts, images = [], []
    for seed, (pieces, sizes) in enumerate(CASES.values()):
        prompts.append(with_placeholders(gen, pieces, 280))
        images.append([image(w, h, seed * 10 + i) for i, (w, h) in enumerate(sizes)])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    requests = [{"prompt_token_ids": p, **({"multi_modal_data": {"image": ims}} if ims else {})}
                for p, ims in zip(prompts, images)]
    outs = llm.generate(requests, params, use_tqdm=False)
    for ims, out in zip(images, outs):
        prompt, gen_ids = out.prompt_token_ids, out.outputs[0].token_ids
        assert prompt.count(IMAGE) == sum(w * h // 64 for w, h in (im.size for im in ims))
        assert len(gen_ids) == 16
        ref = hf_forward_logprobs(hf, prompt + gen_ids[:-1], ims)
        ours_prompt = torch.tensor([lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:], prompt[1:])])
        ref_prompt = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(ours_prompt, ref_prompt, atol=1e-4, rtol=0)
        assert gen_ids == ref[len(prompt) - 1:].argmax(-1).tolist()
        ours_gen = torch.tensor([lp[tok].logprob for lp, tok in zip(out.outputs[0].logprobs, gen_ids)])
        ref_gen = ref[torch.arange(len(prompt) - 1, len(prompt) + 15), torch.tensor(gen_ids)]
        torch.testing.assert_close(ours_gen, ref_gen, atol=1e-4, rtol=0)
    assert llm.llm_engine.cache.all_free()


def test_prefix_cache_keys_pages_on_image_content(hf, llm):
    """The same tokens with another image (image tokens share one id) find only the text pages before the image;
    the same image again resumes past it. Each output is transformers' for its own image."""
    gen = torch.Generator().manual_seed(9)
    ids = with_placeholders(gen, [40, 20], 280)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    cached = []
    for seed in (1, 2, 2):
        im = image(32, 32, seed)
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [im]}}, params,
                           use_tqdm=False)[0]
        prompt, gen_ids = out.prompt_token_ids, out.outputs[0].token_ids
        ref = hf_forward_logprobs(hf, prompt + gen_ids[:-1], [im])
        assert gen_ids == ref[len(prompt) - 1:].argmax(-1).tolist()
        ours = torch.tensor([lp[tok].logprob for lp, tok in zip(out.outputs[0].logprobs, gen_ids)])
        torch.testing.assert_close(ours, ref[torch.arange(len(prompt) - 1, len(prompt) + 7), torch.tensor(gen_ids)],
                                   atol=1e-4, rtol=0)
        cached.append(out.num_cached_tokens)
    first_image = prompt.index(IMAGE)
    assert cached[1] <= first_image < cached[2], cached
    assert llm.llm_engine.cache.all_free()


def test_encoder_runs_once_per_image_across_chunks(llm):
    engine = llm.llm_engine
    calls = []
    encode = engine.model.encode_images

    def counting(items):
        calls.append(len(items))
        return encode(items)

    engine.model.encode_images = counting
    try:
        ids = [5, 6, START, IMAGE, END, 7, START, IMAGE, END, 8]
        ims = [image(32, 48, 1), image(40, 24, 2)]  # 24 and 15 image tokens: prefilled over 3 steps of 24
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": ims}},
                           SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    finally:
        del engine.model.encode_images
    assert sum(calls) == 2 and len(out.prompt_token_ids) == 8 + 24 + 15
    assert all(r.mm is None or not r.mm.features for r in engine.scheduler.running)


def test_image_sources_and_errors(tmp_path):
    import base64
    import io

    im = image(8, 8, 0)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    data = buf.getvalue()
    (tmp_path / "a.png").write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for source in (im, data, str(tmp_path / "a.png"), f"file://{tmp_path / 'a.png'}", url):
        assert np.array_equal(np.asarray(load_image(source)), np.asarray(im))
    cases = [(b"not an image", "not a readable image"), ("ftp://host/a.png", "unsupported URL scheme 'ftp'"),
             ("data:image/png;base64,@@@", "base64 is invalid"), (str(tmp_path / "missing.png"), "no such file")]
    for source, message in cases:
        with pytest.raises(ImageError, match=message) as e:
            load_image(source, "messages[0].content[1].image_url")
        assert e.value.field == "messages[0].content[1].image_url"


def test_offline_errors_name_the_field(llm):
    with pytest.raises(ImageError, match=r"multi_modal_data.image: 2 image placeholders .* for 1 images"):
        llm.generate({"prompt_token_ids": [5, IMAGE, 6, IMAGE], "multi_modal_data": {"image": image(8, 8, 0)}},
                     use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data: only 'image'"):
        llm.generate({"prompt_token_ids": [5, IMAGE], "multi_modal_data": {"audio": b""}}, use_tqdm=False)


# ----- a make-random --vision checkpoint, offline and served -----

@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    from qwen4exp.weights.random_checkpoint import make_random

    path = str(tmp_path_factory.mktemp("tiny-vision"))
    make_random(path, "tiny", dtype="float32", vision=True)
    return path


def data_url(im) -> str:
    import base64
    import io

    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_random_vision_checkpoint_equals_transformers(vision_dir):
    """make-random --vision writes the released layout: transformers loads it and its processor, and greedy
    decoding of a chat with an image agrees."""
    from transformers import AutoImageProcessor, Qwen4ExpForConditionalGeneration

    from qwen4exp import LLM

    llm = LLM(vision_dir, device="cpu", dtype="float32", max_model_len=256)
    im = image(100, 70, 4)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "image_url", "image_url": {"url": data_url(im)}},
                                             {"type": "text", "text": "What is this?"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    text = llm.get_tokenizer().decode(out.prompt_token_ids)
    pixels = AutoImageProcessor.from_pretrained(vision_dir)(images=[im], return_tensors="pt")
    grid = pixels["image_grid_thw"][0].tolist()
    assert "Look:\n<|vision_start|>" + "<|image_pad|>" * (grid[0] * grid[1] * grid[2] // 4) + "<|vision_end|>\n" \
           "What is this?" in text
    hf = Qwen4ExpForConditionalGeneration.from_pretrained(vision_dir, dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids + out.outputs[0].token_ids[:-1]])
    with torch.no_grad():
        logits = hf(ids, mm_token_type_ids=(ids == hf.config.image_token_id).int(), **pixels).logits[0]
    assert out.outputs[0].token_ids == logits[len(out.prompt_token_ids) - 1:].argmax(-1).tolist()


def test_server_answers_images_and_refuses_bad_ones(vision_dir):
    import httpx
    import openai
    from helpers import serve_on_loopback

    from qwen4exp.config import EngineConfig
    from qwen4exp.engine.engine import LLMEngine
    from qwen4exp.entrypoints.async_engine import AsyncEngine
    from qwen4exp.entrypoints.server import build_app

    engine = LLMEngine(vision_dir, EngineConfig(max_model_len=256, device="cpu", dtype="float32",
                                                limit_mm_per_prompt={"image": 2}))
    async_engine = AsyncEngine(engine).start()
    try:
        with serve_on_loopback(build_app(async_engine, "tiny-vision", max_model_len=256,
                                         model_path=vision_dir)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            part = {"type": "image_url", "image_url": {"url": data_url(image(64, 96, 1))}}
            r = client.chat.completions.create(model="tiny-vision", max_tokens=5, temperature=0, messages=[
                {"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}])
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
            assert r.usage.prompt_tokens > 6 * 4  # the image's 6 tokens among the template's

            def post(parts):
                return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                    "model": "tiny-vision", "max_tokens": 2,
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]})

            for parts, field, message in [
                ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                      + "aGVsbG8gd29ybGQ="}}], "messages[0].content[1].image_url",
                 "not a readable image"),
                ([{"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}}],
                 "messages[0].content[1].image_url", "unsupported URL scheme 'ftp'"),
                ([part] * 3, "messages", "3 images in one prompt, more than the 2"),
                ([{"type": "image_url", "image_url": {}}], "messages[0].content[1].image_url", "must be"),
            ]:
                r = post(parts)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == field and message in err["message"], err
            assert engine.cache.all_free()
    finally:
        async_engine.shutdown()


def test_config_errors_name_the_field(vision_dir, tmp_path):
    import json
    import shutil

    from qwen4exp.config import ConfigError, EngineConfig, load_model_config

    with pytest.raises(ConfigError, match="limit_mm_per_prompt.image"):
        EngineConfig(limit_mm_per_prompt={"image": -1})
    with pytest.raises(ConfigError, match="limit_mm_per_prompt"):
        EngineConfig(limit_mm_per_prompt={"audio": 1})
    shutil.copytree(vision_dir, tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    raw = json.loads(path.read_text())
    for key, value, field in [("out_hidden_size", 48, "vision_config.out_hidden_size"),
                              ("num_position_embeddings", 50, "vision_config.num_position_embeddings"),
                              ("hidden_act", "relu", "vision_config.hidden_act")]:
        path.write_text(json.dumps(dict(raw, vision_config=dict(raw["vision_config"], **{key: value}))))
        with pytest.raises(ConfigError, match=field):
            load_model_config(str(tmp_path / "m"))


def test_text_steps_of_a_request_with_images_are_1d_rotary_at_offset_positions(llm):
    """A step of a request with images that feeds no image token (a decode, text after an image) has equal M-RoPE
    rows, which CUDA graphs take as 1-D rotary at the logical position plus an offset (StepLayout.text_rope): the
    cos/sin equal M-RoPE's exactly, for tokens and completed QSA blocks. A step that feeds image tokens, or completes
    a block that starts inside an image, has no such form and runs eagerly."""
    from qwen4exp.engine.step_builder import RequestChunk, StepBuilder

    engine = llm.llm_engine
    config, rotary = engine.model_config, engine.model.model.rotary_emb
    C = config.indexer_compress_ratio
    builder = StepBuilder(config, 8)
    gen = torch.Generator().manual_seed(7)
    ids, mm = engine.mm_processor.prepare(with_placeholders(gen, [9, 14], 280), [image(16, 32, 1)])
    im = mm.images[0]
    pages = list(range(1, 1 + 64 // 8))

    def layout(start: int, end: int, features: bool = False):
        chunk = RequestChunk(ids[start:end] if end <= len(ids) else [5] * (end - start), start, ids[:start], pages,
                             1, end - start - 1, mm=mm, mm_features=[(0, torch.zeros(1, 1))] if features else [])
        return builder.build([chunk], multimodal=True)

    def rope(positions):
        return rotary(torch.as_tensor(positions), torch.float32)

    text_steps = [(len(ids) + 6, len(ids) + 7),  # a decode after the prompt
                  (im.offset + im.length + 1 + C, len(ids))]  # the text after the image
    for start, end in text_steps:
        lay = layout(start, end)
        text = lay.text_rope()
        assert text is not None, (start, end)
        for a, b in zip(rope(lay.rope_positions), rope(lay.positions + text[0])):
            assert torch.equal(a, b)
        assert len(text[1]) == len(lay.new_block_positions)
        for a, b in zip(rope(lay.rope_block_positions), rope(text[1])):
            assert torch.equal(a, b)
    assert layout(len(ids) + 6, len(ids) + 7).text_rope()[0].tolist() == [mm.delta] and mm.delta < 0
    assert (layout(*text_steps[1]).text_rope()[0] == mm.delta).all()
    assert layout(im.offset, im.offset + im.length, features=True).text_rope() is None
    # the first text token whose step completes a block starting inside the image
    end_of_block = next(p for p in range(im.offset + im.length, len(ids)) if (p + 1) % C == 0)
    assert end_of_block - C + 1 < im.offset + im.length
    assert layout(im.offset + im.length, end_of_block + 1).text_rope() is None


def test_decodes_of_requests_with_images_through_the_graph_buffers_equal_the_eager_path(monkeypatch):
    """Through the CUDA-graph runner's buffers (replays run eagerly on the CPU, on the metadata a graph captures:
    rotary positions = logical + the offset buffer): the decodes of requests with images replay graphs at their
    offset positions, beside a text-only request, and give the eager reference's tokens and logprobs. (A QSA budget
    past every context here: block selection breaks ties of zero scores by its row's length, which differs between
    a graph's rows and an eager step's.)"""
    from helpers import EagerBufferRunner, graph_runner

    import qwen4exp.ops as ops
    from qwen4exp import LLM

    hf = vl_model(indexer_budget=64)

    def vl_llm():
        return LLM(None, model_config=our_config(hf), weights=hf.state_dict().items(), image_processor=processor(),
                   max_model_len=512, num_pages=256, page_size=8, device="cpu", dtype="float32",
                   max_num_batched_tokens=24)

    gen = torch.Generator().manual_seed(9)
    pieces = [([9, 14], [(16, 32)]), ([0, 6, 3], [(24, 16), (16, 16)]), ([21], [])]
    requests = []
    for seed, (lengths, sizes) in enumerate(pieces):
        ims = [image(w, h, 40 + seed * 10 + i) for i, (w, h) in enumerate(sizes)]
        requests.append({"prompt_token_ids": with_placeholders(gen, lengths, 280),
                         **({"multi_modal_data": {"image": ims}} if ims else {})})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    ref = vl_llm().generate(requests, params, use_tqdm=False)

    monkeypatch.setattr(ops.settings, "fast_on_cpu", True)
    fast = vl_llm()
    graphs = fast.llm_engine.runner.graphs = graph_runner(fast, EagerBufferRunner, 512, 4, "cpu", buckets=[1, 2, 4])
    offsets = []
    put = graphs._put_rope_offset
    graphs._put_rope_offset = lambda buf, text, rows: offsets.append(text is not None) or put(buf, text, rows)
    outs = fast.generate(requests, params, use_tqdm=False)
    assert sum(offsets) >= 4, "the decodes of the requests with images must replay graphs"
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp = [d[t].logprob for d, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        lp_ref = [d[t].logprob for d, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(lp_ref), atol=1e-4, rtol=0)
    assert fast.llm_engine.cache.all_free()
