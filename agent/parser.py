"""One tool-call parser for every model: Hermes/Qwen `<tool_call>{json}</tool_call>` text, OpenAI
`tool_calls`, and plain dicts. Anything unreadable becomes a typed `ParseError`, never an exception."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sandbox.skills import SKILLS

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_THINK = re.compile(r"<think>(.*?)</think>", re.S)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict
    reasoning: str = ""

    def as_dict(self) -> dict:
        return {"name": self.name, "arguments": self.arguments}


@dataclass(frozen=True, slots=True)
class ParseError:
    message: str
    code: str = "parse_error"
    reasoning: str = ""


def _from_obj(obj: Any, reasoning: str = "") -> ToolCall | ParseError:
    if not isinstance(obj, dict):
        return ParseError("a tool call must be a JSON object", reasoning=reasoning)
    if "function" in obj and isinstance(obj["function"], dict):  # OpenAI tool_calls entry
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParseError("the tool call has no name", reasoning=reasoning)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):  # JSONDecodeError, and ints past the digit limit
            return ParseError(f"the arguments of {name[:40]} are not valid JSON", reasoning=reasoning)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParseError(f"the arguments of {name[:40]} must be a JSON object", reasoning=reasoning)
    return ToolCall(name=name, arguments=args, reasoning=reasoning)


def parse_text(text: str) -> ToolCall | ParseError:
    """Parse model text: optional reasoning, then one `<tool_call>{...}</tool_call>` block."""
    if not isinstance(text, str):
        return ParseError("model output is not text")
    m = _TOOL_CALL.search(text)
    think = _THINK.search(text)
    reasoning = (think.group(1) if think else text[: m.start()] if m else text).strip()
    if not m:
        return ParseError("no <tool_call> block in the output", reasoning=reasoning)
    body = m.group(1).strip()
    if body and not body.startswith("{"):
        return parse_compact(body, reasoning)
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # JSONDecodeError, and ints past the digit limit
        return ParseError("the <tool_call> block is not valid JSON", reasoning=reasoning)
    return _from_obj(obj, reasoning)


def parse_compact(body: str, reasoning: str = "") -> ToolCall | ParseError:
    """The compact form a tiny student's chat template renders: `navigate kitchen`,
    `ask_for_help alice|unlock|door_1|the door is locked` (arguments in the skill's parameter order)."""
    name, _, rest = body.partition(" ")
    skill = SKILLS.get(name)
    if skill is None:
        return ParseError(f"there is no skill called {name[:40]!r}", code="parse_error", reasoning=reasoning) \
            if not name.isidentifier() else ToolCall(name=name, arguments={}, reasoning=reasoning)
    values = [v.strip() for v in rest.split("|")] if rest.strip() else []
    if len(values) > len(skill.params):
        return ParseError(f"{name} takes at most {len(skill.params)} arguments", reasoning=reasoning)
    return ToolCall(name=name, arguments={p.name: v for p, v in zip(skill.params, values, strict=False)},
                    reasoning=reasoning)


def render_compact(name: str, arguments: dict) -> str:
    """Inverse of `parse_compact` for calls whose arguments follow the skill's parameters."""
    skill = SKILLS.get(name)
    if skill is None:
        return name
    vals = [str(arguments[p.name]) for p in skill.params if arguments.get(p.name) is not None]
    return name + (" " + "|".join(vals) if vals else "")


def parse_action(action: Any) -> ToolCall | ParseError:
    """Text, a plain dict, an OpenAI message with `tool_calls`, or a ToolCall."""
    if isinstance(action, ToolCall):
        return action
    if isinstance(action, str):
        return parse_text(action)
    if isinstance(action, dict):
        if "tool_calls" in action:  # an OpenAI assistant message
            calls = action.get("tool_calls") or []
            reasoning = action.get("content") or ""
            if not isinstance(calls, list) or not calls:
                text = reasoning if isinstance(reasoning, str) else ""
                return parse_text(text) if "<tool_call>" in text else ParseError("the message has no tool call")
            return _from_obj(calls[0], reasoning if isinstance(reasoning, str) else "")
        return _from_obj(action)
    return ParseError(f"cannot read an action of type {type(action).__name__}")


def render_tool_call(name: str, arguments: dict) -> str:
    """The Hermes/Qwen text form the student is trained to emit (inverse of `parse_text`)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    # "</" inside a JSON string is written "<\/" (same value), so a value can never close the block early
    return "<tool_call>\n" + body.replace("</", "<\\/") + "\n</tool_call>"
