"""Policies for the episode loop (`agent.episode.play`): a chat model, and scripted agents.

* `ChatPolicy(client)`: any `agent.models.ChatModel` (an OpenAI-compatible endpoint, a local transformers model)
  answers every live episode's step prompt in one `chat_many` call, with the skills as tools.
* `ScriptedPolicy(factory)`: one scripted agent per episode (`factory(env, seed)`: the expert, the random or
  the noisy-expert agent of `sandbox.agents`), acting on the env's `info`. With `as_text=True` it answers as a
  model would, the thought then the `<tool_call>` markup, on the step prompt it is shown (the teacher: its
  trajectories keep the prompts and the text the SFT dataset is made of).

`decide` is one decision of a chat model outside the loop (the pixel and browser agents use it).
"""

from __future__ import annotations

from typing import Any, Callable

from agent.clients import tool_call_text
from agent.episode import Reply, Request
from agent.models import ChatModel, ChatReply, ModelError
from agent.parser import ToolCall, render_tool_call
from agent.tools import tool_definitions


def step_seed(episode_seed: int, step: int) -> int:
    """The sampling seed of one decision: a function of the episode's seed and step only, so an episode replays
    whatever else is played beside it."""
    return (episode_seed * 1_000_003 + step) % 2**31


class ChatPolicy:
    """A chat model as a policy: each round's step prompts go to `client.chat_many` in one call, with the skills
    as `tools` and one sampling seed per episode and step (`step_seed`). The reply's text (OpenAI tool calls
    rendered as `<tool_call>` markup) is recorded as the turn's raw output, and the reply is read by the shared
    parser (`ChatReply.action()`). A request the backend failed on after its retries comes back as a
    `ModelError`."""

    reads_prompt = True

    def __init__(self, client: ChatModel, name: str | None = None, tools: list[dict] | None = None):
        self.client = client
        self.name = name or getattr(client, "name", None) or type(client).__name__
        self.tools = tool_definitions() if tools is None else tools

    def start(self, episode: int, env: Any, seed: int) -> None:
        pass

    def act(self, requests: list[Request]) -> list[Reply | ModelError]:
        replies = self.client.chat_many([r.messages for r in requests], tools=self.tools,
                                        seed=[step_seed(r.seed, r.step) for r in requests])
        return [r if isinstance(r, ModelError) else Reply(text=tool_call_text(r), action=r.action())
                for r in replies]


class ScriptedPolicy:
    """One scripted agent per episode, made by `factory(env, seed)` when the episode starts; an agent has
    `act(info) -> (thought, call dict or text)` and `observe(call, info, observation)`, which it is given
    before its next decision. `as_text`: answer as a model would (thought, then the call as `<tool_call>`
    markup), parsed by the loop like any model's text, with the step prompt recorded."""

    def __init__(self, factory: Callable[[Any, int], Any], name: str, as_text: bool = False):
        self.factory, self.name, self.as_text = factory, name, as_text
        self.reads_prompt = as_text
        self.agents: dict[int, Any] = {}
        self.pending: dict[int, dict | None] = {}   # per episode: the call the env read last, to observe

    def start(self, episode: int, env: Any, seed: int) -> None:
        self.agents[episode] = self.factory(env, seed)
        self.pending.pop(episode, None)

    def act(self, requests: list[Request]) -> list[Reply]:
        out = []
        for r in requests:
            agent = self.agents[r.episode]
            if r.episode in self.pending:
                agent.observe(self.pending[r.episode], r.info, r.observation)
            thought, action = agent.act(r.info)
            self.pending[r.episode] = action if isinstance(action, dict) else None
            if isinstance(action, dict) and self.as_text:
                out.append(Reply(text=thought + "\n" + render_tool_call(action["name"], action["arguments"])))
            elif isinstance(action, dict):
                out.append(Reply(action=action, reasoning=thought))
            else:   # text the agent wants read like a model's (an unreadable reply, for the oracle's noisy agent)
                out.append(Reply(text=action, reasoning=None if self.as_text else thought))
        return out


def decide(client: ChatModel, messages: list[dict], seed: int, step: int, tools: list[dict] | None = None
           ) -> tuple[str, dict | str, str, ChatReply]:
    """One decision of a chat model through the shared parser: (reasoning, the call as a dict or the unreadable
    text, the raw output with OpenAI tool calls rendered as `<tool_call>` markup, the reply)."""
    reply = client.chat(messages, tools=tools if tools is not None else tool_definitions(), seed=step_seed(seed, step))
    raw = tool_call_text(reply)
    parsed = reply.action()
    if isinstance(parsed, ToolCall):
        return parsed.reasoning, parsed.as_dict(), raw, reply
    # the text an env must fail on exactly as the parser did: the content, or the first tool call
    unreadable = reply.text if not reply.tool_calls else tool_call_text(ChatReply("", reply.tool_calls[:1]))
    return parsed.reasoning, unreadable, raw, reply
