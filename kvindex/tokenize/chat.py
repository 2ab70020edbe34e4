"""OpenAI chat messages -> the prompt text vLLM renders, with jinja2 set up as transformers sets it up.

vLLM's chat path (``renderers/hf.py`` and ``renderers/chat_utils.py`` in vLLM 0.32) is, for text:

1. Messages are parsed into a "conversation": content ``None`` -> no parts, a string -> one text part;
   text-like parts (``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``) are kept,
   joined with ``"\\n"`` when the template treats content as a string, or kept as
   ``{"type": "text", "text": ...}`` dicts when the template iterates over ``message.content``
   (detected from the template's syntax tree). Assistant ``tool_calls`` get their JSON ``arguments``
   parsed into objects; ``reasoning`` is also passed as ``reasoning_content``; tool-message content
   lists become strings. ``developer`` messages become ``system`` ones when the template does not
   mention the role.
2. The request's ``chat_template_kwargs`` are merged with ``add_generation_prompt``,
   ``continue_final_message``, ``documents`` and ``tools``; values ``None`` and ``"auto"`` are
   dropped, and only keys the template references (or ``apply_chat_template`` parameters) are kept.
3. transformers renders the template in an ``ImmutableSandboxedEnvironment`` (``trim_blocks``,
   ``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` tag) with the filters
   and globals ``tojson`` (no HTML escaping), ``raise_exception`` and ``strftime_now``, and the named
   special tokens (``bos_token``, ...) as variables; ``continue_final_message`` cuts the text after
   the last message's content.

The text is then encoded without adding special tokens (vLLM's chat default): the template writes
the BOS text itself. Multimodal parts are refused (kvindex cannot expand image placeholders).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from kvindex.tokenize import bounded_json
from kvindex.tokenize.bounded_json import TooDeep
from kvindex.tokenize.errors import TokenizeError
from kvindex.tokenize.loader import ModelTokenizer

TEXT_PART_TYPES = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
TEXT_PART_TYPES["thinking"] = "thinking"
# Keys of OpenAI/vLLM content parts; anything else on a text part travels to the template with it.
KNOWN_PART_FIELDS = frozenset(
    [
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    ]
)
# transformers' apply_chat_template parameters: accepted in chat_template_kwargs whatever the template.
APPLY_PARAMS = frozenset(
    [
        "add_generation_prompt",
        "continue_final_message",
        "conversation",
        "documents",
        "max_length",
        "padding",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "tokenizer_kwargs",
        "tools",
        "truncation",
    ]
)
BILLING_HEADER = "x-anthropic-billing-header"
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclass(frozen=True)
class ChatOptions:
    """The chat options of vLLM's OpenAI API that change the prompt, with vLLM's defaults."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    documents: list[Any] | None = None
    add_special_tokens: bool = False


# -- the Jinja environment -------------------------------------------------------------------------


class GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it; rendering
    just outputs the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # As transformers': no HTML escaping (jinja2's own tojson escapes <, >, &, ').
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizeError(f"the chat template does not compile: {exc}") from exc


@lru_cache(maxsize=64)
def template_variables(source: str) -> frozenset[str]:
    return frozenset(jinja2.meta.find_undeclared_variables(_ENV.parse(source)))


# -- content format: does the template iterate over message content? -------------------------------


def _is_name(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_item(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_name(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _refers(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``name`` (or ``name.key``), possibly filtered, tested or sliced."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _refers(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _refers(node.node, name, key)
    return _is_item(node, name, key) if key else _is_name(node, name)


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every variable assigned from it (transitively), e.g. ``{% set msgs = messages[1:] %}``."""
    found, queue = [name], [name]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if not isinstance(target, jinja2.nodes.Name):
                continue
            if _refers(assign.node, current) and target.name not in found:
                found.append(target.name)
                queue.append(target.name)
    return found


def _content_loops(root: jinja2.nodes.Template) -> Iterator[jinja2.nodes.For]:
    message_vars = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_refers(loop.iter, v) for v in _aliases(root, "messages")) and isinstance(
            loop.target, jinja2.nodes.Name
        ):
            message_vars.append(loop.target.name)
    in_macros: set[int] = set()
    macro_params: dict[int, set[str]] = {}
    for macro in root.find_all(jinja2.nodes.Macro):
        names = [arg.name for arg in macro.args]
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(names) and any(_refers(arg, v, "content") for v in message_vars):
                    params.add(names[i])
            for kw in call.kwargs:
                if kw.key in names and any(_refers(kw.value, v, "content") for v in message_vars):
                    params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                macro_params[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        it = loop.iter
        if any(_refers(it, v, "content") for v in message_vars) or (
            isinstance(it, jinja2.nodes.Name)
            and (
                it.name in macro_params.get(id(loop), ())
                or (id(loop) not in in_macros and it.name == "content")
            )
        ):
            yield loop


@lru_cache(maxsize=64)
def content_format(source: str) -> str:
    """ "openai" when the template loops over a message's content parts, else "string" (vLLM's detection)."""
    try:
        root = _ENV.parse(source)
    except jinja2.TemplateError:
        return "string"
    return "openai" if next(_content_loops(root), None) is not None else "string"


# -- messages -> conversation ----------------------------------------------------------------------


def _parts(message: dict[str, Any], index: int) -> list[Any]:
    content = message.get("content")
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return content
    raise TokenizeError(f"messages[{index}].content must be a string, a list of parts or null")


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    # vLLM drops Claude Code's per-request attribution line from system text (it would defeat caching).
    out = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _text_parts(parts: list[Any], index: int, as_dicts: bool) -> list[Any]:
    out: list[Any] = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            out.append({"type": "text", "text": part} if as_dicts else part)
            continue
        if not isinstance(part, dict):
            raise TokenizeError(f"messages[{index}].content[{j}] must be an object or a string")
        kind = part.get("type")
        if kind is None:
            raise TokenizeError(f"messages[{index}].content[{j}] has no 'type'")
        if kind == "tool_reference":
            out.append({"type": "tool_reference", "name": part.get("name")} if as_dicts else part.get("name"))
            continue
        field = TEXT_PART_TYPES.get(kind)
        if field is None:
            raise TokenizeError(
                f"messages[{index}].content[{j}] is of type {kind!r}: only text parts can be tokenized "
                "here (multimodal prompts need the engine's own processor)"
            )
        text = part.get(field)
        if text is None:
            continue  # vLLM skips text parts without text
        if not isinstance(text, str):
            raise TokenizeError(f"messages[{index}].content[{j}].{field} must be a string")
        if as_dicts:
            item = {"type": "text", "text": text}
            item.update({k: v for k, v in part.items() if k not in KNOWN_PART_FIELDS})
            out.append(item)
        else:
            out.append(text)
    return out


def _tool_arguments(message: dict[str, Any]) -> None:
    """Assistant tool-call arguments as objects, as vLLM passes them (templates expect mappings)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return
    if not calls:
        message.pop("tool_calls", None)
        return
    for call in calls:
        if not isinstance(call, dict):
            raise TokenizeError("assistant tool_calls entries must be objects")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise TokenizeError("only assistant tool_calls of type 'function' are supported")
        arguments = function.get("arguments")
        if not arguments:
            function["arguments"] = {}
        elif not isinstance(arguments, dict):
            parsed = arguments
            if isinstance(arguments, str):
                try:
                    parsed = bounded_json.loads(arguments, "a tool call's function.arguments")
                except TooDeep as exc:
                    raise TokenizeError(str(exc)) from None
                except ValueError:
                    parsed = None  # vLLM coerces malformed history to {} so the chat can go on
            function["arguments"] = parsed if isinstance(parsed, dict) else {}


def conversation(messages: Any, fmt: str) -> list[dict[str, Any]]:
    """vLLM's ``parse_chat_messages`` for text: the message dicts the template sees."""
    if not isinstance(messages, list):
        raise TokenizeError("messages must be a JSON list of message objects")
    if not messages:
        raise TokenizeError("messages is empty: a chat needs at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TokenizeError(f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise TokenizeError(f"messages[{i}].role is required and must be a string")
        content = message.get("content")
        result: dict[str, Any]
        if isinstance(content, str) and role != "system":
            # The usual message, one text part: what the general path below makes of it, without building
            # and joining parts (a 256 K-token agent conversation has thousands of messages).
            result = {
                "role": role,
                "content": [{"type": "text", "text": content}] if fmt == "openai" else content,
            }
        else:
            parts = _parts(message, i)
            if role == "system":
                parts = _strip_billing_header(parts)
            texts = _text_parts(parts, i, as_dicts=fmt == "openai")
            result = {"role": role, "content": texts if fmt == "openai" else "\n".join(texts)}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                result["tool_calls"] = copy.deepcopy(list(message["tool_calls"]))
            if message.get("reasoning") is not None:
                result["reasoning"] = result["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                result["tool_call_id"] = message["tool_call_id"]
            content = result["content"]
            if isinstance(content, list):
                if any(isinstance(p, dict) and p.get("type") != "text" for p in content):
                    pass  # structured parts (tool references) stay as they are
                else:
                    result["content"] = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
        if isinstance(message.get("name"), str):
            result["name"] = message["name"]
        if isinstance(message.get("task"), str):
            result["task"] = message["task"]
        if role == "developer":
            result["tools"] = message.get("tools")
        if role == "assistant":
            _tool_arguments(result)
        out.append(result)
    return out


def _developer_as_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    converted = []
    for msg in conv:
        if msg["role"] == "developer":
            msg = {**msg, "role": "system"}
            msg.pop("tools", None)
        converted.append(msg)
    # Then all system messages merged into the first position (some templates require it).
    system_texts: list[str] = []
    others = []
    merge = False
    for i, msg in enumerate(converted):
        if msg["role"] != "system":
            others.append(msg)
            continue
        if i > 0 or system_texts:
            merge = True
        content = msg.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, dict) and "text" in p else p  # type: ignore[misc]  # (as vLLM joins them)
                for p in content
                if isinstance(p, dict | str)
            )
        if content:
            system_texts.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]


def _tool_dump(tool: Any, index: int) -> dict[str, Any]:
    """A request tool as vLLM hands it to the template (``ChatCompletionToolsParam.model_dump()``)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise TokenizeError(f"tools[{index}] must be an object with a 'function' object")
    if tool.get("type", "function") != "function":
        raise TokenizeError(f"tools[{index}].type must be 'function'")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str):
        raise TokenizeError(f"tools[{index}].function.name is required")
    function: dict[str, Any] = {
        "name": fn["name"],
        "description": fn.get("description"),
        "parameters": fn.get("parameters"),
    }
    defer = tool.get("defer_loading")
    if fn.get("strict") is not None:
        function["strict"] = fn["strict"]
    if fn.get("defer_loading") is not None or defer is not None:
        function["defer_loading"] = fn.get("defer_loading") if fn.get("defer_loading") is not None else defer
    out: dict[str, Any] = {"type": "function", "function": function}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def render_chat(mt: ModelTokenizer, messages: Any, options: ChatOptions) -> str:
    """The prompt text vLLM's chat endpoint renders for ``messages`` with ``options``."""
    call = _template_call(mt, options)
    source = call.source
    conv = conversation(messages, content_format(source))
    if any(m["role"] == "developer" for m in conv) and not (
        '"developer"' in source or "'developer'" in source
    ):
        conv = _developer_as_system(conv)
    final_text = _mark_final(conv, call.continue_final, source) if call.continue_final else None
    variables = {**mt.special_tokens, **call.variables}
    template = compile_template(source)
    try:
        text = template.render(
            messages=conv,
            tools=call.tools,
            documents=call.documents,
            add_generation_prompt=call.add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as exc:
        raise TokenizeError(f"the chat template rejected the request: {exc}") from exc
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        raise TokenizeError(
            f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
        ) from exc
    if final_text is not None:
        text = _cut_final(text, final_text)
    return text


@dataclass
class _TemplateCall:
    """What the template is rendered with, besides the messages (``_template_call``)."""

    source: str
    tools: list[Any] | None
    documents: list[dict[str, Any]] | None
    add_generation_prompt: bool
    continue_final: Any
    variables: dict[str, Any]


def _template_call(mt: ModelTokenizer, options: ChatOptions) -> _TemplateCall:
    """The template's source and arguments from the request's options, merged and checked as vLLM
    does: request kwargs under the explicit options, ``None`` and ``"auto"`` dropped, only what the
    template reads kept."""
    tools = None
    if options.tools is not None:
        if not isinstance(options.tools, list):
            raise TokenizeError("tools must be a JSON list")
        tools = [_tool_dump(t, i) for i, t in enumerate(options.tools)]
    request_kwargs = options.chat_template_kwargs or {}
    if not isinstance(request_kwargs, dict):
        raise TokenizeError("chat_template_kwargs must be a JSON object")
    for key in ("chat_template", "tokenize"):
        if key in request_kwargs:
            raise TokenizeError(f"chat_template_kwargs may not set {key!r}")
    unset = (None, "auto")
    kwargs = dict(request_kwargs)
    kwargs.update(
        (k, v)
        for k, v in (
            ("add_generation_prompt", options.add_generation_prompt),
            ("continue_final_message", options.continue_final_message),
            ("documents", options.documents),
        )
        if v not in unset
    )
    merged: dict[str, Any] = {"tools": tools}
    merged.update(
        (k, v) for k, v in kwargs.items() if not (v is None or (isinstance(v, str) and v == "auto"))
    )
    tools = merged.pop("tools", None)
    source = mt.template(tools is not None)
    accepted = template_variables(source) | APPLY_PARAMS
    merged = {k: v for k, v in merged.items() if k in accepted}

    add_generation_prompt = bool(merged.pop("add_generation_prompt", False))
    continue_final = merged.pop("continue_final_message", False)
    documents = merged.pop("documents", None)
    for key in APPLY_PARAMS - {"tools"}:
        merged.pop(key, None)
    if continue_final and add_generation_prompt:
        raise TokenizeError(
            "continue_final_message and add_generation_prompt are not compatible (add_generation_prompt "
            "defaults to true for chats: set it to false to continue the final message)"
        )
    if tools is not None and not isinstance(tools, list):
        raise TokenizeError("tools must be a list")
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
    ):
        raise TokenizeError("documents must be a list of objects")
    return _TemplateCall(source, tools, documents, add_generation_prompt, continue_final, merged)


def _mark_final(conv: list[dict[str, Any]], continue_final: Any, source: str) -> str:
    """Mark the end of the final message (continue_final_message: its field, ``content`` unless it
    names another) with CONTINUE_TAG, so that the rendering can be cut there; its text before."""
    field = continue_final if isinstance(continue_final, str) else "content"
    final = conv[-1].get(field)
    if final is None:
        raise TokenizeError(f'continue_final_message is set but the final message has no "{field}"')
    if field not in source:
        raise TokenizeError(f'continue_final_message: the chat template does not use "{field}"')
    if isinstance(final, list | tuple):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                final_text: str = block["text"]
                block["text"] = block["text"] + CONTINUE_TAG
                return final_text
        raise TokenizeError("continue_final_message is set but the final message has no text")
    conv[-1][field] = final + CONTINUE_TAG
    return str(final)


def _cut_final(text: str, final_text: str) -> str:
    """The rendering up to the end of the final message (its CONTINUE_TAG), which must be in it."""
    if final_text.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise TokenizeError(
            "continue_final_message is set but the final message does not appear in the rendered chat "
            "(the template changes it)"
        )
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
