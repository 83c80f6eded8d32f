"""Structured output: grammars that constrain what a request generates (StructuredOutputsParams), on xgrammar.

Each constrained sequence holds a GrammarMatcher (`Request.grammar`) that has accepted every id it generated. Before
a step samples, the matchers of its constrained rows fill one row each of a token bitmask on the host (one bit per
vocabulary id, 1 = allowed); the bitmask crosses to the device in one copy and sets the forbidden ids' logits to
-inf before the sampler sees them (Sampler.sample). After the step, the output processor hands each sampled id to
its matcher; a matcher that terminates (it accepted a stop token where the grammar may end) finishes its sequence.
Steps without a constrained row do none of this.

Grammars compile once per engine against one TokenizerInfo (the tokenizer's vocabulary at the model's vocabulary
size: ids past the tokenizer's, the logits' padding, are never allowed) and are cached by their source, so a server
that compiles a request's grammar in a thread before the request reaches the engine leaves the engine a cache hit.
Special tokens other than the stop tokens are never allowed (vLLM's xgrammar backend does the same): a template
token inside a JSON string would be invisible in the text yet change what the model reads.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

import torch

from .request import StructuredOutputsError, StructuredOutputsParams
from .step_builder import to_device

# compiled grammars kept for reuse (xgrammar's cache, by source); vLLM's default VLLM_XGRAMMAR_CACHE_MB
GRAMMAR_CACHE_BYTES = 512 << 20
# the value of each bit of a bitmask word (int32: bit 31 is the sign bit)
_BIT_VALUES = [1 << k for k in range(31)] + [-(1 << 31)]


@dataclass
class GrammarMask:
    """One step's grammar bitmask on the logits' device: bitmask row j constrains logits row rows[j]."""

    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, bit k of word w: id 32 w + k allowed
    rows: torch.Tensor | None  # long; None: rows 0, 1, ... (every row of the batch is constrained)
    bit_values: torch.Tensor  # [32] int32, _BIT_VALUES

    @torch.inference_mode()  # the model's logits are inference tensors: only there may they change in place
    def apply(self, logits: torch.Tensor) -> None:
        """Sets the logits the grammars forbid to -inf, in place; other rows stay as they are. A few elementwise
        kernels over the constrained rows, without compilation or host sync (xgrammar's Triton kernel does it in
        one, but compiles anew for new batch-size classes while serving)."""
        forbidden = (self.bitmask[:, :, None] & self.bit_values) == 0
        forbidden = forbidden.flatten(1)[:, :logits.shape[-1]]
        if self.rows is None:
            logits.masked_fill_(forbidden, float("-inf"))
        else:
            logits[self.rows] = logits[self.rows].masked_fill(forbidden, float("-inf"))


class StructuredOutputs:
    """The engine's grammar compiler, the matchers it hands to requests and the bitmask of each step. Nothing is
    built before the first constrained request; `compile` may be called from any thread."""

    def __init__(self, tokenizer, vocab_size: int, max_rows: int, device, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.max_rows = tokenizer, vocab_size, max_rows
        self.device = torch.device(device)
        self.stop_token_ids = list(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler = None
        self._batch = None  # BatchGrammarMatcher: fills many rows in parallel threads
        self._host = self._device_mask = self._copied = self._bit_values = None

    # ----- grammars -----
    def compile(self, params: StructuredOutputsParams):
        """The xgrammar CompiledGrammar of `params`; an invalid schema, regex or grammar raises
        StructuredOutputsError naming its field."""
        compiler = self._get_compiler()
        kind = params.kind
        spec = getattr(params, kind)
        any_whitespace = not params.disable_any_whitespace
        separators = (",", ":") if params.disable_any_whitespace else None
        try:
            if kind == "json":
                text = spec if isinstance(spec, str) else json.dumps(spec)
                return compiler.compile_json_schema(text, any_whitespace=any_whitespace, separators=separators)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace,
                                                    separators=separators)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec))
            return compiler.compile_grammar(spec)
        except Exception as e:  # noqa: BLE001 - xgrammar reports every kind of invalid input as some exception
            what = {"json": "invalid JSON schema", "json_object": "invalid JSON schema", "regex": "invalid regex",
                    "choice": "invalid choice", "grammar": "invalid grammar"}[kind]
            raise StructuredOutputsError(f"structured_outputs.{kind}", f"{what}: {_xgrammar_message(e)}") from None

    def matcher(self, compiled, stop_token_ids: list[int]):
        """A fresh matcher of a compiled grammar for one sequence. It terminates on one of `stop_token_ids` (the
        sequence's stop ids; none given: the model's end-of-sequence ids)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or self.stop_token_ids or None)

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise StructuredOutputsError("structured_outputs", "needs the model's tokenizer, and this "
                                                                       "engine has none")
                import xgrammar as xgr

                info = _tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
            return self._compiler

    # ----- the step -----
    def bitmask(self, rows: list[int], matchers: list, num_rows: int) -> GrammarMask:
        """The mask of logits rows `rows` (of a batch of `num_rows`), one per matcher: filled on the host, its copy
        to the device started (no wait)."""
        import xgrammar as xgr

        if self._host is None:
            self._batch = xgr.BatchGrammarMatcher()
            shape = xgr.get_bitmask_shape(self.max_rows, self.vocab_size)
            cuda = self.device.type == "cuda"
            self._host = torch.empty(shape, dtype=xgr.bitmask_dtype, pin_memory=cuda)
            self._device_mask = torch.empty(shape, dtype=xgr.bitmask_dtype, device=self.device) if cuda else None
            self._copied = torch.cuda.Event() if cuda else None
            self._bit_values = torch.tensor(_BIT_VALUES, dtype=torch.int32, device=self.device)
        elif self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffer (already, in practice)
        n = len(rows)
        self._batch.batch_fill_next_token_bitmask(matchers, self._host[:n])
        rows_t = None if n == num_rows else to_device(rows, self.device)
        if self._device_mask is None:
            return GrammarMask(self._host[:n], rows_t, self._bit_values)
        self._device_mask[:n].copy_(self._host[:n], non_blocking=True)
        self._copied.record()
        return GrammarMask(self._device_mask[:n], rows_t, self._bit_values)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the tokenizer at the model's vocabulary size, with the special tokens blanked out (never
    allowed) except as stop tokens."""
    import xgrammar as xgr

    full = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    special = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    vocab = [""] * full.vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < len(vocab) and i not in special:
            vocab[i] = token
    return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, full.dump_metadata())


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's error without the source location it starts with ("[12:00:00] /project/cpp/x.cc:12: ...")."""
    text = str(e).strip()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?", "", text) or type(e).__name__
