"""Model runner: runs one step's scheduled chunks through the model and returns the wanted logits rows, eagerly or
from a CUDA graph.

Nothing here decides what runs; the scheduler does. Nothing here knows layer internals; the model does. The step
layout comes from step_builder.py, for eager and graph steps alike.
"""

from __future__ import annotations

import torch

from ..model import ModelCache, Qwen4ExpForCausalLM
from ..model.state import copy_slots
from .rejection_sampler import greedy_acceptance
from .step_builder import RequestChunk, StepBuilder, fill_pending, to_device

__all__ = ["ModelRunner"]


class ModelRunner:
    def __init__(self, model: Qwen4ExpForCausalLM, cache: ModelCache, page_size: int, device, graphs=None):
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.config = model.config
        self.builder = StepBuilder(self.config, page_size)
        self.graphs = graphs  # CUDAGraphRunner for decode and small mixed steps, or None (eager)

    @torch.inference_mode()
    def copy_state_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Queues the copies of the recurrent states of slot `source` to slot `destination` for every pair (prefix
        caching's checkpoints), ordered on the device with the steps around them."""
        index = to_device(list(zip(*pairs)), self.device, torch.long)
        copy_slots(self.cache, index[0], index[1])

    @torch.inference_mode()
    def execute(self, chunks: list[RequestChunk], pending_ids: torch.Tensor | None = None,
                mixed_graphs: bool = True, return_streams: bool = False,
                multimodal: bool = False) -> torch.Tensor | tuple:
        """Runs one step; returns the logits (fp32) of the wanted rows, in the order of `chunks`. `pending_ids`:
        the previous step's sampled ids on the device, for chunks with a `pending_row`. `mixed_graphs=False` runs
        steps with prefill chunks eagerly even where a mixed-step graph would take them.

        After a CUDA-graph decode step the logits are a view of the graph's output, valid until the next step is
        launched: work reading them must be queued before (the sampler's is) or take a copy. (The engine keeps
        logits past a step only for prompt logprobs, whose steps never run as graphs: graphs want each request's
        last row only.)

        return_streams (speculative decoding, which orders its chunks decodes first): returns (logits, every row's
        multi-stream state [T, hc*H] for the MTP draft layer (model/mtp.py), the argmax of each wanted row, the
        drafts greedy verification keeps per chunk (rejection_sampler.greedy_acceptance)), from the speculative
        graphs (cuda_graph.py; then views of the graph's outputs, valid until the next step is launched) or
        eagerly.

        multimodal: some chunk has images (RequestChunk.mm). A step that feeds image tokens runs eagerly (graphs
        take no image features); the others replay graphs where their rotary positions allow (cuda_graph.py)."""
        if self.graphs is not None:
            self.graphs.last_key = None
        if (self.graphs is not None and return_streams == bool(self.graphs.speculative)
                and not (multimodal and any(c.mm_features for c in chunks))
                and self.graphs.can_run(chunks, mixed=mixed_graphs)):
            out = self.graphs.execute(chunks, pending_ids, multimodal)
            if out is not None:
                return out
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) != 1)  # decodes first
        ordered = [chunks[i] for i in order]
        layout = self.builder.build(ordered, multimodal)
        meta = layout.to_metadata(self.device)
        fill_pending(meta.input_ids, layout.pending, pending_ids)
        if return_streams:
            assert order == sorted(order), "the caller orders the chunks decodes first"
            hidden, streams = self.model(meta, self.cache, return_streams=True)
            logits = self.model.compute_logits(hidden[meta.logits_indices])
            tokens = logits.argmax(-1)
            return logits, streams, tokens, greedy_acceptance(tokens, meta, meta.logits_indices)
        hidden = self.model(meta, self.cache)
        logits = self.model.compute_logits(hidden[meta.logits_indices])
        if order == sorted(order):
            return logits
        # rows come grouped per chunk in execution order; put the groups back in the caller's order
        sizes = [len(c.token_ids) - c.logits_from for c in ordered]
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        where = {i: j for j, i in enumerate(order)}
        index = [r for i in range(len(chunks)) for r in range(starts[where[i]], starts[where[i]] + sizes[where[i]])]
        return logits[to_device(index, logits.device)]
