"""The Meta-Judge: checks a judge's turn verdict against the trajectory, per dimension.

Dimensions (each `ok` with an `issue` when not):
- `accuracy`: the label and the score are supported by the trajectory (a verified malformed call is labelled
  malformed; the score lies on its label's side: useful above 0, the other labels below);
- `soundness`: no unsupported leap between evidence, rubric and score: the rubric applied is the turn's
  skill's section (plus `general`), every violation names a component of the prompt and, where it is a rule
  check, that check really fires on this turn; the label is at least as severe as the violations cited;
- `completeness`: the embodied constraints are covered: a verified omission (reporting before observing,
  finishing early, asking for help before meeting the obstacle) is cited, a verified redundant action
  (blind retry, no effect, back to an earlier state, repeated search or question, already there) is not
  called useful;
- `clarity`: the evidence cites turns that exist, none after the judged one, including the judged one; the
  rationale is not empty;
- `feedback`: a negative verdict says which rule it applies (a violation id) so a prompt edit can act on it.

The facts it checks against come from `reward_engine.rules.CHECKS`, executed on the recorded state history,
independently of the prompt under test (an edit that drops a rule does not also drop the Meta-Judge's check).
`RuleMetaBackend` is offline and deterministic; `LLMMetaBackend` asks a chat model for the same dimensions as
JSON and is bounded by the code checks (a dimension passes only if both pass; an unreadable reply after the
repairs is a counted `meta_error`, never a pass).

`plant_errors` makes the four kinds of bad verdicts the Meta-Judge is measured on: flipped sign, missed
omission, evidence citing a turn that does not exist, wrong rubric applied.
"""

from __future__ import annotations

import json
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from agent.trajectory import Trajectory
from reward_engine.judge import BAD_LABELS, TrajectoryVerdict, TurnVerdict, Violation, turn_skill, turn_line, ask_json
from reward_engine.prompt import SEVERITY, RewardPrompt
from reward_engine.rules import CHECKS, History

DIMENSIONS = ("accuracy", "soundness", "completeness", "clarity", "feedback")
MALFORMED_FACTS = ("unreadable", "invalid_tool", "bad_arguments", "after_end")
OMISSION_FACTS = ("report_before_observe", "help_before_obstacle", "finish_before_done")
REDUNDANT_FACTS = ("blind_retry", "no_effect", "revisit", "already_there", "repeat_search", "repeat_question")
# what the Meta-Judge itself takes each verified fact to mean (its reference, independent of the prompt)
FACT_LABEL = {**{f: "malformed" for f in MALFORMED_FACTS}, **{f: "inconsistent" for f in OMISSION_FACTS},
              **{f: "redundant" for f in REDUNDANT_FACTS}, "unknown_entity": "inconsistent",
              "uninformative_failure": "inconsistent", "known_locked": "inconsistent",
              "known_blocked": "inconsistent", "known_constraint": "unsafe", "unasked_report": "redundant"}
PLANTS = ("flipped_sign", "missed_omission", "phantom_evidence", "wrong_rubric")


class DimensionCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ok: bool
    issue: str = ""


class MetaVerdict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    turn: int
    ok: bool
    dimensions: dict[str, DimensionCheck]
    source: Literal["rule", "llm"] = "rule"
    meta_error: str | None = None

    @property
    def failed(self) -> list[str]:
        return [d for d, c in self.dimensions.items() if not c.ok]


def _facts(h: History, t: int, names) -> dict[str, str]:
    out = {}
    for n in names:
        hit = CHECKS[n](h, t)
        if hit is not None:
            out[n] = hit.rationale
    return out


def _section_of(prompt: RewardPrompt, vid: str) -> str | None:
    for s in prompt.sections:
        if any(it.id == vid for it in s.items):
            return s.id
    return None


def code_checks(prompt: RewardPrompt, h: History, v: TurnVerdict) -> dict[str, DimensionCheck]:
    """The verifiable part of every dimension (both backends apply it)."""
    t = v.index
    n = len(h.traj.turns)
    issues: dict[str, list[str]] = {d: [] for d in DIMENSIONS}
    if v.label is None or v.score is None:
        return {d: DimensionCheck(ok=False, issue="no verdict (judge_error)") for d in DIMENSIONS}
    # accuracy
    malformed = _facts(h, t, MALFORMED_FACTS)
    if malformed and v.label != "malformed":
        issues["accuracy"].append(f"the call is malformed ({'; '.join(malformed.values())}) but labelled {v.label}")
    facts = _facts(h, t, FACT_LABEL)
    if v.label == "useful" and facts:
        issues["accuracy"].append("labelled useful although " + "; ".join(facts.values()))
    u = h.traj.turns[t]
    if v.label != "useful" and not facts and u.error is None and (u.subgoals_met or h.learned(t)):
        issues["accuracy"].append(f"labelled {v.label}, yet no check fires and the turn made progress")
    if v.label == "useful" and v.score <= 0:
        issues["accuracy"].append(f"labelled useful but scored {v.score:+.2f}")
    if v.label != "useful" and v.score >= 0:
        issues["accuracy"].append(f"labelled {v.label} but scored {v.score:+.2f}")
    # soundness
    skill = turn_skill(h.traj, t)
    want = prompt.section_for(skill).id
    if v.section != want:
        issues["soundness"].append(f"applied the {v.section!r} rubric to a {skill or 'malformed'} turn "
                                   f"(its rubric is {want!r})")
    known = {c.id: c for c in prompt.components()}
    worst = None
    for viol in v.violations:
        comp = known.get(viol.id)
        if comp is None:
            issues["soundness"].append(f"cites {viol.id!r}, which is not in the prompt")
            continue
        sec = _section_of(prompt, viol.id)
        if sec is not None and sec not in ("general", want):
            issues["soundness"].append(f"cites {viol.id!r} from the {sec!r} rubric, which does not apply here")
        rule_for = getattr(comp, "skill", None)
        if rule_for is not None and rule_for != skill:
            issues["soundness"].append(f"cites {viol.id!r}, a precondition of {rule_for}, on a {skill} turn")
        check = getattr(comp, "check", None)
        if viol.kind != "semantic" and check in CHECKS and CHECKS[check](h, t) is None:
            issues["soundness"].append(f"cites {viol.id!r} but its check {check!r} does not hold on turn {t}")
        lab = getattr(comp, "label", None)
        if lab is not None and (worst is None or SEVERITY[lab] > SEVERITY[worst]):
            worst = lab
    if worst is not None and SEVERITY[v.label] < SEVERITY[worst]:
        issues["soundness"].append(f"cites a {worst} violation but labels the turn {v.label}")
    # completeness
    omitted = _facts(h, t, OMISSION_FACTS)
    if omitted and not (v.label in BAD_LABELS and any(x.omission for x in v.violations)):
        issues["completeness"].append("misses the omission: " + "; ".join(omitted.values()))
    redundant = _facts(h, t, REDUNDANT_FACTS)
    if redundant and v.label == "useful":
        issues["completeness"].append("calls a redundant action useful: " + "; ".join(redundant.values()))
    # clarity
    bad_ev = [i for i in v.evidence if not 0 <= i < n]
    late = [i for i in v.evidence if 0 <= i < n and i > t]
    if bad_ev:
        issues["clarity"].append(f"evidence cites turns {bad_ev} that do not exist (the trajectory has {n})")
    if late:
        issues["clarity"].append(f"evidence cites turns {late} after the judged turn {t}")
    if t not in v.evidence:
        issues["clarity"].append(f"evidence does not cite the judged turn {t}")
    if not v.rationale.strip():
        issues["clarity"].append("the rationale is empty")
    # feedback value
    if v.label != "useful" and not v.violations:
        issues["feedback"].append(f"labels the turn {v.label} without citing a rubric item or rule")
    return {d: DimensionCheck(ok=not issues[d], issue="; ".join(issues[d])) for d in DIMENSIONS}


class RuleMetaBackend:
    id = "rule"

    def check(self, prompt: RewardPrompt, h: History, verdicts: list[TurnVerdict]) -> list[MetaVerdict]:
        out = []
        for v in verdicts:
            dims = code_checks(prompt, h, v)
            out.append(MetaVerdict(turn=v.index, ok=all(c.ok for c in dims.values()), dimensions=dims))
        return out


class _LLMDims(BaseModel):
    model_config = ConfigDict(extra="forbid")

    accuracy: DimensionCheck
    soundness: DimensionCheck
    completeness: DimensionCheck
    clarity: DimensionCheck
    feedback: DimensionCheck


META_SYSTEM = (
    "You check another judge's verdict on one turn of an embodied agent's trajectory. For each dimension say "
    "whether the verdict is fine (ok true) or not (ok false, with the issue in one sentence):\n"
    "- accuracy: is the label and score supported by what happened in the trajectory?\n"
    "- soundness: does the score follow from the evidence and the rubric, without unsupported leaps? Is the "
    "rubric applied the one for the turn's skill?\n"
    "- completeness: are the embodied constraints covered (skipped necessary steps, redundant actions)?\n"
    "- clarity: are evidence turns and rules cited explicitly and correctly?\n"
    "- feedback: is the verdict specific enough that someone could improve the judge's prompt from it?\n"
    "Reply with one JSON object only: {\"accuracy\": {\"ok\": bool, \"issue\": str}, \"soundness\": ..., "
    "\"completeness\": ..., \"clarity\": ..., \"feedback\": ...}.")


class LLMMetaBackend:
    """A chat model checks the dimensions; the code checks still bound it (AND per dimension)."""

    def __init__(self, client, max_repairs: int = 1, seed: int = 0, max_tokens: int = 400):
        self.client = client
        self.max_repairs = max_repairs
        self.seed = seed
        self.max_tokens = max_tokens
        self.id = f"llm:{getattr(client, 'name', type(client).__name__)}"
        self.stats = {"calls": 0, "repairs": 0, "meta_errors": 0}

    def messages(self, prompt: RewardPrompt, h: History, v: TurnVerdict) -> list[dict]:
        traj = h.traj
        key = sorted({i for i in v.evidence if 0 <= i < len(traj.turns)} | {v.index})
        lines = [f"Task: {traj.instruction}", f"Judged turn: {v.index} (skill {turn_skill(traj, v.index)}, rubric "
                 f"section {prompt.section_for(turn_skill(traj, v.index)).id!r})", "", "Key turns:"]
        lines += [turn_line(traj, i, full=True) for i in key]
        lines += ["", "Whole trajectory:"] + [turn_line(traj, i) for i in range(len(traj.turns))]
        lines += ["", "The verdict to check:", json.dumps(v.model_dump(mode="json"), sort_keys=True)[:3000]]
        return [{"role": "system", "content": META_SYSTEM}, {"role": "user", "content": "\n".join(lines)}]

    def check(self, prompt: RewardPrompt, h: History, verdicts: list[TurnVerdict]) -> list[MetaVerdict]:
        convs = [self.messages(prompt, h, v) for v in verdicts]
        replies = self.client.chat_many(convs, temperature=0.0, seed=self.seed, max_tokens=self.max_tokens,
                                        json_mode=True)
        out = []
        for v, msgs, reply in zip(verdicts, convs, replies, strict=True):
            self.stats["calls"] += 1
            code = code_checks(prompt, h, v)
            dims, err = ask_json(self.client, msgs, reply, _parse_dims, self.max_repairs, self.stats,
                                 seed=self.seed, max_tokens=self.max_tokens)
            if dims is None:
                self.stats["meta_errors"] += 1
                out.append(MetaVerdict(turn=v.index, ok=False, dimensions=code, source="llm", meta_error=err))
                continue
            merged = {}
            for d in DIMENSIONS:
                a, b = code[d], getattr(dims, d)
                merged[d] = DimensionCheck(ok=a.ok and b.ok, issue="; ".join(x for x in (a.issue, "" if b.ok else
                                                                                     b.issue) if x))
            out.append(MetaVerdict(turn=v.index, ok=all(c.ok for c in merged.values()), dimensions=merged,
                                   source="llm"))
        return out


def _parse_dims(text: str) -> _LLMDims | str:
    try:
        return _LLMDims.model_validate(json.loads(text))
    except (ValueError, ValidationError) as e:
        return f"not the JSON object asked for ({str(e)[:160]})"


class MetaJudge:
    """`check(prompt, trajectory, verdict)` for one turn; `check_trajectory` for a whole TrajectoryVerdict."""

    def __init__(self, backend=None):
        self.backend = backend or RuleMetaBackend()

    def check(self, prompt: RewardPrompt, traj: Trajectory, verdict: TurnVerdict) -> MetaVerdict:
        return self.backend.check(prompt, History(traj), [verdict])[0]

    def check_trajectory(self, prompt: RewardPrompt, traj: Trajectory, tv: TrajectoryVerdict) -> list[MetaVerdict]:
        return self.backend.check(prompt, History(traj), list(tv.turns))


def quality(metas: list[MetaVerdict]) -> float:
    """The Meta-Judge's quality score of a set of verdicts: the share that pass every dimension."""
    return sum(m.ok for m in metas) / len(metas) if metas else 1.0


# --------------------------------------------------------------------------- planted bad verdicts


def plant_error(prompt: RewardPrompt, traj: Trajectory, v: TurnVerdict, kind: str,
                rng: random.Random) -> TurnVerdict | None:
    """A copy of a good verdict with one known error; None when the kind does not apply to this turn."""
    t = v.index
    if v.label is None:
        return None
    if kind == "flipped_sign":
        score = -v.score if abs(v.score) > 1e-6 else (0.5 if v.label != "useful" else -0.5)
        if rng.random() < 0.5:  # the score alone
            return v.model_copy(update={"score": score})
        if v.label == "useful":  # the whole polarity: label and score, rationale unchanged
            return v.model_copy(update={"label": "redundant", "score": -abs(score)})
        return v.model_copy(update={"label": "useful", "score": abs(score), "violations": []})
    if kind == "missed_omission":
        if not any(x.omission for x in v.violations) or v.label not in BAD_LABELS:
            return None
        return v.model_copy(update={"label": "useful", "score": 0.3, "rationale": "the turn moved the task on",
                                    "violations": [x for x in v.violations if not x.omission]})
    if kind == "phantom_evidence":
        return v.model_copy(update={"evidence": sorted(set(v.evidence) | {len(traj.turns) + rng.randint(0, 5)})})
    if kind == "wrong_rubric":
        skill = turn_skill(traj, t)
        own = prompt.section_for(skill).id
        others = [s for s in prompt.sections if s.id not in ("general", own) and s.items]
        if not others:
            return None
        other = rng.choice(others)
        item = rng.choice(other.items)
        return v.model_copy(update={"section": other.id, "violations": [
            Violation(id=item.id, kind=item.kind, omission=item.omission, penalty=item.penalty,
                      rationale=item.text)], "label": item.label if item.label != "useful" else v.label,
            "score": min(v.score, prompt.scoring.label_scores[item.label]) if item.label != "useful" else v.score})
    raise ValueError(f"unknown planted error {kind!r}; kinds: {', '.join(PLANTS)}")


class PlantedCase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trajectory: int
    kind: str | None               # None: the clean verdict
    verdict: TurnVerdict


def planted_cases(prompt: RewardPrompt, trajs: list[Trajectory], verdicts: list[TrajectoryVerdict],
                  per_kind: int = 100, clean: int = 300, seed: int = 0) -> list[PlantedCase]:
    """Up to `per_kind` planted verdicts of each kind and `clean` untouched ones, sampled with a seed."""
    rng = random.Random(seed)
    cells = [(i, v) for i, tv in enumerate(verdicts) for v in tv.turns if v.judge_error is None]
    out: list[PlantedCase] = []
    for kind in PLANTS:
        order = cells[:]
        rng.shuffle(order)
        n = 0
        for i, v in order:
            bad = plant_error(prompt, trajs[i], v, kind, rng)
            if bad is not None:
                out.append(PlantedCase(trajectory=i, kind=kind, verdict=bad))
                n += 1
                if n >= per_kind:
                    break
    order = cells[:]
    rng.shuffle(order)
    out += [PlantedCase(trajectory=i, kind=None, verdict=v) for i, v in order[:clean]]
    return out


def measure(meta: MetaJudge, prompt: RewardPrompt, trajs: list[Trajectory], cases: list[PlantedCase]) -> dict:
    """Recall per planted kind and overall, false alarms on clean verdicts."""
    by: dict[str | None, list[bool]] = {}
    hist = {}
    for c in cases:
        h = hist.setdefault(c.trajectory, History(trajs[c.trajectory]))
        m = meta.backend.check(prompt, h, [c.verdict])[0]
        by.setdefault(c.kind, []).append(not m.ok)
    planted = [f for k, fs in by.items() if k is not None for f in fs]
    clean = by.get(None, [])
    return {"recall": round(sum(planted) / len(planted), 4) if planted else None,
            "false_alarms": round(sum(clean) / len(clean), 4) if clean else None,
            "per_kind": {k: {"n": len(fs), "recall": round(sum(fs) / len(fs), 4)} for k, fs in by.items()
                         if k is not None},
            "planted": len(planted), "clean": len(clean)}


__all__ = ["DIMENSIONS", "PLANTS", "DimensionCheck", "MetaVerdict", "MetaJudge", "RuleMetaBackend", "LLMMetaBackend",
           "code_checks", "quality", "plant_error", "planted_cases", "measure"]
