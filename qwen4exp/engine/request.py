"""Requests, sampling parameters and outputs, with vLLM's field names and defaults."""

from __future__ import annotations

import enum
import json as _json
import time
from dataclasses import dataclass, field
from typing import Any

_SAMPLING_EPS = 1e-5
# vLLM's bounds on bad words (VLLM_MAX_NUM_BAD_WORDS, VLLM_MAX_BAD_WORDS_TOTAL_TOKENS): every sampling step of the
# request compares the multi-token ones with its last tokens on the host
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_TOKENS = 1024
# the constraint fields of StructuredOutputsParams; exactly one is set
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsError(ValueError):
    """A structured-output constraint is invalid; `field` names it (e.g. "structured_outputs.json")."""

    def __init__(self, field_name: str, reason: str):
        self.field, self.reason = field_name, reason
        super().__init__(f"{field_name}: {reason}")


@dataclass
class StructuredOutputsParams:
    """vLLM's constraint on what a request may generate: exactly one of `json` (a JSON schema, as a dict or its
    text), `regex`, `choice` (one of these strings), `grammar` (EBNF / GBNF, as xgrammar reads it) or
    `json_object=True` (any JSON object). `disable_any_whitespace` lets JSON have no whitespace outside strings."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            raise StructuredOutputsError(f"structured_outputs.{name}", f"{why}, got {getattr(self, name)!r}")

        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise StructuredOutputsError(
                "structured_outputs", f"exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)} must be given, got "
                f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            bad("json", "must be a JSON schema (a dict or its JSON text)")
        if isinstance(self.json, dict):
            try:
                _json.dumps(self.json)
            except (TypeError, ValueError) as e:
                raise StructuredOutputsError("structured_outputs.json", f"is not JSON: {e}") from None
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            bad("regex", "must be a non-empty string")
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            bad("choice", "must be a non-empty list of non-empty strings")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            bad("grammar", "must be a non-empty string")
        if self.json_object is not None and self.json_object is not True:
            bad("json_object", "must be true when given")
        if not isinstance(self.disable_any_whitespace, bool):
            bad("disable_any_whitespace", "must be a boolean")
        if self.choice is not None:
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """The constraint's field name."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None)


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    # only these ids may be sampled
    allowed_token_ids: list[int] | None = None
    # never generated: a one-token word is never sampled, a longer word's last token is not sampled right after the
    # rest of it (generated tokens only, as vLLM)
    bad_words: list[str] | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # bad_words as token id sequences (see bad_words_token_ids); the engine fills it from its tokenizer when None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be at least 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "must be greater than zero")
        if not self.temperature >= 0.0:
            bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be 0 or -1 (disable), or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be at least 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be greater than or equal to 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", "must be non-negative")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            bad("prompt_logprobs", "must be non-negative")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                bad("allowed_token_ids", "must be a non-empty list of token ids")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids):
                bad("allowed_token_ids", "must be non-negative integers")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS:
                bad("bad_words", f"must be a list of at most {MAX_BAD_WORDS} strings")
            if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                bad("bad_words", "must be strings with at least one non-space character")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS


def bad_word_variants(words: list[str]) -> list[str]:
    """The texts whose token ids `bad_words_token_ids` reads: each word as it starts a text and after a space."""
    return [text for w in words for text in (w.lstrip(), " " + w.lstrip())]


def bad_words_token_ids(encoded: list[list[int]]) -> list[list[int]]:
    """vLLM's bad-word sequences from the token ids of `bad_word_variants` (in order): a word's ids, and its ids
    after a space as well where the space merges into a different first token of the same length (tokenizers that
    fold the space into the word, as Qwen's byte-level BPE does). Raises ValueError beyond MAX_BAD_WORDS_TOKENS."""
    out = []
    for plain, spaced in zip(encoded[::2], encoded[1::2]):
        out.append(list(plain))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(list(spaced))
    total = sum(map(len, out))
    if total > MAX_BAD_WORDS_TOKENS:
        raise ValueError(f"bad_words: {total} tokens in all, more than {MAX_BAD_WORDS_TOKENS}")
    return out


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (the first sequence's, at its admission)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One sequence being generated (a request with n > 1 becomes n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # completion index within the parent request
    parent_id: str | None = None
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0  # tokens sampled on the device whose ids the host has not read yet (async scheduling)
    status: RequestStatus = RequestStatus.WAITING
    pages: list[int] = field(default_factory=list)
    state_slot: int | None = None
    # speculative decoding: the tokens the draft layer proposes after the last token, and the request's other state
    # slots, which receive the states after each verified row (one of them becomes state_slot when drafts are
    # rejected)
    draft_token_ids: list[int] = field(default_factory=list)
    # the draft layer's drafts stay on the device: (ids, first row) holds their values, draft_token_ids only their
    # number; None: draft_token_ids are the values
    drafts_on_device: Any = None
    spare_slots: list[int] = field(default_factory=list)
    # the xgrammar GrammarMatcher of a structured-output request: it has accepted every id in output_token_ids
    grammar: Any = None
    # a prompt with images: their inputs, the prompt's M-RoPE positions and the features not yet consumed
    # (multimodal.MultiModalState)
    mm: Any = None
    max_tokens: int = 16  # resolved against max_model_len at admission
    # prefix caching (engine/prefix_cache.py): the prompt's salt (only requests with the same salt share pages), the
    # keys of its full pages, the page boundaries still to save a checkpoint at (ascending), and the prompt tokens
    # found cached at first admission
    cache_salt: str | None = None
    page_keys: list[bytes] | None = None
    checkpoint_positions: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    # outputs
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # the phases of the request (time.monotonic(), as arrival_time), for the metrics: queued by the scheduler, first
    # scheduled (a preempted request's later admissions do not move it), first and latest token read by the host
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return self.num_tokens + self.num_pending

    def stops_by_length(self, max_model_len: int) -> bool:
        """Whether the pending tokens already reach max_tokens or max_model_len: nothing more to schedule."""
        return (len(self.output_token_ids) + self.num_pending >= self.max_tokens
                or self.num_tokens_with_pending >= max_model_len)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:  # the decode case: no copy of the whole history
            return self.output_token_ids[start - p: end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
