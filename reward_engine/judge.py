"""Turn-level and episode-level judges behind one entry point: `RewardEngine.score(trajectory)`.

Each turn goes to its skill's rubric section (plus the `general` section and the skill's temporal rules).
Verifiable checks (malformed output, invalid tool, bad arguments, unknown entities, temporal preconditions)
always run in code on the recorded state history. The semantic judgment (useful, redundant, unsafe,
malformed, inconsistent, with a score, a rationale and evidence turns) comes from one of two backends:

- `RuleBackend` (offline default, deterministic): executes the rubric items' checks;
- `LLMBackend`: renders the same components as a prompt, asks a `ChatModel` for a JSON verdict, validates
  it with pydantic, repairs a bad reply a bounded number of times, and otherwise records a `judge_error`
  (never a silent score).

The episode score (efficiency against the expert's optimal steps, consistency, completeness of subgoals,
correctness of the final report) is the terminal reward RL uses. Verdicts are cached by (backend, hash of
the components that judge the turn, hash of the turn and its history), so after a prompt edit only the turns
whose rubric changed are judged again.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.models import ModelError
from agent.trajectory import Trajectory
from reward_engine.prompt import (LABELS, SEVERITY, SKILL_SECTION, RewardPrompt, TurnJudgment, default_prompt)
from reward_engine.rules import CHECKS, History, Hit, call_text

BAD_LABELS = frozenset({"inconsistent", "unsafe", "malformed"})


class Violation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    kind: Literal["verifiable", "semantic", "rule"]
    omission: bool = False
    penalty: float = 0.0
    rationale: str = ""


class TurnVerdict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int
    skill: str | None
    section: str
    label: str | None                 # None only with judge_error
    score: float | None
    rationale: str = ""
    evidence: list[int] = Field(default_factory=list)
    violations: list[Violation] = Field(default_factory=list)
    source: Literal["rule", "llm"] = "rule"
    judge_error: str | None = None


class EpisodeVerdict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # None when a turn's verdict failed (judge_error): the episode's consistency is then unknown, and a score
    # made without it would pass for a judgment (rewards and the distillation filter skip such an episode)
    score: float | None
    efficiency: float
    consistency: float | None           # None when no turn was judged
    completeness: float
    correctness: float
    steps: int
    optimal_steps: int
    success: bool


class TrajectoryVerdict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: str
    policy: str
    seed: int
    difficulty: str
    scene: str
    prompt_name: str
    prompt_version: int
    prompt_hash: str
    backend: str
    turns: list[TurnVerdict]
    episode: EpisodeVerdict
    judge_errors: int = 0
    cache_hits: int = 0

    @property
    def turn_rewards(self) -> list[float | None]:
        """Per-turn rewards for RL (None where the judge failed: such trajectories are left out of training)."""
        return [v.score for v in self.turns]


# --------------------------------------------------------------------------- cache


class VerdictCache:
    """(backend, component hash, turn-content hash) -> verdict. In memory, optionally persisted as JSONL."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self._d: dict[str, dict] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self._pending: list[dict] = []
        if self.path and self.path.exists():
            with open(self.path) as f:
                for line in f:
                    if line.strip():
                        try:
                            row = json.loads(line)
                        except ValueError:
                            continue  # a torn last line after a crash: that verdict is simply re-judged
                        self._d[row["key"]] = row["verdict"]

    def get(self, key: str) -> TurnVerdict | None:
        with self._lock:
            v = self._d.get(key)
            if v is None:
                self.misses += 1
                return None
            self.hits += 1
        return TurnVerdict.model_validate(v)

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._d

    def put(self, key: str, verdict: TurnVerdict) -> None:
        if verdict.judge_error is not None:
            return  # failures are retried next time, never replayed
        row = verdict.model_dump(mode="json")
        with self._lock:
            self._d[key] = row
            self._pending.append({"key": key, "verdict": row})

    def flush(self) -> None:
        """Append the new verdicts to the file (one fsync per call, so a crash loses at most one batch)."""
        with self._lock:
            rows, self._pending = self._pending, []
        if not rows or not self.path:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())

    def __len__(self) -> int:
        return len(self._d)


def turn_content_hashes(traj: Trajectory) -> list[str]:
    """Chained hashes: turn t's hash covers the task text, the subgoals and every turn up to t (a verdict
    may depend on the whole history before it), but not the stored prompt messages."""
    base = json.dumps([traj.instruction, [g.model_dump() for g in traj.subgoals], traj.subgoals_total,
                       traj.initial_observation, traj.initial_state_key], sort_keys=True)
    h = hashlib.sha256(base.encode()).hexdigest()
    out = []
    for u in traj.turns:
        body = json.dumps(u.model_dump(mode="json", exclude={"prompt"}), sort_keys=True)
        h = hashlib.sha256((h + body).encode()).hexdigest()
        out.append(h[:24])
    return out


# --------------------------------------------------------------------------- shared scoring


def turn_skill(traj: Trajectory, t: int) -> str | None:
    """The skill turn t called, when it is one the reward prompt has a section for."""
    c = traj.turns[t].tool_call
    name = c.get("name") if c else None
    return name if name in SKILL_SECTION else None


def verifiable_hits(prompt: RewardPrompt, h: History, t: int, semantic: bool) -> list[tuple[object, Hit]]:
    """(component, hit) for every item and temporal rule that fires on turn t. With semantic=False only the
    verifiable items and the temporal rules run (what every backend applies in code)."""
    skill = turn_skill(h.traj, t)
    general = prompt.section("general")
    sec = prompt.section_for(skill)
    items = list(general.items) + (list(sec.items) if sec.id != "general" else [])
    out = []
    for it in items:
        if semantic or it.kind == "verifiable":
            hit = CHECKS[it.check](h, t)
            if hit is not None:
                out.append((it, hit))
    for r in prompt.rules_for(skill):
        hit = CHECKS[r.check](h, t)
        if hit is not None:
            out.append((r, hit))
    return out


def _violation(comp, hit: Hit) -> Violation:
    kind = "rule" if comp.id.startswith("rule.") or not hasattr(comp, "kind") else comp.kind
    return Violation(id=comp.id, kind=kind, omission=comp.omission, penalty=comp.penalty, rationale=hit.rationale)


def rule_verdict(prompt: RewardPrompt, h: History, t: int, hits=None) -> TurnVerdict:
    """The rule-program judgment of one turn."""
    u = h.traj.turns[t]
    skill = turn_skill(h.traj, t)
    hits = verifiable_hits(prompt, h, t, semantic=True) if hits is None else hits
    sc = prompt.scoring
    label = max((c.label for c, _ in hits), key=SEVERITY.__getitem__, default="useful")
    score = sc.label_scores[label]
    notes = [hit.rationale for _, hit in hits]
    if label == "useful":
        if u.subgoals_met:
            score += sc.subgoal_bonus * len(u.subgoals_met)
            notes.append(f"completed {', '.join(u.subgoals_met)}")
        if u.error is not None:
            score += sc.informative_failure
            notes.append(f"failed ({u.error}) but revealed: {u.observation[:80]}")
        elif t > 0 and h.traj.turns[t - 1].error is not None and h.traj.turns[t - 1].tool_call != u.tool_call:
            score += sc.recovery_bonus
            notes.append(f"recovered from the failure at turn {t - 1} by other means")
        if not notes:
            learned = h.learned(t)
            notes.append(f"{call_text(u)} made progress" + (f" (learned {', '.join(learned[:3])})" if learned
                                                             else ""))
    score -= sum(c.penalty for c, _ in hits)
    evidence = sorted({i for _, hit in hits for i in hit.evidence} | {t})
    if label == "useful" and u.error is None and t > 0 and h.traj.turns[t - 1].error is not None:
        evidence = sorted(set(evidence) | {t - 1})
    return TurnVerdict(index=t, skill=skill, section=prompt.section_for(skill).id, label=label,
                       score=round(max(-1.0, min(1.0, score)), 4), rationale="; ".join(notes), evidence=evidence,
                       violations=[_violation(c, hit) for c, hit in hits], source="rule")


def episode_verdict(prompt: RewardPrompt, traj: Trajectory, turns: list[TurnVerdict]) -> EpisodeVerdict:
    steps = len(traj.turns)
    total = traj.subgoals_total or len(traj.subgoals)
    completeness = traj.subgoals_met / total if total else float(traj.success)
    reported = [g.id for g in traj.subgoals if g.kind == "reported"]
    if reported:
        met = set(traj.initial_subgoals_met) | {s for u in traj.turns for s in u.subgoals_met}
        correctness = sum(g in met for g in reported) / len(reported)
    else:
        correctness = float(traj.success)
    opt = max(traj.optimal_steps, 1)
    efficiency = min(1.0, opt / max(steps, 1)) if traj.success else 0.0
    judged = [v for v in turns if v.judge_error is None]
    if judged:
        consistency = 1.0 - sum(v.label in BAD_LABELS for v in judged) / len(judged)
    else:
        consistency = None if turns else 0.0
    w = prompt.episode.weights
    parts = {"efficiency": efficiency, "consistency": consistency, "completeness": completeness,
             "correctness": correctness}
    failed = len(judged) < len(turns)
    score = None if failed else round(sum(w[k] * parts[k] for k in w) / sum(w.values()), 4)
    return EpisodeVerdict(score=score, steps=steps, optimal_steps=traj.optimal_steps, success=traj.success,
                          **{k: None if v is None else round(v, 4) for k, v in parts.items()})


# --------------------------------------------------------------------------- backends


class RuleBackend:
    """Executes every rubric item as a predicate over the trajectory and its state history."""

    id = "rule"

    def judge(self, prompt: RewardPrompt, h: History, ts: list[int]) -> list[TurnVerdict]:
        return [rule_verdict(prompt, h, t) for t in ts]


def turn_line(traj: Trajectory, i: int, full: bool = False) -> str:
    """Turn i as one line of a judge's prompt: the call, its result and the observation (`full`: longer, with
    the thought and what the env recorded)."""
    u = traj.turns[i]
    res = "ok" if u.error is None else u.error
    line = f"[{i}] {call_text(u)} -> {res}: {u.observation[:400 if full else 160]}"
    if full:
        if u.reasoning:
            line = f"[{i}] thought: {u.reasoning[:400]}\n" + line
        if u.state is not None:
            line += f"\n    at {u.state.place}, holding {', '.join(u.state.holding) or 'nothing'}; " \
                    f"learned: {', '.join(u.state.learned[:10]) or 'nothing'}"
        if u.subgoals_met:
            line += f"\n    subgoals met: {', '.join(u.subgoals_met)}"
    return line


def ask_json(client, messages: list[dict], first, check: Callable[[str], object], max_repairs: int, stats: dict,
             seed: int = 0, max_tokens: int = 400):
    """Validate a model's JSON reply, feeding the error back at most `max_repairs` times.

    `first` is the reply to `messages` already fetched (a `ChatReply`, a `ModelError`, or None to fetch it
    here); `check(text)` returns the parsed object or an error string. Returns (object, None) or
    (None, "model_error: ..." | "invalid_reply: ..."). A transport failure is not retried here: the client
    already retried it. `stats` counts "calls" (beyond the first) and "repairs"."""
    reply, err, msgs = first, None, list(messages)
    for attempt in range(max_repairs + 1):
        if attempt > 0 or reply is None:
            if attempt > 0:
                stats["repairs"] = stats.get("repairs", 0) + 1
                stats["calls"] = stats.get("calls", 0) + 1
            try:
                reply = client.chat(msgs, temperature=0.0, seed=seed, max_tokens=max_tokens, json_mode=True)
            except ModelError as e:
                reply = e
        if isinstance(reply, Exception):
            return None, f"model_error:{getattr(reply, 'kind', 'error')}: {str(reply)[:160]}"
        checked = check(reply.text)
        if not isinstance(checked, str):
            return checked, None
        err = f"invalid_reply: {checked}"
        msgs = msgs + [{"role": "assistant", "content": reply.text[:2000]},
                       {"role": "user", "content": f"Your reply was invalid: {checked}. Reply again with only the "
                                                   "JSON object."}]
    return None, err


class LLMBackend:
    """Asks a chat model for each turn's verdict as JSON, rendered from the same prompt components."""

    def __init__(self, client, context_turns: int = 8, max_repairs: int = 2, seed: int = 0,
                 max_tokens: int = 400):
        self.client = client
        self.context_turns = context_turns
        self.max_repairs = max_repairs
        self.seed = seed
        self.max_tokens = max_tokens
        self.id = f"llm:{getattr(client, 'name', type(client).__name__)}"
        self.stats = {"calls": 0, "repairs": 0, "judge_errors": 0}

    def messages(self, prompt: RewardPrompt, h: History, t: int, hits) -> list[dict]:
        traj = h.traj
        lines = [f"Task: {traj.instruction}",
                 "Subgoals: " + "; ".join(f"{g.id} {g.description}" for g in traj.subgoals),
                 f"Initial observation: {traj.initial_observation[:300]}"]
        lo = max(0, t - self.context_turns)
        if lo < t:
            lines.append("Earlier turns:" + (f" ({lo} older turns omitted)" if lo else ""))
            lines += [turn_line(traj, i) for i in range(lo, t)]
        lines += ["", f"Judge this turn ({t}):", turn_line(traj, t, full=True)]
        if hits:
            lines.append("Verified by the environment: " + "; ".join(f"[{c.id}] {hit.rationale}" for c, hit in hits))
        lines.append("Reply with the JSON verdict.")
        return [{"role": "system", "content": prompt.render_turn_system(turn_skill(traj, t))},
                {"role": "user", "content": "\n".join(lines)}]

    def _check(self, prompt: RewardPrompt, text: str, t: int) -> TurnJudgment | str:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as e:
            return f"the reply is not valid JSON ({str(e)[:80]})"
        try:
            j = TurnJudgment.model_validate(obj)
        except ValidationError as e:
            errs = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'reply'}: {x['msg']}" for x in e.errors()[:4])
            return f"the reply does not match the schema ({errs})"
        bad = [i for i in j.evidence if not 0 <= i <= t]
        if bad:
            return f"evidence cites turns {bad} that do not exist or come after turn {t}"
        known = {c.id for c in prompt.components()}
        unknown = [v for v in j.violations if v not in known]
        if unknown:
            return f"violations name unknown components {unknown}"
        return j

    def judge(self, prompt: RewardPrompt, h: History, ts: list[int]) -> list[TurnVerdict]:
        hits = {t: verifiable_hits(prompt, h, t, semantic=False) for t in ts}
        convs = {t: self.messages(prompt, h, t, hits[t]) for t in ts}
        first = self.client.chat_many([convs[t] for t in ts], temperature=0.0, seed=self.seed,
                                      max_tokens=self.max_tokens, json_mode=True)
        out = []
        for t, reply in zip(ts, first, strict=True):
            self.stats["calls"] += 1
            verdict, err = ask_json(self.client, convs[t], reply, lambda text, t=t: self._check(prompt, text, t),
                                    self.max_repairs, self.stats, seed=self.seed, max_tokens=self.max_tokens)
            if verdict is None:
                self.stats["judge_errors"] += 1
                skill = turn_skill(h.traj, t)
                out.append(TurnVerdict(index=t, skill=skill, section=prompt.section_for(skill).id, label=None,
                                       score=None, source="llm", judge_error=err,
                                       violations=[_violation(c, hit) for c, hit in hits[t]]))
                continue
            out.append(self._combine(prompt, h, t, verdict, hits[t]))
        return out

    @staticmethod
    def _combine(prompt: RewardPrompt, h: History, t: int, j: TurnJudgment, hits) -> TurnVerdict:
        """Verified facts bound the model's opinion: the most severe label wins, a verified failure caps the
        score at its label's base score, and rule penalties still apply."""
        label, score = j.label, j.score
        for c, _ in hits:
            if SEVERITY[c.label] > SEVERITY[label]:
                label = c.label
            score = min(score, prompt.scoring.label_scores[c.label])
        score -= sum(c.penalty for c, _ in hits)
        viol = [_violation(c, hit) for c, hit in hits]
        seen = {v.id for v in viol}
        for vid in j.violations:
            if vid not in seen:
                comp = prompt.get(vid)
                viol.append(Violation(id=vid, kind="semantic", omission=getattr(comp, "omission", False),
                                      rationale="named by the judge"))
        skill = turn_skill(h.traj, t)
        evidence = sorted(set(j.evidence) | {i for _, hit in hits for i in hit.evidence} | {t})
        return TurnVerdict(index=t, skill=skill, section=prompt.section_for(skill).id, label=label,
                           score=round(max(-1.0, min(1.0, score)), 4), rationale=j.rationale, evidence=evidence,
                           violations=viol, source="llm")


# --------------------------------------------------------------------------- entry point


class RewardEngine:
    """Score trajectories: turn verdicts and an episode verdict, with provenance (prompt version, backend)."""

    def __init__(self, prompt: RewardPrompt | None = None, backend=None, cache: VerdictCache | None = None):
        self.prompt = prompt or default_prompt()
        self.backend = backend or RuleBackend()
        self.cache = cache if cache is not None else VerdictCache()

    def cache_keys(self, traj: Trajectory) -> list[str]:
        """One key per turn: (backend, hash of the components that judge it, hash of the turn and its past)."""
        p = self.prompt
        content = turn_content_hashes(traj)
        return [f"{self.backend.id}|{p.turn_components_hash(turn_skill(traj, t))}|{content[t]}"
                for t in range(len(traj.turns))]

    def uncached(self, trajs) -> int:
        """How many turn judgments scoring these trajectories would cost (the cache answers the rest)."""
        return len({k for tr in trajs for k in self.cache_keys(tr) if not self.cache.has(k)})

    def score(self, traj: Trajectory) -> TrajectoryVerdict:
        p = self.prompt
        keys = self.cache_keys(traj)
        verdicts: list[TurnVerdict | None] = [self.cache.get(k) for k in keys]
        hits = sum(v is not None for v in verdicts)
        todo = [t for t, v in enumerate(verdicts) if v is None]
        if todo:
            h = History(traj)  # only built when something must be judged
            for v in self.backend.judge(p, h, todo):
                verdicts[v.index] = v
                self.cache.put(keys[v.index], v)
            self.cache.flush()
        turns = [v for v in verdicts if v is not None]
        return TrajectoryVerdict(task_id=traj.task_id, policy=traj.policy, seed=traj.seed,
                                 difficulty=traj.difficulty, scene=traj.scene, prompt_name=p.name,
                                 prompt_version=p.version, prompt_hash=p.content_hash(), backend=self.backend.id,
                                 turns=turns, episode=episode_verdict(p, traj, turns),
                                 judge_errors=sum(v.judge_error is not None for v in turns), cache_hits=hits)

    def score_many(self, trajs, progress: Callable[[int], None] | None = None) -> list[TrajectoryVerdict]:
        out = []
        for tr in trajs:
            out.append(self.score(tr))
            if progress:
                progress(1)
        return out


def summarize(verdicts: list[TrajectoryVerdict], bad_lines: list[dict] | None = None) -> dict:
    """The judge summary: mean episode score, score per skill, label counts, judge_error count."""
    labels = {k: 0 for k in LABELS}
    per_skill: dict[str, list[float]] = {}
    errors = 0
    for v in verdicts:
        for u in v.turns:
            if u.judge_error is not None:
                errors += 1
                continue
            labels[u.label] += 1
            per_skill.setdefault(u.skill or "(malformed)", []).append(u.score)
    eps = [v.episode.score for v in verdicts if v.episode.score is not None]
    return {"trajectories": len(verdicts), "turns": sum(len(v.turns) for v in verdicts),
            "mean_episode_score": round(sum(eps) / len(eps), 4) if eps else None,
            "episodes_with_judge_errors": sum(v.judge_errors > 0 for v in verdicts),
            "score_per_skill": {k: round(sum(s) / len(s), 4) for k, s in sorted(per_skill.items())},
            "labels": labels, "judge_error": errors,
            "judge_error_share": round(errors / max(1, sum(len(v.turns) for v in verdicts)), 4),
            "success_rate": round(sum(v.episode.success for v in verdicts) / len(verdicts), 4) if verdicts else None,
            "bad_lines": len(bad_lines or []), "bad_line_errors": (bad_lines or [])[:20],
            "prompt_version": verdicts[0].prompt_version if verdicts else None,
            "prompt_hash": verdicts[0].prompt_hash if verdicts else None,
            "backend": verdicts[0].backend if verdicts else None}
