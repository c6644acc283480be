"""OpenAI tool calling for chat templates in the Hermes style that Qwen2.5 uses.

The template lists the tools as JSON lines inside ``<tools></tools>`` in the system prompt and
teaches the model to answer a call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several calls one after the other, separated by a newline. In Qwen2.5's vocabulary ``<tool_call>`` and
``</tool_call>`` are single added tokens (151657, 151658): not "special" to Hugging Face (they show up in
decoded text) but special to llguidance, whose lexer matches them only as ``<tool_call>`` token references,
never as the text ``"<tool_call>"``. :meth:`ToolSpec.grammar` therefore names them as tokens.

This module turns the request's ``tools``/``tool_choice`` into a :class:`ToolSpec` (what the template renders
and, for ``"required"`` or a named function, the grammar that forces a call), converts OpenAI chat history into
what the template expects (:func:`template_messages`), and parses finished (:func:`parse_tool_calls`) or streamed
(:class:`ToolCallStream`) output back into OpenAI ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llguidance import LLMatcher

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# Arguments are constrained to the exact JSON layout the template's ``tojson`` (json.dumps) renders.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The text of one call, as the template renders it: OPEN CALL_HEAD name NAME_TAIL arguments CALL_TAIL CLOSE.
CALL_HEAD, NAME_TAIL, CALL_TAIL = '\n{"name": "', '", "arguments": ', "}\n"
_BLOCK_RE = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

Event = tuple[str, str] | tuple[str, int, dict[str, Any]]  # ("content", text) | ("tool_call", index, delta)


def default_parameters() -> dict[str, Any]:
    """The schema of a function declared without ``parameters``: an object, of any properties."""
    return {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A malformed ``tools``/``tool_choice``/tool message; ``param`` is the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class Tool:
    """One function the model may call; ``parameters`` is the JSON schema of its arguments (an object)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=default_parameters)

    def template_dict(self) -> dict[str, Any]:
        """The tool as OpenAI shapes it (what the chat template renders with ``tojson``)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and its ``tool_choice``: ``"auto"``, ``"none"``, ``"required"`` or a function name."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True  # OpenAI's parallel_tool_calls: False allows one call at most

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for ``tokenizer.apply_chat_template(tools=...)``; None under ``"none"`` (nothing rendered)."""
        if self.choice == "none":
            return None
        return [t.template_dict() for t in self.tools]

    def grammar(self, *, tags_as_tokens: bool = True) -> str | None:
        """An llguidance grammar forcing the output to be tool calls in the template's format; None unless forced.

        A named choice forces exactly one call of that function, ``"required"`` one or more calls of any listed
        function, separated by ``"\\n"``; each call's arguments follow its ``parameters`` schema, laid out as
        ``json.dumps`` lays them out. ``tags_as_tokens`` (default) matches ``<tool_call>``/``</tool_call>`` as the
        single tokens Qwen's vocabulary has; False matches them as text, for a tokenizer without such tokens.
        """
        if self.choice in ("auto", "none"):
            return None
        tools = [t for t in self.tools if t.name == self.choice] if self.choice != "required" else list(self.tools)
        open_, close = (OPEN, CLOSE) if tags_as_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
        lines = ['start: call ("\\n" call)*' if self.choice == "required" and self.parallel else "start: call",
                 f"call: {open_} {json.dumps(CALL_HEAD)} function {json.dumps(CALL_TAIL)} {close}",
                 "function: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            lines.append(f"fn_{i}: {json.dumps(tool.name + NAME_TAIL)} args_{i}")
            lines.append(f"args_{i}: %json {json.dumps(_constrained(tool.parameters))}")
        return LLMatcher.grammar_from_lark("\n".join(lines) + "\n")


def _constrained(parameters: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` with the object type made explicit and the template's JSON layout imposed."""
    schema = dict(parameters)
    schema.setdefault("type", "object")
    schema["x-guidance"] = dict(JSON_OPTIONS)
    return schema


def _check_schema(parameters: Any, param: str) -> dict[str, Any]:
    if not isinstance(parameters, dict):
        raise ToolError("parameters must be a JSON schema object", param)
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ToolError(f"parameters must be a JSON schema of type \"object\", not {kind!r}", param)
    try:
        grammar = LLMatcher.grammar_from_json_schema(parameters, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    except (ValueError, TypeError) as e:
        raise ToolError(f"parameters is not a usable JSON schema: {e}", param) from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ToolError(f"parameters is not a supported JSON schema: {'; '.join(messages)}", param)
    return parameters


def _parse_tool(i: int, tool: Any) -> Tool:
    at = f"tools[{i}]"
    if not isinstance(tool, Mapping):
        raise ToolError("each tool must be an object {\"type\": \"function\", \"function\": {...}}", at)
    if tool.get("type", "function") != "function":
        raise ToolError(f"unsupported tool type {tool.get('type')!r}; only \"function\" tools are supported",
                        f"{at}.type")
    fn = tool.get("function")
    if not isinstance(fn, Mapping):
        raise ToolError("a function tool needs a \"function\" object", f"{at}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ToolError(f"function name {name!r} must be 1 to 64 letters, digits, underscores or dashes",
                        f"{at}.function.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError("description must be a string", f"{at}.function.description")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError("strict must be a boolean", f"{at}.function.strict")
    parameters = fn.get("parameters")
    parameters = default_parameters() if parameters is None else \
        _check_schema(parameters, f"{at}.function.parameters")
    return Tool(name, description, parameters)


def parse_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                parallel: bool = True) -> ToolSpec | None:
    """Validate OpenAI's ``tools`` and ``tool_choice``; None when there are no tools (and no choice needing them).

    Raises :class:`ToolError` naming the field at fault: a tool not of the ``{"type": "function", "function":
    {"name", "description"?, "parameters"?, "strict"?}}`` shape, a bad or repeated name, parameters that are not
    an object schema llguidance compiles, a ``tool_choice`` that is none of ``"none"``, ``"auto"``,
    ``"required"`` and ``{"type": "function", "function": {"name": ...}}`` or names no listed function, or one
    other than ``"none"`` without tools.
    """
    if tools is not None and not isinstance(tools, list):
        raise ToolError("tools must be a list of function tools", "tools")
    parsed: list[Tool] = []
    for i, tool in enumerate(tools or []):
        t = _parse_tool(i, tool)
        if any(p.name == t.name for p in parsed):
            raise ToolError(f"function name {t.name!r} is given twice", f"tools[{i}].function.name")
        parsed.append(t)
    choice = _parse_choice(tool_choice)
    named = isinstance(tool_choice, Mapping)
    if not parsed:
        if choice not in (None, "none") or named:
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    choice = choice or "auto"
    if named and choice not in {t.name for t in parsed}:
        raise ToolError(f"tool_choice names function {choice!r}, which is not among the tools", "tool_choice")
    if named and choice in CHOICES:
        raise ToolError(f"a function named {choice!r} cannot be forced: use tool_choice \"required\"",
                        "tool_choice")
    return ToolSpec(tuple(parsed), choice, parallel)


def _parse_choice(tool_choice: str | dict[str, Any] | None) -> str | None:
    if tool_choice is None:
        return None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolError(f"tool_choice must be \"none\", \"auto\", \"required\" or a function, not "
                            f"{tool_choice!r}", "tool_choice")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":  # type: ignore[union-attr]
        raise ToolError("tool_choice must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return name


# -- chat history ------------------------------------------------------------------------------


def _text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ToolError("only text content parts are supported", param)
            parts.append(part["text"])
        return "".join(parts)
    raise ToolError("content must be a string or a list of text parts", param)


def _template_call(call: Any, at: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping):
        raise ToolError("a tool call needs a \"function\" object", f"{at}.function")
    name, arguments = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str):
        raise ToolError("a tool call's function needs a name", f"{at}.function.name")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ToolError(f"arguments is not valid JSON: {e}", f"{at}.function.arguments") from None
    elif arguments is None:
        arguments = {}
    elif not isinstance(arguments, dict):
        raise ToolError("arguments must be a JSON string", f"{at}.function.arguments")
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat history as Qwen2.5's template wants it.

    Content given as text parts is joined; a ``developer`` message becomes ``system`` (the template knows no
    other); an assistant message's ``tool_calls`` keep their name and get their ``arguments`` JSON string parsed,
    since the template renders ``arguments | tojson`` (a string would come out quoted); ``tool`` messages keep
    their content (the template wraps consecutive ones in ``<tool_response>`` blocks of one user turn).
    Raises :class:`ToolError` for arguments that are not JSON and for malformed tool calls or content.
    """
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ToolError("each message must be an object", f"messages[{i}]")
        m = {k: v for k, v in message.items() if v is not None}
        role = m.get("role")
        if role == "developer":
            m["role"] = "system"
        calls = m.pop("tool_calls", None)
        if role == "assistant" and calls:
            if not isinstance(calls, list):
                raise ToolError("tool_calls must be a list", f"messages[{i}].tool_calls")
            m["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
            text = _text(m.get("content"), f"messages[{i}].content")
            m["content"] = text or None
        else:
            m["content"] = _text(m.get("content"), f"messages[{i}].content")
        out.append(m)
    return out


# -- parsing output ----------------------------------------------------------------------------


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _parse_block(inner: str, spec: ToolSpec) -> dict[str, Any] | None:
    """The OpenAI ``function`` of one block's JSON, or None if it is not a call of a listed function."""
    try:
        obj = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in spec.names:
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models quote the arguments object
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}


def parse_tool_calls(text: str, spec: ToolSpec) -> tuple[str | None, list[dict[str, Any]]]:
    """Split a finished output into its content and OpenAI ``tool_calls``.

    Each ``<tool_call>...</tool_call>`` block holding ``{"name": ..., "arguments": {...}}`` for a listed function
    becomes a call; it leaves the content together with the whitespace right before it, and whitespace ending the
    output right after a call goes too. Blocks that do not parse or name an unknown function stay in the content,
    as does an unclosed block. The content is None when calls leave nothing of it. Under ``"none"`` nothing is
    parsed. The same split as :class:`ToolCallStream` makes.
    """
    if spec.choice == "none":
        return text, []
    pieces: list[str] = []
    calls: list[dict[str, Any]] = []
    last, after_call = 0, False
    for m in _BLOCK_RE.finditer(text):
        between = text[last:m.start()]
        function = _parse_block(m.group(1), spec) if spec.parallel or not calls else None
        if function is None:
            pieces.append(between + m.group(0))
            after_call = False
        else:
            pieces.append(between.rstrip())
            calls.append({"id": _call_id(), "type": "function", "function": function})
            after_call = True
        last = m.end()
    tail = text[last:]
    pieces.append("" if after_call and not tail.strip() else tail)
    if not calls:
        return text, []
    content = "".join(pieces)
    return content or None, calls


def _open_prefix_len(text: str) -> int:
    """Length of the longest end of ``text`` that could begin ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Incremental :func:`parse_tool_calls` for streamed output.

    :meth:`feed` takes each text delta and returns events: ``("content", text)`` for content, and
    ``("tool_call", index, delta)`` with the OpenAI streamed ``delta.tool_calls`` entry ``{"index", "id", "type",
    "function": {"name", "arguments"}}`` once a block closes. Text that may begin ``<tool_call>`` is held until
    decided, as is whitespace that a following call would remove. :meth:`finish` flushes what is held (an unclosed
    block as content). The content events join to :func:`parse_tool_calls`' content for any chunking.
    """

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self._buf = ""  # undecided text: held whitespace, then a possible "<tool_call>" start or a block's body
        self._ws = ""  # whitespace held before _buf: dropped if a call follows
        self._in_block = False
        self._after_call = False  # nothing but whitespace since the last call
        self._count = 0
        self._done = False

    @property
    def calls(self) -> int:
        """How many tool calls have been emitted."""
        return self._count

    def feed(self, text: str) -> list[Event]:
        """Events for one more delta of the output."""
        if self._done:
            raise RuntimeError("ToolCallStream.feed after finish")
        if self.spec.choice == "none":
            return [("content", text)] if text else []
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        """Events for what is still held at the end of the output."""
        if self._done:
            return []
        self._done = True
        if self.spec.choice == "none":
            return []
        events = self._drain(final=True)
        if self._in_block:  # unclosed: content after all
            self._emit(events, OPEN + self._buf)
            self._buf, self._in_block = "", False
        if self._ws and not self._after_call:
            events.append(("content", self._ws))
        self._ws = ""
        return _merge(events)

    def _emit(self, events: list[Event], text: str) -> None:
        """Emit content ``text`` (no trailing whitespace left to hold) after the held whitespace."""
        if not text:
            return
        events.append(("content", self._ws + text))
        self._ws, self._after_call = "", False

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self._buf:
            if self._in_block:
                j = self._buf.find(CLOSE)
                if j < 0:
                    break
                inner, self._buf = self._buf[:j], self._buf[j + len(CLOSE):]
                self._in_block = False
                function = _parse_block(inner, self.spec) if self.spec.parallel or not self._count else None
                if function is None:
                    self._emit(events, OPEN + inner + CLOSE)
                    continue
                events.append(("tool_call", self._count, {"index": self._count, "id": _call_id(),
                                                          "type": "function", "function": function}))
                self._count += 1
                self._ws, self._after_call = "", True
                continue
            i = self._buf.find(OPEN)
            if i >= 0:
                head, self._buf = self._buf[:i], self._buf[i + len(OPEN):]
                self._content(events, head)
                self._in_block = True
                continue
            keep = 0 if final else _open_prefix_len(self._buf)
            head, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            self._content(events, head)
            break
        return _merge(events)

    def _content(self, events: list[Event], text: str) -> None:
        """Content ``text``, holding its trailing whitespace back."""
        body = text.rstrip()
        self._emit(events, body)
        self._ws += text[len(body):]


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent content events as one."""
    out: list[Event] = []
    for e in events:
        if e[0] == "content" and out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + e[1])  # type: ignore[operator]
        else:
            out.append(e)
    return out
