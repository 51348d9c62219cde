"""A request's prompt: chat messages through the model's chat template (with the tools
offered, where it takes them, else in plain text), or a completion's text or token ids.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from jinja2 import TemplateError

from app.server.output import ToolFormat, think_markers, tool_format, tool_prompt
from app.server.request import APIError
from dflash_mlx import apply_chat_template

__all__ = ["chat_prompt", "check_tools", "reply_format", "template_kwargs", "text_content", "text_prompt"]

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
#: `chat_template_kwargs` the server sets itself.
RESERVED_TEMPLATE_KWARGS = {"messages", "conversation", "tools", "add_generation_prompt", "tokenize", "return_dict"}


def text_content(content: Any, where: str) -> str:
    """A content field: a string, or a list of text parts (OpenAI's and Anthropic's
    `{"type": "text", "text": ...}`), joined; other fields of a part are ignored."""
    text_parts = isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    )
    if text_parts:
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(f"'{where}' must be a string or a list of text parts", param=where, code="invalid_type")
    return content


def conversation(messages: Any, system: Optional[str] = None) -> tuple[dict, ...]:
    """The text turns of a checked chat (its system, user and assistant messages that hold
    text), as a conversation log keeps them (`dflash serve --keep-conversations`)."""
    turns = [{"role": "system", "content": system}] if system else []
    for m in messages if isinstance(messages, list) else []:
        if isinstance(m, dict) and m.get("role") in ("system", "user", "assistant"):
            try:
                text = text_content(m.get("content") or "", "content")
            except APIError:  # images and the like: no text to learn from
                continue
            if text:
                turns.append({"role": m["role"], "content": text})
    return tuple(turns)


def _tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as templates take them (arguments as objects)."""
    if not isinstance(value, list):
        raise APIError(f"'{where}' must be a list", param=where, code="invalid_type")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise APIError(f"'{where}[{i}].function.name' must be a string", param=f"{where}[{i}]")
        arguments = function.get("arguments") or {}
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            raise APIError(f"'{where}[{i}].function.arguments' is not JSON", param=f"{where}[{i}]") from None
        calls.append({"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


def _content(message: Any, i: int, roles: dict) -> dict:
    """One chat message as `{"role", "content"}` with text content (and an assistant's
    `tool_calls`, a tool message's `tool_call_id`)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise APIError(f"'{where}' must be an object with 'role' and 'content'", param=where, code="invalid_type")
    role = message.get("role")
    if role not in roles:
        raise APIError(f"'{where}.role' must be one of {', '.join(roles)}; got {role!r}", param=f"{where}.role")
    calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    text = "" if content is None and calls else text_content(content, f"{where}.content")
    turn = {"role": roles[role], "content": text}
    if calls:
        turn["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    if role == "tool":
        turn["tool_call_id"] = message.get("tool_call_id")
    return turn


def check_tools(value: Any) -> list[dict]:
    """OpenAI's `tools` (functions with a name and JSON-schema parameters), checked."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise APIError("'tools' must be a list", param="tools", code="invalid_type")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(f"'tools[{i}]' must be {{'type': 'function', 'function': {{'name', ...}}}}", param="tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise APIError(f"'tools[{i}].function.parameters' must be an object", param="tools")
    return value


def _plain_turns(turns: list[dict], fmt: ToolFormat) -> list[dict]:
    """`turns` for a template that knows no tools: an assistant's calls written in `fmt`
    after its text, a tool's result as a user turn in `<tool_response>` tags."""
    out = []
    for turn in turns:
        calls = [
            fmt.start + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}) + fmt.end
            for c in turn.get("tool_calls", ())
        ]
        if turn["role"] == "tool":
            turn = {"role": "user", "content": f"<tool_response>\n{turn['content']}\n</tool_response>"}
        elif calls:
            turn = {"role": "assistant", "content": "\n".join(([turn["content"]] if turn["content"] else []) + calls)}
        out.append(turn)
    return out


def template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs` (e.g. `enable_thinking`), passed to the chat template."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise APIError("'chat_template_kwargs' must be an object", param="chat_template_kwargs", code="invalid_type")
    taken = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if taken:
        raise APIError(f"'chat_template_kwargs' cannot set {', '.join(taken)}", param="chat_template_kwargs")
    return kwargs


def chat_prompt(
    body: dict,
    tokenizer: Any,
    system: Optional[str] = None,
    roles: dict = ROLES,
    tools: Sequence[dict] = (),
    messages: Optional[list] = None,
    kwargs: Optional[dict] = None,
    continue_final: bool = False,
) -> list[int]:
    """The templated prompt of `messages` (default `body["messages"]`), after a `system`
    message if given, offering `tools`: to the template where it takes tools (it names
    `tools`), else as a system message (`tool_prompt`) with the tool turns in plain text.
    `kwargs` (default `template_kwargs(body)`) go to the template. `continue_final`: a
    last assistant message with text is the start of the answer (Anthropic's prefill),
    left open instead of a new turn."""
    messages = body.get("messages") if messages is None else messages
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages", code="invalid_type")
    turns = [{"role": "system", "content": system}] if system else []
    turns += [_content(m, i, roles) for i, m in enumerate(messages)]
    last = turns[-1]
    prefill = continue_final and last["role"] == "assistant" and bool(last["content"]) and "tool_calls" not in last
    kwargs = dict(template_kwargs(body) if kwargs is None else kwargs)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "tools" in template:
        kwargs["tools"] = list(tools) or None
    else:
        turns = _plain_turns(turns, tool_format(tokenizer))
        if tools:
            offer = tool_prompt(tools, tool_format(tokenizer))
            head = turns[0]["content"] + "\n\n" if turns[0]["role"] == "system" else ""
            turns = [{"role": "system", "content": head + offer}] + turns[bool(head) :]
    try:
        return list(apply_chat_template(tokenizer, turns, continue_final=prefill, **kwargs))
    except (TemplateError, TypeError, KeyError, ValueError) as exc:  # ValueError: a prefill it cannot find
        raise APIError(f"the chat template refused these messages: {exc}", param="messages") from None


def text_prompt(body: dict, tokenizer: Any) -> list[int]:
    """A completion's `prompt` as token ids: a string (a list of one string too), encoded with
    the BOS token unless it starts with it, or a list of token ids in the vocabulary."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        return list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(tokenizer.get_vocab()) if hasattr(tokenizer, "get_vocab") else None
        if vocab and any(not 0 <= t < vocab for t in prompt):
            raise APIError(f"'prompt' token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)
    raise APIError("'prompt' must be a string or a list of token ids", param="prompt", code="invalid_type")


def reply_format(tokenizer: Any, prompt: Sequence[int], tools: Sequence[dict]) -> dict:
    """The `CompletionRequest` fields that say how to split a chat reply: the tools
    offered and how the model calls them, the think markers, and whether the prompt
    ends inside an opened reasoning (templates that start the thinking themselves)."""
    think = think_markers(tokenizer)
    thinking = False
    if think:
        tail = tokenizer.decode(list(prompt[-64:]))
        thinking = tail.rfind(think[0]) > tail.rfind(think[1])
    return {"tools": tuple(tools), "tool_format": tool_format(tokenizer), "think": think, "thinking": thinking}
