"""The sandbox skills rendered as tool definitions (OpenAI function-calling JSON schema)."""

from __future__ import annotations

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


def tool_definitions() -> list[dict]:
    """Every skill as an OpenAI `tools` entry (the same list for teacher, SFT data, RL and evaluation)."""
    return [dict(t) for t in _tools()]
