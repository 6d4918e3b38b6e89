"""The structured reward prompt: a versioned pydantic object, not a string.

Components (each with an `id` and a `version`):
- rubric sections, one per skill family (navigation, search, manipulation, dialogue and help, reporting,
  termination) plus a `general` section that every turn is checked against (format, retries, loops);
- temporal precondition rules (report only after observing the target, ask for help only after meeting the
  obstacle, finish only after the subgoals are verified);
- reasoning examples (worked verdicts an LLM judge reads);
- label scores and bonuses, the episode rubric and the output constraints (the verdict's JSON schema).

The rule-program backend executes each item's `check` (a name in `reward_engine.rules.CHECKS`); the LLM
backend renders the same components as text. Edits are data: `with_component` returns a new prompt with the
component's version bumped, its parent recorded and a new content hash. `PromptStore` keeps snapshots so
any earlier version can be restored.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent.trajectory import read_text
from reward_engine.rules import CHECKS  # the names rubric items may reference

Label = Literal["useful", "redundant", "unsafe", "malformed", "inconsistent"]
LABELS: tuple[str, ...] = ("useful", "redundant", "unsafe", "malformed", "inconsistent")
# when several items fire on one turn, the most severe label wins
SEVERITY = {"malformed": 4, "unsafe": 3, "inconsistent": 2, "redundant": 1, "useful": 0}

SKILL_SECTION = {"navigate": "navigation", "look_around": "search", "search": "search", "inspect": "search",
                 "pick_up": "manipulation", "place": "manipulation", "open": "manipulation",
                 "close": "manipulation", "operate": "manipulation", "talk_to": "dialogue",
                 "ask_for_help": "dialogue", "report": "reporting", "finish": "termination"}
SECTIONS: tuple[str, ...] = ("general", "navigation", "search", "manipulation", "dialogue", "reporting",
                             "termination")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Component(_Model):
    id: str = Field(min_length=1, max_length=80, pattern=r"^[a-z][a-z0-9_.]*$")
    version: int = Field(default=1, ge=1)

    def content_hash(self) -> str:
        return _hash(self.model_dump(mode="json"))


class RubricItem(Component):
    """One check. `kind="verifiable"` items are facts about the state history that every backend applies in
    code; `semantic` items are what an LLM judge decides from the text (the rule backend runs them too)."""

    text: str = Field(min_length=1, max_length=600)
    check: str                       # a name in reward_engine.rules.CHECKS
    kind: Literal["verifiable", "semantic"] = "semantic"
    label: Label
    penalty: float = Field(default=0.0, ge=0.0, le=2.0)   # subtracted from the turn score when it fires
    omission: bool = False           # an action-omission penalty (a necessary causal step was skipped)


class RubricSection(Component):
    title: str
    skills: list[str]
    guidance: str = Field(max_length=1200)
    items: list[RubricItem] = Field(default_factory=list)


class TemporalRule(Component):
    """A precondition in time: the turn's skill may only be used after something happened earlier."""

    text: str = Field(min_length=1, max_length=600)
    skill: str
    check: str
    label: Label = "inconsistent"
    penalty: float = Field(default=0.5, ge=0.0, le=2.0)
    omission: bool = True


class ReasoningExample(Component):
    section: str
    situation: str = Field(max_length=1200)
    label: Label
    score: float = Field(ge=-1.0, le=1.0)
    rationale: str = Field(max_length=600)


class Scoring(Component):
    """Base score per label and the bonuses a useful turn can earn."""

    label_scores: dict[str, float]
    subgoal_bonus: float = Field(default=0.5, ge=0.0, le=1.0)     # per subgoal the turn completed
    recovery_bonus: float = Field(default=0.2, ge=0.0, le=1.0)    # first success after a failure, by other means
    informative_failure: float = Field(default=-0.2, ge=-1.0, le=0.0)  # a failed turn that revealed an obstacle

    @model_validator(mode="after")
    def _all_labels(self):
        missing = set(LABELS) - set(self.label_scores)
        extra = set(self.label_scores) - set(LABELS)
        if missing or extra:
            raise ValueError(f"label_scores must have exactly the labels {LABELS}; missing {sorted(missing)}, "
                             f"unknown {sorted(extra)}")
        if any(not -1.0 <= v <= 1.0 for v in self.label_scores.values()):
            raise ValueError("label_scores must lie in [-1, 1]")
        return self


class EpisodeRubric(Component):
    text: str = Field(max_length=1200)
    weights: dict[str, float]

    @model_validator(mode="after")
    def _weights(self):
        want = {"efficiency", "consistency", "completeness", "correctness"}
        if set(self.weights) != want:
            raise ValueError(f"episode weights must be exactly {sorted(want)}, got {sorted(self.weights)}")
        if any(v < 0 for v in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError("episode weights must be non-negative with a positive sum")
        return self


class OutputConstraints(Component):
    instructions: str = Field(max_length=1200)


class RewardPrompt(_Model):
    name: str = "embodied-reward"
    version: int = Field(default=1, ge=1)
    parent_hash: str | None = None
    sections: list[RubricSection]
    rules: list[TemporalRule] = Field(default_factory=list)
    examples: list[ReasoningExample] = Field(default_factory=list)
    scoring: Scoring
    episode: EpisodeRubric
    output: OutputConstraints

    @model_validator(mode="after")
    def _consistent(self):
        ids = [c.id for c in self.components()]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"component ids must be unique: {dup}")
        names = {s.id for s in self.sections}
        if "general" not in names:
            raise ValueError("the prompt needs a 'general' section (checks every turn)")
        for s in self.sections:
            for it in s.items:
                if it.check not in CHECKS:
                    raise ValueError(f"{it.id}: unknown check {it.check!r}; known: {', '.join(sorted(CHECKS))}")
            for sk in s.skills:
                if sk not in SKILL_SECTION:
                    raise ValueError(f"section {s.id}: unknown skill {sk!r}")
        for r in self.rules:
            if r.check not in CHECKS:
                raise ValueError(f"{r.id}: unknown check {r.check!r}")
            if r.skill not in SKILL_SECTION:
                raise ValueError(f"{r.id}: unknown skill {r.skill!r}")
        for e in self.examples:
            if e.section not in names:
                raise ValueError(f"{e.id}: unknown section {e.section!r}")
        return self

    # ----------------------------------------------------------------- access

    def components(self) -> list[Component]:
        items = [it for s in self.sections for it in s.items]
        return [*self.sections, *items, *self.rules, *self.examples, self.scoring, self.episode, self.output]

    def get(self, cid: str) -> Component:
        for c in self.components():
            if c.id == cid:
                return c
        raise KeyError(f"no component {cid!r} in prompt v{self.version}")

    def section(self, sid: str) -> RubricSection:
        for s in self.sections:
            if s.id == sid:
                return s
        raise KeyError(f"no section {sid!r}")

    def section_for(self, skill: str | None) -> RubricSection:
        """The rubric a turn is sent to: its skill's section (malformed turns go to `general` only)."""
        if skill is not None:
            for s in self.sections:
                if skill in s.skills:
                    return s
        return self.section("general")

    def rules_for(self, skill: str | None) -> list[TemporalRule]:
        return [r for r in self.rules if r.skill == skill]

    def examples_for(self, sid: str) -> list[ReasoningExample]:
        return [e for e in self.examples if e.section in (sid, "general")]

    def content_hash(self) -> str:
        """Hash of everything that decides a verdict (not of the version counter or lineage)."""
        return _hash(self.model_dump(mode="json", exclude={"version", "parent_hash"}))

    def turn_components_hash(self, skill: str | None) -> str:
        """Hash of exactly the components that judge a turn of this skill: the verdict cache key, so an edit
        elsewhere (another skill's rubric, the episode weights) re-judges nothing here."""
        sec = self.section_for(skill)
        parts = [self.section("general"), sec, *self.rules_for(skill), *self.examples_for(sec.id),
                 self.scoring, self.output]
        return _hash([p.content_hash() for p in parts])

    # ----------------------------------------------------------------- edits

    def with_component(self, new: Component) -> "RewardPrompt":
        """A new prompt where the component with `new.id` is replaced (its version bumped), validated."""
        old = self.get(new.id)
        if type(old) is not type(new):
            raise TypeError(f"{new.id}: cannot replace a {type(old).__name__} with a {type(new).__name__}")
        bumped = new.model_copy(update={"version": old.version + 1})
        data = self.model_dump(mode="json")

        def swap(obj):
            if isinstance(obj, dict):
                if obj.get("id") == new.id and "version" in obj:
                    return bumped.model_dump(mode="json")
                return {k: swap(v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [swap(v) for v in obj]
            return obj

        data = swap(data)
        data["version"] = self.version + 1
        data["parent_hash"] = self.content_hash()
        return RewardPrompt.model_validate(data)

    def without_checks(self, checks: frozenset[str] | set[str]) -> "RewardPrompt":
        """The prompt without the rubric items and temporal rules that run these checks (an env that has no
        people or reports drops `rules.SANDBOX_ONLY`); its content hash, and so the verdict cache, changes."""
        data = self.model_dump(mode="json")
        for sec in data["sections"]:
            sec["items"] = [it for it in sec["items"] if it["check"] not in checks]
        data["rules"] = [r for r in data["rules"] if r["check"] not in checks]
        return RewardPrompt.model_validate(data)

    # ----------------------------------------------------------------- LLM rendering

    def render_turn_system(self, skill: str | None) -> str:
        """The judge's system prompt for one turn: general + the skill's rubric, rules, examples, output."""
        sec = self.section_for(skill)
        general = self.section("general")
        lines = [f"You judge one turn of an embodied agent's trajectory (reward prompt {self.name} "
                 f"v{self.version}).", "", f"## Rubric: {general.title}", general.guidance]
        lines += [f"- [{it.id}] ({it.label}) {it.text}" for it in general.items]
        if sec.id != "general":
            lines += ["", f"## Rubric: {sec.title} (skills: {', '.join(sec.skills)})", sec.guidance]
            lines += [f"- [{it.id}] ({it.label}) {it.text}" for it in sec.items]
        rules = self.rules_for(skill)
        if rules:
            lines += ["", "## Temporal preconditions"]
            lines += [f"- [{r.id}] {r.text}" for r in rules]
        ex = self.examples_for(sec.id)
        if ex:
            lines += ["", "## Examples"]
            for e in ex:
                lines.append(f"- [{e.id}] {e.situation} -> label {e.label}, score {e.score:+.1f}: {e.rationale}")
        sc = self.scoring.label_scores
        lines += ["", "## Scores", "Base score by label: " + ", ".join(f"{k} {sc[k]:+.1f}" for k in LABELS) +
                  f". A useful turn that completes a subgoal earns +{self.scoring.subgoal_bonus:.1f}.",
                  "", "## Output", self.output.instructions,
                  "JSON schema: " + json.dumps(turn_judgment_schema(), separators=(",", ":"))]
        return "\n".join(lines)


class TurnJudgment(BaseModel):
    """What an LLM judge must reply for one turn (validated; anything else is repaired or a judge_error)."""

    model_config = ConfigDict(extra="forbid")

    label: Label
    score: float = Field(ge=-1.0, le=1.0)
    rationale: str = Field(min_length=1, max_length=1000)
    evidence: list[int] = Field(default_factory=list, max_length=20)
    violations: list[str] = Field(default_factory=list, max_length=20)


def turn_judgment_schema() -> dict:
    return TurnJudgment.model_json_schema()


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- snapshots


class PromptStore:
    """Snapshots of every prompt version in a folder: `v0003-<hash>.json`, written atomically."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def save(self, prompt: RewardPrompt) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"v{prompt.version:04d}-{prompt.content_hash()}.json"
        if path.exists():
            return path
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".snap.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(prompt.model_dump_json(indent=2))
        os.replace(tmp, path)
        return path

    def versions(self) -> list[tuple[int, str, Path]]:
        out = []
        for p in sorted(self.folder.glob("v*-*.json")):
            v, h = p.stem[1:].split("-", 1)
            out.append((int(v), h, p))
        return out

    def load(self, ref: int | str) -> RewardPrompt:
        """Restore a snapshot by version number or content hash (a unique prefix is enough)."""
        for v, h, p in self.versions():
            if (isinstance(ref, int) and v == ref) or (isinstance(ref, str) and h.startswith(ref)):
                return load_prompt(p)
        raise KeyError(f"{self.folder}: no snapshot {ref!r}")


def load_prompt(path: str | Path) -> RewardPrompt:
    text = read_text(path)   # a bad byte names its line
    try:
        return RewardPrompt.model_validate_json(text)
    except Exception as e:
        raise ValueError(f"{path}: not a valid reward prompt: {e}") from e


# --------------------------------------------------------------------------- the default prompt


def _item(iid, text, check, label, penalty=0.0, kind="semantic", omission=False) -> RubricItem:
    return RubricItem(id=iid, text=text, check=check, label=label, penalty=penalty, kind=kind, omission=omission)


def default_prompt() -> RewardPrompt:
    """Version 1 of the embedded reward prompt (the rule-program judge executes it as is)."""
    sections = [
        RubricSection(id="general", title="Every turn", skills=[], guidance=(
            "Every turn must be one well-formed call of a known skill that changes something the agent knows "
            "or the world; repeating a failed call unchanged or returning to an earlier state is wasted."),
            items=[
                _item("general.unreadable", "The output has no readable tool call.", "unreadable", "malformed",
                      kind="verifiable"),
                _item("general.invalid_tool", "The call names a skill that does not exist.", "invalid_tool",
                      "malformed", kind="verifiable"),
                _item("general.bad_arguments", "The call's arguments are missing, extra, mistyped or out of range.",
                      "bad_arguments", "malformed", kind="verifiable"),
                _item("general.after_end", "The call comes after the episode ended.", "after_end", "malformed",
                      kind="verifiable"),
                _item("general.unknown_entity", "The call uses an id the agent has never seen (a hallucinated "
                      "entity).", "unknown_entity", "inconsistent", kind="verifiable"),
                _item("general.blind_retry", "The call repeats an earlier failed call unchanged and fails the "
                      "same way: nothing was learned from the failure.", "blind_retry", "redundant", penalty=0.3),
                _item("general.no_effect", "The call succeeded but changed nothing: same state, no new facts.",
                      "no_effect", "redundant"),
                _item("general.loop", "The call returns the agent to a state it was in before.", "revisit",
                      "redundant"),
                _item("general.uninformative_failure", "The call failed on a precondition the agent could have "
                      "known, and revealed nothing new.", "uninformative_failure", "inconsistent"),
                _item("general.known_constraint", "The call tries to break a constraint the agent already "
                      "knows: entering a restricted area without permission, lifting a fragile object with full "
                      "hands.", "known_constraint", "unsafe", penalty=0.2),
            ]),
        RubricSection(id="navigation", title="Navigation", skills=["navigate"], guidance=(
            "Navigate to known places or seen objects along open routes; after meeting an obstacle, choose "
            "another route or remove the obstacle first."),
            items=[
                _item("navigation.already_there", "Navigating to the place the agent is already in.",
                      "already_there", "redundant"),
                _item("navigation.known_blocked", "Navigating along a route the agent already knows is blocked.",
                      "known_blocked", "inconsistent", penalty=0.2),
            ]),
        RubricSection(id="search", title="Search and observation", skills=["look_around", "search", "inspect"],
                      guidance="Search where the target could be; do not repeat the same search in the same "
                               "place; inspect what the task asks about.",
                      items=[_item("search.repeat", "The same search in the same place was already done.",
                                   "repeat_search", "redundant", penalty=0.2)]),
        RubricSection(id="manipulation", title="Manipulation", skills=["pick_up", "place", "open", "close",
                                                                      "operate"],
                      guidance="Pick up, place, open and operate only what is here and needed; a locked or "
                               "broken thing needs its key or a person's help first.",
                      items=[_item("manipulation.known_locked", "Opening something the agent knows is locked, "
                                   "without holding a key.", "known_locked", "inconsistent", penalty=0.2)]),
        RubricSection(id="dialogue", title="Dialogue and help", skills=["talk_to", "ask_for_help"],
                      guidance="Ask people about what the task needs; ask for help with a reason, and only for "
                               "an obstacle the agent has met or checked.",
                      items=[_item("dialogue.repeat_question", "Asking the same person the same thing again "
                                   "after a full answer.", "repeat_question", "redundant", penalty=0.2)]),
        RubricSection(id="reporting", title="Reporting", skills=["report"],
                      guidance="Report an answer the agent has observed or been told; one report per answer.",
                      items=[_item("reporting.unasked", "Reporting when the task asks for no report.",
                                   "unasked_report", "redundant")]),
        RubricSection(id="termination", title="Termination", skills=["finish"],
                      guidance="Finish once every part of the instruction is verified done.", items=[]),
    ]
    rules = [
        TemporalRule(id="rule.report_after_observe", skill="report", check="report_before_observe",
                     text="Report a location, state or answer only after observing the target (seeing it, "
                          "inspecting it, or being told) in this episode.", penalty=0.8),
        TemporalRule(id="rule.help_after_obstacle", skill="ask_for_help", check="help_before_obstacle",
                     text="Ask for help only after meeting the obstacle or checking the constraint (a locked door "
                          "tried, a blocked path met, a heavy object tried, a search done).", penalty=0.6),
        TemporalRule(id="rule.finish_after_subgoals", skill="finish", check="finish_before_done",
                     text="Finish only after every subgoal of the instruction is verified.", penalty=0.8),
    ]
    examples = [
        ReasoningExample(id="example.recovery", section="general",
                         situation="Turn 4 navigate fails: the door is locked. Turn 5 the agent asks a person "
                                   "nearby to unlock it, giving the reason, and the door opens.",
                         label="useful", score=0.5, rationale="A recovery by other means after a met obstacle "
                                                              "(evidence: turns 4, 5)."),
        ReasoningExample(id="example.blind_retry", section="general",
                         situation="Turn 4 navigate fails: the door is locked. Turn 5 the same navigate again, "
                                   "same failure.", label="redundant", score=-0.6,
                         rationale="The failure taught nothing; the retry repeats it (evidence: turns 4, 5)."),
        ReasoningExample(id="example.premature_report", section="reporting",
                         situation="The task asks where the mug is. Turn 1 the agent reports 'kitchen' without "
                                   "having seen the mug or asked anyone.", label="inconsistent", score=-0.5,
                         rationale="The report precedes any observation of the target: an omitted step "
                                   "(evidence: turn 1)."),
    ]
    scoring = Scoring(id="scoring", label_scores={"useful": 0.3, "redundant": -0.3, "inconsistent": -0.6,
                                                  "unsafe": -0.8, "malformed": -1.0})
    episode = EpisodeRubric(
        id="episode", weights={"completeness": 0.4, "correctness": 0.3, "efficiency": 0.15, "consistency": 0.15},
        text="Score the whole episode: completeness (subgoals met), correctness of the final report or end state, "
             "efficiency against the expert's optimal steps, and consistency (share of turns that were not "
             "inconsistent, unsafe or malformed).")
    output = OutputConstraints(
        id="output", instructions="Reply with one JSON object only: label (one of useful, redundant, unsafe, "
                                  "malformed, inconsistent), score in [-1, 1], a short rationale, evidence (indices "
                                  "of the turns that support it, none after the judged turn) and violations (ids "
                                  "of rubric items or rules that the turn breaks).")
    return RewardPrompt(sections=sections, rules=rules, examples=examples, scoring=scoring, episode=episode,
                        output=output)


def draft_prompt() -> RewardPrompt:
    """A first draft, as someone might write before looking at any labelled data: the same sections and
    scores as `default_prompt`, but only the general format checks, hallucinated ids filed under malformed,
    no skill rubric items, no temporal rules and no examples. The evolution benchmark starts from it
    (`benchmarks/reward_evolution.py`); it is never the default judge."""
    base = default_prompt()
    fmt = {"general.unreadable", "general.invalid_tool", "general.bad_arguments", "general.after_end",
           "general.unknown_entity"}
    sections = []
    for s in base.sections:
        items = [it.model_copy(update={"label": "malformed"}) if it.id == "general.unknown_entity" else it
                 for it in s.items if it.id in fmt]
        sections.append(s.model_copy(update={"items": items}))
    return RewardPrompt(name="embodied-reward-draft", sections=sections, rules=[], examples=[],
                        scoring=base.scoring, episode=base.episode, output=base.output)
