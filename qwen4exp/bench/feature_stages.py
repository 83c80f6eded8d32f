"""The suite's stages for speculative decoding, prefix caching, images and structured output
(`qwen4exp bench suite --stages spec_decode,prefix_cache,vision,structured`).

  spec_decode   spec_trained, then spec_dummy (each also a stage of its own: minutes apiece on an H200).
  spec_trained  `small` trained briefly (its MTP layer beside it), then batch-1 decode of held-out code with k = 0, 1,
                2, 3 drafts: TPOT, acceptance, speedup.
  spec_dummy    flash-next-128e on random bf16 weights with k = 0 and 1: the time of a step against a plain decode
                step, 64 concurrent requests (1k in / 256 out) with k = 1 against k = 0. Once both parts are in the
                results, the batch-1 speed projected at the trained model's acceptance.
  prefix_cache  flash-next-128e, the multi-turn chat workload of bench/multi_turn.py with the prefix cache on and off.
  vision        flash-next-128e with the released vision tower: preprocessing and encoding one 1024 x 1024 image, and
                a request with it against the same text alone and against text of the same token length.
  structured    flash-next-128e with the repository's tokenizer: 64 requests (1k in / 256 out) free against 16 of them
                under a grammar, alternating, two runs each.

Every stage takes the preset, engine options and workload as arguments (the suite's by default), so that tests run
it on the CPU at the tiny preset's widths. Prefix caching is on by default and the benchmarks' prompts are seeded, so
prompts repeat across runs on one engine: every timed run starts from an empty prefix cache (bench/offline.py's
runs, and `_alone` here).
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from ..engine.request import SamplingParams
from .suite import OURS_ENGINE, OURS_PRESET

# the trained `small` model's engines: batch 1, prompts of 256 tokens; pages for max_num_seqs x max_model_len rather
# than all the GPU memory the default share would give them
SMALL_ENGINE = dict(max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=2048, num_pages=1024)
MULTI_TURN = dict(num_conversations=16, num_turns=8, system_len=2000, turn_len=200, output_len=200)


def _spec(k: int) -> dict | None:
    return {"method": "mtp", "num_speculative_tokens": k} if k else None


# ---- spec_decode ----

def spec_trained(results, device, log, steps: int, seconds: float | None, corpus_chars: int, batch: int = 32,
                 seq_len: int = 512, engine_options: dict | None = None, prompts: int = 6, prompt_len: int = 256,
                 output_len: int = 128, ks: tuple[int, ...] = (1, 2, 3)) -> dict:
    """`small` trained briefly (train_small.train trains its MTP layer with it), then one bf16 engine on its weights
    per k (k = 0 first), one after the other: batch-1 greedy decode of `prompts` - 1 spans of held-out code (one more
    warms each engine up). Per k: median TPOT; with drafts, of all runs together, the share of draft tokens accepted,
    the acceptance rate of each draft position (position 0: the first draft token), the tokens a step emits
    (acceptance length), the share of its steps chained to the step before, and the speedup over k = 0."""
    from ..config import EngineConfig
    from ..engine.engine import LLMEngine
    from .engines import return_gpu_memory
    from .offline import run_requests
    from .train_small import train_for_engines

    options = engine_options or SMALL_ENGINE
    cfg, weights, held, record = train_for_engines(device, steps, log, batch=batch, seq_len=seq_len, seconds=seconds,
                                                   corpus_chars=corpus_chars)
    stride = len(held) // prompts
    code = [held[i * stride: i * stride + prompt_len] for i in range(prompts)]
    out = results.setdefault("spec_decode", {})["trained"] = {
        "preset": "small", "training": record, "engine": options, "prompts": prompts - 1, "prompt_len": prompt_len,
        "output_len": output_len, "k": {}}
    # k = 0 again last, which the speedups are taken against: the first engine a process builds has measured ~20%
    # slow at times (small preset on an H100: 470-544 us a step against ~400 us for one built after it)
    for i, k in enumerate((0, *ks, 0)):
        config = EngineConfig(**options, dtype="bfloat16", device=str(device), speculative_config=_spec(k))
        engine = LLMEngine(None, config, model_config=cfg, tokenizer=None, weights=iter(weights.items()))
        run_requests(engine, [code[0]], min(output_len, 16))
        chained = engine.spec.chained_steps if k else 0
        runs = [run_requests(engine, [p], output_len) for p in code[1:]]
        r = {"median_tpot_ms": statistics.median(x["median_tpot_ms"] for x in runs),
             "tpot_ms": [x["median_tpot_ms"] for x in runs]}
        if i == len(ks) + 1:  # the second k = 0
            r["first_engine_median_tpot_ms"] = out["k"]["0"]["median_tpot_ms"]
        if k:
            drafts = sum(x["spec_decode_num_drafts"] for x in runs)
            accepted = sum(x["spec_decode_accepted_tokens"] for x in runs)
            r |= {"acceptance_rate": accepted / sum(x["spec_decode_draft_tokens"] for x in runs),
                  "per_position_acceptance": [
                      sum(x["spec_decode_per_position_acceptance_rates"][j] * x["spec_decode_num_drafts"]
                          for x in runs) / drafts for j in range(k)],
                  "acceptance_length": 1 + accepted / drafts,
                  # verification steps launched before the host read the step before (SpecDecoder.chain)
                  "chained_share": (engine.spec.chained_steps - chained) / drafts}
        out["k"][str(k)] = r
        log(f"spec_decode, small trained, k={k}: " + ", ".join(f"{n} {v}" for n, v in r.items() if n != "tpot_ms"))
        results.save()
        del engine
        return_gpu_memory()
    for k in ks:
        r = out["k"][str(k)]
        r["speedup_vs_k0"] = out["k"]["0"]["median_tpot_ms"] / r["median_tpot_ms"]
        log(f"spec_decode, small trained, k={k}: {r['speedup_vs_k0']:.3f}x k = 0")
    results.save()
    return out


def spec_dummy(results, device, log, preset: str = OURS_PRESET, engine_options: dict | None = None,
               ks: tuple[int, ...] = (1,), input_len: int = 128, output_len: int = 128, iters: int = 3,
               concurrency: int = 64, concurrent_input_len: int = 1024, concurrent_output_len: int = 256,
               concurrent_ks: tuple[int, ...] = (0, 1)) -> dict:
    """`preset` on random bf16 weights, one engine per k (k = 0 first): batch-1 decode (vLLM's bench latency) and,
    for `concurrent_ks`, `concurrency` requests at once. By default k = 1 only beside k = 0: each engine of the
    stand-in takes minutes to start, and the trained model's acceptance at k = 2 and 3 is measured on `small`.

    The time of a speculative step. Random weights' drafts are almost never accepted, so speed with speculation
    says nothing of its benefit here; the cost of a step it does give. A step of one request runs the target over
    1 + k rows (its last token and k drafts, whatever is accepted afterwards), then the draft layer once over those
    rows and k - 1 times over one row. A batch-1 run emits `acceptance length` tokens a step, so TPOT x acceptance
    length is the time of its steps, measured at whatever acceptance the weights give; acceptance does not change
    the work of a step. So neither forced acceptance nor timing the verification alone is needed: `step_over_k0` is
    that time over a plain decode step's (TPOT at k = 0), drafting and the host's wait for each verification
    included, and the projection (stage_spec_decode) divides the trained model's tokens per step by it."""
    from ..config import EngineConfig
    from .engines import dummy_engine, preset_model_config, return_gpu_memory
    from .offline import latency, throughput

    options = engine_options or OURS_ENGINE
    out = results.setdefault("spec_decode", {})["dummy"] = {
        "preset": preset, "engine": options, "input_len": input_len, "output_len": output_len,
        "concurrency": concurrency, "concurrent_input_len": concurrent_input_len,
        "concurrent_output_len": concurrent_output_len, "k": {}}
    for k in (0, *ks):
        engine, startup = dummy_engine(preset_model_config(preset),
                                       EngineConfig(**options, speculative_config=_spec(k)), device)
        b1 = latency(engine, 1, input_len, output_len, iters=iters)
        tokens_per_step = b1.get("spec_decode_acceptance_length") or 1.0
        r = out["k"][str(k)] = {"startup_s": startup, "decode_b1": b1, "median_tpot_ms": b1["median_tpot_ms"],
                                "acceptance_length": tokens_per_step,
                                "step_ms": b1["median_tpot_ms"] * tokens_per_step}
        r["step_over_k0"] = r["step_ms"] / out["k"]["0"]["step_ms"]
        log(f"spec_decode, {preset}, k={k}: TPOT {r['median_tpot_ms']:.2f} ms, {tokens_per_step:.3f} tokens a step, "
            f"step {r['step_ms']:.2f} ms = {r['step_over_k0']:.3f} x k=0")
        results.save()
        if k in concurrent_ks:
            r["concurrent"] = run = throughput(engine, concurrency, concurrent_input_len, concurrent_output_len)
            r["concurrent_tok_s"] = run["output_throughput"]
            log(f"spec_decode, {preset}, k={k}: {concurrency} concurrent {run['output_throughput']:.0f} tok/s, "
                f"{run.get('spec_decode_acceptance_length', 1.0):.3f} tokens a step")
            results.save()
        del engine
        return_gpu_memory()
    return out


def project_spec_decode(results, log) -> None:
    """The batch-1 decode speed of the dummy preset if its drafts were accepted as the trained model's are: the
    trained model's tokens per step over the dummy preset's step time (spec_dummy says why that holds). Recomputed
    whenever either part is measured, once both are in the results."""
    data = results.get("spec_decode", {})
    trained, dummy = data.get("trained"), data.get("dummy")
    if not trained or not dummy:
        return
    k0_tok_s = 1000.0 / dummy["k"]["0"]["step_ms"]
    projection = data["projection"] = {"k0_tok_s": k0_tok_s, "k": {}}
    for k, r in dummy["k"].items():
        if k != "0" and k in trained["k"]:
            tok_s = 1000.0 * trained["k"][k]["acceptance_length"] / r["step_ms"]
            projection["k"][k] = {"acceptance_length": trained["k"][k]["acceptance_length"], "tok_s": tok_s,
                                  "speedup_vs_k0": tok_s / k0_tok_s}
    log("spec_decode projection", projection)
    results.save()


def stage_spec_trained(results, device, log, steps: int, seconds: float | None, corpus_chars: int,
                       stage: str = "spec_trained", **options) -> None:
    spec_trained(results, device, log, steps, seconds, corpus_chars, **options)["stage"] = stage
    project_spec_decode(results, log)


def stage_spec_dummy(results, device, log, stage: str = "spec_dummy", **options) -> None:
    spec_dummy(results, device, log, **options)["stage"] = stage
    project_spec_decode(results, log)


def stage_spec_decode(results, device, log, steps: int, seconds: float | None, corpus_chars: int,
                      trained_options: dict | None = None, dummy_options: dict | None = None) -> None:
    """spec_trained (training first, while no engine holds the GPU's memory), then spec_dummy and the projection.
    The two parts also run as stages of their own (each takes minutes on an H200)."""
    results["spec_decode"] = {}
    stage_spec_trained(results, device, log, steps, seconds, corpus_chars, "spec_decode", **(trained_options or {}))
    stage_spec_dummy(results, device, log, "spec_decode", **(dummy_options or {}))


# ---- prefix_cache ----

def stage_prefix_cache(results, device, log, preset: str = OURS_PRESET, engine_options: dict | None = None,
                       workload: dict | None = None) -> None:
    """bench/multi_turn.multi_turn on `preset` (random bf16 weights, prefix caching on): each turn's TTFT with the
    cache on and off, the last turn's TTFT speedup, single-request decode speed both ways."""
    from ..config import EngineConfig
    from .engines import dummy_engine, preset_model_config, return_gpu_memory
    from .multi_turn import multi_turn

    options = (engine_options or OURS_ENGINE) | {"enable_prefix_caching": True}
    engine, startup = dummy_engine(preset_model_config(preset), EngineConfig(**options), device)
    r = multi_turn(engine, **(workload or MULTI_TURN))
    r["decode_cached_over_uncached"] = r["decode_cached"] / r["decode_uncached"]
    results["prefix_cache"] = {"preset": preset, "engine": options, "startup_s": startup} | r
    log(f"prefix_cache: last turn TTFT {r['cached'][-1]['median_ttft_ms']:.1f} ms on, "
        f"{r['uncached'][-1]['median_ttft_ms']:.1f} ms off ({r['last_turn_ttft_speedup']:.2f}x); decode on / off "
        f"{r['decode_cached_over_uncached']:.4f}; hit rate {r['hit_rate']:.1%}")
    results.save()
    del engine
    return_gpu_memory()


# ---- vision ----

def _alone(engine, prompt: dict, output_len: int) -> tuple[float, float, int]:
    """(TTFT ms, TPOT ms, prompt tokens with its images expanded) of one greedy request run alone, from an empty
    prefix cache; the image processor's work is in the TTFT, as a user's request has it."""
    from .offline import _sync

    engine.reset_prefix_cache()  # a request alone finds nothing of the runs before it
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    _sync(engine)
    t0 = time.perf_counter()
    engine.add_request(f"alone-{t0}", prompt, params)
    first = last = out = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = time.perf_counter()
            first = first or last
    tokens = len(out.outputs[0].token_ids)
    return 1000 * (first - t0), 1000 * (last - first) / max(1, tokens - 1), len(out.prompt_token_ids)


def _draw(rng: random.Random, n: int, vocab: int, exclude: set[int]) -> list[int]:
    """n random token ids, none of them in `exclude` (the vision tokens: one in the text would be an image)."""
    out = []
    while len(out) < n:
        t = rng.randrange(10, vocab)
        if t not in exclude:
            out.append(t)
    return out


def stage_vision(results, device, log, preset: str = OURS_PRESET, engine_options: dict | None = None,
                 image_side: int = 1024, text_len: int = 64, output_len: int = 128, runs: int = 3,
                 encode_runs: int = 5) -> None:
    """`preset` with its vision tower (the released widths for the flash-next presets; random bf16 weights) and the
    image processor `make-random --vision` writes. One random image of image_side x image_side pixels: the image
    processor's time (on the host) and the vision tower's, medians of `encode_runs` after a warm-up; then requests
    alone (medians of `runs` after a warm-up): `text_len` tokens of text with the image in the middle, the same
    text without it, and text of as many tokens as the first once its image is expanded."""
    import numpy as np
    from PIL import Image

    from ..config import EngineConfig
    from .engines import dummy_engine, preset_image_processor, preset_model_config, return_gpu_memory
    from .offline import _sync

    options = engine_options or OURS_ENGINE
    cfg = preset_model_config(preset, vision=True)
    engine, startup = dummy_engine(cfg, EngineConfig(**options), device, image_processor=preset_image_processor(preset))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (image_side, image_side, 3), dtype=np.uint8))
    processor, prep, enc = engine.mm_processor.processor, [], []
    for i in range(encode_runs + 1):
        t0 = time.perf_counter()
        items = processor([image])
        t1 = time.perf_counter()
        with torch.inference_mode():
            engine.model.encode_images(items)
        _sync(engine)
        if i:
            prep.append(1000 * (t1 - t0))
            enc.append(1000 * (time.perf_counter() - t1))
    grid = items[0][1]
    vision = cfg.vision
    image_tokens = grid[0] * grid[1] * grid[2] // vision.spatial_merge_size ** 2
    r = results["vision"] = {"preset": preset, "engine": options, "startup_s": startup,
                             "vision_config": {n: getattr(vision, n) for n in ("depth", "hidden_size", "num_heads")},
                             "image_size": [image_side, image_side], "grid_thw": list(grid),
                             "image_tokens": image_tokens, "encode_runs": encode_runs,
                             "preprocess_ms": statistics.median(prep), "encode_ms": statistics.median(enc),
                             "runs": runs, "output_len": output_len}
    log(f"vision: {image_tokens} image tokens, preprocess {r['preprocess_ms']:.1f} ms, encode {r['encode_ms']:.1f} ms")
    rng = random.Random(0)
    special = {vision.image_token_id, vision.video_token_id, vision.vision_start_token_id, vision.vision_end_token_id}
    words = _draw(rng, text_len, cfg.vocab_size, special)
    half = text_len // 2
    prompts = {"image": {"prompt_token_ids": words[:half] + [vision.vision_start_token_id, vision.image_token_id,
                                                            vision.vision_end_token_id] + words[half:],
                         "multi_modal_data": {"image": [image]}},
               "text": {"prompt_token_ids": words},
               "text_same_len": {"prompt_token_ids": _draw(rng, text_len + 2 + image_tokens, cfg.vocab_size,
                                                           special)}}
    for name, prompt in prompts.items():
        _alone(engine, prompt, min(4, output_len))
        times = [_alone(engine, prompt, output_len) for _ in range(runs)]
        r[name] = {"prompt_tokens": times[0][2], "ttft_ms": statistics.median(t[0] for t in times),
                   "tpot_ms": statistics.median(t[1] for t in times), "ttfts_ms": [t[0] for t in times]}
        log(f"vision, {name}: {r[name]}")
        results.save()
    del engine
    return_gpu_memory()


# ---- structured ----

def stage_structured(results, device, log, preset: str = OURS_PRESET, engine_options: dict | None = None,
                     num_prompts: int = 64, input_len: int = 1024, output_len: int = 256, fraction: float = 0.25,
                     repeats: int = 2) -> None:
    """`preset` (random bf16 weights) with the repository's tokenizer, which the grammar needs: bench/offline's
    throughput run of `num_prompts` requests, all free, then `fraction` of them under its grammar, alternating,
    `repeats` times each; the ratio of the medians of output tok/s."""
    from ..config import EngineConfig
    from .engines import dummy_engine, preset_model_config, preset_tokenizer, return_gpu_memory
    from .offline import throughput

    options = engine_options or OURS_ENGINE
    engine, startup = dummy_engine(preset_model_config(preset), EngineConfig(**options), device,
                                   tokenizer=preset_tokenizer(preset))
    r = results["structured"] = {"preset": preset, "engine": options, "startup_s": startup,
                                 "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
                                 "runs": []}
    for _ in range(repeats):
        for share in (0.0, fraction):
            x = throughput(engine, num_prompts, input_len, output_len, share)
            r["runs"].append({"structured_fraction": share, "num_structured": x["num_structured"],
                              "output_throughput": x["output_throughput"], "median_tpot_ms": x["median_tpot_ms"],
                              "median_ttft_ms": x["median_ttft_ms"]})
            log("structured", r["runs"][-1])
            results.save()
    free, constrained = (statistics.median(x["output_throughput"] for x in r["runs"] if (x["num_structured"] > 0) == c)
                         for c in (False, True))
    r |= {"free_tok_s": free, "constrained_tok_s": constrained, "constrained_over_free": constrained / free}
    log(f"structured: constrained / free {r['constrained_over_free']:.3f}")
    results.save()
    del engine
    return_gpu_memory()
