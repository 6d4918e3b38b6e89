"""The per-step prompt builder shared by teacher, SFT data, RL rollouts and evaluation.

A step prompt is: the system message (role and rules), then one user message with the known map (places,
doors, the places not yet visited nearest first, objects), known facts, the memory of recent steps, the current
observation, and last the task (next to the decision it governs, where even a tiny model reads it). It is built
from the instruction and the agent's belief only (`sandbox.observation.known_map`), so it carries no hidden
state. The user message ends with a fixed line, so the assistant turn always starts at the chat template's
special tokens and never inside a BPE merge.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sandbox.skills import id_words

SYSTEM_PROMPT = (
    "You are an embodied assistant. Each turn think briefly, then call one skill as "
    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>, using only ids you have seen. "
    "When blocked, recover: another way, a search, or a person's help (give a reason). "
    "Report answers with report; finish only when the whole task is done."
)


# how a memory line of a step that succeeded joins its call and what it observed (`- navigate(kitchen) -> ok: You
# are in the kitchen [kitchen]`); the tiny student's template (`sft.student`, short_memory) cuts such lines here
MEMORY_OK = " -> ok: "


@dataclass
class StepMemory:
    """A short memory of recent steps: (call text, short result)."""

    size: int = 4
    steps: list[tuple[str, str]] = field(default_factory=list)

    def add(self, call: dict | None, error: str | None, observation: str) -> None:
        if call is None:
            text = "(unreadable output)"
        else:
            args = ", ".join(f"{v}" for v in (call.get("arguments") or {}).values() if isinstance(v, str))
            text = f"{call.get('name')}({args[:80]})"
        # what a step found lives on in the known map and facts; the memory keeps the gist: its first sentence
        first = observation.split(". ", 1)[0]
        result = ("ok" if error is None else error) + ": " + (first if len(first) <= 90 else first[:87] + "...")
        self.steps.append((text, result))
        del self.steps[: -self.size]


def _place(pid: str, name: str, landmarks: list[str]) -> str:
    text = pid if name == pid.replace("_", " ") else f"{pid} {name}"
    return text + (f" [{', '.join(landmarks)}]" if landmarks else "")


def _door(cid: str, a: str, b: str, state: str) -> str:
    # built scenes name a door after the places it joins (`blue_door_room_0_2_room_1_2`); other ids say them
    return f"{cid} {state}" if a in cid and b in cid else f"{cid} {state} ({a}-{b})"


_EXITS = re.compile(r" ?Exits: [^.]*\.")


def abridged(observation: str) -> str:
    """The observation without its `Exits: ...` sentence: the known map above it lists the same places and doors,
    and a small student reads a shorter prompt (every token of it costs, at training and in rollouts)."""
    return _EXITS.sub("", observation, count=1)


def _object(oid: str, name: str, loc: str, known: dict, here: bool = False) -> str:
    """One known object: the name first and the id right after it, as in observations ("white phone charger
    [charger_1]"), so the id to copy into a call follows the words the instruction matches; a descriptive id
    (`yellow_key`, the BabyAI vocabulary) stands alone, like a place named by its id. An object on or in a
    landmark also names the landmark's place: where to go is one look-up, not two. With `here`, an object in
    the agent's own place says so."""
    text = oid if name.replace(" ", "_") == oid else f"{name} {oid}"
    if loc == "held":
        return text + " held"
    place = {lm: pid for pid, lms in known.get("landmarks", {}).items() for lm in lms}.get(loc)
    text += f" at {place} {loc}" if place else f" at {loc}"
    return text + (" (here)" if here and (place or loc) == known["place"] else "")


def _words(text: str) -> str:
    return " " + re.sub(r"[^a-z0-9]+", " ", text.lower()) + " "


# the words that end an object phrase of an instruction ("the purple key next to ...", "the mug in the kitchen")
_PHRASE_END = {"next", "to", "in", "into", "on", "onto", "and", "then", "is", "are", "of", "from", "with", "which",
               "where", "whether", "it", "report", "near", "by", "for", "at"}


def named_phrases(instruction: str) -> list[str]:
    """The things an instruction names: the words after each "the", "a" or "an" up to the next word that ends a
    phrase ("Put the purple key next to the yellow box." -> purple key, yellow box). A clause that asks a person
    something names a question, not an object, and is skipped."""
    out = []
    for clause in re.split(r",|\band\b|\bthen\b", instruction.lower()):
        words = re.findall(r"[a-z0-9']+", clause)
        if not words or words[0] in ("ask", "report"):
            continue
        for i, w in enumerate(words):
            if w in ("the", "a", "an"):
                phrase = []
                for x in words[i + 1:]:
                    if x in _PHRASE_END or x in ("the", "a", "an"):
                        break
                    phrase.append(x)
                if phrase:
                    out.append(" ".join(phrase))
    return out


def _covers(known_words: str, phrase: str) -> bool:
    """Whether a known thing's words (" red ball ") and a phrase ("ball", "big red ball") name the same thing."""
    return bool(known_words.strip()) and (_words(phrase) in known_words or known_words in _words(phrase))


def task_objects(instruction: str, known: dict) -> str:
    """The known objects the instruction names (by their name, or their id read as words: `yellow_key` is
    "yellow key"), in the order it names them, each with where it is: the part of the agent's memory that the
    task is about, looked up for it. A thing it names that matches nothing known (no object, place, landmark,
    door or person) is listed as "not seen", in its place: "purple key not seen; yellow_box at room_1_0" says the
    key is still to be found, and that the box is not the key."""
    said = _words(instruction)
    entries, names = [], []
    for oid, name, loc in known["objects"]:
        forms = (_words(name), _words(" ".join(id_words(oid))))   # each object's words, computed once
        names += forms
        for words in forms:
            if words.strip() and words in said:
                entries.append((said.index(words), _object(oid, name, loc, known, here=True)))
                break
    names += [_words(x) for p in known.get("places", ()) for x in p[:2]]
    names += [_words(x) for pid, lms in known.get("landmarks", {}).items() for x in [pid, *lms]]
    names += [_words(c[0]) for c in known.get("connections", ())]
    names += [_words(x) for p in known.get("people", ()) for x in p[:2]]
    # an env whose instructions are free prose names the things its task is about (`task_phrases`); else the
    # phrases after "the"/"a"/"an" are those things
    phrases = known.get("task_phrases")
    for phrase in named_phrases(instruction) if phrases is None else phrases:
        if not any(_covers(n, phrase) for n in names):
            entries.append((said.find(_words(phrase)), f"{phrase}{NOT_SEEN}"))
    entries.sort(key=lambda e: e[0])
    return "; ".join(text for _, text in entries) or "none seen"


NOT_SEEN = " not seen"
# the lines of a step prompt that list what the agent knows by id (`render_known`, the facts, the task objects),
# and the words the builder itself writes in them around the ids
KNOWN_LINES = ("At:", "Places:", "Doors:", "Unvisited:", "Objects:", "People:", "Facts:", "Task objects:")
_LABEL_WORDS = frozenset({"At", "Holding", "nothing", "Places", "Doors", "Unvisited", "Objects", "People", "Facts",
                          "Task", "objects", "at", "held", "here", "open", "closed", "locked", "none", "seen"})
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_'\-]*")
# a `Recent:` line ("- pick_up(bug) -> precondition_unmet: ..."): the skill, its arguments, "ok" or the error. The
# arguments of a call that worked name known ids, and so does an id an observation names in brackets ("You walk to
# the east room [room_1_2]"). A tiny student's template may leave out the `Places:` line, which these stand for.
_RECENT = re.compile(r"- (\w+)\((.*?)\) -> (\w+)")
_BRACKETED = re.compile(r"\[([A-Za-z0-9][A-Za-z0-9_'\-]*)\]")


def known_ids(prompt: str) -> tuple[set[str], str | None]:
    """The words a call may name as ids, read off a step prompt's text: the words of its known-state lines (what
    the agent has seen, as `build_step_messages` renders it), without the builder's own words and without the
    task's things listed as not seen; never the task's prose, the observation, the recent results or the system
    message; and the arguments of the recent calls that worked and the ids the env's text names in brackets
    (`[room_1_2]`). And the agent's own place (the `At:` line), or None.

    Every id argument of the teachers' calls is among them (checked over the sandbox's and TextWorld's distilled
    rows); a word of prose is not: a student that copies `been` out of an echoed error (`I know no 'x' here or
    anywhere I have been.`) or `Places` out of a label cannot name it."""
    ids, here = set(), None
    for line in prompt.splitlines():
        call = _RECENT.match(line)
        if call and call.group(3) == "ok":
            ids.update(_ID.findall(call.group(2)))
        ids.update(_BRACKETED.findall(line))
        if not line.startswith(KNOWN_LINES):
            continue
        if line.startswith("At: "):
            here = line[4:].split(".", 1)[0].strip() or None
        if line.startswith("Task objects:"):
            line = "; ".join(e for e in line.split("; ") if not e.endswith(NOT_SEEN))
        ids.update(w for w in _ID.findall(line) if w not in _LABEL_WORDS)
    return ids, here


_BRACKETS = re.compile(r"\[[^\]]*\]")
_JOINED = re.compile(r"\(([^()]*)\)")


def place_ids(prompt: str) -> set[str]:
    """The words of a step prompt's known-state lines that name places: the `At:` place, each `Places:` entry
    outside its brackets (its id and its name; the brackets hold the place's landmarks), the `Unvisited:` exits and
    the places a door joins (`passageway closed (studio-kitchen)`). An argument that names an object, a door, a
    device or a person is none of them (`agent.constrained`: `pick_up recreation_zone_north` is no call).

        place_ids("At: hall. Holding: nothing.\nPlaces: hall [desk], dish_pit dish pit\nUnvisited: hall_east")
        # {"hall", "dish_pit", "dish", "pit", "hall_east"}"""
    out: set[str] = set()
    for line in prompt.splitlines():
        if line.startswith("At: "):
            out.update(_ID.findall(line[4:].split(".", 1)[0]))
        elif line.startswith(("Places: ", "Unvisited: ")):
            out.update(_ID.findall(_BRACKETS.sub(" ", line.split(":", 1)[1])))
        elif line.startswith("Doors: "):
            for joined in _JOINED.findall(line):
                out.update(_ID.findall(joined))
                out.update(_ID.findall(joined.replace("-", " ")))
    return out - _LABEL_WORDS


def recent_calls(prompt: str) -> list[tuple[str, list[str], str] | None]:
    """The calls of the prompt's `Recent:` block, oldest first, each as `(skill, arguments, result)` (`result`:
    "ok" or the error type, e.g. `precondition_unmet`), or None for a step whose output was unreadable; [] when
    the prompt has no such block.

        recent_calls("Recent:\n- navigate(cookery) -> ok\n- pick_up(bug) -> precondition_unmet: You can't see "
                     "any such thing.\nTask: ...")
        # [("navigate", ["cookery"], "ok"), ("pick_up", ["bug"], "precondition_unmet")]

    `StepMemory` writes the arguments joined by ", " (and cut at 80 characters): ids split back exactly, free text
    with commas does not."""
    lines = prompt.splitlines()
    if "Recent:" not in lines:
        return []
    out = []
    for line in lines[len(lines) - lines[::-1].index("Recent:"):]:
        if line.startswith(("Observation:", "Task")):   # the lines `build_step_messages` writes after the block
            break
        if line.startswith("- "):
            m = _RECENT.match(line)
            out.append(m and (m.group(1), m.group(2).split(", ") if m.group(2) else [], m.group(3)))
    return out


def render_known(known: dict) -> str:
    """The known map, compactly: places with their landmarks, doors (ids and states), objects (with the place of
    the landmark they are on or in), people."""
    marks = known.get("landmarks", {})
    lines = [f"At: {known['place']}. Holding: {', '.join(known['holding']) or 'nothing'}.",
             "Places: " + ", ".join(_place(pid, name, marks.get(pid, [])) for pid, name in known["places"])]
    # doors only: plain passages need no id and no action (navigate finds routes over the known map)
    doors = [_door(cid, a, b, door) for cid, a, b, door in known["connections"] if door]
    if doors:
        lines.append("Doors: " + ", ".join(doors))
    if known.get("unvisited"):
        # nearest first (over the known map): where to look next for something not yet seen is the first one
        lines.append("Unvisited: " + ", ".join(known["unvisited"]))
    if known["objects"]:
        # ids stand as words (" at kitchen", not "@kitchen"), so a BPE tokenizer splits an id the same way here as
        # in a call ("navigate kitchen")
        lines.append("Objects: " + "; ".join(_object(oid, name, loc, known) for oid, name, loc in known["objects"]))
    if known["people"]:
        lines.append("People: " + "; ".join(f"{pid} {name}, {role} at {loc}" for pid, name, role, loc
                                             in known["people"]))
    return "\n".join(lines)


def build_step_messages(instruction: str, known: dict, memory: StepMemory, observation: str,
                        step: int, budget: int, task: str | None = None) -> list[dict]:
    """The chat messages for one decision (system + user). `task`: the task line when it is not the instruction
    itself (a finer instruction granularity, `agent.instructions`); the task objects are the instruction's."""
    parts = [f"Step {step + 1}/{budget}.", render_known(known)]
    if known["facts"]:
        parts.append("Facts: " + "; ".join(known["facts"]))
    if memory.steps:
        parts.append("Recent:\n" + "\n".join(f"- {c} -> {r}" for c, r in memory.steps))
    parts.append(f"Observation: {abridged(observation)}")
    # the task closes the prompt, right before the decision: what to do next is read against it, and so is what
    # the agent already knows of the objects it names (a tiny student does not learn that look-up by itself:
    # trained without this line, its choice of skill ignored which object the task names)
    parts.append(f"Task objects: {task_objects(instruction, known)}")
    parts.append(f"Task: {instruction if task is None else task}")
    parts.append("Next skill call?")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n".join(parts)}]


def prompt_text(messages: list[dict]) -> str:
    """Plain text of a prompt (for isolation checks and token counting without a tokenizer)."""
    return "\n".join(m["content"] for m in messages)
