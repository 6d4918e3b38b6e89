"""Cost of the rule-program reward engine per turn (what RL pays for dense rewards), cold and warm cache.

    python benchmarks/judge_speed.py            # ci recipe, expert + random trajectories, 5 rounds
    python benchmarks/judge_speed.py --rounds 3

Trajectories are made once (untimed) by the expert and the random policy on the ci recipe's train split.
Each round judges all of them with a fresh cache (cold: every turn is judged) and then again with that
cache (warm: every turn is a cache hit). Medians over rounds; one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evaluation.sandbox_eval import evaluate  # noqa: E402
from pipeline.recipe import load_recipe  # noqa: E402
from pipeline.stages import build_tasks  # noqa: E402
from reward_engine.judge import RewardEngine, VerdictCache, summarize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "ci.yaml"))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tasks = build_tasks(load_recipe(args.recipe), show_progress=False)[0]["train"]
    trajs = evaluate(tasks, "expert")[1] + evaluate(tasks, "random")[1]
    n_turns = sum(len(t.turns) for t in trajs)
    cold, warm = [], []
    for _ in range(args.rounds):
        cache = VerdictCache()
        t0 = time.perf_counter()
        verdicts = [RewardEngine(cache=cache).score(t) for t in trajs]
        cold.append(n_turns / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        [RewardEngine(cache=cache).score(t) for t in trajs]
        warm.append(n_turns / (time.perf_counter() - t0))
    s_exp = summarize(verdicts[: len(tasks)])
    s_rnd = summarize(verdicts[len(tasks):])
    print(json.dumps({
        "benchmark": "judge_speed", "python": platform.python_version(), "rounds": args.rounds,
        "trajectories": len(trajs), "turns": n_turns,
        "rule_judge_turns_per_s_cold": round(statistics.median(cold)),
        "rule_judge_turns_per_s_warm_cache": round(statistics.median(warm)),
        "mean_episode_score": {"expert": s_exp["mean_episode_score"], "random": s_rnd["mean_episode_score"]},
        "labels": {"expert": s_exp["labels"], "random": s_rnd["labels"]},
    }, indent=2))


if __name__ == "__main__":
    main()
