"""The sandbox skills rendered as tool definitions (OpenAI function-calling JSON schema)."""

from __future__ import annotations

import copy
from functools import lru_cache

from sandbox.skills import SKILLS, Skill


def tool_schema(skill: Skill) -> dict:
    props = {}
    for p in skill.params:
        prop = {"type": "string", "description": p.description}
        if p.enum:
            prop["enum"] = list(p.enum)
        props[p.name] = prop
    return {"type": "function",
            "function": {"name": skill.name, "description": skill.description,
                         "parameters": {"type": "object", "properties": props,
                                        "required": [p.name for p in skill.params if p.required],
                                        "additionalProperties": False}}}


@lru_cache(maxsize=1)
def _tools() -> tuple[dict, ...]:
    return tuple(tool_schema(s) for s in SKILLS.values())


def tool_definitions(operate_actions: tuple[str, ...] | None = None) -> list[dict]:
    """Every skill as an OpenAI `tools` entry (the same list for teacher, SFT data, RL and evaluation).
    `operate_actions`: the actions `operate` takes in another env (TextWorld's eat, cook, slice, ...) instead of
    the sandbox's."""
    tools = [dict(t) for t in _tools()]
    if operate_actions is None:
        return tools
    out = []
    for t in tools:
        if t["function"]["name"] == "operate":
            t = copy.deepcopy(t)
            t["function"]["parameters"]["properties"]["action"]["enum"] = list(operate_actions)
        out.append(t)
    return out
