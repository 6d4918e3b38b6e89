"""Episode metrics for any policy on a split: TSR, GCR, steps, ratio to optimal, invalid actions, help, loops."""

from __future__ import annotations

from collections import Counter

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
