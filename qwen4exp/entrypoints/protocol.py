"""OpenAI API request models with vLLM's extra sampling fields, their conversion to SamplingParams, and the
response models of the OpenAPI document.

Requests are validated strictly: a boolean, an integer or a token id must arrive as that JSON type (`"stream":
"yes"` or `[[false, true]]` as token ids are 400s, not coerced). Every check that an input can fail raises
RequestError (a ValueError) whose `param` names the offending field, so the server can answer 400. Responses are
plain dicts built by the serving modules; their models here only document them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, WrapValidator, model_validator

from ..engine.request import SamplingParams, StructuredOutputsError, StructuredOutputsParams

# vLLM's default --max-logprobs: the top-k lists are built per token in Python, so k must stay small
MAX_LOGPROBS = 20
# the server's default body limit: a prompt of 262,144 tokens sent as token ids is about 1.8 MB of JSON, and parsing
# the worst 4 MiB body holds the event loop for about 0.1-0.5 s
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class OpenAIBaseModel(BaseModel):
    # unknown fields are ignored (as vLLM does) so that newer clients keep working; NaN/Infinity, which Python's
    # json module accepts, would slip through every range check below
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


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


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    # name, tool_calls... go to the template as is
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None

    def for_template(self) -> dict[str, Any]:
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"messages: content part type {part.get('type')!r} is not supported "
                                       f"(only 'text')", "messages")
                texts.append(part["text"])
            msg["content"] = "\n".join(texts)
        return msg


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow BaseModel.schema
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` request field (StructuredOutputsParams): exactly one constraint."""

    json_schema: str | dict[str, Any] | None = Field(None, alias="json")  # `json` would shadow BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _SamplingRequest(OpenAIBaseModel):
    model: str | None = None
    n: int = Field(1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

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
        kwargs = {} if so is None else {"json": so.json_schema, "regex": so.regex, "choice": so.choice,
                                        "grammar": so.grammar, "json_object": so.json_object,
                                        "disable_any_whitespace": so.disable_any_whitespace}
        rf = self.response_format
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

    def _sampling_params(self, vocab_size: int, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None) -> SamplingParams:
        if self.stream and self.prompt_logprobs is not None:  # a stream has no place for them (vLLM: 400 too)
            raise RequestError("prompt_logprobs: not available when stream is true", "prompt_logprobs")
        for name, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if k is not None and k > MAX_LOGPROBS:
                raise RequestError(f"{name} must be at most {MAX_LOGPROBS}, got {k}.", name)
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not re.fullmatch(r"-?\d+", key.strip()) or not 0 <= int(key) < vocab_size:
                raise RequestError(f"logit_bias: {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
            if not -100.0 <= value <= 100.0:
                raise RequestError(f"logit_bias: {value} for token {key} is outside [-100, 100]", "logit_bias")
            bias[int(key)] = value
        # the sampler indexes logits with these ids (min_tokens masking), so they must exist
        bad = [t for t in self.stop_token_ids or [] if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids: {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                               "stop_token_ids")
        top_k = self.top_k
        if top_k is not None and top_k > vocab_size:
            top_k = 0  # keeping more than the vocabulary keeps everything; avoids int64 overflow in the sampler
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if top_k is None else top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=bias or None,
            structured_outputs=self._structured_outputs_params(),
        )


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt: must not be empty", "prompt")
        return [p] if isinstance(p[0], int) else list(p)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: score the prompt, generate nothing (lm-eval's loglikelihood requests)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, vocab_size: int) -> SamplingParams:
        if self.suffix is not None:
            raise RequestError("suffix is not supported", "suffix")
        # the engine always generates at least one token; an echo-only request drops it again
        max_tokens = 1 if self.echo_only else self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        return self._sampling_params(vocab_size, max_tokens, self.logprobs, prompt_logprobs)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self, vocab_size: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs: requires logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise RequestError(f"top_logprobs must be non-negative, got {self.top_logprobs}.", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(vocab_size, max_tokens, logprobs, self.prompt_logprobs)


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's TokenizeCompletionRequest ({prompt}) and TokenizeChatRequest ({messages}) in one model."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' or 'messages' must be given")
        return self


class DetokenizeRequest(OpenAIBaseModel):
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


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str
    tool_calls: list[dict[str, Any]]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs


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
