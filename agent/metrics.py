"""Episode metrics for any policy on a split: TSR, GCR, steps, ratio to optimal, invalid actions, help, loops."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field

from agent.trajectory import Trajectory
from sandbox.schema import INVALID_CODES
from sandbox.skills import HELP_SKILLS



def has_loop(t: Trajectory, repeats: int = 3) -> bool:
    """The same state seen `repeats` times with no subgoal met in between (a loop or deadlock)."""
    counts: Counter = Counter()
    for turn in t.turns:
        if turn.subgoals_met:
            counts.clear()
        counts[turn.state_key] += 1
        if counts[turn.state_key] >= repeats:
            return True
    return False


def episode_metrics(t: Trajectory) -> dict:
    steps = len(t.turns)
    invalid = sum(1 for x in t.turns if x.error in INVALID_CODES)
    helps = sum(1 for x in t.turns if x.tool_call and x.tool_call.get("name") in HELP_SKILLS)
    return {"success": t.success, "gcr": t.subgoals_met / t.subgoals_total if t.subgoals_total else 0.0,
            "steps": steps, "invalid": invalid, "help": helps, "loop": has_loop(t),
            "ratio": steps / t.optimal_steps if t.success and t.optimal_steps else None}


def aggregate(trajs: list[Trajectory]) -> dict:
    if not trajs:
        return {"episodes": 0, "tsr": 0.0, "gcr": 0.0, "mean_steps": 0.0, "invalid_action_rate": 0.0,
                "ratio_to_optimal": None, "help_requests": 0.0, "loop_rate": 0.0}
    ms = [episode_metrics(t) for t in trajs]
    n = len(ms)
    total_steps = sum(m["steps"] for m in ms)
    ratios = [m["ratio"] for m in ms if m["ratio"] is not None]
    return {"episodes": n,
            "tsr": round(sum(m["success"] for m in ms) / n, 4),
            "gcr": round(sum(m["gcr"] for m in ms) / n, 4),
            "mean_steps": round(total_steps / n, 3),
            "invalid_action_rate": round(sum(m["invalid"] for m in ms) / total_steps, 4) if total_steps else 0.0,
            "ratio_to_optimal": round(sum(ratios) / len(ratios), 4) if ratios else None,
            "help_requests": round(sum(m["help"] for m in ms) / n, 3),
            "loop_rate": round(sum(m["loop"] for m in ms) / n, 4)}


def split_metrics(trajs: list[Trajectory]) -> dict:
    """Metrics per difficulty (the sandbox's easy, medium and hard; another env's own groups, such as TextWorld's
    game families, when its episodes have them) and over `all`."""
    levels = ("easy", "medium", "hard")
    others = sorted({t.difficulty for t in trajs} - set(levels))
    keys = [d for d in levels if not others or any(t.difficulty == d for t in trajs)] + others
    out = {d: aggregate([t for t in trajs if t.difficulty == d]) for d in keys}
    out["all"] = aggregate(trajs)
    return out


# ----------------------------------------------------------------------------- deadlocks (PokeGym's taxonomy)

DEADLOCK_K = 3   # skill calls with no change of place, holdings or world state (has_loop's count of repeats)
# a thought that says the agent knows it is stuck (PokeGym's "aware")
STUCK_WORDS = re.compile(r"\b(stuck|no progress|not working|nothing (?:has )?changed|(?:did|does) not work|"
                         r"didn't work|doesn't work|failed|fails|cannot|can't|could not|couldn't|unable|blocked|"
                         r"try (?:something|another|a different))\b", re.I)


@dataclass(frozen=True)
class Decision:
    """One decision of an episode as the deadlock classifier reads it: the state after it (place, holdings and
    world state; a key), the call (None: unreadable), the thought, and whether it made progress (a subgoal or
    score point, or success)."""

    state: str
    call: dict | None
    thought: str = ""
    progress: bool = False


@dataclass(frozen=True)
class Deadlock:
    start: int                  # the window's first decision (index into the episode's decisions)
    length: int                 # decisions in a row after which the state had not changed
    aware: bool
    signals: tuple[str, ...] = field(default=())   # why aware: help, reported_failure, switched, thought
    recovered: bool = False     # progress came after it


def find_deadlocks(start_state: str, decisions: list[Decision], k: int = DEADLOCK_K) -> list[Deadlock]:
    """The deadlocks of one episode: maximal runs of at least `k` decisions none of which changed the state
    (place, holdings, world). A deadlock is *aware* when within it the agent asks for help, reports failure (a
    `finish` whose words say so), switches skill or target (more than one distinct call), or its thought says it
    is stuck; *unaware* otherwise (the same call again and again, no word of it). It is *recovered* when progress
    follows it. (PokeGym: deadlock recovery, not planning, is the bottleneck; Unaware vs Aware deadlocks.)"""
    if k < 1:
        raise ValueError(f"deadlock window k must be >= 1, not {k}")
    out, prev, i = [], start_state, 0
    while i < len(decisions):
        if decisions[i].state != prev:
            prev, i = decisions[i].state, i + 1
            continue
        j = i
        while j < len(decisions) and decisions[j].state == prev:
            j += 1
        if j - i >= k:
            window = decisions[i:j]
            signals = set()
            for d in window:
                name = (d.call or {}).get("name")
                if name in HELP_SKILLS:
                    signals.add("help")
                if name == "finish" and STUCK_WORDS.search(" ".join(map(str, (d.call or {}).get("arguments",
                                                                                             {}).values()))):
                    signals.add("reported_failure")
                if d.thought and STUCK_WORDS.search(d.thought):
                    signals.add("thought")
            if len({json.dumps(d.call, sort_keys=True) for d in window}) > 1:
                signals.add("switched")
            out.append(Deadlock(start=i, length=j - i, aware=bool(signals), signals=tuple(sorted(signals)),
                                recovered=any(d.progress for d in decisions[j:])))
        i = j
    return out


def trajectory_deadlocks(t: Trajectory, k: int = DEADLOCK_K) -> list[Deadlock]:
    """`find_deadlocks` on a sandbox or TextWorld trajectory (its turns' state keys, calls and thoughts; progress:
    a subgoal met, or the last turn of a won episode)."""
    last = len(t.turns) - 1
    return find_deadlocks(t.initial_state_key, [
        Decision(u.state_key, u.tool_call, u.reasoning, bool(u.subgoals_met) or (t.success and i == last))
        for i, u in enumerate(t.turns)], k)


def deadlock_report(episodes: list[tuple[list[Deadlock], bool]]) -> dict:
    """Per evaluation: `episodes` is (deadlocks, success) per episode. Counts (aware / unaware / recovered), the
    share of failed episodes with an aware and with an unaware deadlock, the recovery rate, and the correlation
    of having a deadlock with failing (phi, Pearson's r on the two 0/1 variables, with its p-value; None when
    either is constant)."""
    locks = [d for ds, _ in episodes for d in ds]
    failed = [ds for ds, ok in episodes if not ok]
    has = [float(bool(ds)) for ds, _ in episodes]
    fail = [float(not ok) for _, ok in episodes]
    phi = p = None
    if len(set(has)) > 1 and len(set(fail)) > 1:
        from scipy.stats import pearsonr
        r = pearsonr(has, fail)
        phi, p = round(float(r.statistic), 4), round(float(r.pvalue), 4)
    n_failed = len(failed)
    return {"episodes": len(episodes), "deadlocks": len(locks),
            "aware": sum(d.aware for d in locks), "unaware": sum(not d.aware for d in locks),
            "recovered": sum(d.recovered for d in locks),
            "recovery_rate": round(sum(d.recovered for d in locks) / len(locks), 4) if locks else None,
            "episodes_with_deadlock": int(sum(has)),
            "failed_episodes": n_failed,
            "failed_with_aware": round(sum(any(d.aware for d in ds) for ds in failed) / n_failed, 4)
            if n_failed else None,
            "failed_with_unaware": round(sum(any(not d.aware for d in ds) for ds in failed) / n_failed, 4)
            if n_failed else None,
            "phi_deadlock_failure": phi, "phi_p_value": p,
            "signals": dict(Counter(s for d in locks for s in d.signals))}


def trajectories_deadlock_report(trajs: list[Trajectory], k: int = DEADLOCK_K) -> dict:
    """`deadlock_report` over sandbox or TextWorld trajectories, with the window `k` it used."""
    return {"k": k, **deadlock_report([(trajectory_deadlocks(t, k), t.success) for t in trajs])}
