"""The judge filter: the reward engine scores every teacher trajectory and only coherent ones are kept.

The judge (`pipeline.stages.make_reward_engine`: the rule program by default, an LLM through a client) labels
each turn and scores the episode on task completion, obstacle handling, loop avoidance, tool feasibility and
consistency with the embodiment's constraints. A trajectory is kept iff

* it succeeded (`not_successful` otherwise),
* the judge failed on none of its turns (`judge_error`),
* its episode score is at least `min_episode_score` (`low_score`),
* the share of turns labelled inconsistent, unsafe or malformed is at most `max_bad_turn_share`
  (`inconsistent_turns`),
* the share of turns labelled redundant (loops, blind retries, repeats) is at most `max_loop_share` (`loops`).

A rejected trajectory counts once under its first failing reason (in the order above) in `rejected_reasons`,
and under every failing reason in `reasons_all`.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from pydantic import BaseModel, ConfigDict

from agent.trajectory import Trajectory
from reward_engine.judge import BAD_LABELS, TrajectoryVerdict

REASONS = ("not_successful", "judge_error", "low_score", "inconsistent_turns", "loops")
DIFFICULTIES = ("easy", "medium", "hard")

# Which of the five criteria a rubric component checks (components the reward loop adds later count as
# "other" until they are named here).
CRITERIA: dict[str, tuple[str, ...]] = {
    "task_completion": ("rule.finish_after_subgoals", "reporting.unasked"),
    "obstacle_handling": ("general.uninformative_failure", "navigation.known_blocked", "manipulation.known_locked",
                          "rule.help_after_obstacle"),
    "loop_avoidance": ("general.blind_retry", "general.no_effect", "general.loop", "search.repeat",
                       "dialogue.repeat_question", "navigation.already_there"),
    "tool_feasibility": ("general.unreadable", "general.invalid_tool", "general.bad_arguments", "general.after_end",
                         "general.unknown_entity"),
    "embodiment_constraints": ("general.known_constraint", "rule.report_after_observe"),
}
_CRITERION_OF = {cid: name for name, ids in CRITERIA.items() for cid in ids}


class FilterThresholds(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_episode_score: float
    max_bad_turn_share: float
    max_loop_share: float


class Decision(BaseModel):
    """Why a trajectory was kept or rejected (one line of `decisions` in metrics, and the dataset's filter)."""

    model_config = ConfigDict(extra="forbid")

    task_id: str
    difficulty: str
    kept: bool
    reasons: list[str]
    episode_score: float | None     # None: a turn verdict failed (then also "judge_error")
    bad_turn_share: float
    loop_share: float


def decide(traj: Trajectory, verdict: TrajectoryVerdict, th: FilterThresholds) -> Decision:
    if verdict.task_id != traj.task_id:
        raise ValueError(f"the verdict is for task {verdict.task_id!r}, not {traj.task_id!r}")
    judged = [v for v in verdict.turns if v.judge_error is None]
    n = len(judged)
    bad = sum(v.label in BAD_LABELS for v in judged) / n if n else 0.0
    loops = sum(v.label == "redundant" for v in judged) / n if n else 0.0
    reasons = []
    if not traj.success:
        reasons.append("not_successful")
    if verdict.judge_errors:
        reasons.append("judge_error")
    if verdict.episode.score is not None and verdict.episode.score < th.min_episode_score:
        reasons.append("low_score")
    if bad > th.max_bad_turn_share:
        reasons.append("inconsistent_turns")
    if loops > th.max_loop_share:
        reasons.append("loops")
    return Decision(task_id=traj.task_id, difficulty=traj.difficulty, kept=not reasons, reasons=reasons,
                    episode_score=verdict.episode.score, bad_turn_share=round(bad, 4), loop_share=round(loops, 4))


def judge_and_filter(trajs: list[Trajectory], engine, th: FilterThresholds,
                     progress: Callable[[int], None] | None = None
                     ) -> tuple[list[TrajectoryVerdict], list[Decision]]:
    """Score every trajectory with the reward engine and decide which to keep (order kept)."""
    verdicts, decisions = [], []
    for traj in trajs:
        v = engine.score(traj)
        verdicts.append(v)
        decisions.append(decide(traj, v, th))
        if progress:
            progress(1)
    return verdicts, decisions


def filter_stats(decisions: list[Decision], verdicts: list[TrajectoryVerdict], th: FilterThresholds) -> dict:
    """Kept and rejected counts (overall and per difficulty), reasons, and what the judge found per criterion."""
    primary = Counter(d.reasons[0] for d in decisions if not d.kept)
    every = Counter(r for d in decisions for r in d.reasons)
    by_diff = {}
    for diff in DIFFICULTIES:
        ds = [d for d in decisions if d.difficulty == diff]
        by_diff[diff] = {"episodes": len(ds), "kept": sum(d.kept for d in ds), "rejected": sum(not d.kept for d in ds),
                         "rejected_reasons": dict(sorted(Counter(d.reasons[0] for d in ds if not d.kept).items()))}
    criteria = {name: {"turns": 0, "trajectories": 0} for name in (*CRITERIA, "other")}
    labels = Counter()
    for v in verdicts:
        hit = set()
        for u in v.turns:
            if u.label is not None:
                labels[u.label] += 1
            for viol in u.violations:
                name = _CRITERION_OF.get(viol.id, "other")
                criteria[name]["turns"] += 1
                hit.add(name)
        for name in hit:
            criteria[name]["trajectories"] += 1
    unsuccessful = sum("not_successful" in d.reasons for d in decisions)
    criteria["task_completion"]["trajectories_not_successful"] = unsuccessful
    kept_scores = [d.episode_score for d in decisions if d.kept]
    return {"episodes": len(decisions), "kept": sum(d.kept for d in decisions),
            "rejected": sum(not d.kept for d in decisions),
            "rejected_reasons": {r: primary.get(r, 0) for r in REASONS},
            "reasons_all": {r: every.get(r, 0) for r in REASONS},
            "by_difficulty": by_diff, "thresholds": th.model_dump(),
            "turn_labels": dict(sorted(labels.items())), "criteria": criteria,
            "judge_errors": sum(v.judge_errors for v in verdicts),
            "kept_mean_episode_score": round(sum(kept_scores) / len(kept_scores), 4) if kept_scores else None}
