"""Instruction granularity (goal / step / visual) and the deadlock hint, side by side, on one environment.

    python benchmarks/instructions.py --env sandbox --recipe recipes/medium.yaml --student outputs/medium/rl/gigpo/final
    python benchmarks/instructions.py --env babyai --levels GoToLocal,GoTo --episodes 50 --student DIR
    python benchmarks/instructions.py --env textworld --recipe recipes/textworld.yaml --student DIR --hint

For each policy (expert, random, the student) and each granularity (`agent.instructions`), one evaluation of the
same episodes: the sandbox's and TextWorld's test split of the recipe (`pipeline.stages.run_eval`), or `--episodes`
seeds of each BabyAI level from top-down frames (`evaluation.babyai.evaluate_babyai`). Each row: success (TSR /
games won) with a Wilson 95% interval, and the deadlock breakdown (aware / unaware / recovered, the share of
failed episodes with each, phi of deadlock with failure). `--hint` adds, for the goal granularity, the same
evaluation with the deadlock hint (`--deadlock-hint`; sandbox and TextWorld), so recovery with and without it sit
side by side. The scripted expert and random policies act on the env's state, not on a task line: their rows are
measured anyway and show the granularity changes nothing for them. Prints one JSON object; `--out` keeps each
evaluation's folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEADLOCK_KEYS = ("deadlocks", "aware", "unaware", "recovered", "recovery_rate", "episodes_with_deadlock",
                 "failed_with_aware", "failed_with_unaware", "phi_deadlock_failure")


def row(policy: str, granularity: str, hint: bool, n: int, successes: int, deadlocks: dict, seconds: float) -> dict:
    from evaluation.pixel_report import wilson
    lo, hi = wilson(successes, n)
    return {"policy": policy, "instructions": granularity, "hint": hint, "episodes": n,
            "success": round(successes / n, 4) if n else None, "wilson95": [round(lo, 4), round(hi, 4)],
            "deadlocks": {k: deadlocks.get(k) for k in DEADLOCK_KEYS}, "seconds": round(seconds, 1)}


def run_recipe(recipe_path: str, tasks: Path, policy: str, granularity: str, hint: bool, out: Path) -> dict:
    """One evaluation of the recipe's test split (the sandbox, or TextWorld with `env: textworld`), its tasks
    read from `tasks` (`pipeline.stages.write_build`, once per benchmark run)."""
    from pipeline.recipe import load_recipe
    from pipeline.stages import run_eval
    recipe = load_recipe(recipe_path)
    t0 = time.time()
    m = run_eval(recipe, policy, "test", out, tasks, show_progress=False, deadlock_hint=hint,
                 instructions=granularity)
    if recipe.env == "textworld":
        n, k = m["games"], round(m["all"]["won_rate"] * m["games"])
    else:
        n, k = m["all"]["episodes"], round(m["all"]["tsr"] * m["all"]["episodes"])
    return row(policy, granularity, hint, n, k, m["deadlocks"], time.time() - t0)


def run_babyai(levels: list[str], policy: str, granularity: str, episodes: int, seed: int, constrained: bool,
               out: Path) -> dict:
    """Every level's `episodes` seeds, pooled into one row (and each level's success kept beside it)."""
    from agent.metrics import Deadlock, deadlock_report
    from evaluation.babyai import evaluate_babyai
    t0 = time.time()
    n = k = 0
    per_level, pooled = {}, []
    for level in levels:
        m = evaluate_babyai(level, policy, episodes, out / level, seed=seed, bot=False, strips=0,
                            constrained=constrained and policy not in ("expert", "random"), instructions=granularity)
        n, k = n + m["episodes"], k + m["successes"]
        per_level[level] = round(m["success_rate"], 4)
        rows = [json.loads(line) for line in (out / level / "episodes.jsonl").read_text().splitlines()]
        pooled += [([Deadlock(**d) for d in r["deadlocks"]], r["success"]) for r in rows]
    return {**row(policy, granularity, False, n, k, deadlock_report(pooled), time.time() - t0), "levels": per_level}


def main() -> None:
    from tqdm import tqdm

    from agent.instructions import GRANULARITIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", required=True, choices=("sandbox", "babyai", "textworld"))
    ap.add_argument("--recipe", default=None, help="sandbox / textworld: the recipe whose test split is played "
                                                   "(default recipes/medium.yaml / recipes/textworld.yaml)")
    ap.add_argument("--student", default=None, help="a model folder (the main job's student)")
    ap.add_argument("--policies", default="expert,random,student")
    ap.add_argument("--instructions", default=",".join(GRANULARITIES))
    ap.add_argument("--hint", action="store_true", help="also the goal granularity with the deadlock hint")
    ap.add_argument("--levels", default="GoToLocal,GoTo,Pickup,Open", help="babyai: levels")
    ap.add_argument("--episodes", type=int, default=50, help="babyai: episodes per level")
    ap.add_argument("--seed", type=int, default=1000, help="babyai: the first seed")
    ap.add_argument("--constrained", action="store_true", help="babyai: the student decodes only well-formed "
                                                               "calls (the recipes' eval.constrained)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    grans = a.instructions.split(",")
    for g in grans:
        if g not in GRANULARITIES:
            ap.error(f"--instructions: {g!r} is not one of {', '.join(GRANULARITIES)}")
    if a.hint and a.env == "babyai":
        ap.error("--hint: the deadlock hint runs in the sandbox and TextWorld")
    policies = []
    for p in a.policies.split(","):
        if p == "student":
            if a.student is None:
                ap.error("--policies has student: give --student DIR")
            if not (Path(a.student) / "config.json").is_file():
                ap.error(f"--student {a.student}: no config.json there")
            policies.append(a.student)
        elif p in ("expert", "random"):
            policies.append(p)
        else:
            ap.error(f"--policies: {p!r} is not expert, random or student")
    recipe = a.recipe or str(ROOT / "recipes" / ("textworld.yaml" if a.env == "textworld" else "medium.yaml"))
    out = Path(a.out or tempfile.mkdtemp(prefix=f"instructions_{a.env}_"))
    runs = [(p, g, False) for p in policies for g in grans] + ([(p, "goal", True) for p in policies] if a.hint else [])
    res = {"benchmark": "instructions", "env": a.env, "recipe": recipe if a.env != "babyai" else None,
           "levels": a.levels.split(",") if a.env == "babyai" else None, "student": a.student, "rows": []}
    t0 = time.time()
    if a.env != "babyai":
        from pipeline.recipe import load_recipe
        from pipeline.stages import write_build
        write_build(load_recipe(recipe), out / "tasks", show_progress=False)
    for p, g, hint in tqdm(runs, desc=f"{a.env} evaluations", unit="eval", file=sys.stderr):
        name = "student" if p == a.student else p
        folder = out / f"{name}-{g}{'-hint' if hint else ''}"
        if a.env == "babyai":
            r = run_babyai(a.levels.split(","), p, g, a.episodes, a.seed, a.constrained, folder)
        else:
            r = run_recipe(recipe, out / "tasks", p, g, hint, folder)
        res["rows"].append({**r, "policy": name})
        print(json.dumps(res["rows"][-1]), file=sys.stderr)
    res["wall_s"] = round(time.time() - t0, 1)
    res["out"] = str(out)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
