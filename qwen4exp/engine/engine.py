"""LLMEngine: add requests, then `step()` until done. One step = schedule -> execute -> sample -> update."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from .. import ops
from ..config import (LINEAR, EngineConfig, ModelConfig, default_max_num_batched_tokens, load_model_config,
                      resolve_device)
from ..weights.loader import load_model
from .cache import CacheManager
from .detokenizer import IncrementalDetokenizer
from .metrics import EngineMetrics
from .request import CompletionOutput, Logprob, Request, RequestOutput, RequestStatus, SamplingParams
from .runner import ModelRunner, RequestChunk, to_device
from .sampler import SampledBatch, Sampler, prompt_logprobs, reads_history
from .scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger("qwen4exp")


def resolve_dtype(dtype, model_config: ModelConfig, device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if torch.device(device).type == "cpu":
            return torch.float32
        return getattr(torch, model_config.torch_dtype)
    names = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "half": torch.float16,
             "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype: unknown {dtype!r} (auto, float32, bfloat16, float16)")
    return names[dtype]


@dataclass
class _Launched:
    """A step on the device: its chunks as (request, start, end, first logits position), the logits when prompt
    logprobs need them, and the sampled rows (`rows`: request id -> row)."""

    spans: list[tuple[Request, int, int, int]]
    logits: torch.Tensor | None
    sample_reqs: list[Request]
    sampled: SampledBatch | None
    rows: dict[str, int]


@dataclass
class _Parent:
    """A client request; with n > 1 it fans out into n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]


class LLMEngine:
    def __init__(
        self,
        model: str | None,
        engine_config: EngineConfig | None = None,
        weights=None,
        tokenizer=None,
        model_config: ModelConfig | None = None,
    ):
        self.config = engine_config or EngineConfig()
        self.device = resolve_device(self.config.device)
        self.model_config = model_config or load_model_config(model)
        mc = self.model_config
        if self.config.max_num_batched_tokens is None:
            self.config = dataclasses.replace(
                self.config, max_num_batched_tokens=default_max_num_batched_tokens(self.device, server=False))
            logger.info("max_num_batched_tokens=%d (this device's default)", self.config.max_num_batched_tokens)
        self.dtype = resolve_dtype(self.config.dtype, mc, self.device)
        torch.manual_seed(self.config.seed)
        self.model = load_model(mc, model, self.dtype, self.device, self.config.load_format, weights,
                                seed=self.config.seed,
                                ple_table_device=self.config.ple_table_device,
                                ple_table_dtype=self.config.ple_table_dtype,
                                gpu_memory_utilization=self.config.gpu_memory_utilization)
        self.cache = CacheManager(mc, self.config, self.dtype, self.device)
        self.scheduler = Scheduler(self.config, self.cache)
        graphs = None
        if self.device.type == "cuda" and not self.config.enforce_eager:
            from .cuda_graph import CUDAGraphRunner

            graphs = CUDAGraphRunner(self.model, self.cache, self.config.max_model_len, self.config.max_num_seqs,
                                     self.device, self.config.cuda_graph_sizes, self.config.max_num_batched_tokens)
            graphs.capture()
        self.runner = ModelRunner(self.model, self.cache, self.device, graphs)
        self.sampler = Sampler(self.device, self.config.seed)
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(model)
        self.metrics = EngineMetrics()
        self._parents: dict[str, _Parent] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.eos_token_ids = list(mc.stop_token_ids)
        async_scheduling = self.config.async_scheduling
        self.async_scheduling = self.device.type == "cuda" if async_scheduling is None else async_scheduling
        self._inflight: _Launched | None = None  # the launched step whose samples are not read yet
        if self.device.type == "cuda":
            self._warm_up()

    def _warm_up(self) -> None:
        """Eager steps of the shapes serving meets first: decodes mixed with prefills, prompts continued across
        steps (with a context longer than the QSA budget where the model allows), token counts that are and are not
        multiples of 16. Their compilation (dynamo recompiling a size as dynamic, Triton specialising integer
        arguments, fla autotuning) then happens here, not as a stall of several seconds in the middle of serving."""
        t0 = time.perf_counter()
        c, mc = self.config, self.model_config
        limit = c.max_model_len - 4
        if limit < 1:
            return
        short = [min(n, limit) for n in (5, 100, 37, 300)]
        long = []
        if mc.qsa and mc.indexer_budget + mc.indexer_compress_ratio + 200 <= limit:
            long = [mc.indexer_budget + mc.indexer_compress_ratio + 200]
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
        config = self.scheduler.config
        # Two chunk sizes, so that every prefill-only path sees two token counts. Then one prefill step of each size
        # at which a kernel choice or an autotuning key changes, up to the full budget: the 64-request runs met
        # those (MoE tile configs, fla's l2norm buckets) as 0.3-7 s stalls. A step larger than max_model_len is
        # several prompts, as serving meets it.
        def prompts(n):
            return [limit] * (n // limit) + [n % limit] * (n % limit > 0)

        def pages(n):
            return sum(self.cache.pages_needed(m + params.max_tokens) for m in prompts(n))

        full = min(config.max_num_batched_tokens, c.max_num_seqs * limit)
        while full > 1 and pages(full) > self.cache.pages.num_usable:
            full -= c.page_size
        sizes = set(ops.moe.warm_up_token_counts(mc.num_experts, mc.num_experts_per_tok, full)) | {full}
        if any(t == LINEAR for t in mc.layer_types):
            sizes |= set(ops.gated_delta.warm_up_token_counts(mc.linear_num_key_heads, full))
        # Largest first: kernels that autotune once per shape of their weights (fla's chunk kernels) keep the
        # choice of their first call, and the large prefill steps are where their time goes (H200, 16 x 1k tokens:
        # fla's kkt + solve kernel tuned on a 64-token step took 0.94 ms a layer, tuned on the full step 0.31 ms).
        rounds = [(n, prompts(n)) for n in sorted(sizes, reverse=True) if n > 1] + [(64, short), (1000, short + long)]
        # prefills eagerly, mixed-step graphs or not: the steps those graphs do not take (prompt logprobs,
        # speculative verification, more tokens than their largest bucket) are eager
        graphs = self.runner.graphs
        mixed_sizes = graphs.mixed_sizes if graphs is not None else []
        if graphs is not None:
            graphs.mixed_sizes = []
        try:
            for budget, lengths in rounds:
                budget = min(budget, config.max_num_batched_tokens)
                self.scheduler.config = dataclasses.replace(config, max_num_batched_tokens=budget)
                for i, n in enumerate(lengths):
                    prompt = [(7 * j + i) % mc.vocab_size for j in range(n)]
                    self.add_request(f"warm-up-{budget}-{i}", {"prompt_token_ids": prompt}, params)
                while self.has_unfinished_requests():
                    self.step()
        finally:
            self.scheduler.config = config
            if graphs is not None:
                graphs.mixed_sizes = mixed_sizes
        self.metrics = EngineMetrics()
        logger.info("warm-up steps (compiling the eager step shapes) took %.1f s", time.perf_counter() - t0)

    # ----- requests -----
    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        text, ids = self._tokenize_prompt(prompt)
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        limit = self.config.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} in the completion). "
                f"Please reduce the length of the messages or completion."
            )
        if max_tokens < 1:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within max_model_len={limit}")
        now = arrival_time if arrival_time is not None else time.monotonic()
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            req = Request(child_id, list(ids), params, index=i, parent_id=request_id, prompt=text, arrival_time=now,
                          max_tokens=max_tokens)
            req.logprobs = [] if params.logprobs is not None else None
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None]
            if params.detokenize and self.tokenizer is not None:
                self._detok[child_id] = IncrementalDetokenizer(
                    self.tokenizer, ids, params.skip_special_tokens, params.spaces_between_special_tokens,
                    params.stop, params.include_stop_str_in_output,
                )
            children.append(req)
            self.scheduler.add(req)
        self._parents[request_id] = _Parent(request_id, text, list(ids), children)

    def _tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass prompt_token_ids instead")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("prompt: expected a string, a list of token ids or {'prompt_token_ids': [...]}")

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        for req in parent.children:
            if not req.finished:
                self.scheduler.finish(req)
                req.finish_reason = "abort"
            self._forget(req)
        self._update_gauges()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ----- the step -----
    def step(self) -> list[RequestOutput]:
        """Schedules and launches one step. Synchronous: waits for it and returns its outputs. With asynchronous
        scheduling it returns the outputs of the step launched by the previous call instead, so the host's
        bookkeeping overlaps the device's work; a request that stops on a sampled token then runs one extra
        position whose token is dropped, and new decode tokens reach the device without a host round trip."""
        overlap = self._overlap()
        if self._inflight is not None and not overlap:
            done, self._inflight = self._inflight, None  # drain first: this step's sampling needs every id
            outs = self._complete(done)
            self._update_gauges()
            return outs
        sched = self.scheduler.schedule()
        if sched.preempted:
            self.metrics.preemptions.inc(len(sched.preempted))
        launched = self._launch(sched) if sched.scheduled else None
        if overlap:
            done, self._inflight = self._inflight, launched
        else:
            done = launched
        outs = self._complete(done) if done is not None else []
        self._update_gauges()
        return outs

    def _overlap(self) -> bool:
        """Asynchronous scheduling, unless a request's sampling reads its previous ids (penalties, min_tokens), which
        the host has not read yet while a step is in flight."""
        if not self.async_scheduling:
            return False
        return not any(reads_history(r.params) for q in (self.scheduler.running, self.scheduler.waiting) for r in q)

    def _launch(self, sched: SchedulerOutput) -> "_Launched":
        """Builds the chunks, runs the model and the sampler without waiting for them; advances the requests."""
        n_ctx = self.model_config.ngram_size - 1
        prev = self._inflight
        chunks, spans = [], []
        for s in sched.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            end = start + s.num_tokens
            known = min(end, req.num_tokens)
            pending_row = -1
            if end > known:  # the last token was sampled by the step still in flight
                pending_row = prev.rows[req.request_id]
            first = self._logits_from(req, start, end)
            chunks.append(RequestChunk(
                token_ids=req.token_ids(start, known) + [0] * (end - known),
                context_len=start,
                history=req.token_ids(max(0, start - n_ctx), start),
                pages=req.pages,
                state_slot=req.state_slot,
                logits_from=first - start,
                pending_row=pending_row,
            ))
            spans.append((req, start, end, first))
        pending_ids = prev.sampled.token_ids if prev is not None and prev.sampled is not None else None
        logits = self.runner.execute(chunks, pending_ids)
        row, sample_rows, sample_reqs, keep_logits = 0, [], [], False
        for req, start, end, first in spans:
            keep_logits |= req.prompt_logprobs is not None and first < req.num_prompt_tokens - 1
            req.num_computed_tokens = end
            if end == req.num_tokens_with_pending:
                sample_rows.append(row + end - first - 1)
                sample_reqs.append(req)
            row += end - first
        sampled = None
        if sample_reqs:
            if sample_rows != list(range(logits.shape[0])):  # decode steps sample every row, in order
                logits_s = logits[to_device(sample_rows, logits.device)]
            else:
                logits_s = logits
            sampled = self.sampler.sample(logits_s, sample_reqs, [self._stop_ids(r) for r in sample_reqs])
            for req in sample_reqs:
                req.num_pending += 1
        return _Launched(spans, logits if keep_logits else None, sample_reqs, sampled,
                         {r.request_id: i for i, r in enumerate(sample_reqs)})

    @staticmethod
    def _logits_from(req: Request, start: int, end: int) -> int:
        """First position of the chunk whose logits are needed (end for none)."""
        samples = end == req.num_tokens_with_pending
        if req.prompt_logprobs is not None:
            pending = len(req.prompt_logprobs) - 1  # prompt logprobs come from positions pending.. prompt_len-2
            if pending < req.num_prompt_tokens - 1 and pending < end:
                return max(start, pending)
        return end - 1 if samples else end

    def _complete(self, step: "_Launched") -> list[RequestOutput]:
        """Reads a launched step's samples (waiting for the device) and applies them; returns the outputs."""
        out = step.sampled.to_host() if step.sampled is not None else None
        row = prompt_tokens = 0
        for req, start, end, first in step.spans:
            if step.logits is not None and req.prompt_logprobs is not None and first < req.num_prompt_tokens - 1:
                upto = min(end, req.num_prompt_tokens - 1)
                self._record_prompt_logprobs(req, step.logits[row: row + upto - first], first)
            prompt_tokens += max(0, min(end, req.num_prompt_tokens) - start)
            row += end - first
        if prompt_tokens:
            self.metrics.prompt_tokens.inc(prompt_tokens)
        touched: dict[str, _Parent] = {}
        now = time.monotonic()
        generated = 0
        for i, req in enumerate(step.sample_reqs):
            req.num_pending -= 1
            if req.finished:  # stopped or aborted while this step ran: its extra token is dropped
                continue
            generated += 1
            self._append(req, out, i, now)
            touched[req.parent_id] = self._parents[req.parent_id]
        if generated:
            self.metrics.generation_tokens.inc(generated)
        for req, *_ in step.spans:
            if req.prompt_logprobs is not None and req.parent_id in self._parents:
                touched.setdefault(req.parent_id, self._parents[req.parent_id])
        return [self._output(p) for p in touched.values()]

    def _stop_ids(self, req: Request) -> list[int]:
        ids = list(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            ids += [t for t in self.eos_token_ids if t not in ids]
        return ids

    def _record_prompt_logprobs(self, req: Request, rows: torch.Tensor, first: int) -> None:
        k = req.params.prompt_logprobs
        targets = req.prompt_token_ids[first + 1: first + 1 + rows.shape[0]]
        chosen, ranks, top_ids, top_lps = prompt_logprobs(rows, targets, k)
        for j, tok in enumerate(targets):
            entry = {tok: Logprob(chosen[j], ranks[j], self._piece(tok))}
            for tid, lp in zip(top_ids[j], top_lps[j]):
                if tid not in entry:
                    entry[tid] = Logprob(lp, top_ids[j].index(tid) + 1, self._piece(tid))
            req.prompt_logprobs.append(entry)

    def _piece(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _append(self, req: Request, out, i: int, now: float) -> None:
        tok = out.token_ids[i]
        req.output_token_ids.append(tok)
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.observe(now - req.arrival_time)
        else:
            self.metrics.itl.observe(now - req.last_token_time)
        req.last_token_time = now
        req.cumulative_logprob += out.logprobs[i]
        if req.logprobs is not None:
            entry = {tok: Logprob(out.logprobs[i], out.ranks[i], self._piece(tok))}
            for rank, (tid, lp) in enumerate(zip(out.topk_ids[i], out.topk_logprobs[i]), start=1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, self._piece(tid))
            req.logprobs.append(entry)
        detok = self._detok.get(req.request_id)
        if detok is not None and detok.add(tok):
            return self._finish(req, "stop", detok.stop_reason)
        n_out = len(req.output_token_ids)
        if n_out >= req.params.min_tokens:
            if tok in req.params.stop_token_ids:
                return self._finish(req, "stop", tok)
            if not req.params.ignore_eos and tok in self.eos_token_ids:
                return self._finish(req, "stop", None)
        if n_out >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            self._finish(req, "length", None)

    def _finish(self, req: Request, reason: str, stop_reason) -> None:
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.scheduler.finish(req)
        self.sampler.release(req)
        self.metrics.finished.labels(finished_reason=reason).inc()
        self.metrics.e2e.observe(time.monotonic() - req.arrival_time)

    def _forget(self, req: Request) -> None:
        self._detok.pop(req.request_id, None)
        self.sampler.release(req)

    def _output(self, parent: _Parent) -> RequestOutput:
        outputs = []
        for req in parent.children:
            detok = self._detok.get(req.request_id)
            if detok is None:
                text = ""
            elif req.finished:
                text = detok.flush()
            else:
                text = detok.text[: len(detok.text) - detok.held_back()]
            outputs.append(CompletionOutput(
                index=req.index, text=text, token_ids=list(req.output_token_ids),
                cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                logprobs=list(req.logprobs) if req.logprobs is not None else None,
                finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            ))
        finished = all(r.finished for r in parent.children)
        first = parent.children[0]
        out = RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            outputs=outputs, finished=finished,
            metrics={"arrival_time": first.arrival_time, "first_token_time": first.first_token_time,
                     "num_preemptions": sum(r.num_preemptions for r in parent.children)},
        )
        if finished:
            self._parents.pop(parent.request_id, None)
            for req in parent.children:
                self._forget(req)
        return out

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self.metrics.cache_usage.set(self.cache.usage)


def _load_tokenizer(model_dir: str | None):
    if model_dir is None:
        return None
    import os

    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")) and not os.path.isfile(
        os.path.join(model_dir, "tokenizer_config.json")
    ):
        logger.warning("no tokenizer in %s: text prompts and detokenization are disabled", model_dir)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


__all__ = ["LLMEngine", "RequestStatus"]
