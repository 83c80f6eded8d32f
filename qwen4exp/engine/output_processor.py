"""Output processing: turns the ids a step sampled into what clients receive.

The engine core (engine.py) schedules, runs the model and samples; the sampled ids come here on the host. This
module appends them to their sequences and to the grammar matchers of structured-output sequences, records logprobs
and prompt logprobs, detokenizes incrementally and matches stop strings, decides finish reasons (stop ids, EOS, stop
strings, a grammar that ended, max_tokens, max_model_len), records the metrics, and builds one RequestOutput per
client request, its n sequences together. It frees nothing: the engine frees the pages, slot, sampler state and
matcher of the sequences it reports finished.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from .detokenizer import IncrementalDetokenizer
from .metrics import EngineMetrics
from .request import CompletionOutput, Logprob, Request, RequestOutput
from .sampler import SamplerOutput, prompt_logprobs

logger = logging.getLogger("qwen4exp")


@dataclass
class ParentRequest:
    """A client request; with n > 1 it fans out into n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int, metrics: EngineMetrics):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.parents: dict[str, ParentRequest] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def add(self, parent: ParentRequest) -> None:
        """Starts the outputs of a client request's sequences."""
        for req in parent.children:
            params = req.params
            req.logprobs = [] if params.logprobs is not None else None
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None]
            if params.detokenize and self.tokenizer is not None:
                self._detok[req.request_id] = IncrementalDetokenizer(
                    self.tokenizer, parent.prompt_token_ids, params.skip_special_tokens,
                    params.spaces_between_special_tokens, params.stop, params.include_stop_str_in_output,
                )
        self.parents[parent.request_id] = parent

    def abort(self, request_id: str) -> list[Request]:
        """Drops a client request; returns its sequences that were still unfinished (now finished by "abort")."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        aborted = [req for req in parent.children if req.finish_reason is None]
        for req in aborted:
            req.finish_reason = "abort"
        for req in parent.children:
            self._detok.pop(req.request_id, None)
        return aborted

    def process(self, spans: list[tuple[Request, int, int, int]], logits: torch.Tensor | None,
                sampled: list[Request], samples: SamplerOutput | None) -> tuple[list[RequestOutput], list[Request]]:
        """Applies one step: `spans` are its chunks as (request, start, end, first logits position), `logits` its
        logits rows when prompt logprobs need them, `sampled` the requests that sampled a token and `samples` their
        ids (row i: sampled[i]; a request with several tokens in the step, speculative decoding, is listed once per
        token, in order: a token that finishes it drops the ones after). Returns the outputs of the client requests
        it touched and the sequences that finished in it."""
        if logits is not None:
            row = 0
            for req, start, end, first in spans:
                if req.prompt_logprobs is not None and first < req.num_prompt_tokens - 1:
                    upto = min(end, req.num_prompt_tokens - 1)
                    self._record_prompt_logprobs(req, logits[row: row + upto - first], first)
                row += end - first
        touched: dict[str, ParentRequest] = {}
        finished = []
        now = time.monotonic()
        # as vLLM counts them: a sequence's prompt tokens once, at its first token (a recomputation after a
        # preemption is not counted again)
        prompt_tokens = generated = 0
        for i, req in enumerate(sampled):
            if req.finish_reason is not None:  # stopped or aborted while this step ran: its extra token is dropped
                continue
            generated += 1
            if req.first_token_time is None:
                prompt_tokens += req.num_prompt_tokens
            if self._append(req, samples, i, now):
                finished.append(req)
            touched[req.parent_id] = self.parents[req.parent_id]
        self.metrics.record_step(prompt_tokens, generated)
        for req, *_ in spans:
            if req.prompt_logprobs is not None and req.parent_id in self.parents:
                touched.setdefault(req.parent_id, self.parents[req.parent_id])
        return [self._output(p) for p in touched.values()], finished

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

    def _append(self, req: Request, out: SamplerOutput, i: int, now: float) -> bool:
        """Appends row i's token to req (and to its grammar matcher); returns whether req finished with it."""
        tok = out.token_ids[i]
        req.output_token_ids.append(tok)
        grammar = req.grammar
        # the mask allows only what the matcher accepts, unless it allowed nothing (min_tokens banning the stop ids
        # where the grammar must end): then the row's sample is arbitrary and the sequence cannot go on
        rejected = grammar is not None and not grammar.accept_token(tok)
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.observe(now - req.arrival_time)
        elif req.last_token_time != now:  # tokens of one step (speculative decoding) are one interval, as in vLLM
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
        if rejected:
            logger.warning("request %s: its grammar allowed no token after %d tokens; it ends with "
                           "finish_reason 'error'", req.request_id, len(req.output_token_ids) - 1)
            return self._finish(req, "error", None)
        n_out = len(req.output_token_ids)
        if n_out >= req.params.min_tokens:
            if tok in req.params.stop_token_ids:
                return self._finish(req, "stop", tok)
            if not req.params.ignore_eos and tok in self.eos_token_ids:
                return self._finish(req, "stop", None)
        if grammar is not None and grammar.is_terminated():  # the grammar ended on a stop id ignore_eos kept
            return self._finish(req, "stop", tok if tok in req.params.stop_token_ids else None)
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return self._finish(req, "length", None)
        return False

    def _finish(self, req: Request, reason: str, stop_reason) -> bool:
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.metrics.record_finished(req, req.last_token_time)
        return True

    def _output(self, parent: ParentRequest) -> RequestOutput:
        outputs = []
        for req in parent.children:
            detok = self._detok.get(req.request_id)
            if detok is None:
                text = ""
            elif req.finish_reason is not None:
                text = detok.flush()
            else:
                text = detok.text[: len(detok.text) - detok.held_back()]
            outputs.append(CompletionOutput(
                index=req.index, text=text, token_ids=list(req.output_token_ids),
                cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                logprobs=list(req.logprobs) if req.logprobs is not None else None,
                finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            ))
        finished = all(r.finish_reason is not None for r in parent.children)
        first = parent.children[0]
        out = RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            outputs=outputs, finished=finished, num_cached_tokens=first.num_cached_tokens,
            metrics={"arrival_time": first.arrival_time, "first_token_time": first.first_token_time,
                     "num_preemptions": sum(r.num_preemptions for r in parent.children)},
        )
        if finished:
            self.metrics.record_parent_finished(len(parent.children), max(len(c.token_ids) for c in outputs))
            self.parents.pop(parent.request_id, None)
            for req in parent.children:
                self._detok.pop(req.request_id, None)
        return out
