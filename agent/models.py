"""The one small protocol every chat model speaks: teacher, judge, student, persona, builder, evaluation.

A `ChatModel` takes OpenAI-style chat messages (and optionally the skill `tools`) and returns a `ChatReply`.
Implementations live in `agent.clients`: an OpenAI-compatible endpoint, a local transformers model and the
scripted expert. A reply's action is read by the shared parser (`agent.parser.parse_action`), whichever way
the model wrote it (Hermes/Qwen `<tool_call>` text or OpenAI `tool_calls`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from agent.parser import ParseError, ToolCall, parse_action


class ModelError(RuntimeError):
    """A model call that failed after its bounded retries. `kind` is one of: timeout, http, connection,
    bad_response. Callers count these; they never turn into a score or an action silently."""

    def __init__(self, kind: str, message: str, attempts: int = 1):
        super().__init__(f"{kind} after {attempts} attempt(s): {message}")
        self.kind = kind
        self.attempts = attempts


@dataclass
class ChatReply:
    text: str                                            # assistant content ("" when only tool_calls came)
    tool_calls: list[dict] = field(default_factory=list)  # [{"name": str, "arguments": dict | str}]
    reasoning: str = ""                                  # separate reasoning channel, when the server sends one
    usage: dict = field(default_factory=dict)             # prompt_tokens / completion_tokens when known
    model: str = ""

    def action(self) -> ToolCall | ParseError:
        """The reply as one skill call, through the shared parser."""
        if self.tool_calls:
            msg = {"content": self.reasoning or self.text, "tool_calls": self.tool_calls}
            return parse_action(msg)
        parsed = parse_action(self.text)
        if self.reasoning and isinstance(parsed, ToolCall) and not parsed.reasoning:
            return ToolCall(parsed.name, parsed.arguments, self.reasoning)
        return parsed


@runtime_checkable
class ChatModel(Protocol):
    name: str

    def chat(self, messages: list[dict], *, tools: list[dict] | None = None, temperature: float | None = None,
             seed: int | None = None, max_tokens: int | None = None, json_mode: bool = False) -> ChatReply:
        """One completion. Raises `ModelError` after bounded retries."""
        ...

    def chat_many(self, batch: list[list[dict]], *, tools: list[dict] | None = None,
                  temperature: float | None = None, seed: int | list[int] | None = None,
                  max_tokens: int | None = None, json_mode: bool = False) -> list[ChatReply | ModelError]:
        """Many completions (concurrently where the backend allows); order kept; failures returned, not
        raised, so one bad request does not lose the others. `seed`: one for the batch, or one per
        conversation (a backend that samples a whole batch from one generator uses the first seed of each
        batch it generates)."""
        ...
