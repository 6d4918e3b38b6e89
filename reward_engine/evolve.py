"""The self-evolution loop: Cluster -> Analyzer -> Refiner -> Validator, with rollback and provenance.

- **Cluster** groups the low-quality judge cases of the validation set (the judge disagrees with the label,
  or the Meta-Judge fails the verdict) by skill and failure type (the judge's label -> the correct label).
- **Analyzer** finds the component at fault and plans one revision. Offline (`RuleAnalyzer`) it is a
  deterministic diagnoser: a component cited on most of the cluster's cases whose citations carry another
  label on the whole set is relabelled (or removed when its cases are mostly useful); a check from the
  library `reward_engine.rules.CHECKS` that fires on the cluster's cases and rarely elsewhere becomes a new
  rubric item (or a temporal rule when the cluster is one skill's omission). With an LLM (`LLMProposer`) the
  model reads the cluster's cases and the section and answers a `PromptEdit` as JSON.
- **Refiner** turns the plan into a `PromptEdit`: data in the prompt's schema that touches one component (a
  rubric item, a section's item list, a rule or an example), validated before use. Nothing generated is ever
  executed: an item can only name a check that exists in `CHECKS`.
- **Validator** judges the full validation set with the revised prompt and accepts it only if agreement with
  the labels rises, no skill's agreement drops by more than `tolerance`, and the Meta-Judge's quality does
  not drop; otherwise the loop rolls back to the previous snapshot (restored from the `PromptStore`).

Judge calls are budgeted: every turn judgment the cache cannot answer costs one. Verdicts are cached by the
hash of the components that judge each turn, so an edit to one section re-judges only that section's turns.
The held-out set is never passed to the loop; `select_final` alone reads it, to pick and report the final
version among the accepted ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.trajectory import Trajectory
from reward_engine.audit import agreement as _agreement
from reward_engine.audit import cohen_kappa
from reward_engine.judge import RewardEngine, RuleBackend, TrajectoryVerdict, VerdictCache, turn_line, ask_json
from reward_engine.labels import LabelRecord, trajectory_key
from reward_engine.meta_judge import MetaJudge, MetaVerdict, quality
from reward_engine.prompt import (SEVERITY, SKILL_SECTION, PromptStore, ReasoningExample, RewardPrompt, RubricItem,
                                  RubricSection, TemporalRule, default_prompt)
from reward_engine.rules import CHECKS, History

OMISSION_CHECKS = frozenset({"report_before_observe", "help_before_obstacle", "finish_before_done"})
VERIFIABLE_CHECKS = frozenset({"unreadable", "invalid_tool", "bad_arguments", "after_end", "unknown_entity"})


class EditError(ValueError):
    """A proposed edit that does not fit the prompt (unknown component, bad schema, unknown check...)."""


# --------------------------------------------------------------------------- data


@dataclass
class LabelledSet:
    """Trajectories and the labels of their turns (labels whose trajectory is absent are refused)."""

    trajs: list[Trajectory]
    labels: list[LabelRecord]
    index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        self.index = {trajectory_key(t): i for i, t in enumerate(self.trajs)}
        missing = sorted({lb.trajectory for lb in self.labels} - set(self.index))
        if missing:
            raise ValueError(f"{len(missing)} labelled trajectories are not in the trajectory set, e.g. "
                             f"{missing[:3]} (keys are task_id|policy|seed)")
        for lb in self.labels:
            n = len(self.trajs[self.index[lb.trajectory]].turns)
            if lb.turn >= n:
                raise ValueError(f"label {lb.case_id}: turn {lb.turn} but the trajectory has {n} turns")

    def subset(self, keep: Callable[[LabelRecord], bool]) -> "LabelledSet":
        labels = [lb for lb in self.labels if keep(lb)]
        used = sorted({self.index[lb.trajectory] for lb in labels})
        return LabelledSet([self.trajs[i] for i in used], labels)


def split_by_task(data: LabelledSet, held_out: float = 0.4, seed: int = 0) -> tuple[LabelledSet, LabelledSet]:
    """(validation, held-out), split by task id so no task's turns sit on both sides."""
    if not 0.0 < held_out < 1.0:
        raise ValueError(f"held_out must be in (0, 1), got {held_out}")

    def is_held(lb: LabelRecord) -> bool:
        task = lb.trajectory.split("|", 1)[0]
        h = int(hashlib.sha256(f"{seed}:{task}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        return h < held_out

    return data.subset(lambda lb: not is_held(lb)), data.subset(is_held)


def skill_key(skill: str | None) -> str:
    return skill or "(malformed)"


# --------------------------------------------------------------------------- evaluation


class Evaluation(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    prompt_version: int
    prompt_hash: str
    n: int
    agreement: float
    kappa: float
    per_skill: dict[str, dict]
    meta_quality: float
    judge_calls: int
    judge_errors: int
    pred: dict[str, str | None] = Field(default_factory=dict, repr=False)
    verdicts: list[TrajectoryVerdict] = Field(default_factory=list, repr=False)
    metas: dict[str, MetaVerdict] = Field(default_factory=dict, repr=False)

    def summary(self) -> dict:
        return {"prompt_version": self.prompt_version, "prompt_hash": self.prompt_hash, "n": self.n,
                "agreement": self.agreement, "kappa": self.kappa, "meta_quality": self.meta_quality,
                "per_skill": self.per_skill, "judge_calls": self.judge_calls, "judge_errors": self.judge_errors}


class Judging:
    """Judges a labelled set with any prompt version through one shared verdict cache, counting judge calls."""

    def __init__(self, backend=None, cache: VerdictCache | None = None, meta: MetaJudge | None = None):
        self.backend = backend or RuleBackend()
        self.cache = cache if cache is not None else VerdictCache()
        self.meta = meta or MetaJudge()
        self.calls = 0

    def cost(self, prompt: RewardPrompt, data: LabelledSet) -> int:
        return RewardEngine(prompt, self.backend, self.cache).uncached(data.trajs)

    def evaluate(self, prompt: RewardPrompt, data: LabelledSet) -> Evaluation:
        eng = RewardEngine(prompt, self.backend, self.cache)
        before = self.cache.misses
        verdicts = [eng.score(t) for t in data.trajs]
        calls = self.cache.misses - before
        self.calls += calls
        metas: dict[str, MetaVerdict] = {}
        for tr, tv in zip(data.trajs, verdicts, strict=True):
            key = trajectory_key(tr)
            for m in self.meta.check_trajectory(prompt, tr, tv):
                metas[f"{key}#{m.turn}"] = m
        pred: dict[str, str | None] = {}
        for tr, tv in zip(data.trajs, verdicts, strict=True):
            key = trajectory_key(tr)
            for v in tv.turns:
                pred[f"{key}#{v.index}"] = v.label
        gold = [lb.label for lb in data.labels]
        got = [pred[lb.case_id] or "(judge_error)" for lb in data.labels]
        per: dict[str, list[bool]] = {}
        for lb, g in zip(data.labels, got, strict=True):
            per.setdefault(skill_key(lb.skill), []).append(g == lb.label)
        labelled = [metas[lb.case_id] for lb in data.labels]
        return Evaluation(prompt_version=prompt.version, prompt_hash=prompt.content_hash(), n=len(gold),
                          agreement=round(_agreement(gold, got), 4) if gold else 0.0,
                          kappa=round(cohen_kappa(gold, got), 4) if gold else 0.0,
                          per_skill={k: {"n": len(v), "agreement": round(sum(v) / len(v), 4)}
                                     for k, v in sorted(per.items())},
                          meta_quality=round(quality(labelled), 4), judge_calls=calls,
                          judge_errors=sum(v.judge_error is not None for tv in verdicts for v in tv.turns),
                          pred=pred, verdicts=verdicts, metas=metas)


# --------------------------------------------------------------------------- edits (data, validated)


class PromptEdit(BaseModel):
    """One edit of one component. `replace` swaps a component by id (same type); `add_item`/`remove_item`
    change one section's item list; `add_rule`/`remove_rule` one temporal rule; `add_example` one example."""

    model_config = ConfigDict(extra="forbid")

    op: Literal["replace", "add_item", "remove_item", "add_rule", "remove_rule", "add_example"]
    target: str = Field(min_length=1, max_length=80)   # component id, or the section id for add_item
    component: dict | None = None
    rationale: str = Field(default="", max_length=1000)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(exclude={"rationale"}), sort_keys=True).encode()
                              ).hexdigest()[:16]


def apply_edit(prompt: RewardPrompt, edit: PromptEdit) -> RewardPrompt:
    """The edited prompt (a new version with its parent's hash), or EditError naming what does not fit."""
    try:
        if edit.op == "replace":
            old = prompt.get(edit.target)
            if not edit.component:
                raise EditError("replace needs the new component")
            if isinstance(old, RubricSection):
                raise EditError(f"{edit.target} is a section: edit its items with add_item/remove_item")
            new = type(old).model_validate({**edit.component, "id": edit.target, "version": old.version})
            return prompt.with_component(new)
        if edit.op in ("add_item", "remove_item"):
            if edit.op == "add_item":
                sec = prompt.section(edit.target)
                item = RubricItem.model_validate(edit.component or {})
                if any(c.id == item.id for c in prompt.components()):
                    raise EditError(f"component id {item.id!r} already exists")
                return prompt.with_component(sec.model_copy(update={"items": [*sec.items, item]}))
            for sec in prompt.sections:
                if any(it.id == edit.target for it in sec.items):
                    return prompt.with_component(sec.model_copy(update={
                        "items": [it for it in sec.items if it.id != edit.target]}))
            raise EditError(f"no rubric item {edit.target!r} to remove")
        data = prompt.model_dump(mode="json")
        if edit.op == "add_rule":
            rule = TemporalRule.model_validate(edit.component or {})
            if any(c.id == rule.id for c in prompt.components()):
                raise EditError(f"component id {rule.id!r} already exists")
            data["rules"].append(rule.model_dump(mode="json"))
        elif edit.op == "remove_rule":
            if not any(r.id == edit.target for r in prompt.rules):
                raise EditError(f"no temporal rule {edit.target!r} to remove")
            data["rules"] = [r for r in data["rules"] if r["id"] != edit.target]
        elif edit.op == "add_example":
            ex = ReasoningExample.model_validate(edit.component or {})
            if any(c.id == ex.id for c in prompt.components()):
                raise EditError(f"component id {ex.id!r} already exists")
            data["examples"].append(ex.model_dump(mode="json"))
        data["version"] = prompt.version + 1
        data["parent_hash"] = prompt.content_hash()
        return RewardPrompt.model_validate(data)
    except EditError:
        raise
    except (KeyError, TypeError, ValueError, ValidationError) as e:
        raise EditError(f"{edit.op} {edit.target}: {str(e)[:400]}") from e


# --------------------------------------------------------------------------- cluster


class Cluster(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str
    skill: str                     # the turns' skill ("(malformed)" for unreadable output)
    section: str                   # the rubric section that judges that skill
    judge_label: str
    label: str
    cases: list[str]
    failure_types: dict[str, int]


def cluster_cases(prompt: RewardPrompt, data: LabelledSet, ev: Evaluation, min_size: int = 2) -> list[Cluster]:
    """Low-quality cases (disagreement with the label, or a Meta-Judge failure) grouped by skill and failure type
    (the judge's label -> the correct label); each cluster also counts its turns' error codes and failed
    Meta-Judge dimensions. Largest first, ties by key (deterministic)."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    kinds: dict[tuple[str, str, str], Counter] = {}
    for lb in data.labels:
        got = ev.pred.get(lb.case_id) or "(judge_error)"
        meta = ev.metas.get(lb.case_id)
        if got == lb.label and (meta is None or meta.ok):
            continue
        u = data.trajs[data.index[lb.trajectory]].turns[lb.turn]
        k = (skill_key(lb.skill if lb.skill in SKILL_SECTION else None), got, lb.label)
        groups.setdefault(k, []).append(lb.case_id)
        c = kinds.setdefault(k, Counter())
        c[u.error or "ok"] += 1
        if meta is not None and not meta.ok:
            for d in meta.failed:
                c[f"meta:{d}"] += 1
    out = [Cluster(key=f"{sk}:{j}->{g}", skill=sk,
                   section=prompt.section_for(None if sk == skill_key(None) else sk).id, judge_label=j, label=g,
                   cases=cs, failure_types=dict(kinds[(sk, j, g)]))
           for (sk, j, g), cs in groups.items() if len(cs) >= min_size]
    return sorted(out, key=lambda c: (-len(c.cases), c.key))


# --------------------------------------------------------------------------- analyzer + refiner (offline)


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cluster: str
    action: Literal["relabel", "remove_item", "remove_rule", "add_item", "add_rule"]
    component: str | None = None
    check: str | None = None
    section: str | None = None
    skill: str | None = None
    label: str | None = None
    support: int = 0
    against: int = 0
    why: str = ""


def check_texts() -> dict[str, str]:
    """A sentence per check for new rubric items: the embedded prompt's wording, else the check's docstring."""
    out = {}
    base = default_prompt()
    for c in base.components():
        chk = getattr(c, "check", None)
        if chk and chk not in out:
            out[chk] = c.text
    for name, fn in CHECKS.items():
        if name not in out:
            out[name] = ((fn.__doc__ or "").strip().split("\n")[0] or name.replace("_", " ")).strip()[:600]
    return out


class _Index:
    """Per validation set: History per trajectory and each check's firings, computed once (no judge calls)."""

    def __init__(self, data: LabelledSet):
        self.data = data
        self.hist = [History(t) for t in data.trajs]
        self._fires: dict[str, set[str]] = {}
        self.gold = {lb.case_id: lb for lb in data.labels}

    def fires(self, check: str) -> set[str]:
        if check not in self._fires:
            out = set()
            for lb in self.data.labels:
                if CHECKS[check](self.hist[self.data.index[lb.trajectory]], lb.turn) is not None:
                    out.add(lb.case_id)
            self._fires[check] = out
        return self._fires[check]


class RuleAnalyzer:
    """Deterministic diagnosis from check firings and citations (reads no held-out data, makes no judge calls)."""

    id = "rule"

    def __init__(self, data: LabelledSet):
        self.ix = _Index(data)

    def _scope(self, prompt: RewardPrompt, section: str) -> set[str]:
        if section == "general":
            return set(self.ix.gold)
        skills = set(prompt.section(section).skills)
        return {cid for cid, lb in self.ix.gold.items() if lb.skill in skills}

    def plans(self, prompt: RewardPrompt, ev: Evaluation, cl: Cluster, max_plans: int = 3) -> list[Plan]:
        gold = self.ix.gold
        plans: list[Plan] = []
        cited: Counter = Counter()
        cites: dict[str, set[str]] = {}
        for tv in ev.verdicts:
            key = trajectory_key(tv)
            for v in tv.turns:
                for x in v.violations:
                    cites.setdefault(x.id, set()).add(f"{key}#{v.index}")
        for cid in cl.cases:
            for comp, cs in cites.items():
                if cid in cs:
                    cited[comp] += 1
        # 1. a cited component that carries another label on the whole set: relabel or remove it
        for comp_id, n in cited.most_common():
            if n * 2 < len(cl.cases):
                break
            try:
                comp = prompt.get(comp_id)
            except KeyError:
                continue
            dist = Counter(gold[c].label for c in cites[comp_id] if c in gold)
            best, m = dist.most_common(1)[0]
            if best == comp.label:
                continue
            if best == "useful":
                act = "remove_rule" if isinstance(comp, TemporalRule) else "remove_item"
                plans.append(Plan(cluster=cl.key, action=act, component=comp_id, support=m,
                                  against=sum(dist.values()) - m,
                                  why=f"{comp_id} is cited on {n}/{len(cl.cases)} cases of {cl.key}; where it "
                                      f"fires the label is useful {m}/{sum(dist.values())} times"))
            else:
                plans.append(Plan(cluster=cl.key, action="relabel", component=comp_id, label=best, support=m,
                                  against=dist.get(comp.label, 0),
                                  why=f"{comp_id} ({comp.label}) is cited on {n}/{len(cl.cases)} cases of {cl.key}; "
                                      f"where it fires the label is {best} {m}/{sum(dist.values())} times"))
        # 2. the judge is too lenient: a check that fires on the cluster and rarely elsewhere in its scope
        if SEVERITY.get(cl.label, 0) > SEVERITY.get(cl.judge_label, -1) or cl.judge_label == "useful":
            existing = {(s.id, it.check) for s in prompt.sections for it in s.items} | \
                {(f"rule:{r.skill}", r.check) for r in prompt.rules}
            cands = []
            skills = Counter(gold[c].skill for c in cl.cases)
            only_skill = next(iter(skills)) if len(skills) == 1 else None
            for chk in sorted(CHECKS):
                fired = self.ix.fires(chk)
                tp = sum(c in fired for c in cl.cases)
                if tp == 0:
                    continue
                for sec in ([cl.section, "general"] if cl.section != "general" else ["general"]):
                    if chk in OMISSION_CHECKS and only_skill:
                        place, act = f"rule:{only_skill}", "add_rule"
                        scope = {c for c, lb in gold.items() if lb.skill == only_skill}
                    else:
                        place, act = sec, "add_item"
                        scope = self._scope(prompt, sec)
                    if (place, chk) in existing:
                        continue
                    hits = fired & scope
                    support = sum(gold[c].label == cl.label for c in hits)
                    against = len(hits) - support
                    if support > against:
                        cands.append((support - against, -against, chk, place, act, support, against, tp))
            cands.sort(key=lambda c: (-c[0], c[1], c[2]))
            for _, _, chk, place, act, support, against, tp in cands[:max_plans]:
                plans.append(Plan(cluster=cl.key, action=act, check=chk, label=cl.label,
                                  section=None if act == "add_rule" else place,
                                  skill=place.split(":", 1)[1] if act == "add_rule" else None,
                                  support=support, against=against,
                                  why=f"{chk} fires on {tp}/{len(cl.cases)} cases of {cl.key}; in its scope it "
                                      f"fires on {support} turns labelled {cl.label} and {against} others"))
        seen, out = set(), []
        for p in plans:
            k = (p.action, p.component, p.check, p.section, p.skill, p.label)
            if k not in seen:
                seen.add(k)
                out.append(p)
        return out[:max_plans]


class RuleRefiner:
    """Plan -> PromptEdit on exactly the component the plan names."""

    def __init__(self):
        self.texts = check_texts()

    def edit(self, prompt: RewardPrompt, plan: Plan) -> PromptEdit:
        if plan.action == "relabel":
            comp = prompt.get(plan.component)
            body = comp.model_dump(mode="json")
            body["label"] = plan.label
            return PromptEdit(op="replace", target=comp.id, component=body, rationale=plan.why)
        if plan.action in ("remove_item", "remove_rule"):
            return PromptEdit(op=plan.action, target=plan.component, rationale=plan.why)
        ids = {c.id for c in prompt.components()}
        if plan.action == "add_rule":
            rid = _fresh(f"rule.{plan.skill}.{plan.check}", ids)
            return PromptEdit(op="add_rule", target=rid, rationale=plan.why, component={
                "id": rid, "skill": plan.skill, "check": plan.check, "text": self.texts[plan.check],
                "label": plan.label, "penalty": 0.5, "omission": True})
        iid = _fresh(f"{plan.section}.{plan.check}", ids)
        return PromptEdit(op="add_item", target=plan.section, rationale=plan.why, component={
            "id": iid, "text": self.texts[plan.check], "check": plan.check, "label": plan.label,
            "kind": "verifiable" if plan.check in VERIFIABLE_CHECKS else "semantic",
            "omission": plan.check in OMISSION_CHECKS})


def _fresh(base: str, ids: set[str]) -> str:
    base = base[:76]
    if base not in ids:
        return base
    i = 2
    while f"{base}_{i}" in ids:
        i += 1
    return f"{base}_{i}"


# --------------------------------------------------------------------------- proposer with an LLM


PROPOSER_SYSTEM = (
    "You improve a structured reward prompt that judges the turns of an embodied agent. You get a cluster of "
    "cases where the judge's label is wrong, the rubric section involved, and the checks the rubric may use. "
    "Propose ONE edit to ONE component as a JSON object with keys op, target, component, rationale. op is one "
    "of replace (target = the component id, component = its full new body), add_item (target = the section id, "
    "component = a rubric item: id, text, check, label, kind, penalty, omission), remove_item (target = the "
    "item id), add_rule (component = a temporal rule: id, skill, check, text, label, penalty, omission), "
    "remove_rule, add_example (component = id, section, situation, label, score, rationale). A check must be "
    "one of the listed names. Reply with the JSON object only.")


class LLMProposer:
    """Analyzer and Refiner in one chat model call per cluster: the reply is a `PromptEdit` (JSON), validated
    and applied to a copy; a reply that does not validate is repaired at most `max_repairs` times."""

    id = "llm"

    def __init__(self, client, data: LabelledSet, max_repairs: int = 1, seed: int = 0, cases_shown: int = 6):
        self.client = client
        self.data = data
        self.max_repairs = max_repairs
        self.seed = seed
        self.cases_shown = cases_shown
        self.texts = check_texts()
        self.stats = {"calls": 0, "repairs": 0, "invalid": 0}

    def messages(self, prompt: RewardPrompt, ev: Evaluation, cl: Cluster) -> list[dict]:
        gold = {lb.case_id: lb for lb in self.data.labels}
        lines = [f"Cluster {cl.key}: {len(cl.cases)} cases where the judge said {cl.judge_label} and the label "
                 f"is {cl.label}. Failure types: {json.dumps(cl.failure_types)}", ""]
        for cid in cl.cases[:self.cases_shown]:
            lb = gold[cid]
            tr = self.data.trajs[self.data.index[lb.trajectory]]
            v = next(tv for tv in ev.verdicts if trajectory_key(tv) == lb.trajectory)
            tv = v.turns[lb.turn]
            lines += [f"Case {cid} (task: {tr.instruction})",
                      *[turn_line(tr, i) for i in range(max(0, lb.turn - 3), lb.turn)],
                      "JUDGED: " + turn_line(tr, lb.turn, full=True),
                      f"judge: {tv.label} {tv.score} cited {[x.id for x in tv.violations]}; correct: {lb.label}", ""]
        sec = prompt.section(cl.section)
        lines += ["Section:", sec.model_dump_json(), "Temporal rules:",
                  json.dumps([r.model_dump(mode="json") for r in prompt.rules]),
                  "Checks:", json.dumps(self.texts)]
        return [{"role": "system", "content": PROPOSER_SYSTEM}, {"role": "user", "content": "\n".join(lines)}]

    def propose(self, prompt: RewardPrompt, ev: Evaluation, cl: Cluster) -> list[PromptEdit]:
        def check(text: str) -> PromptEdit | str:
            try:
                edit = PromptEdit.model_validate(json.loads(text))
                apply_edit(prompt, edit)  # validated against the prompt's schema before anyone uses it
                return edit
            except (ValueError, ValidationError, EditError) as e:
                self.stats["invalid"] += 1
                return f"that edit does not fit the prompt: {str(e)[:300]}"

        self.stats["calls"] += 1
        edit, _ = ask_json(self.client, self.messages(prompt, ev, cl), None, check, self.max_repairs, self.stats,
                           seed=self.seed, max_tokens=800)
        return [edit] if edit is not None else []


# --------------------------------------------------------------------------- validator + loop


class Decision(BaseModel):
    model_config = ConfigDict(extra="forbid")

    accepted: bool
    reason: str
    deltas: dict


class Validator:
    """Accept a revised prompt only if it is better overall, hurts no skill beyond `tolerance`, and the
    Meta-Judge's quality does not drop."""

    def __init__(self, tolerance: float = 0.02, min_gain: float = 1e-4, min_skill_n: int = 5):
        self.tolerance = tolerance
        self.min_gain = min_gain
        self.min_skill_n = min_skill_n

    def decide(self, cur: Evaluation, cand: Evaluation) -> Decision:
        per = {}
        worst = None
        for k, c in cur.per_skill.items():
            d = round(cand.per_skill.get(k, {"agreement": 0.0})["agreement"] - c["agreement"], 4)
            per[k] = d
            if c["n"] >= self.min_skill_n and (worst is None or d < worst[1]):
                worst = (k, d)
        deltas = {"agreement": round(cand.agreement - cur.agreement, 4), "kappa": round(cand.kappa - cur.kappa, 4),
                  "meta_quality": round(cand.meta_quality - cur.meta_quality, 4), "per_skill": per}
        if cand.judge_errors > cur.judge_errors:
            return Decision(accepted=False, reason=f"judge errors rose to {cand.judge_errors}", deltas=deltas)
        if deltas["agreement"] < self.min_gain:
            return Decision(accepted=False, reason=f"agreement {cur.agreement:.4f} -> {cand.agreement:.4f}: no gain",
                            deltas=deltas)
        if worst is not None and worst[1] < -self.tolerance:
            return Decision(accepted=False, reason=f"skill {worst[0]} regresses by {-worst[1]:.4f} "
                                                   f"(tolerance {self.tolerance})", deltas=deltas)
        if deltas["meta_quality"] < 0:
            return Decision(accepted=False, reason=f"Meta-Judge quality drops {cur.meta_quality:.4f} -> "
                                                   f"{cand.meta_quality:.4f}", deltas=deltas)
        return Decision(accepted=True, reason="better overall, no skill regression, Meta-Judge quality kept",
                        deltas=deltas)


class EvolutionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_iterations: int = Field(default=30, ge=0)
    budget: int = Field(default=200_000, ge=0)          # judge calls (turn judgments the cache cannot answer)
    tolerance: float = Field(default=0.02, ge=0.0, le=1.0)
    min_gain: float = Field(default=1e-4, ge=0.0)
    max_clusters: int = Field(default=8, ge=1)
    plans_per_cluster: int = Field(default=3, ge=1)
    min_cluster: int = Field(default=2, ge=1)


class EvolutionResult(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    start: dict
    versions: list[dict]            # accepted versions in order: version, hash, validation metrics
    log: list[dict]                 # every tried edit with its decision
    judge_calls: int
    stopped: str
    final_hash: str


def _atomic_append(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def evolve(start: RewardPrompt, validation: LabelledSet, out: str | Path | None = None,
           config: EvolutionConfig | None = None, judging: Judging | None = None, proposer=None,
           validator: Validator | None = None, progress: Callable[[str], None] | None = None) -> EvolutionResult:
    """Run the loop on the validation set only. With `out`, writes `out/prompts/` (every accepted snapshot),
    `out/edits.jsonl` (every tried edit: cluster, cases, plan, edit, decision, metric deltas, judge calls)."""
    cfg = config or EvolutionConfig()
    judging = judging or Judging()
    validator = validator or Validator(cfg.tolerance, cfg.min_gain)
    analyzer = RuleAnalyzer(validation) if proposer is None else None
    refiner = RuleRefiner()
    out = Path(out) if out else Path(tempfile.mkdtemp(prefix="evolve-"))
    store = PromptStore(out / "prompts")
    log_path = out / "edits.jsonl"
    if log_path.exists():
        log_path.unlink()  # a fresh run; the snapshots stay (they are content-addressed)
    current = start
    store.save(current)
    cur = judging.evaluate(current, validation)
    start_summary = cur.summary()
    versions = [{**cur.summary(), "accepted_edit": None}]
    log: list[dict] = []
    tried: set[str] = set()
    stopped = "max_iterations"
    for it in range(cfg.max_iterations):
        clusters = cluster_cases(current, validation, cur, cfg.min_cluster)[:cfg.max_clusters]
        if not clusters:
            stopped = "no low-quality cases left"
            break
        accepted = False
        out_of_budget = False
        for cl in clusters:
            if proposer is None:
                edits = [(p.model_dump(), refiner.edit(current, p))
                         for p in analyzer.plans(current, cur, cl, cfg.plans_per_cluster)]
            else:
                edits = [(None, e) for e in proposer.propose(current, cur, cl)]
            for plan, edit in edits:
                fp = edit.fingerprint() + current.content_hash()
                if fp in tried:
                    continue
                tried.add(fp)
                try:
                    cand = apply_edit(current, edit)
                except EditError as e:
                    row = {"iteration": it, "cluster": cl.key, "cases": cl.cases[:20], "plan": plan,
                           "edit": edit.model_dump(), "accepted": False, "reason": f"invalid edit: {e}"}
                    log.append(row)
                    _atomic_append(log_path, row)
                    continue
                cost = judging.cost(cand, validation)
                if judging.calls + cost > cfg.budget:
                    out_of_budget = True
                    break
                ev = judging.evaluate(cand, validation)
                d = validator.decide(cur, ev)
                row = {"iteration": it, "cluster": cl.key, "cluster_size": len(cl.cases), "cases": cl.cases[:20],
                       "failure_types": cl.failure_types, "plan": plan, "edit": edit.model_dump(),
                       "accepted": d.accepted, "reason": d.reason, "deltas": d.deltas,
                       "before": {"version": current.version, "hash": current.content_hash(),
                                  "agreement": cur.agreement, "kappa": cur.kappa, "meta_quality": cur.meta_quality},
                       "after": {"version": cand.version, "hash": cand.content_hash(), "agreement": ev.agreement,
                                 "kappa": ev.kappa, "meta_quality": ev.meta_quality},
                       "judge_calls": ev.judge_calls, "judge_calls_total": judging.calls}
                log.append(row)
                _atomic_append(log_path, row)
                if progress:
                    progress(f"{'accept' if d.accepted else 'reject'} {edit.op} {edit.target}: agreement "
                             f"{cur.agreement:.3f} -> {ev.agreement:.3f} ({d.reason})")
                if d.accepted:
                    current, cur = cand, ev
                    store.save(current)
                    versions.append({**cur.summary(), "accepted_edit": edit.model_dump(), "motivated_by": {
                        "cluster": cl.key, "cases": cl.cases[:20]}, "deltas": d.deltas})
                    accepted = True
                    break
                # rejected: roll back to the previous snapshot (restored from disk, not kept in memory)
                current = store.load(current.content_hash())
            if accepted or out_of_budget:
                break
        if out_of_budget:
            stopped = "budget"
            break
        if not accepted:
            stopped = "no edit accepted"
            break
    return EvolutionResult(start=start_summary, versions=versions, log=log, judge_calls=judging.calls,
                           stopped=stopped, final_hash=current.content_hash())


def select_final(result: EvolutionResult, store_dir: str | Path, held_out: LabelledSet,
                 judging: Judging) -> tuple[RewardPrompt, list[dict]]:
    """Pick the final version among the accepted ones by held-out agreement (ties: the later version).
    The held-out set is read here only, after the loop has chosen every edit."""
    store = PromptStore(store_dir)
    scored = []
    for v in result.versions:
        p = store.load(v["prompt_hash"])
        ev = judging.evaluate(p, held_out)
        scored.append((ev.agreement, ev.kappa, v["prompt_version"], p, ev.summary()))
    best = max(scored, key=lambda s: (s[0], s[1], s[2]))
    return best[3], [s[4] for s in scored]
