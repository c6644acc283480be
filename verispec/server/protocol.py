"""Request and response bodies in OpenAI's format, plus verispec's ``speculative`` extension and vLLM's
``structured_outputs`` extension (``json``, ``regex``, ``choice``, ``grammar``: llguidance's Lark dialect).

Unknown top-level fields are ignored, as OpenAI-compatible servers do, so clients that send
extra options keep working; options verispec cannot honour (echo with logprobs) are refused
rather than silently ignored. Integers and booleans are strict, as OpenAI's are: ``true``
or ``2.0`` is no integer and ``"yes"`` or ``1`` no boolean (400). Numbers such as ``temperature``
take integers as well as floats, but never booleans or strings.
"""

from __future__ import annotations

from typing import Any, Literal

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


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object (JSON mode) or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's extension: the output follows one of these (exactly one)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect)")
    json_object: StrictBool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object")
        return self


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
    n: StrictInt = Field(1, ge=1, description="choices per request (each its own row and seed stream)")
    stop: str | list[str] | None = Field(None, description="stop strings (not included in the output)")
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="end-user id; also the canary routing key")
    ignore_eos: StrictBool = Field(False, description="extension: keep generating past the end-of-sequence token")
    speculative: SpeculativeOptions | None = None
    prediction: Prediction | None = Field(None, description="predicted output: drafted where the answer repeats it")
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, StrictFloat] | None = Field(None, description="token id (as a string) -> bias in "
                                                      "[-100, 100], added to the logits")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. One prompt: a string, token ids, or a one-element list of either."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=5, description="log-probabilities of each token and of the "
                                       "this many likeliest")
    echo: StrictBool = Field(False, description="the prompt's text before the completion (without logprobs)")

    @model_validator(mode="after")
    def _single(self) -> CompletionRequest:
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
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

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
    logprobs: StrictBool | None = Field(None, description="log-probabilities of each generated token")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20, description="and of this many likeliest (logprobs)")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = Field(None, description="false: one tool call at most")


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


FinishReason = Literal["stop", "length", "tool_calls", "constraint_dead_end"]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
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
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
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
