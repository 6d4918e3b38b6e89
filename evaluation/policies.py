"""Policies that act in the sandbox: the expert (teacher role, belief only), a seeded random policy (a floor
for every metric), and `ModelPolicy`, which runs any `agent.models.ChatModel` through the shared prompt
builder and parser (the same prompt a student sees in SFT data and RL)."""

from __future__ import annotations

import random

from agent.models import ChatModel
from agent.parser import ToolCall
from agent.prompt import StepMemory, build_step_messages
from agent.tools import tool_definitions
from sandbox.expert import ExpertPlanner
from sandbox.gym_env import SandboxEnv
from sandbox.skills import SKILLS


class ExpertPolicy:
    name = "expert"

    def reset(self, env: SandboxEnv, seed: int) -> None:
        self.planner = ExpertPlanner(env.ctrl, privileged=False)

    def act(self, env: SandboxEnv, observation: str) -> tuple[str, dict]:
        return self.planner.act()

    def observe(self, call, result_info: dict, observation: str) -> None:
        from sandbox.controller import StepResult
        res = StepResult(ok=result_info["error"] is None, observation=observation, error=result_info["error"])
        self.planner.observe(call, res)


def random_call(rng: random.Random, ids: list[str]) -> dict:
    """A uniformly random skill with arguments drawn from `ids` (and sometimes junk)."""
    skill = SKILLS[rng.choice(list(SKILLS))]
    args = {}
    for p in skill.params:
        if not p.required and rng.random() < 0.5:
            continue
        if p.enum:
            args[p.name] = rng.choice(p.enum)
        elif p.name in ("reason", "message", "summary", "answer", "query"):
            args[p.name] = rng.choice(ids + ["help", "something"]) if ids else "x"
        else:
            args[p.name] = rng.choice(ids) if ids and rng.random() < 0.9 else "thing"
    return {"name": skill.name, "arguments": args}


class RandomPolicy:
    """Uniform over skills, arguments drawn from ids the agent has seen (and sometimes junk)."""

    name = "random"

    def reset(self, env: SandboxEnv, seed: int) -> None:
        self.rng = random.Random(seed)

    def act(self, env: SandboxEnv, observation: str) -> tuple[str, dict]:
        known = env.known()
        ids = [p for p, _ in known["places"]] + [o for o, _, _ in known["objects"]] + \
            [f for fs in known["landmarks"].values() for f in fs] + \
            [c for c, *_ in known["connections"]] + [p for p, *_ in known["people"]]
        return "random", random_call(self.rng, ids)

    def observe(self, call, result_info: dict, observation: str) -> None:
        pass


class ModelPolicy:
    """A chat model as a policy. Each step's prompt is `agent.prompt.build_step_messages` (instruction, the
    agent's known map, a memory of recent steps, the observation) with `agent.tools.tool_definitions()`;
    the reply is read by the shared parser. `act` returns (reasoning, tool-call dict) when the reply holds a
    readable call, else (reasoning, the raw text), which the env turns into a `parse_error` observation.

    `last_prompt` (the messages) and `last_raw` (the model's text, OpenAI tool calls rendered as
    `<tool_call>` markup) are kept for the caller to record. Sampling is seeded per step from the episode
    seed, so an episode replays. A `ModelError` (the endpoint failed after its retries) propagates: an
    infrastructure failure must not be scored as the model's invalid action.
    """

    def __init__(self, client: ChatModel, name: str | None = None, memory_size: int = 4):
        if memory_size < 0:
            raise ValueError(f"ModelPolicy: memory_size must be >= 0, not {memory_size}")
        self.client = client
        self.name = name or getattr(client, "name", None) or type(client).__name__
        self.memory_size = memory_size
        self.memory = StepMemory(size=memory_size)
        self.seed = 0
        self.last_prompt: list[dict] = []
        self.last_raw = ""
        self.last_reply = None

    def reset(self, env: SandboxEnv, seed: int) -> None:
        self.memory = StepMemory(size=self.memory_size)
        self.seed = seed
        self.last_prompt, self.last_raw, self.last_reply = [], "", None
        if hasattr(self.client, "reset") and getattr(self.client, "env", None) is env:
            self.client.reset()  # a client bound to this env (the scripted expert) starts the episode afresh

    def act(self, env: SandboxEnv, observation: str) -> tuple[str, dict | str]:

        task, step = env.task, env.ctrl.steps
        messages = build_step_messages(task.instruction, env.known(), self.memory, observation, step,
                                       task.step_budget)
        self.last_prompt = messages
        thought, action, self.last_raw, self.last_reply = model_decision(self.client, messages, self.seed, step)
        return thought, action

    def observe(self, call, result_info: dict, observation: str) -> None:
        self.memory.add(call if isinstance(call, dict) else None, result_info["error"], observation)


def model_decision(client: ChatModel, messages: list[dict], seed: int, step: int, tools: list[dict] | None = None):
    """One decision of a chat model through the shared parser: (reasoning, the call as a dict or the unreadable
    text, the raw output with OpenAI tool calls rendered as `<tool_call>` markup, the reply). Sampling is seeded
    per step from the episode seed, so an episode replays. Sandbox and pixel policies all decide through here
    (`tools` defaults to the sandbox skills)."""
    from agent.clients import tool_call_text
    from agent.models import ChatReply

    reply = client.chat(messages, tools=tools if tools is not None else tool_definitions(),
                        seed=(seed * 1_000_003 + step) % 2**31)
    raw = tool_call_text(reply)
    parsed = reply.action()
    if isinstance(parsed, ToolCall):
        return parsed.reasoning, parsed.as_dict(), raw, reply
    # the text the env must fail on exactly as the parser did: the content, or the first tool call
    unreadable = reply.text if not reply.tool_calls else tool_call_text(ChatReply("", reply.tool_calls[:1]))
    return parsed.reasoning, unreadable, raw, reply


POLICIES = {"expert": ExpertPolicy, "random": RandomPolicy}
