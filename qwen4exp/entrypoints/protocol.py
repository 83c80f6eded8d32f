"""OpenAI API request models with vLLM's extra fields, their conversion to SamplingParams, and the response models of
the OpenAPI document.

Requests are validated strictly: a boolean, an integer or a token id must arrive as that JSON type (`"stream":
"yes"` or `[[false, true]]` as token ids are 400s, not coerced). Every check that an input can fail raises
RequestError (a ValueError) whose `param` names the offending field, so the server can answer 400. Every field
vLLM 0.33 accepts is a field here: it works, or it has no effect on what a single engine generates (user, metadata,
session_id...), or a value other than its default is refused with a 400 that says why (`UNSUPPORTED`). Fields
vLLM does not know either have no effect and are logged once by name. Responses are plain dicts built by the
serving modules; their models here only document them.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, WrapValidator, model_validator

from ..engine.request import MAX_BAD_WORDS, SamplingParams, StructuredOutputsError, StructuredOutputsParams
from ..multimodal import IMAGE_PLACEHOLDER

logger = logging.getLogger("qwen4exp")

# vLLM's default --max-logprobs: the top-k lists are built per token in Python, so k must stay small
MAX_LOGPROBS = 20
# vLLM's bounds: VLLM_MAX_STOP_STRINGS, VLLM_MAX_COMPLETION_PROMPTS
MAX_STOP_STRINGS = 4
MAX_COMPLETION_PROMPTS = 1024
# the server's default body limit: a prompt of 262,144 tokens sent as token ids is about 1.8 MB of JSON, and parsing
# the worst 4 MiB body holds the event loop for about 0.1-0.5 s
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class OpenAIBaseModel(BaseModel):
    # NaN/Infinity, which Python's json module accepts, would slip through every range check below
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


_LOGGED_UNKNOWN: set[str] = set()
_MAX_LOGGED_UNKNOWN = 1000  # names remembered; a client sending ever new names cannot grow the set further


class RequestModel(OpenAIBaseModel):
    """A request body. A field unknown to the model has no effect (clients of newer OpenAI versions keep working,
    as with vLLM); each such name is logged once, as a warning."""

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data):
        if isinstance(data, dict):
            new = sorted(str(k)[:64] for k in data.keys() - cls.model_fields.keys()
                         if str(k)[:64] not in _LOGGED_UNKNOWN)
            if new:
                if len(_LOGGED_UNKNOWN) < _MAX_LOGGED_UNKNOWN:
                    _LOGGED_UNKNOWN.update(new)
                logger.warning("%s: fields this server does not know have no effect: %s", cls.__name__,
                               ", ".join(new))
        return data

    # fields this server cannot honour: set to anything but their default (or null, false, empty), a 400 says why
    UNSUPPORTED: ClassVar[dict[str, str]] = {}

    def _refuse_unsupported(self) -> None:
        for name, why in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if not (value is None or value is False or value == type(self).model_fields[name].default
                    or (isinstance(value, (dict, list)) and not value)):
                raise RequestError(f"{name}: not supported: {why}", name)


def _lists_by_first_item(value, handler):
    """Validates a list prompt as the type its first item announces. The union's own validation tries every list
    type on every item and collects an error per item: a second of event-loop time for a few megabytes of
    prompts."""
    if isinstance(value, list) and value:
        first = value[0]
        adapter = _STRINGS if isinstance(first, str) else _ID_LISTS if isinstance(first, list) else _IDS
        return adapter.validate_python(value)
    return handler(value)


_STRICT = ConfigDict(strict=True)
_STRINGS, _IDS, _ID_LISTS = (TypeAdapter(t, config=_STRICT) for t in (list[str], list[int], list[list[int]]))
# a text, token ids, or a batch of either
Prompt = Annotated[list[int] | list[list[int]] | str | list[str], WrapValidator(_lists_by_first_item)]
Stop = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


def text_of_parts(parts: list, field: str, images: bool = False) -> str:
    """A message's list of content parts as the text the template gets: the text parts joined by newlines (vLLM's
    "string" content format); with `images` (a model with a vision tower), each image_url part is the image's
    placeholder `<|vision_start|><|image_pad|><|vision_end|>` in its place. Any other part is a RequestError
    naming `field`."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if images and kind == "image_url":
            texts.append(IMAGE_PLACEHOLDER)
            continue
        if kind != "text" or not isinstance(part.get("text"), str):
            supported = "'text' and 'image_url'" if images else "'text': the model reads text only"
            raise RequestError(f"{field}: content part type {kind!r} is not supported (only {supported})", field)
        texts.append(part["text"])
    return "\n".join(texts)


def image_urls(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(url, field) of every image_url part of the messages, in order; a part without a URL string is a
    RequestError naming its field."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            field = f"messages[{i}].content[{j}].image_url"
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            if not isinstance(url, str) or not url:
                raise RequestError(f"{field}: must be {{\"url\": \"...\"}} (a data:, http(s) or file URL)", field)
            out.append((url, field))
    return out


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCallParam(OpenAIBaseModel):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallParam(OpenAIBaseModel):
    """A call in an assistant message of the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam

    def for_template(self) -> dict[str, Any]:
        # chat templates take the arguments as a mapping (transformers' convention, as vLLM passes them); text that
        # is no JSON object becomes {} rather than failing every later turn of the conversation, as in vLLM
        args = self.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args else {}
            except ValueError:
                args = {}
        call = {"type": "function", "function": {"name": self.function.name,
                                                 "arguments": args if isinstance(args, dict) else {}}}
        return call if self.id is None else {"id": self.id, **call}


class ChatMessage(BaseModel):
    # other fields go to the template as they are
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer to that call
    # an assistant's reasoning (vLLM's name; `reasoning_content` is its older one): templates get it under both
    reasoning: str | None = None
    reasoning_content: str | None = None

    def for_template(self, images: bool = False) -> dict[str, Any]:
        """The message as the chat template reads it; `images`: image_url parts become image placeholders (a model
        with a vision tower), else they are refused."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            msg["content"] = text_of_parts(self.content, "messages", images)
        elif self.content is None:  # an assistant's turn that only calls tools
            msg["content"] = ""
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        if self.tool_calls:
            msg["tool_calls"] = [call.for_template() for call in self.tool_calls]
        else:
            msg.pop("tool_calls", None)
        return msg


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow BaseModel.schema
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]  # structural_tag: refused
    json_schema: JsonSchemaResponseFormat | None = None


_NO_STRUCTURAL_TAG = "structural tags are not implemented; use a JSON schema, regex, choice or grammar"


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` request field (StructuredOutputsParams): exactly one constraint."""

    json_schema: str | dict[str, Any] | None = Field(None, alias="json")  # `json` would shadow BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # as in vLLM's xgrammar backend, no effect: a schema's objects already take no properties it does not name, and
    # whitespace is JSON's (or none, with disable_any_whitespace)
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None  # refused


_TEXT_OUT = "the model writes text only"
_NO_MEDIA_OPTIONS = ("per-request media and processor options are not supported (images are prepared as the "
                     "checkpoint's preprocessor_config.json says)")
_NO_RENDER = "it applies to vLLM's /render endpoints, which this server does not have"
# vLLM request fields that this server cannot honour, with the reason a value other than the default is refused
_UNSUPPORTED_SAMPLING = {
    "use_beam_search": "beam search is not implemented",
    "length_penalty": "it applies to beam search, which is not implemented",
    "watermarking": "watermarking is not implemented",
    "logprob_token_ids": "logprobs of chosen token ids are not implemented; use logprobs (top-k)",
    "logits_processors": "custom logits processors are not supported",
    "kv_transfer_params": "disaggregated serving (KV transfer) is not supported",
    "ec_transfer_params": "disaggregated serving (encoder cache transfer) is not supported",
    "vllm_xargs": "the server has no extensions that read them",
    "repetition_detection": "repetition detection is not implemented",
    "return_weight_versions": "weight versions are not tracked (the weights never change while serving)",
    "routed_experts_prompt_start": "routed experts are not returned",
    "return_token_offsets": _NO_RENDER,
    "mm_payload": _NO_RENDER,
    "return_mm_kwargs": _NO_RENDER,
    "priority": "the scheduler serves requests in arrival order (no priority scheduling, where vLLM refuses it too)",
}


class _SamplingRequest(RequestModel):
    model: str | None = None
    n: int = Field(1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, description="Accepted; has no effect on the output.")
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    allowed_token_ids: list[int] | None = Field(None, description="Only these token ids may be sampled.")
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] = Field(
        default_factory=list, description="Words never generated (a multi-token word's last token is not sampled "
                                          "right after the rest of it).")
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = Field(
        None, description="Keep only this many prompt tokens (-1: as many as max_model_len allows).")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="With truncate_prompt_tokens: left (the default) keeps the last tokens, right the first.")
    return_token_ids: bool | None = Field(None, description="Add the prompt's and each choice's token ids.")
    return_tokens_as_token_ids: bool | None = Field(
        None, description="Logprob tokens as 'token_id:{id}' (default: --return-tokens-as-token-ids).")
    stream_interval: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Tokens per streamed chunk (the first and the last chunk go out at once).")
    request_id: str | None = Field(
        None, max_length=256, description="The response's id (after its prefix), unless an X-Request-Id header "
                                          "gives one.")
    session_id: str | None = Field(None, description="Accepted; has no effect on the output.")
    cache_salt: str | None = Field(
        None, description="Prefix caching shares cached pages only between prompts with the same salt (checked as vLLM "
                          "does).")
    priority: Int64 = 0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    watermarking: bool | None = None
    logprob_token_ids: list[int] | None = None
    logits_processors: list[str | dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    repetition_detection: dict[str, Any] | None = None
    return_weight_versions: bool = False
    routed_experts_prompt_start: Annotated[int, Field(ge=0)] = 0
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None

    @model_validator(mode="after")
    def _check_vllm_rules(self):
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise RequestError("stream_options: only allowed when stream is true", "stream_options")
        salt = self.cache_salt
        if salt is not None and (not salt or len(salt) > 128 or any(c in salt for c in "@/\\\0")):
            raise RequestError("cache_salt: must be 1 to 128 characters without '@', '/', '\\' or NUL",
                               "cache_salt")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def structured_outputs_field(self) -> str:
        """The request field the constraint comes from, for errors about it (response_format wins, as in vLLM)."""
        rf = self.response_format
        return "response_format" if rf is not None and rf.type != "text" else "structured_outputs"

    def _structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint of `structured_outputs`, with `response_format`'s replacing the one of its kind (vLLM's
        merge)."""
        so = self.structured_outputs
        if so is not None and so.structural_tag is not None:
            raise RequestError(f"structured_outputs.structural_tag: not supported: {_NO_STRUCTURAL_TAG}",
                               "structured_outputs.structural_tag")
        kwargs = {} if so is None else {"json": so.json_schema, "regex": so.regex, "choice": so.choice,
                                        "grammar": so.grammar, "json_object": so.json_object,
                                        "disable_any_whitespace": so.disable_any_whitespace}
        rf = self.response_format
        if rf is not None and rf.type == "structural_tag":
            raise RequestError(f"response_format: type structural_tag is not supported: {_NO_STRUCTURAL_TAG}",
                               "response_format")
        if rf is not None and rf.type == "json_object":
            kwargs["json_object"] = True
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise RequestError("response_format: type json_schema needs json_schema.schema", "response_format")
            kwargs["json"] = rf.json_schema.json_schema
        if not kwargs:
            return None
        try:
            return StructuredOutputsParams(**kwargs)
        except StructuredOutputsError as e:
            raise RequestError(str(e), self.structured_outputs_field) from None

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def tokens_as_ids(self, server_default: bool) -> bool:
        return server_default if self.return_tokens_as_token_ids is None else self.return_tokens_as_token_ids

    def truncation(self, max_model_len: int) -> tuple[int, str] | None:
        """(tokens to keep, side) of truncate_prompt_tokens, or None; -1 keeps max_model_len - 1 (room for one
        generated token), as vLLM."""
        k = self.truncate_prompt_tokens
        if k is None:
            return None
        if k > max_model_len:
            raise RequestError(f"truncate_prompt_tokens: {k} is more than max_model_len={max_model_len}",
                               "truncate_prompt_tokens")
        return (max_model_len - 1 if k == -1 else k), self.truncation_side or "left"

    def _sampling_params(self, vocab_size: int, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None, defaults: dict) -> SamplingParams:
        self._refuse_unsupported()
        if self.stream and self.prompt_logprobs is not None:  # a stream has no place for them (vLLM: 400 too)
            raise RequestError("prompt_logprobs: not available when stream is true", "prompt_logprobs")
        for name, k in (("top_logprobs" if isinstance(self.logprobs, bool) else "logprobs", logprobs),
                        ("prompt_logprobs", prompt_logprobs)):
            if k is not None and (k > MAX_LOGPROBS or k == -1):  # -1: the whole vocabulary
                raise RequestError(f"{name} must be at most {MAX_LOGPROBS}, got {k}.", name)
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not re.fullmatch(r"-?\d+", key.strip()) or not 0 <= int(key) < vocab_size:
                raise RequestError(f"logit_bias: {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
            if not -100.0 <= value <= 100.0:
                raise RequestError(f"logit_bias: {value} for token {key} is outside [-100, 100]", "logit_bias")
            bias[int(key)] = value
        # the sampler indexes logits with these ids (min_tokens masking, allowed_token_ids), so they must exist
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(self, name) or [] if not 0 <= t < vocab_size]
            if bad:
                raise RequestError(f"{name}: {bad[:5]} are outside the vocabulary [0, {vocab_size})", name)

        def pick(name: str, neutral):  # the request's value, else the generation config's, else vLLM's neutral one
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, neutral)

        top_k = pick("top_k", 0)
        if top_k > vocab_size:
            top_k = 0  # keeping more than the vocabulary keeps everything; avoids int64 overflow in the sampler
        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=top_k,
            min_p=pick("min_p", 0.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=pick("skip_special_tokens", True),
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=bias or None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            structured_outputs=self._structured_outputs_params(),
        )


class CompletionRequest(_SamplingRequest):
    prompt: Prompt | None = None
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, description="Only null or n: one candidate per returned choice.")
    add_special_tokens: bool = True
    prompt_embeds: str | list[str] | None = None

    UNSUPPORTED: ClassVar[dict[str, str]] = {**_UNSUPPORTED_SAMPLING,
                   "suffix": "insertion (text after the completion) is not implemented",
                   "prompt_embeds": "prompts are token ids or text; embeddings are not accepted"}

    @model_validator(mode="before")
    @classmethod
    def _null_max_tokens_is_default(cls, data):
        if isinstance(data, dict) and "max_tokens" in data and data["max_tokens"] is None:
            data = {**data, "max_tokens": 16}  # vLLM reads null as the default
        return data

    def prompts(self) -> list[str | list[int]]:
        self._refuse_unsupported()
        p = self.prompt
        if p is None or p == "" or p == []:
            raise RequestError("prompt: must not be empty", "prompt")
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        if len(p) > MAX_COMPLETION_PROMPTS:
            raise RequestError(f"prompt: {len(p)} prompts, more than {MAX_COMPLETION_PROMPTS}", "prompt")
        return list(p)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: score the prompt, generate nothing (lm-eval's loglikelihood requests)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, vocab_size: int, defaults: dict | None = None) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of: not supported: each choice is one sampled sequence (set it to n or leave "
                               "it out)", "best_of")
        # the engine always generates at least one token; an echo-only request drops it again
        max_tokens = 1 if self.echo_only else self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        return self._sampling_params(vocab_size, max_tokens, self.logprobs, prompt_logprobs, defaults or {})


_UNSUPPORTED_CHAT = {
    **_UNSUPPORTED_SAMPLING,
    "mm_processor_kwargs": _NO_MEDIA_OPTIONS,
    "media_io_kwargs": _NO_MEDIA_OPTIONS,
    "audio": "audio output is not available: " + _TEXT_OUT,
    "web_search_options": "web search is not available",
    "verbosity": "the model has no verbosity setting",
    "reasoning_effort": "Qwen3 templates take no effort level; chat_template_kwargs {\"enable_thinking\": false} turns "
                        "thinking off",
    "thinking_token_budget": "reasoning is not cut at a budget; max_tokens bounds the whole answer",
}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(
        False, description="Render the last message open-ended, for the model to continue it (add_generation_prompt "
                           "must then be false, or left out).")
    add_special_tokens: bool = False
    echo: bool = False
    documents: list[dict[str, str]] | None = Field(None, description="Passed to the chat template as `documents`.")
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = Field(None, description="Add the rendered prompt as `prompt_text`.")
    tools: list[ChatCompletionTool] | None = None
    # left out: "auto" when there are tools, else "none"
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    # OpenAI fields vLLM does not model
    metadata: dict[str, str] | None = Field(None, description="Accepted; has no effect (nothing is stored).")
    store: bool | None = Field(None, description="Accepted; completions are not stored (no retrieval API).")
    service_tier: str | None = Field(None, description="Accepted; one tier.")
    prediction: dict[str, Any] | None = Field(None, description="Accepted; a latency hint that cannot change the "
                                                                "output.")
    modalities: list[str] | None = Field(None, description="Only text.")
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    reasoning_effort: str | None = None
    thinking_token_budget: int | None = None

    UNSUPPORTED: ClassVar[dict[str, str]] = _UNSUPPORTED_CHAT

    @model_validator(mode="after")
    def _default_tool_choice(self):
        if "tool_choice" not in self.model_fields_set:
            self.tool_choice = "auto" if self.tools else "none"
        return self

    def check_tool_use(self) -> None:
        """vLLM's checks of `tools` against `tool_choice`."""
        if self.tools is not None and not self.tools:
            raise RequestError("tools: must not be an empty array; give at least one tool or leave the field out",
                               "tools")
        choice = self.tool_choice
        if choice is None or choice == "none":
            return
        if self.tools is None:
            raise RequestError("tool_choice: when using `tool_choice`, `tools` must be set", "tool_choice")
        if isinstance(choice, NamedToolChoice) and not any(t.function.name == choice.function.name
                                                           for t in self.tools):
            raise RequestError(f"tool_choice: the function {choice.function.name!r} it names is not among `tools`",
                               "tool_choice")
        so = self.structured_outputs
        if isinstance(choice, NamedToolChoice) and so is not None and any(
                v is not None for v in (so.json_schema, so.regex, so.choice)):
            raise RequestError("structured_outputs: a json, regex or choice constraint cannot be used with a named "
                               "tool_choice, which constrains the answer to the function's arguments",
                               "structured_outputs")

    @property
    def named_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @model_validator(mode="after")
    def _check_chat_rules(self):
        if self.continue_final_message and self.add_generation_prompt and (
                "add_generation_prompt" in self.model_fields_set):
            raise RequestError("continue_final_message: cannot be used with add_generation_prompt true",
                               "continue_final_message")
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise RequestError(f"modalities: not supported: {self.modalities}: {_TEXT_OUT}", "modalities")
        return self

    @property
    def generation_prompt(self) -> bool:
        """add_generation_prompt, off when the last message is continued (vLLM refuses both set)."""
        return self.add_generation_prompt and not self.continue_final_message

    def to_sampling_params(self, vocab_size: int, defaults: dict | None = None) -> SamplingParams:
        k = self.top_logprobs
        if k is not None and k < 0 and k != -1:
            raise RequestError(f"top_logprobs must be non-negative or -1, got {k}.", "top_logprobs")
        if k is not None and k != 0 and not self.logprobs:
            raise RequestError("top_logprobs: requires logprobs to be true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (k if k is not None else 0) if self.logprobs else None
        return self._sampling_params(vocab_size, max_tokens, logprobs, self.prompt_logprobs, defaults or {})


class TokenizeRequest(RequestModel):
    """vLLM's TokenizeCompletionRequest ({prompt}) and TokenizeChatRequest ({messages}) in one model."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' or 'messages' must be given")
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


def param_of(error: ValueError, fields: set[str]) -> str | None:
    """The request field a ValueError from SamplingParams or the engine is about ("top_p must be ...",
    "prompt: ...")."""
    param = getattr(error, "param", None) or getattr(error, "field", None)
    if param:
        return param
    m = re.match(r"(\w+)[: ]", str(error))
    return m.group(1) if m and m.group(1) in fields else None


# ----- responses (the OpenAPI document; the serving modules build them as dicts) -----
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details and a cache hit
    completion_tokens_details: CompletionTokensDetails | None = None  # chat, with --reasoning-parser


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str | None


# per prompt token: None (the first) or {token id: its logprob}
PromptLogprobs = list[dict[str, PromptLogprob] | None] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobs = None
    # with return_token_ids
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning: str | None  # with --reasoning-parser
    tool_calls: list[ToolCall]  # with --tool-call-parser


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    prompt_text: str | None = None  # with return_prompt_text


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int
    permission: list[Any]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]
