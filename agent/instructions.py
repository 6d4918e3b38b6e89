"""Instruction granularity (PokeGym's three): how much of the plan the task line gives the agent.

    goal     the task's own instruction (what every stage trains on)
    step     the instruction, then the ordered steps of the plan: "Steps: 1. pick up the green ball; 2. put it
             next to the purple key; 3. finish."
    visual   the steps, each with visual anchors for the things it names, from what the agent has seen so far:
             "1. pick up the green ball (seen: green_ball at room_0_1); 2. put it next to the purple key (not
             seen yet); ..."

An env gives the plan as `info["task"]["procedure"]`: a list of `{"text": ..., "things": [...]}` steps derived from
what the evaluator knows (the sandbox's subgoals, TextWorld's walkthrough, BabyAI's mission grammar), written
without any where-information (no room, container, direction or answer the instruction does not give). The
anchors are looked up here, on every step, in the agent's known map (`info["known"]`) alone: the text never says
more than the agent could know at that point (tests/test_instructions.py checks it against the hidden state of
each env).
"""

from __future__ import annotations

import re

from agent.prompt import _object   # the prompt's own wording of a known object

GRANULARITIES = ("goal", "step", "visual")


def check_granularity(granularity: str) -> str:
    if granularity not in GRANULARITIES:
        raise ValueError(f"instructions must be one of {', '.join(GRANULARITIES)}, not {granularity!r}")
    return granularity


def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower().replace("_", " ")))


def _names(thing: str, *names: str) -> bool:
    """Whether `thing` (an id, or words: "red ball", or "ball" for any ball) names something called `names` (the
    words may also lead an id: "grey door" names `grey_door_room_0_0_room_0_1`)."""
    want = _words(thing)
    return bool(want) and any(n == thing or _words(n) == want or _words(n).endswith(" " + want)
                              or _words(n).startswith(want + " ") for n in names)


def anchors(thing: str, known: dict) -> list[str]:
    """Where the agent has seen `thing` (an id, or a name as the step words it), from its known map only: each
    known object it names with its place and the landmark it is on or next to, a known place with its landmarks,
    a known door with its state and the places it joins."""
    out = []
    for oid, name, loc in known.get("objects", ()):
        if _names(thing, oid, name):
            out.append(_object(oid, name, loc, known, here=True))
    marks = known.get("landmarks", {})
    for pid, name in known.get("places", ()):
        if _names(thing, pid, name):
            out.append(pid + (f" with {', '.join(marks[pid])}" if marks.get(pid) else ""))
    for cid, a, b, state in known.get("connections", ()):
        if state and _names(thing, cid):
            out.append(f"{cid} {state}, between {a} and {b}")
    return out


def instruction_text(instruction: str, procedure: list[dict] | None, granularity: str, known: dict) -> str:
    """The task line the agent reads at this step (module docstring)."""
    check_granularity(granularity)
    if granularity == "goal":
        return instruction
    if not procedure:
        raise ValueError(f"--instructions {granularity} needs the env's plan (info['task']['procedure']); this "
                         f"task has none")
    steps = []
    for i, step in enumerate(procedure, 1):
        text = step["text"]
        if granularity == "visual" and step.get("things"):
            seen = [a for thing in step["things"] for a in anchors(thing, known)]
            text += f" (seen: {'; '.join(dict.fromkeys(seen))})" if seen else " (not seen yet)"
        steps.append(f"{i}. {text}")
    return f"{instruction.rstrip()} Steps: {'; '.join(steps)}."
