"""A TextWorld objective read into steps: TextWorld's instruction grammar (`go north`, `take the X from the Y`,
`rest the X on the Y`, ...). The teacher carries the steps out; the env names their things on the prompt's
`Task objects` line (`TextWorldEnv`: read from the objective's text, which the agent is given, never from the game).

    goal_steps("First, open the antique trunk. Then, take the old key from the antique trunk.")
    # [Step("open", "antique trunk"), Step("take", "old key", "antique trunk")]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_GO = r"(?:go|head|venture|travel|move|take a trip|walk)"
_ROOM_SUFFIX = re.compile(r" (?:in|within|inside) the [a-z' -]+$")
_DONE = re.compile(r"\b(?:you win|you're the winner|you can stop|you are done|the game is yours)\b")


@dataclass(frozen=True)
class Step:
    verb: str               # go | take | put | insert | drop | open | close | unlock | lock | eat
    thing: str = ""         # a direction for go, else the name of the object (or door/container)
    other: str = ""         # where to take it from / put it / the key


def _name(text: str) -> str:
    return _ROOM_SUFFIX.sub("", text.strip(" .!")).strip()


def goal_steps(objective: str) -> list[Step]:
    """The steps a detailed objective lists, in order (an objective that lists none gives []). tw-simple's brief
    objective ("It's only missing a grilled carrot.") means: take the carrot, put it on the stove."""
    if m := re.search(r"missing an? grilled (.+?)[.!]", objective.lower()):
        return [Step("take", m.group(1).strip()), Step("put", m.group(1).strip(), "stove")]
    steps = []
    for sentence in re.split(r"(?<=[.!?])\s+", objective.lower()):
        if _DONE.search(sentence):
            continue
        clause = sentence.rsplit(", ", 1)[-1].strip(" .!")   # drop the lead-in ("Having taken the milk, ...")
        if m := re.search(rf"\b{_GO} (?:to the |through the )?(north|south|east|west)\b", clause):
            steps.append(Step("go", m.group(1)))
        elif m := re.search(r"\b(?:take|retrieve|recover|pick up|pick-up|lift) the (.+?)"
                            r"(?: (?:from|in|that's in) the (?:floor of the )?(.+))?$", clause):
            steps.append(Step("take", _name(m.group(1)), _name(m.group(2) or "")))
        elif m := re.search(r"\b(?:place|drop|ditch|throw|toss|deposit) the (.+?) on the floor of the (.+)$", clause):
            steps.append(Step("drop", _name(m.group(1)), _name(m.group(2))))
        # a key into a lock: "insert the key into the wooden door's lock to unlock it", "... the safe to lock it"
        elif m := re.search(r"\b(?:insert|put|place|deposit) the (.+?) into the (.+?) to (unlock|lock) it$", clause):
            target = re.sub(r"'s lock$", "", _name(re.sub(r"'s lock$", "", m.group(2))))
            steps.append(Step(m.group(3), _name(target), _name(m.group(1))))
        # put before insert: "place the X on the Y inside the kitchen" ends with the room, not a container
        elif m := re.search(r"\b(?:put|place|sit|rest) the (.+?) (?:on|upon) the (.+)$", clause):
            steps.append(Step("put", _name(m.group(1)), _name(m.group(2))))
        elif m := re.search(r"\b(?:insert|put|place|deposit) the (.+?) (?:into|inside) the (.+)$", clause):
            steps.append(Step("insert", _name(m.group(1)), _name(m.group(2))))
        # "unlock the X", or a state to reach: "(make sure | ensure | assure | check that) the X is unlocked"
        elif m := re.search(r"\bunlock the (.+?)(?: with the (.+))?$", clause) or \
                re.search(r"\bthe (.+?) is unlocked(?: with the (.+))?$", clause):
            steps.append(Step("unlock", _name(m.group(1)), _name(m.group(2) or "")))
        elif m := re.search(r"\block the (.+?)(?: with the (.+))?$", clause) or \
                re.search(r"\bthe (.+?) is locked(?: with the (.+))?$", clause):
            steps.append(Step("lock", _name(m.group(1)), _name(m.group(2) or "")))
        elif m := re.search(r"\bopen the (.+)$", clause) or \
                re.search(r"\bthe (.+?) is (?:opened|open|wide open|ajar)$", clause):
            steps.append(Step("open", _name(m.group(1))))
        elif m := re.search(r"\bclose the (.+)$", clause) or re.search(r"\bthe (.+?) is (?:closed|shut)$", clause):
            steps.append(Step("close", _name(m.group(1))))
        elif m := re.search(r"\beat the (.+)$", clause):
            steps.append(Step("eat", _name(m.group(1))))
    return steps


def step_things(steps: list[Step]) -> list[str]:
    """The things the steps name (not directions), in order, each once: what the task is about."""
    out: list[str] = []
    for step in steps:
        for thing in (step.thing, step.other) if step.verb != "go" else ():
            if thing and thing not in out:
                out.append(thing)
    return out


# the walkthrough's commands that say nothing of the plan's things: a route (`go east`: the map the agent has not
# seen) and looking around
_NO_STEP = re.compile(r"^(?:go \w+|look|inventory|wait)$")


def walkthrough_procedure(commands: list[str]) -> list[dict]:
    """The game's walkthrough as plan steps for `--instructions step|visual` (`agent.instructions`), each
    `{"text", "things"}`: what to do with which things, in order, never where: a route (`go east`) is left out,
    and so is where a thing is taken from (`take old key from antique trunk` -> "take the old key"); where a
    thing goes (`put`, `insert`), the door a key unlocks and the tool a verb uses are part of the step.
    `examine cookbook` stays (it is how a cooking game gives its recipe)."""
    steps = []
    for command in commands:
        c = " ".join(command.lower().split())
        if not c or _NO_STEP.match(c):
            continue
        verb, _, rest = c.partition(" ")
        if not rest:
            steps.append({"text": verb, "things": []})
            continue
        if verb == "take":
            rest = rest.split(" from ", 1)[0]
            steps.append({"text": f"take the {rest}", "things": [rest]})
            continue
        for word in (" on ", " into ", " with "):
            if word in rest:
                a, b = rest.split(word, 1)
                steps.append({"text": f"{verb} the {a}{word}the {b}", "things": [a, b]})
                break
        else:
            steps.append({"text": f"{verb} the {rest}", "things": [rest]})
    return steps
