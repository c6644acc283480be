"""The generation endpoints' logic: validate, route, submit to the worker, answer or stream."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from verispec.config import PLAIN, SpecConfig
from verispec.constraints import Constraint, ConstraintError
from verispec.engine.detok import StreamText
from verispec.engine.engine import GenerationResult
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams, TokenLogprob
from verispec.server.errors import APIError, error_body
from verispec.server.limits import utf8_len
from verispec.server.logprobs import chat_logprobs, completion_logprobs
from verispec.server.protocol import (
    MAX_SEED,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionTokensDetails,
    SpeculativeOptions,
    SpeculativeUsage,
    Usage,
)
from verispec.server.state import ServerState
from verispec.server.streaming import SSEResponse, race_disconnect, sse
from verispec.server.tools import ToolCallStream, ToolError, ToolSpec, parse_tool_calls, parse_tools, template_messages
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
    """One accepted request, ready to run: one generation per choice (``n``)."""

    kind: Kind
    id: str
    created: int
    model: str
    gens: tuple[GenRequest, ...]
    include_usage: bool
    tools: ToolSpec | None = None  # chat tool calls to parse out of the text
    echo: str = ""  # completions with echo: the prompt's text, before each choice's text
    logprobs: bool = False

    @property
    def gen(self) -> GenRequest:
        return self.gens[0]


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


def _encode(state: ServerState, body: CompletionRequest | ChatCompletionRequest, tools: ToolSpec | None) -> list[int]:
    """The prompt's token ids; runs off the event loop (tokenizing a long prompt takes a while)."""
    engine = state.engine
    if isinstance(body, ChatCompletionRequest):
        messages = template_messages([m.model_dump(exclude_none=True) for m in body.messages])
        rendered = tools.template_tools() if tools is not None else None
        if state.prompt_byte_limit is not None and engine.tokenizer.chat_template:
            # The rendered conversation is what is tokenized (a template may add or drop text).
            text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                        **({"tools": rendered} if rendered else {}))
            _check_bytes(state, text, "messages")
        return engine.encode(messages, chat=True, tools=rendered)
    prompt = body.single_prompt
    if isinstance(prompt, str):
        _check_bytes(state, prompt, "prompt")
    return engine.encode(prompt)


def _constraint(body: CompletionRequest | ChatCompletionRequest, tools: ToolSpec | None) -> Constraint | None:
    """The grammar a request's output follows: its tool choice's, its response_format's or its structured_outputs'."""
    grammar = tools.grammar() if tools is not None else None
    try:
        if grammar is not None:
            return Constraint("llguidance", grammar)
        fmt, so = body.response_format, body.structured_outputs
        if fmt is not None and so is not None and fmt.type != "text":
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        if fmt is not None and fmt.type == "json_object":
            return Constraint.json_object()
        if fmt is not None and fmt.type == "json_schema":
            assert fmt.json_schema is not None
            return Constraint.json_schema(fmt.json_schema.schema_)
        if so is None:
            return None
        if so.json_object:
            return Constraint.json_object()
        if so.json_ is not None:
            return Constraint.json_schema(so.json_)
        if so.regex is not None:
            return Constraint.regex(so.regex)
        if so.choice is not None:
            return Constraint.regex("|".join(re.escape(c) for c in so.choice))
        assert so.grammar is not None
        return Constraint.lark(so.grammar)
    except ConstraintError as e:
        param = "tool_choice" if grammar is not None else (
            "response_format" if body.response_format is not None else "structured_outputs")
        raise APIError(400, str(e), param=param) from None


def _params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int, seed: int | None,
            vocab: int) -> SamplingParams:
    logprobs = None
    if isinstance(body, ChatCompletionRequest) and body.logprobs:
        logprobs = body.top_logprobs or 0
    elif isinstance(body, CompletionRequest):
        logprobs = body.logprobs
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab:
            raise APIError(400, f"logit_bias keys are token ids below {vocab}, not {key!r}", param="logit_bias")
        bias[int(key)] = value
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=_temperature(body.temperature),
                              top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else body.top_p,
                              seed=seed, stop=body.stop_list, ignore_eos=body.ignore_eos,
                              presence_penalty=body.presence_penalty or 0.0,
                              frequency_penalty=body.frequency_penalty or 0.0, logit_bias=bias, logprobs=logprobs)
    except VerispecError as e:
        raise APIError(400, str(e), param="logit_bias" if "logit_bias" in str(e) else None) from None


async def _prepare(state: ServerState, request: Request, body: CompletionRequest | ChatCompletionRequest,
                   kind: Kind) -> _Call:
    config = state.config
    if body.model != config.model_name:
        raise APIError(404, f"the model '{body.model}' does not exist (this server serves '{config.model_name}')",
                       param="model", code="model_not_found")
    slots = state.worker.stats().get("max_batch", 1)
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (the prompt's log-probabilities are not computed)",
                       param="echo")
    if body.n > slots:
        raise APIError(400, f"n is {body.n} but this server runs at most {slots} requests at once (--max-batch)",
                       param="n")
    # Our own id keys the worker (a client's X-Request-Id need not be unique); the client's id, when
    # given, is the canary key after ``user``, so retries of one request stay on one path.
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    routing_key = body.user or request.headers.get("x-request-id") or request_id
    tools = None
    if isinstance(body, ChatCompletionRequest):
        requested = body.max_completion_tokens or body.max_tokens
        try:
            tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls is not False)
        except ToolError as e:
            raise APIError(400, e.message, param=e.param) from None
    else:
        requested = body.max_tokens or config.default_max_tokens
    try:
        prompt_ids = await asyncio.to_thread(_encode, state, body, tools)
    except APIError:
        raise
    except ToolError as e:
        raise APIError(400, e.message, param=e.param) from None
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
    constraint = await asyncio.to_thread(_constraint, body, tools)
    try:
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
    # Choice i has its own seed stream: seed + i (or fresh entropy for each, without a seed).
    gens = tuple(GenRequest(request_id if i == 0 else f"{request_id}-{i}", prompt_ids,
                            _params(body, max_tokens, None if body.seed is None else (body.seed + i) % (MAX_SEED + 1),
                                    state.engine.target.args.vocab_size),
                            spec, prediction, constraint) for i in range(body.n))
    echo = ""
    if isinstance(body, CompletionRequest) and body.echo:
        prompt = body.single_prompt
        echo = prompt if isinstance(prompt, str) else (state.engine.decode(prompt) or "")
    logprobs = gens[0].params.logprobs is not None
    return _Call(kind, request_id, int(time.time()), body.model, gens, include_usage, tools, echo, logprobs)


def _submit(state: ServerState, gen: GenRequest) -> TokenStream:
    try:
        return state.worker.submit(gen)
    except QueueFullError:
        raise APIError(429, "the server is busy: too many requests are waiting; retry shortly", code="queue_full",
                       headers={"Retry-After": str(state.config.retry_after_s)}) from None
    except ShuttingDownError:
        raise APIError(503, "the server is shutting down", code="shutting_down") from None
    except VerispecError as e:  # the worker refuses a request that could never run (e.g. the KV budget)
        raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None


def _usage(call: _Call, results: list[GenerationResult]) -> dict[str, Any]:
    """Usage summed over the choices; the speculative figures are the first choice's."""
    m, spec = results[0].metrics, call.gen.spec
    prompt, completion = len(results[0].prompt_token_ids), sum(len(r.token_ids) for r in results)
    spec_usage = SpeculativeUsage(path=call.gen.path, method=call.gen.method, k=spec.k if spec.enabled else 0,
                                  steps=m.steps, drafted=m.drafted, accepted=m.accepted,
                                  acceptance_rate=m.acceptance_rate, mean_accepted_length=m.mean_accepted_length)
    details = CompletionTokensDetails(
        accepted_prediction_tokens=sum(r.metrics.accepted_prediction_tokens for r in results),
        rejected_prediction_tokens=sum(r.metrics.rejected_prediction_tokens for r in results))
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
    streams = []
    try:
        for gen in call.gens:
            streams.append(_submit(state, gen))
    except APIError:
        for gen in call.gens[: len(streams)]:
            state.worker.cancel(gen.request_id)
        raise
    headers = {"X-Request-Id": request.headers.get("x-request-id") or call.id}

    def cancel_all() -> None:
        for gen in call.gens:
            state.worker.cancel(gen.request_id)

    if body.stream:
        return SSEResponse(_events(state, call, streams), on_close=cancel_all, headers=headers)
    try:
        finished, events = await race_disconnect(asyncio.gather(*(_last_event(s) for s in streams)), request.receive)
    finally:
        cancel_all()  # a no-op once finished; frees the engine when the client left
    if not finished:
        return Response(status_code=499)  # nobody is listening; the status is for the access log
    for event in events:
        if isinstance(event, FailedEvent):
            raise _error_from(event)
    results = [event.result for event in events]
    if any(r.finish_reason == "cancelled" for r in results):
        raise APIError(503, _SHUTDOWN_MESSAGE, code="shutting_down")
    tok = state.engine.tokenizer
    choices = [_choice(call, i, r, tok) for i, r in enumerate(results)]
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return JSONResponse({"id": call.id, "object": obj, "created": call.created, "model": call.model,
                         "choices": choices, "usage": _usage(call, results)}, headers=headers)


def _choice(call: _Call, index: int, result: GenerationResult, tok: Any) -> dict[str, Any]:
    text = result.text or ""
    logprobs = None
    if call.logprobs and result.logprobs is not None:
        logprobs = chat_logprobs(result.logprobs, tok) if call.kind == "chat" else \
            completion_logprobs(result.logprobs, tok, len(call.echo))
    if call.kind != "chat":
        return {"index": index, "text": call.echo + text, "logprobs": logprobs, "finish_reason": result.finish_reason}
    content, calls = (text, []) if call.tools is None else parse_tool_calls(text, call.tools)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason}


async def _last_event(stream: TokenStream) -> FinishedEvent | FailedEvent:
    async for event in stream:
        if not isinstance(event, TokensEvent):
            return event
    raise RuntimeError("the token stream ended without a result")  # pragma: no cover (the worker always ends it)


def _chunk(call: _Call, index: int, text: str | None, finish_reason: str | None, role: bool = False,
           logprobs: dict[str, Any] | None = None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if call.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": call.id, "object": obj, "created": call.created, "model": call.model, "choices": [choice]}


async def _merged(streams: list[TokenStream]) -> AsyncIterator[tuple[int, Any]]:
    """Every stream's events as (stream index, event), in arrival order, until each stream has ended."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: TokenStream) -> None:
        async for event in stream:
            await queue.put((i, event))
            if not isinstance(event, TokensEvent):
                return

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(sum(1 for _ in streams)):
            while True:
                i, event = await queue.get()
                yield i, event
                if not isinstance(event, TokensEvent):
                    break
    finally:
        for t in tasks:
            t.cancel()


class _ChoiceStream:
    """One choice's text (and tool calls) as it streams."""

    def __init__(self, state: ServerState, call: _Call, index: int) -> None:
        self.call, self.index, self.tok = call, index, state.engine.tokenizer
        self.text = StreamText(self.tok, call.gens[index].params.stop)
        self.tools = ToolCallStream(call.tools) if call.tools is not None else None

    def chunks(self, delta: str, logprobs: list[TokenLogprob] | None, final: bool = False) -> list[dict[str, Any]]:
        lp = None
        if self.call.logprobs and logprobs:
            lp = chat_logprobs(logprobs, self.tok) if self.call.kind == "chat" else \
                completion_logprobs(logprobs, self.tok, 0)
        if self.tools is None:
            return [_chunk(self.call, self.index, delta, None, logprobs=lp)] if delta or lp else []
        events = self.tools.feed(delta) if delta else []
        if final:
            events += self.tools.finish()
        out = []
        for event in events:
            if event[0] == "content":
                out.append(_chunk(self.call, self.index, event[1], None))
            else:
                out.append(_chunk(self.call, self.index, None, None, tool_calls=[event[2]]))
        if lp and out:
            out[0]["choices"][0]["logprobs"] = lp
        elif lp:
            out.append(_chunk(self.call, self.index, None, None, logprobs=lp))
        return out


async def _events(state: ServerState, call: _Call, streams: list[TokenStream]) -> AsyncIterator[str]:
    """The SSE body: chunks as tokens arrive (a step's tokens share a chunk), then usage and [DONE]."""
    choices = [_ChoiceStream(state, call, i) for i in range(len(streams))]
    results: list[GenerationResult | None] = [None] * len(streams)
    for i in range(len(streams)):
        if call.kind == "chat":
            yield sse(_chunk(call, i, None, None, role=True))
        elif call.echo:
            yield sse(_chunk(call, i, call.echo, None))
    async for i, event in _merged(streams):
        c = choices[i]
        if isinstance(event, TokensEvent):
            for chunk in c.chunks(c.text.push(event.token_ids), event.logprobs):
                yield sse(chunk)
        elif isinstance(event, FailedEvent):
            err = _error_from(event)
            yield sse(error_body(err.message, err.status, err.param, err.code))
            yield sse("[DONE]")
            return
        else:
            result = event.result
            if result.finish_reason == "cancelled":
                yield sse(error_body(_SHUTDOWN_MESSAGE, 503, code="shutting_down"))
                yield sse("[DONE]")
                return
            for chunk in c.chunks(c.text.finish(result.text or ""), None, final=True):
                yield sse(chunk)
            calls = c.tools is not None and c.tools.calls
            finish = "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason
            yield sse(_chunk(call, i, None, finish))
            results[i] = result
    if call.include_usage:
        usage_chunk = _chunk(call, 0, None, None)
        usage_chunk["choices"] = []
        usage_chunk["usage"] = _usage(call, [r for r in results if r is not None])
        yield sse(usage_chunk)
    yield sse("[DONE]")
