"""The generation endpoints' logic: validate, route, submit to the worker, answer or stream."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from verispec.config import PLAIN, SpecConfig
from verispec.engine.detok import StreamText
from verispec.engine.engine import GenerationResult
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams
from verispec.server.errors import APIError, error_body
from verispec.server.limits import utf8_len
from verispec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CompletionTokensDetails,
    SpeculativeOptions,
    SpeculativeUsage,
    Usage,
)
from verispec.server.state import ServerState
from verispec.server.streaming import SSEResponse, race_disconnect, sse
from verispec.server.worker import (
    FailedEvent,
    FinishedEvent,
    GenRequest,
    QueueFullError,
    ShuttingDownError,
    TokensEvent,
    TokenStream,
)

Kind = Literal["completion", "chat"]
_MIN_TEMPERATURE = 1e-5
_SHUTDOWN_MESSAGE = "the server is shutting down; the request was cancelled"


@dataclass(frozen=True)
class _Call:
    """One accepted request, ready to run."""

    kind: Kind
    id: str
    created: int
    model: str
    gen: GenRequest
    include_usage: bool


def choose_spec(state: ServerState, opts: SpeculativeOptions | None, key: str) -> SpecConfig:
    """The request's speculation: its own choice if it made one, else the canary's."""
    base = state.config.spec
    override = opts.enabled if opts is not None else None
    if not state.router.speculate(key, override):
        return PLAIN
    method = (opts.method if opts is not None and opts.method else None) or base.method
    k = (opts.k if opts is not None and opts.k is not None else None) or base.k or SpecConfig().k
    if method == "none":
        if override:
            raise APIError(400, "this server has no default speculation method; name one in speculative.method",
                           param="speculative.method")
        return PLAIN  # routed by the canary, but there is nothing to speculate with
    if method not in state.worker.available_methods:
        available = ", ".join(sorted(state.worker.available_methods)) or "none"
        raise APIError(400, f"speculation method '{method}' is not available on this server (available: "
                       f"{available})", param="speculative.method")
    return replace(base, method=method, k=k)


def _temperature(requested: float | None) -> float:
    """OpenAI's default is 1; a temperature too small to divide logits by safely means greedy.

    (The engine divides logits by the temperature: at 1e-300 they overflow to inf and sampling
    fails, so, like vLLM, anything under 1e-5 decodes greedily.)
    """
    if requested is None:
        return 1.0
    return 0.0 if requested < _MIN_TEMPERATURE else requested


def _check_bytes(state: ServerState, text: str, param: str) -> None:
    """Refuse a prompt whose UTF-8 length alone shows that it cannot fit the context (see limits.py)."""
    limit = state.prompt_byte_limit
    if limit is not None and (n := utf8_len(text)) > limit:
        raise APIError(400, f"the prompt is {n} bytes long; this model's context of {state.worker.context_len} "
                       f"tokens cannot hold more than {limit} bytes of text; shorten the prompt", param=param,
                       code="context_length_exceeded")


def _encode(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
    """The prompt's token ids; runs off the event loop (tokenizing a long prompt takes a while)."""
    engine = state.engine
    if isinstance(body, ChatCompletionRequest):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if state.prompt_byte_limit is not None and engine.tokenizer.chat_template:
            # The rendered conversation is what is tokenized (a template may add or drop text).
            text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            _check_bytes(state, text, "messages")
        return engine.encode(messages, chat=True)
    prompt = body.single_prompt
    if isinstance(prompt, str):
        _check_bytes(state, prompt, "prompt")
    return engine.encode(prompt)


async def _prepare(state: ServerState, request: Request, body: CompletionRequest | ChatCompletionRequest,
                   kind: Kind) -> _Call:
    config = state.config
    if body.model != config.model_name:
        raise APIError(404, f"the model '{body.model}' does not exist (this server serves '{config.model_name}')",
                       param="model", code="model_not_found")
    # Our own id keys the worker (a client's X-Request-Id need not be unique); the client's id, when
    # given, is the canary key after ``user``, so retries of one request stay on one path.
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    routing_key = body.user or request.headers.get("x-request-id") or request_id
    if isinstance(body, ChatCompletionRequest):
        requested = body.max_completion_tokens or body.max_tokens
    else:
        requested = body.max_tokens or config.default_max_tokens
    try:
        prompt_ids = await asyncio.to_thread(_encode, state, body)
    except APIError:
        raise
    except VerispecError as e:
        raise APIError(400, str(e), param="messages" if kind == "chat" else "prompt",
                       code="context_length_exceeded" if "context" in str(e) else None) from None
    except Exception as e:  # noqa: BLE001 (the tokenizer rejects some input, e.g. lone surrogates)
        raise APIError(400, f"the prompt could not be tokenized: {e}",
                       param="messages" if kind == "chat" else "prompt") from None
    max_len = state.worker.context_len
    room = max_len - len(prompt_ids)
    max_tokens = requested if requested is not None else room  # chat: the rest of the context by default
    if max_tokens > room:
        raise APIError(400, f"this model's context holds {max_len} tokens, but {len(prompt_ids)} prompt tokens "
                       f"plus max_tokens {max_tokens} need {len(prompt_ids) + max_tokens}; shorten the prompt or "
                       "lower max_tokens", param="max_tokens", code="context_length_exceeded")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=_temperature(body.temperature),
                                top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else body.top_p,
                                seed=body.seed, stop=body.stop_list, ignore_eos=body.ignore_eos)
        spec = choose_spec(state, body.speculative, routing_key)
    except VerispecError as e:
        raise APIError(400, str(e)) from None
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    prediction = None
    if body.prediction is not None:
        try:
            prediction = await asyncio.to_thread(state.engine.encode_prediction, body.prediction.text())
        except VerispecError as e:
            raise APIError(400, str(e), param="prediction") from None
        except Exception as e:  # noqa: BLE001 (the tokenizer rejects some input, e.g. lone surrogates)
            raise APIError(400, f"the prediction could not be tokenized: {e}", param="prediction") from None
    gen = GenRequest(request_id, prompt_ids, params, spec, prediction)
    return _Call(kind, request_id, int(time.time()), body.model, gen, include_usage)


def _submit(state: ServerState, call: _Call) -> TokenStream:
    try:
        return state.worker.submit(call.gen)
    except QueueFullError:
        raise APIError(429, "the server is busy: too many requests are waiting; retry shortly", code="queue_full",
                       headers={"Retry-After": str(state.config.retry_after_s)}) from None
    except ShuttingDownError:
        raise APIError(503, "the server is shutting down", code="shutting_down") from None
    except VerispecError as e:  # the worker refuses a request that could never run (e.g. the KV budget)
        raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None


def _usage(call: _Call, result: GenerationResult) -> dict[str, Any]:
    m, spec = result.metrics, call.gen.spec
    prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
    spec_usage = SpeculativeUsage(path=call.gen.path, method=call.gen.method, k=spec.k if spec.enabled else 0,
                                  steps=m.steps, drafted=m.drafted, accepted=m.accepted,
                                  acceptance_rate=m.acceptance_rate, mean_accepted_length=m.mean_accepted_length)
    details = CompletionTokensDetails(accepted_prediction_tokens=m.accepted_prediction_tokens,
                                      rejected_prediction_tokens=m.rejected_prediction_tokens)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 completion_tokens_details=details, speculative=spec_usage).model_dump()


def _error_from(event: FailedEvent) -> APIError:
    if isinstance(event.error, VerispecError):
        return APIError(400, str(event.error))
    return APIError(500, "the engine failed on this request", code="engine_error")


async def handle(state: ServerState, request: Request, body: CompletionRequest | ChatCompletionRequest,
                 kind: Kind) -> Response:
    """Serve one completion or chat completion request, streamed or not."""
    call = await _prepare(state, request, body, kind)
    stream = _submit(state, call)
    headers = {"X-Request-Id": request.headers.get("x-request-id") or call.id}
    if body.stream:
        text = StreamText(state.engine.tokenizer, call.gen.params.stop)
        return SSEResponse(_events(call, stream, text), on_close=lambda: state.worker.cancel(call.id),
                           headers=headers)
    try:
        finished, event = await race_disconnect(_last_event(stream), request.receive)
    finally:
        state.worker.cancel(call.id)  # a no-op once finished; frees the engine when the client left
    if not finished:
        return Response(status_code=499)  # nobody is listening; the status is for the access log
    if isinstance(event, FailedEvent):
        raise _error_from(event)
    result = event.result
    if result.finish_reason == "cancelled":
        raise APIError(503, _SHUTDOWN_MESSAGE, code="shutting_down")
    text = result.text or ""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": result.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": result.finish_reason}
        obj = "text_completion"
    return JSONResponse({"id": call.id, "object": obj, "created": call.created, "model": call.model,
                         "choices": [choice], "usage": _usage(call, result)}, headers=headers)


async def _last_event(stream: TokenStream) -> FinishedEvent | FailedEvent:
    async for event in stream:
        if not isinstance(event, TokensEvent):
            return event
    raise RuntimeError("the token stream ended without a result")  # pragma: no cover (the worker always ends it)


def _chunk(call: _Call, text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
    if call.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": call.id, "object": obj, "created": call.created, "model": call.model, "choices": [choice]}


async def _events(call: _Call, stream: TokenStream, text: StreamText) -> AsyncIterator[str]:
    """The SSE body: chunks as tokens arrive (a step's tokens share a chunk), then usage and [DONE]."""
    if call.kind == "chat":
        yield sse(_chunk(call, None, None, role=True))
    async for event in stream:
        if isinstance(event, TokensEvent):
            delta = text.push(event.token_ids)
            if delta:
                yield sse(_chunk(call, delta, None))
        elif isinstance(event, FailedEvent):
            err = _error_from(event)
            yield sse(error_body(err.message, err.status, err.param, err.code))
            yield sse("[DONE]")
        else:
            result = event.result
            if result.finish_reason == "cancelled":
                yield sse(error_body(_SHUTDOWN_MESSAGE, 503, code="shutting_down"))
                yield sse("[DONE]")
                return
            yield sse(_chunk(call, text.finish(result.text or ""), result.finish_reason))
            if call.include_usage:
                usage_chunk = _chunk(call, None, None)
                usage_chunk["choices"] = []
                usage_chunk["usage"] = _usage(call, result)
                yield sse(usage_chunk)
            yield sse("[DONE]")
