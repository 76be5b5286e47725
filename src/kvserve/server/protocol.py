"""The OpenAI-compatible request and response records (pydantic), as vLLM spells them.

Requests are strict: a wrong type is a 400, never silently coerced ("5" is not 5, true is
not 1). Unknown fields are ignored, as OpenAI and vLLM do. Ranges that the engine checks again
in ``SamplingParams`` are declared here too, so the OpenAPI document shows them and the 400
names the parameter.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvserve.engine.limits import MAX_N

MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1


def _check_text(value: object) -> None:
    """JSON may carry lone surrogates ("\\ud800"); no tokenizer or hash takes them."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"not valid UTF-8 text: {e.reason} at index {e.start}") from e
    elif isinstance(value, list):
        for item in value:
            _check_text(item)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @field_validator("*", mode="after")
    @classmethod
    def _text(cls, value: object) -> object:
        _check_text(value)
        return value


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # None: the served model (vLLM); a different name is a 404
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1)
    # kvserve's: the response says how many prompt tokens the prefix cache served and, when a
    # cached prefix diverged, where and why ("kv_cache"); not on streams
    return_cache_info: bool = False
    user: str | None = None
    # vLLM's: the top-K logprobs at every prompt position (the first is null); not streamed
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    # a vLLM extra field (the openai client's extra_body): 1 is off
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)


class CompletionRequest(_SamplingRequest):
    # text, token ids, or a batch of either
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: the prompt alone comes back
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt before the completion (text and, with logprobs, its logprobs)
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[dict] | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# -- responses ---------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # --streaming-window: tokens the StreamingLLM policy dropped from attention (left out of the
    # body when the policy is off)
    kv_dropped_tokens: int | None = Field(None, exclude_if=lambda v: v is None)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token of a prompt position, as vLLM's ``Logprob``."""

    logprob: float
    rank: int | None = None  # 1 = the position's most likely token
    decoded_token: str | None = None


# per prompt token (the first is None): token id (as a string, JSON keys are) -> its logprob
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    kv_cache: dict[str, Any] | None = None  # return_cache_info: this prompt's explanation


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's: the prompt's, once per response
    kv_cache: dict[str, Any] | None = None  # return_cache_info: the prompt's explanation


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """GET /tokenizer_info, as vLLM's: the tokenizer_config.json a remote client needs
    (lm-evaluation-harness's ``tokenizer_backend=remote`` reads the special tokens and the
    chat template, then tokenizes through /tokenize)."""

    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    model_max_length: int  # the served context (max_model_len), not the tokenizer's default
    vocab_size: int
    chat_template: str | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
