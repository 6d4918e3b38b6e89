"""The agent's skills, in the spirit of ABot-AgentOS: one typed spec each.

The same specs drive argument validation in the EnvController and the tool definitions (OpenAI
function-calling JSON schema) that `agent.tools` renders for every model.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from functools import cached_property

from sandbox.schema import HELP_REQUESTS
from sandbox.text import normalize

# arguments whose wording is free: two calls that differ only there are the same action
FREE_TEXT_ARGS = ("message", "reason", "summary")


def same_call(pred: dict | None, gold: dict | None, free_text: tuple[str, ...] = FREE_TEXT_ARGS) -> bool:
    """Same skill and same arguments (normalized); free-text arguments (message, reason, summary) are not
    compared. A missing call (an unreadable reply) matches nothing."""
    if not isinstance(pred, dict) or not isinstance(gold, dict) or pred.get("name") != gold.get("name"):
        return False
    pa, ga = pred.get("arguments") or {}, gold.get("arguments") or {}
    keys = (set(pa) | set(ga)) - set(free_text)
    return all(normalize(str(pa.get(k, ""))) == normalize(str(ga.get(k, ""))) for k in keys)


# the skills that ask a person something (their replies are recorded; help requests are counted)
HELP_SKILLS = frozenset({"talk_to", "ask_for_help"})


@dataclass(slots=True)
class StepResult:
    """What one skill call did: the observation, or an error code (and the trigger that fired, if any)."""

    ok: bool
    observation: str
    error: str | None = None
    trigger: str | None = None          # id of the trigger that fired (for judges and validation, never shown)
    subgoals_met: list[str] = field(default_factory=list)
    done: bool = False
    success: bool = False
    state_key: str = ""


@dataclass(frozen=True)
class Param:
    name: str
    description: str
    required: bool = True
    enum: tuple[str, ...] | None = None
    max_length: int = 200


@dataclass(frozen=True)
class Skill:
    name: str
    category: str  # navigation | search | observation | manipulation | dialogue | reporting | termination
    description: str
    params: tuple[Param, ...] = field(default_factory=tuple)

    @cached_property
    def required(self) -> frozenset[str]:
        return frozenset(p.name for p in self.params if p.required)

    @cached_property
    def allowed(self) -> frozenset[str]:
        return frozenset(p.name for p in self.params)


SKILLS: dict[str, Skill] = {
    s.name: s
    for s in (
        Skill("navigate", "navigation",
              "Walk to a known place, or to stand next to a known object, along the shortest known route. "
              "Closed doors on the way are opened; locked doors, blocked paths and restricted areas stop you.",
              (Param("target", "id of a place or of an object you have seen"),)),
        Skill("look_around", "observation",
              "Describe what is in plain sight where you are: objects, people and exits."),
        Skill("search", "search",
              "Search the current place thoroughly for something, including inside closed containers.",
              (Param("query", "what to look for, e.g. a type like 'mug' or 'key'"),)),
        Skill("inspect", "observation",
              "Examine an object or door where you are and learn its state (open, on, locked, broken, labels).",
              (Param("target", "id of an object or door here"),)),
        Skill("pick_up", "manipulation", "Pick up an object that is here and within reach.",
              (Param("object", "id of the object"),)),
        Skill("place", "manipulation",
              "Put a held object down here: on the floor (target = this place), in or on a container or "
              "surface, or next to another object.",
              (Param("object", "id of the held object"),
               Param("target", "id of this place, a container/surface here, or an object to put it next to"))),
        Skill("open", "manipulation",
              "Open a door or container here. A locked one opens if you hold its key.",
              (Param("target", "id of a door or container"),)),
        Skill("close", "manipulation", "Close a door or container here.",
              (Param("target", "id of a door or container"),)),
        Skill("operate", "manipulation", "Operate a device here.",
              (Param("device", "id of the device"), Param("action", "what to do", enum=("turn_on", "turn_off")))),
        Skill("talk_to", "dialogue", "Ask a person here a question about something.",
              (Param("person", "id of the person"),
               Param("topic", "id of what you ask about: an object, a place, or a fact from the instruction"),
               Param("message", "what you say", required=False, max_length=400))),
        Skill("ask_for_help", "dialogue",
              "Ask a person here to do something you cannot: unlock a door, carry a heavy object to a place, "
              "repair a device, grant permission to enter, clear a blocked path, or tell where something is.",
              (Param("person", "id of the person"),
               Param("request", "the kind of help", enum=HELP_REQUESTS),
               Param("target", "id of the door, object, device, place or path concerned"),
               Param("reason", "why you need it", max_length=400),
               Param("destination", "for carry: id of the place to carry it to", required=False))),
        Skill("report", "reporting", "Report an answer to the user: a place id, a state, or what you were told.",
              (Param("answer", "the answer, short", max_length=200),)),
        Skill("finish", "termination", "End the task when every part of the instruction is done.",
              (Param("summary", "one sentence on what was done", required=False, max_length=400),)),
    )
}

SKILL_NAMES: tuple[str, ...] = tuple(SKILLS)


@dataclass(frozen=True)
class CallError:
    """Why a call's shape is wrong: an error code (the controller's vocabulary) and the text the agent reads."""

    code: str
    text: str


def check_call(call) -> tuple[str, dict[str, str]] | CallError:
    """Check a call's shape against the skill specs: (name, cleaned string arguments) or a `CallError`. Every
    backend that executes skills (the sandbox, the pixel skill executor) reads calls through this one check."""
    if not isinstance(call, dict):
        return CallError("bad_arguments", "A tool call must be an object with a name and arguments.")
    name = call.get("name")
    if not isinstance(name, str) or name not in SKILLS:
        shown = name if isinstance(name, str) else type(name).__name__
        return CallError("unknown_tool", f"There is no skill called {shown[:40]!r}.")
    args = call.get("arguments", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return CallError("bad_arguments", f"The arguments of {name} must be an object.")
    skill = SKILLS[name]
    allowed = skill.allowed
    for k in args:
        if k not in allowed:
            return CallError("extra_argument", f"{name} takes no argument {str(k)[:40]!r}.")
    if len(args) < len(allowed):
        missing = sorted(skill.required - set(args))
        if missing:
            return CallError("missing_argument", f"{name} needs the argument {missing[0]!r}.")
    clean: dict[str, str] = {}
    for p in skill.params:
        if p.name not in args:
            continue
        v = args[p.name]
        if not isinstance(v, str):
            return CallError("bad_argument_type", f"{name}.{p.name} must be a string.")
        v = v.strip()
        if p.required and not v:
            return CallError("bad_argument_value", f"{name}.{p.name} is empty.")
        if len(v) > p.max_length:
            return CallError("bad_argument_value", f"{name}.{p.name} is too long.")
        if p.enum is not None and v not in p.enum:
            return CallError("bad_argument_value", f"{name}.{p.name} must be one of {', '.join(p.enum)}.")
        clean[p.name] = v
    return name, clean


def id_words(oid: str) -> list[str]:
    """The words of an id without a look-alike's number: `yellow_key_2` -> ["yellow", "key"] (an id read as the
    words an instruction uses; the prompt's task-objects line and the tiny tokenizer both read ids this way)."""
    return re.sub(r"(_[0-9]+)+$", "", oid).split("_")


def described_id(color: str | None, kind: str, taken) -> str:
    """The id of a coloured object in the BabyAI vocabulary (the `rooms` scene and the pixel tracks' perception):
    its colour and type, `yellow_key`, with a number only for a second look-alike (`yellow_key_2`). A skill call
    names the object in the words the instruction uses ("go to the yellow key" -> `navigate yellow_key`), so
    a student maps the task's words to the argument instead of looking a number up in the map (ALFWorld's ids,
    `apple 1`, are descriptive the same way)."""
    base = f"{color}_{kind}" if color else kind
    oid, n = base, 1
    while oid in taken:
        n += 1
        oid = f"{base}_{n}"
    return oid
