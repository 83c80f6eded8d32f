"""LLMEngine: add requests, then `step()` until done. One step = schedule -> launch (run the model, sample) ->
complete (read the samples; output_processor.py turns them into RequestOutputs), with at most one step in flight.
Structured output (grammar masks on the sampled rows) lives in structured_output.py, speculative decoding (launch
verifies drafts, complete drafts the next ones) in spec_decode.py."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from .. import distributed
from ..config import (
    ConfigError,
    EngineConfig,
    ModelConfig,
    default_max_num_batched_tokens,
    generation_defaults,
    load_model_config,
    resolve_device,
)
from ..memory import InsufficientMemoryError
from ..multimodal import ImageProcessor, MultiModalProcessor
from ..weights.loader import load_model
from .cache import allocate_engine_cache, resolve_page_size
from .metrics import EngineMetrics
from .output_processor import OutputProcessor, ParentRequest
from .request import (
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    bad_word_variants,
    bad_words_token_ids,
)
from .runner import ModelRunner
from .sampler import SampledBatch, Sampler, reads_history
from .scheduler import Scheduler, SchedulerOutput
from .spec_decode import SpecDecoder, SpecStep
from .step_builder import RequestChunk, to_device
from .structured_output import StructuredOutputs
from .warmup import warm_up
from .workers import DriverRunner, start_workers

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
    logprobs need them, and the sampled rows (`rows`: request id -> row). `to_sample`: the logits rows still to
    sample, when a grammar mask waits for ids of the step before (see `step`)."""

    spans: list[tuple[Request, int, int, int]]
    logits: torch.Tensor | None
    sample_reqs: list[Request]
    sampled: SampledBatch | None
    rows: dict[str, int]
    to_sample: torch.Tensor | None = None


class LLMEngine:
    def __init__(
        self,
        model: str | None,
        engine_config: EngineConfig | None = None,
        weights=None,
        tokenizer=None,
        model_config: ModelConfig | None = None,
        served_model_name: str | None = None,
        image_processor=None,
        warm_up_steps: bool = True,
    ):
        """served_model_name: the `model_name` label of the metrics (default: the model path). image_processor: a
        transformers image processor for a multimodal model held in memory (default: the one the checkpoint's
        preprocessor_config.json names). warm_up_steps: on CUDA, run the start-up warm-up (engine/warmup.py);
        measurements that run a few fixed shapes through `runner.execute` skip it (its compilation takes minutes
        on a fresh machine)."""
        self.config = engine_config or EngineConfig()
        self.served_model_name = served_model_name or model or "qwen4exp"
        self.device = resolve_device(self.config.device)
        self.model_config = model_config or load_model_config(model)
        mc = self.model_config
        if self.config.max_num_batched_tokens is None:
            self.config = dataclasses.replace(
                self.config, max_num_batched_tokens=default_max_num_batched_tokens(self.device, server=False))
            logger.info("max_num_batched_tokens=%d (this device's default)", self.config.max_num_batched_tokens)
        self.dtype = resolve_dtype(self.config.dtype, mc, self.device)
        if self.config.enable_prefix_caching and self.config.speculative_config is not None:
            logger.info("prefix caching is off with speculative decoding (its verification steps keep 1 + k states "
                        "per sequence, which checkpoints do not save)")
            self.config = dataclasses.replace(self.config, enable_prefix_caching=False)
        if self.config.enable_prefix_caching and self.config.tensor_parallel_size > 1:
            logger.info("prefix caching is off with tensor_parallel_size > 1 (the ranks' state checkpoints are not "
                        "copied yet)")
            self.config = dataclasses.replace(self.config, enable_prefix_caching=False)
        self.workers = None  # the other ranks' processes (engine/workers.py) when the model is split over several
        if self.config.tensor_parallel_size > 1:
            if weights is not None:
                raise ValueError("weights: a model split over ranks is read by each rank from the checkpoint files")
            if self.config.speculative_config is not None:
                raise ConfigError("speculative_config", "is not supported with tensor_parallel_size > 1")
            self.workers = start_workers(self.config, mc, model, self.device)
        try:
            self.config, self.cache, cache_tensors, graphs, draft_graphs, self.model = build_model_and_cache(
                model, self.config, mc, self.dtype, self.device, weights)
        except BaseException:
            self.shutdown()
            raise
        self.scheduler = Scheduler(self.config, self.cache)
        speculative = self.config.speculative_config is not None
        if self.workers is None:
            self.runner = ModelRunner(self.model, cache_tensors, self.config.page_size, self.device, graphs)
        else:
            self.runner = DriverRunner(self.model, cache_tensors, self.config.page_size, self.device, graphs,
                                       workers=self.workers)
        self.sampler = Sampler(self.device, self.config.seed)
        self.spec = (SpecDecoder(self.config, self.model, cache_tensors, self.config.page_size, self.device,
                                 self.sampler, draft_graphs) if speculative else None)
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(model)
        self.mm_processor = None
        if mc.vision is not None:
            processor = (ImageProcessor(image_processor, mc.vision) if image_processor is not None
                         else ImageProcessor.from_dir(model, mc.vision) if model is not None else None)
            limit = (self.config.limit_mm_per_prompt or {}).get("image")
            self.mm_processor = MultiModalProcessor(mc.vision, processor, limit)
        # the sampling defaults of requests that leave them unset (vLLM's get_diff_sampling_param)
        self.generation_defaults = generation_defaults(model, self.config.generation_config,
                                                       self.config.override_generation_config)
        self.eos_token_ids = list(mc.stop_token_ids)
        self.structured_outputs = StructuredOutputs(self.tokenizer, mc.vocab_size, self.config.max_num_seqs,
                                                    self.device, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.config.max_model_len,
                                                self._new_metrics())
        async_scheduling = self.config.async_scheduling
        self.async_scheduling = self.device.type == "cuda" if async_scheduling is None else async_scheduling
        self._inflight: _Launched | None = None  # the launched step whose samples are not read yet
        if self.device.type == "cuda" and warm_up_steps:
            with _out_of_memory_as_error("warming up", self.config):
                warm_up(self)
            logger.info("memory after the warm-up: %.1f GiB allocated at the peak, %.1f GiB reserved by the allocator "
                        "(of %.1f GiB)", torch.cuda.max_memory_allocated(self.device) / 2**30,
                        torch.cuda.memory_reserved(self.device) / 2**30,
                        torch.cuda.get_device_properties(self.device).total_memory / 2**30)

    def shutdown(self) -> None:
        """Stops the other ranks' processes and leaves the process group (nothing to do in a single process)."""
        if self.workers is None:
            return
        self.workers.stop(getattr(getattr(self, "runner", None), "channel", None))
        self.workers = None
        distributed.shutdown()

    def worker_failure(self) -> str | None:
        """Why a rank of the model stopped (the engine cannot step), or None."""
        return self.workers.failure() if self.workers is not None else None

    @property
    def metrics(self) -> EngineMetrics:
        return self.output_processor.metrics

    def reset_metrics(self, served_model_name: str | None = None) -> None:
        """Starts the metrics from zero, labelled with `served_model_name` when given."""
        self.served_model_name = served_model_name or self.served_model_name
        self.output_processor.metrics = self._new_metrics()

    def _new_metrics(self) -> EngineMetrics:
        c = self.config
        cache_info = {"block_size": str(c.page_size), "cache_dtype": "auto",
                      "enable_prefix_caching": str(self.cache.prefix is not None),
                      "gpu_memory_utilization": str(c.gpu_memory_utilization),
                      "num_gpu_blocks": str(self.cache.pages.num_usable)}
        return EngineMetrics(self.served_model_name, c.max_model_len, cache_info, c.num_speculative_tokens)

    # ----- requests -----
    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        text, ids = self._tokenize_prompt(prompt)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and not (isinstance(salt, str) and salt):
            raise ValueError(f"cache_salt: must be a non-empty string, got {salt!r}")
        mm = self._multimodal(prompt, ids) if isinstance(prompt, dict) else None
        if mm is not None:
            ids = mm[0]
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.bad_words and params.bad_words_token_ids is None:
            if self.tokenizer is None:
                raise ValueError("bad_words: the model has no tokenizer; pass bad_words_token_ids")
            params.bad_words_token_ids = bad_words_token_ids(
                [self.tokenizer.encode(t, add_special_tokens=False) for t in bad_word_variants(params.bad_words)])
        bad = [t for t in params.allowed_token_ids or () if t >= vocab]
        if bad:
            raise ValueError(f"allowed_token_ids: {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for word in params.bad_words_token_ids or () for t in word if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"bad_words: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
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
        # a cache hit where the server compiled it already (off the engine thread)
        grammar = (self.structured_outputs.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        now = arrival_time if arrival_time is not None else time.monotonic()
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            req = Request(child_id, list(ids), params, index=i, parent_id=request_id, prompt=text,
                          arrival_time=now, max_tokens=max_tokens, cache_salt=salt)
            if mm is not None:  # each sequence consumes the features on its own schedule
                req.mm = dataclasses.replace(mm[1], features={})
            if grammar is not None:
                req.grammar = self.structured_outputs.matcher(grammar, self._stop_ids(req))
            children.append(req)
        self.output_processor.add(ParentRequest(request_id, text, list(ids), children))
        for req in children:
            self.scheduler.add(req)

    def _multimodal(self, prompt: dict, ids: list[int]):
        """(expanded ids, MultiModalState) of a prompt with `multi_modal_data` (vLLM's {"image": one or a list}) or
        a `multi_modal_state` prepared by MultiModalProcessor.prepare; None for a prompt without images."""
        state = prompt.get("multi_modal_state")
        data = prompt.get("multi_modal_data")
        if state is not None:
            if self.spec is not None:
                raise ValueError("multi_modal_data: speculative decoding does not take images")
            if self.workers is not None:
                raise ValueError("multi_modal_data: images are not supported with tensor_parallel_size > 1")
            return ids, state
        if not data:
            return None
        if not isinstance(data, dict) or set(data) - {"image"}:
            got = sorted(data) if isinstance(data, dict) else data
            raise ValueError(f"multi_modal_data: only 'image' is supported, got {got!r}")
        if self.mm_processor is None:
            raise ValueError("multi_modal_data: the model has no vision tower (config.json has no vision_config)")
        if self.workers is not None:
            raise ValueError("multi_modal_data: images are not supported with tensor_parallel_size > 1")
        if self.spec is not None:
            raise ValueError("multi_modal_data: speculative decoding does not take images")
        images = data["image"]
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if not images:
            return None
        return self.mm_processor.prepare(ids, images)

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

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached page and checkpoint (vLLM's reset_prefix_cache); False, changing nothing, while a
        request holds pages. True without prefix caching."""
        return self.cache.prefix is None or self.cache.prefix.reset()

    def abort_request(self, request_id: str) -> None:
        for req in self.output_processor.abort(request_id):
            self._free(req)
        self._update_gauges()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # ----- the step -----
    def step(self, *, token_budget: int | None = None, mixed_graphs: bool = True) -> list[RequestOutput]:
        """Schedules and launches one step. Synchronous: waits for it and returns its outputs. With asynchronous
        scheduling it returns the outputs of the step launched by the previous call instead, so the host's
        bookkeeping overlaps the device's work; a request that stops on a sampled token then runs one extra
        position whose token is dropped, and new decode tokens reach the device without a host round trip. A
        structured-output row's mask needs its sequence's previous id accepted by its grammar: while that id is in
        flight, the step launches the model, reads the previous step's ids as the device computes, and samples
        after (as vLLM defers such sampling), so the overlap stays. With speculative decoding a step returns its own
        outputs, launching the next one first where it can be chained to it (SpecDecoder.chain), which then runs
        without being scheduled.

        token_budget: this step's tokens instead of max_num_batched_tokens; mixed_graphs=False: steps with prefill
        chunks run eagerly even where a mixed-step graph would take them (both for the warm-up)."""
        overlap = self._overlap()
        if self.spec is not None and self._inflight is not None:
            launched = self._inflight  # chained to the step before (SpecDecoder.chain): on the device already
        elif self._inflight is not None and not overlap:
            done, self._inflight = self._inflight, None  # drain first: this step's sampling needs every id
            outs = self._complete(done)
            self._update_gauges()
            return outs
        else:
            sched = self.scheduler.schedule(token_budget)
            if sched.preempted:
                self.metrics.preemptions.inc(len(sched.preempted))
            if sched.num_queried_tokens:
                self.metrics.prefix_cache_queries.inc(sched.num_queried_tokens)
                self.metrics.prefix_cache_hits.inc(sched.num_hit_tokens)
            launched = self._launch(sched, mixed_graphs) if sched.scheduled else None
        if self.spec is not None:
            # the next step goes to the device before this one is read, where it can (the speculative overlap)
            self._inflight = self.spec.chain(self, launched) if launched is not None else None
            done = launched
        elif overlap:
            done, self._inflight = self._inflight, launched
        else:
            done = launched
        outs = self._complete(done) if done is not None else []
        if isinstance(launched, _Launched) and launched.to_sample is not None:
            # the grammar masks needed the ids just read: the model already runs while they were read and accepted
            reqs = launched.sample_reqs
            launched.sampled = self._sample(launched.to_sample, reqs,
                                            [i for i, r in enumerate(reqs) if r.grammar is not None])
            launched.to_sample = None
            for req in reqs:  # one that finished just now sampled a dropped position: keep no sampler state for it
                if req.status == RequestStatus.FINISHED:
                    self.sampler.release(req)
        self._update_gauges()
        return outs

    def _overlap(self) -> bool:
        """Asynchronous scheduling, unless a request's sampling reads its previous ids (penalties, min_tokens), which
        the host has not read yet while a step is in flight, or speculative decoding is on (a step's tokens are the
        drafts the previous one accepted)."""
        if not self.async_scheduling or self.spec is not None:
            return False
        return not any(reads_history(r.params) for q in (self.scheduler.running, self.scheduler.waiting) for r in q)

    def _launch(self, sched: SchedulerOutput, mixed_graphs: bool = True) -> "_Launched | SpecStep":
        """Builds the chunks, runs the model and the sampler without waiting for them (the sampler waits where a
        grammar mask needs an id still in flight, see `step`); advances the requests."""
        if self.spec is not None:
            return self.spec.launch(self, sched, mixed_graphs)
        n_ctx = self.model_config.ngram_size - 1
        prev = self._inflight
        chunks, spans, multimodal = [], [], False
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
            if req.mm is not None:
                chunks[-1].mm, chunks[-1].mm_features = req.mm, self._image_features(req, start, end)
                multimodal = True
            spans.append((req, start, end, first))
        pending_ids = prev.sampled.token_ids if prev is not None and prev.sampled is not None else None
        if sched.restores:  # prefix caching: resuming requests start from a checkpoint's state
            self.runner.copy_state_slots(sched.restores)
        logits = self.runner.execute(chunks, pending_ids, mixed_graphs, multimodal=multimodal)
        if sched.saves:  # and chunks ending at a checkpoint boundary leave their state there
            self.runner.copy_state_slots(sched.saves)
        row, sample_rows, sample_reqs, keep_logits = 0, [], [], False
        for req, start, end, first in spans:
            keep_logits |= req.prompt_logprobs is not None and first < req.num_prompt_tokens - 1
            req.num_computed_tokens = end
            if req.mm is not None:
                req.mm.release_consumed(end)
            if end == req.num_tokens_with_pending:
                sample_rows.append(row + end - first - 1)
                sample_reqs.append(req)
            row += end - first
        sampled = to_sample = None
        if sample_reqs:
            if sample_rows != list(range(logits.shape[0])):  # decode steps sample every row, in order
                logits_s = logits[to_device(sample_rows, logits.device)]
            else:
                logits_s = logits
            constrained = [i for i, r in enumerate(sample_reqs) if r.grammar is not None]
            # a grammar mask needs its sequence's every id: one still in flight defers the sampling (see `step`)
            if any(sample_reqs[i].num_pending for i in constrained):
                to_sample = logits_s
            else:
                sampled = self._sample(logits_s, sample_reqs, constrained)
            for req in sample_reqs:
                req.num_pending += 1
        return _Launched(spans, logits if keep_logits else None, sample_reqs, sampled,
                         {r.request_id: i for i, r in enumerate(sample_reqs)}, to_sample)

    def _image_features(self, req: Request, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """(first row within the chunk, features) of the image tokens among positions [start, end) of `req`; the
        vision tower runs once for the images not encoded yet (kept until the prefill has consumed them)."""
        mm = req.mm
        wanted = mm.images_in(start, end)
        missing = [i for i in wanted if i not in mm.features]
        if missing:
            with torch.inference_mode():
                encoded = self.model.encode_images([(mm.images[i].pixel_values, mm.images[i].grid_thw)
                                                    for i in missing])
            mm.features.update(zip(missing, encoded))
        out = []
        for i in wanted:
            image = mm.images[i]
            lo, hi = max(start, image.offset), min(end, image.offset + image.length)
            out.append((lo - start, mm.features[i][lo - image.offset: hi - image.offset]))
        return out

    def _sample(self, logits: torch.Tensor, reqs: list[Request], constrained: list[int]) -> SampledBatch:
        """Samples one row per request, the `constrained` rows under their grammar's mask."""
        mask = None
        if constrained:
            mask = self.structured_outputs.bitmask(constrained, [reqs[i].grammar for i in constrained], len(reqs))
        return self.sampler.sample(logits, reqs, [self._stop_ids(r) for r in reqs], mask)

    @staticmethod
    def _logits_from(req: Request, start: int, end: int) -> int:
        """First position of the chunk whose logits are needed (end for none)."""
        samples = end == req.num_tokens_with_pending
        if req.prompt_logprobs is not None:
            pending = len(req.prompt_logprobs) - 1  # prompt logprobs come from positions pending.. prompt_len-2
            if pending < req.num_prompt_tokens - 1 and pending < end:
                return max(start, pending)
        return end - 1 if samples else end

    def _complete(self, step: "_Launched | SpecStep") -> list[RequestOutput]:
        """Reads a launched step's samples (waiting for the device), hands them to the output processor and frees
        the sequences that finished; returns the outputs."""
        if isinstance(step, SpecStep):
            return self.spec.complete(self, step)
        samples = step.sampled.to_host() if step.sampled is not None else None
        for req in step.sample_reqs:
            req.num_pending -= 1
        outputs, finished = self.output_processor.process(step.spans, step.logits, step.sample_reqs, samples)
        for req in finished:
            self._free(req)
        return outputs

    def _free(self, req: Request) -> None:
        """Frees the pages, slot, sampler state and grammar matcher of a finished or aborted sequence."""
        self.scheduler.finish(req)
        self.sampler.release(req)
        req.grammar = None

    def _stop_ids(self, req: Request) -> list[int]:
        ids = list(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            ids += [t for t in self.eos_token_ids if t not in ids]
        return ids

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self.metrics.cache_usage.set(self.cache.usage)


def build_model_and_cache(model_dir: str | None, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                          device, weights=None):
    """This rank's model, its caches and CUDA graphs (every rank builds them alike). Returns (the config with its page
    size and max_model_len resolved, the cache allocator, the cache tensors, the CUDAGraphRunner or None, the draft
    layer's CUDAGraphRunner or None, the model)."""
    torch.manual_seed(config.seed)
    model = load_model(model_config, model_dir, dtype, device, config.load_format, weights,
                       seed=config.seed,
                       ple_table_device=config.ple_table_device,
                       ple_table_dtype=config.ple_table_dtype,
                       gpu_memory_utilization=config.gpu_memory_utilization,
                       quantization=config.quantization,
                       mtp=config.speculative_config is not None)
    # the page and slot ids the scheduler hands out (the allocator), and the tensors they index (the runner's); the
    # page size follows the model unless given
    config = dataclasses.replace(config, page_size=resolve_page_size(model_config, config.page_size))
    allocator, cache_tensors, max_model_len = allocate_engine_cache(model_config, config, dtype, device, model)
    config = dataclasses.replace(config, max_model_len=max_model_len)
    graphs = draft_graphs = None
    if device.type == "cuda" and not config.enforce_eager:
        from .cuda_graph import CUDAGraphRunner

        def runner(**kw):
            return CUDAGraphRunner(model, cache_tensors, config.page_size, config.max_model_len, config.max_num_seqs,
                                   device, config.cuda_graph_sizes, config.max_num_batched_tokens,
                                   config.num_speculative_tokens, **kw)

        with _out_of_memory_as_error("capturing CUDA graphs", config):
            graphs = runner()
            graphs.capture()
            if config.speculative_config is not None:  # the draft layer's reuse the target's pool: never run at once
                draft_graphs = runner(draft=True, pool=graphs.pool, target=graphs)
                draft_graphs.capture()
                if len(model.mtp.layers) == 1:  # SpecDecoder.chain's steps
                    graphs.capture_chained()
    return config, allocator, cache_tensors, graphs, draft_graphs, model


@contextlib.contextmanager
def _out_of_memory_as_error(what: str, config: EngineConfig):
    """A CUDA out-of-memory error while `what` as one message that says what to change: activations and CUDA graph
    pools live in what gpu_memory_utilization leaves of the device."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        raise InsufficientMemoryError(
            f"out of GPU memory while {what}: activations and CUDA graphs live in the "
            f"{1 - config.gpu_memory_utilization:.0%} of the device that --gpu-memory-utilization "
            f"{config.gpu_memory_utilization} leaves; try a lower "
            f"--max-num-batched-tokens (now {config.max_num_batched_tokens}), a lower --gpu-memory-utilization, fewer "
            f"--cuda-graph-sizes or --enforce-eager ({str(e).splitlines()[0]})") from None


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
