"""Start-up warm-up (CUDA): eager steps of the shapes serving meets first, so that their compilation (dynamo
recompiling a size as dynamic, Triton specialising integer arguments, fla autotuning) happens at start-up, not as a
stall of several seconds in the middle of serving.

`warm_up_rounds` chooses the steps (a pure function of the configs); `warm_up` runs them through an engine's loop,
each round with its own step token budget and with prefill steps eager even where a mixed-step graph would take
them (the steps those graphs leave eager then find their shapes compiled), and then resets the engine's metrics.
"""

from __future__ import annotations

import logging
import time

from .. import ops
from ..config import LINEAR, EngineConfig, ModelConfig
from .request import SamplingParams

logger = logging.getLogger("qwen4exp")

MAX_TOKENS = 4  # tokens each warm-up prompt generates: decodes mixed with the other prompts' prefills


def warm_up_rounds(config: EngineConfig, model_config: ModelConfig,
                   num_usable_pages: int) -> list[tuple[int, list[int]]]:
    """(step token budget, prompt lengths) of each warm-up round, in order.

    First one prefill step of each size at which a kernel choice or an autotuning key changes, up to the full budget
    (the 64-request runs met those, MoE tile configs and fla's l2norm buckets, as 0.3-7 s stalls), largest first:
    kernels that autotune once per shape of their weights (fla's chunk kernels) keep the choice of their first
    call, and the large prefill steps are where their time goes (H200, 16 x 1k tokens: fla's kkt + solve kernel
    tuned on a 64-token step took 0.94 ms a layer, tuned on the full step 0.31 ms). A step larger than
    max_model_len is several prompts, as serving meets it; the cache's pages and max_num_seqs cap the full step.
    Then two rounds at small budgets, so that every prefill-only path sees two token counts: decodes mixed with
    prefills, prompts continued across steps (one past the QSA budget where the model allows), token counts that
    are and are not multiples of 16."""
    c, mc = config, model_config
    limit = c.max_model_len - MAX_TOKENS
    if limit < 1:
        return []
    short = [min(n, limit) for n in (5, 100, 37, 300)]
    long = []
    if mc.qsa and mc.indexer_budget + mc.indexer_compress_ratio + 200 <= limit:
        long = [mc.indexer_budget + mc.indexer_compress_ratio + 200]

    def prompts(n):
        return [limit] * (n // limit) + [n % limit] * (n % limit > 0)

    def pages(n):
        return sum(-(-(m + MAX_TOKENS) // c.page_size) for m in prompts(n))

    full = min(c.max_num_batched_tokens, c.max_num_seqs * limit)
    while full > 1 and pages(full) > num_usable_pages:
        full -= c.page_size
    sizes = set(ops.moe.warm_up_token_counts(mc.num_experts, mc.num_experts_per_tok, full)) | {full}
    if any(t == LINEAR for t in mc.layer_types):
        sizes |= set(ops.gated_delta.warm_up_token_counts(mc.linear_num_key_heads, full))
    rounds = [(n, prompts(n)) for n in sorted(sizes, reverse=True) if n > 1] + [(64, short), (1000, short + long)]
    return [(min(budget, c.max_num_batched_tokens), lengths) for budget, lengths in rounds]


def warm_up(engine) -> None:
    """Runs the warm-up rounds through `engine` (an LLMEngine with nothing scheduled); leaves no request, page or
    metric behind."""
    rounds = warm_up_rounds(engine.config, engine.model_config, engine.cache.pages.num_usable)
    if not rounds:
        return
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    vocab = engine.model_config.vocab_size
    # without prefix caching: its hits and checkpoint boundaries would change the steps' token counts
    prefix, engine.scheduler.prefix = engine.scheduler.prefix, None
    try:
        for budget, lengths in rounds:
            for i, n in enumerate(lengths):
                prompt = [(7 * j + i) % vocab for j in range(n)]
                engine.add_request(f"warm-up-{budget}-{i}", {"prompt_token_ids": prompt}, params)
            while engine.has_unfinished_requests():
                engine.step(token_budget=budget, mixed_graphs=False)
    finally:
        engine.scheduler.prefix = prefix
    engine.reset_metrics()
    logger.info("warm-up steps (compiling the eager step shapes) took %.1f s", time.perf_counter() - t0)
