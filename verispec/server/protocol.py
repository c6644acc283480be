"""Request and response bodies in OpenAI's format, plus verispec's ``speculative`` extension.

Unknown top-level fields are ignored, as OpenAI-compatible servers do, so clients that send
extra options keep working; options verispec cannot honour (logprobs, penalties, n > 1) are
refused rather than silently ignored. Integers and booleans are strict, as OpenAI's are: ``true``
or ``2.0`` is no integer and ``"yes"`` or ``1`` no boolean (400). Numbers such as ``temperature``
take integers as well as floats, but never booleans or strings.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

MAX_SEED = 2**64 - 1


class SpeculativeOptions(BaseModel):
    """verispec's extension: choose this request's path and drafter.

    ``enabled`` overrides the canary routing (omit it to let the server decide); ``method``
    and ``k`` override the server's drafter and draft length when the request speculates.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: StrictBool | None = Field(None, description="true: speculate; false: decode plainly; omitted: canary "
                                       "routing")
    method: str | None = Field(None, description="drafter: draft, ngram, ... (see GET /v1/models)")
    k: StrictInt | None = Field(None, ge=1, le=64, description="draft tokens per step")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's predicted output: text the answer is expected to repeat (a string or a list of text parts).

    Runs of it that the answer repeats are drafted and verified in bulk; the answer stays the model's.
    """

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: StrictBool = Field(False, description="send a last chunk with usage before [DONE]")


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: StrictInt | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0, description="0 is greedy; default 1")
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0, description="extension: keep the k likeliest tokens (0: off)")
    n: StrictInt = Field(1, description="choices per request; only 1 is supported")
    stop: str | list[str] | None = Field(None, description="stop strings (not included in the output)")
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="end-user id; also the canary routing key")
    ignore_eos: StrictBool = Field(False, description="extension: keep generating past the end-of-sequence token")
    speculative: SpeculativeOptions | None = None
    prediction: Prediction | None = Field(None, description="predicted output: drafted where the answer repeats it")
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None

    @model_validator(mode="after")
    def _supported(self) -> _GenerationRequest:
        if self.n != 1:
            raise ValueError("only n=1 is supported")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence and frequency penalties are not supported (they would change the "
                             "distribution that speculation preserves)")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. One prompt: a string, token ids, or a one-element list of either."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, description="not supported")
    echo: StrictBool = Field(False, description="not supported")

    @model_validator(mode="after")
    def _single(self) -> CompletionRequest:
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported")
        if self.echo:
            raise ValueError("echo is not supported")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list) and len(p) != 1:
            raise ValueError("one prompt per request is supported")
        return self

    @property
    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]
        return p


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions; the prompt is the model's chat template over ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: StrictBool | None = Field(None, description="not supported")

    @model_validator(mode="after")
    def _no_logprobs(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self


# -- responses ---------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


class SpeculativeUsage(BaseModel):
    """verispec's figures for one request (plain decoding: k 0, mean accepted length 1)."""

    path: Literal["speculative", "plain"]
    method: str
    k: int
    steps: int = Field(description="target forwards after prefill")
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_length: float = Field(description="tokens per target forward, bonus token included")


class CompletionTokensDetails(BaseModel):
    """OpenAI's breakdown of completion tokens: the predicted output's drafted tokens that verification kept
    and those it threw away (0 without a prediction)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)
    speculative: SpeculativeUsage | None = None


FinishReason = Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "verispec"
    max_model_len: int
    speculative_methods: list[str] = Field(description="methods a request may name in speculative.method")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class FractionUpdate(BaseModel):
    fraction: StrictFloat = Field(ge=0.0, le=1.0, description="share of requests routed through speculation")


class FractionResponse(BaseModel):
    fraction: float
    previous: float
