"""Renamed copies of training rows: the same decision with the things it is about under made-up names.

A tiny student trained on 40 games of a kind learns the names of those games by heart: asked to "take the cake
scented keycard from the counter" in a game it never saw, it writes `pick_up bug`, a name it was trained to write,
instead of copying the new one from its prompt (custom games draw their names from TextWorld's whole vocabulary,
so every test game's names are new). A renamed copy of a row gives each word of the ids it knows (and of the
task's things it has not seen yet) a made-up word, the same everywhere in the row: in the task, the known lists,
the recent calls and the call to learn (`pick_up cake_scented_keycard` becomes `pick_up bodu_scented_kitemo`
when the task says "take the bodu scented kitemo"). The decision is unchanged; only copying the name from the
prompt can predict it.

    from sft.rename import with_renamed_copies
    train = with_renamed_copies(train, fraction=0.5, seed=0)   # + a renamed copy of half the rows, drawn by seed

Kept as they are: the system message, directions (`kitchen_north` keeps `north`: it says which exit), short
words and the words a prompt or a call is built from (skill, enum and error names, the prompt's labels and its
"Next skill call?", `of`, `the`, ...).
The copies are drawn by `seed` alone, so the same recipe and seed give the same rows. Made-up words are no words
of the training rows, and the tokenizer is trained before the copies are added, so they are split into pieces as
a new game's names are.
"""

from __future__ import annotations

import json
import random
import re

from agent.prompt import _LABEL_WORDS, NOT_SEEN, known_ids

# words never renamed: directions, the words a prompt and a call are built from, and the glue of names
# ("pair of headphones")
_KEEP = frozenset("""
north south east west up down northeast northwest southeast southwest
not step recent observation next skill call
the a an of to in into on onto and or for from with by at some
""".split()) | {w.lower() for w in _LABEL_WORDS}   # the known-state lines' own words (`agent.prompt`)
_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"
_TASK_OBJECTS = re.compile(r"^Task objects: (.*)$", re.M)


def _keep_words() -> frozenset[str]:
    from agent.tools import tool_definitions
    from sandbox.schema import ERROR_CODES
    from sandbox.skills import SKILLS
    words = set(_KEEP)
    for code in ERROR_CODES:               # a recent call's result: `-> precondition_unmet: ...`
        words.update([code, *code.split("_")])
    for name, skill in SKILLS.items():
        words.update([name, *name.split("_")])
        for p in skill.params:
            words.update(str(v) for v in (p.enum or ()))
    return frozenset(words | tool_enums(tool_definitions()))


def tool_enums(tools) -> set[str]:
    """The enum values of a tools list (TextWorld's `operate` verbs: eat, cook, ...)."""
    return {str(v) for t in tools or () for p in t["function"]["parameters"]["properties"].values()
            for v in p.get("enum", ())}


def made_up_word(rng: random.Random) -> str:
    """A pronounceable word of 2-3 syllables (`bodu`, `kitemo`)."""
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))


def name_words(prompt: str, call_args: list[str], keep: frozenset[str]) -> list[str]:
    """The words a renamed copy of this row renames: the words of the ids its prompt lists as known, of its call's
    arguments and of the task's things listed as not seen, without the kept ones (sorted: a row's renaming
    depends on nothing but its text and the seed)."""
    ids, _ = known_ids(prompt)
    names = set(ids) | set(call_args)
    for line in _TASK_OBJECTS.findall(prompt):
        names.update(e[: -len(NOT_SEEN)] for e in line.split("; ") if e.endswith(NOT_SEEN))
    words = {w for name in names for w in re.split(r"[_\s]+", name.lower())}
    return sorted(w for w in words if w.isalpha() and len(w) >= 3 and w not in keep)


def rename_text(text: str, mapping: dict[str, str]) -> str:
    """`text` with every whole word of `mapping` replaced (an id's words are whole words: `_` separates them; a
    capitalised word stays capitalised)."""
    if not mapping:
        return text
    pattern = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(map(re.escape, sorted(mapping, key=len, reverse=True)))
                         + r")(?![A-Za-z0-9])", re.I)

    def sub(m: re.Match) -> str:
        new = mapping[m.group(0).lower()]
        return new.capitalize() if m.group(0)[0].isupper() else new

    return pattern.sub(sub, text)


def renamed_row(row: dict, rng: random.Random, keep: frozenset[str], taken: set[str] = frozenset()) -> dict:
    """A copy of a step row (system, user, assistant call) with its names made up, none of them a word of the row
    or of `taken` (the corpus's words); the row itself is unchanged."""
    msgs = row["messages"]
    prompt = "\n".join(m.get("content") or "" for m in msgs if m["role"] == "user")
    call_args = [str(v) for m in msgs if m["role"] == "assistant" for tc in m.get("tool_calls") or []
                 for v in (tc["function"].get("arguments") or {}).values()]
    taken = set(taken) | set(re.findall(r"[a-z]+", prompt.lower()))
    mapping = {}
    tools = row.get("tools")
    keep = keep | tool_enums(json.loads(tools) if isinstance(tools, str) else tools)
    for w in name_words(prompt, call_args, keep):
        new = made_up_word(rng)
        while new in taken:
            new = made_up_word(rng)
        taken.add(new)
        mapping[w] = new
    out = []
    for m in msgs:
        m = dict(m)
        if m["role"] != "system":
            m["content"] = rename_text(m.get("content") or "", mapping)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**tc, "function": {**tc["function"], "arguments": {
                k: rename_text(v, mapping) if isinstance(v, str) else v
                for k, v in (tc["function"].get("arguments") or {}).items()}}} for tc in m["tool_calls"]]
        out.append(m)
    return {**row, "messages": out}


def with_renamed_copies(train, fraction: float, seed: int):
    """`train` (a `datasets.Dataset` of step rows) plus a renamed copy of `fraction` of its rows (drawn by `seed`;
    1.0: every row), shuffled in by the trainer's sampler as any row is."""
    from datasets import Dataset, concatenate_datasets
    if fraction <= 0:
        return train
    rng = random.Random(f"renamed-copies-{seed}")
    n = round(fraction * len(train))
    picked = sorted(rng.sample(range(len(train)), n))
    keep = _keep_words()
    words = {w for row in train for m in row["messages"]
             for w in re.findall(r"[a-z]+", (m.get("content") or "").lower())}
    copies = [renamed_row(train[i], rng, keep, words) for i in picked]
    return concatenate_datasets([train, Dataset.from_list(copies, features=train.features)])
