"""The perception-only expert on every BabyAI level MiniGrid registers, from RGB frames (`evaluation.babyai`).

    python benchmarks/babyai_levels.py                              # every BabyAI-* id, 10 episodes each
    python benchmarks/babyai_levels.py --episodes 30 --levels BabyAI-UnlockLocal-v0,BabyAI-OpenDoor-v0
    python benchmarks/babyai_levels.py --prefix MiniGrid-           # MiniGrid's own ids

For each level: the expert's episodes (seeds SEED .. SEED+EPISODES-1, top-down frames, no bot reference), its
success with a Wilson 95% interval, mean steps, deadlocks and how its failed episodes ended (with the first failed
episode's last skill errors, to say why); or, for a level whose missions or cells the skills cannot express,
`refused` with the reason (`evaluation.babyai.check_level`). Prints one JSON object; `--out` keeps each level's
metrics.json, episodes.jsonl and report.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def why(out: Path) -> dict:
    """How the failed episodes of a finished level ended, and the last skill errors of the first one."""
    rows = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    failed = [r for r in rows if not r["success"]]
    errors = [f"{(e['call'] or {}).get('name', '?') if isinstance(e['call'], dict) else '?'}: {e['error']}: "
              f"{(e['observation'] or '')[:160]}" for e in failed[0]["events"] if not e["ok"]][-2:] if failed else []
    return {"failed_ends": dict(Counter(r["end"] for r in failed)),
            "first_failure": {"seed": failed[0]["seed"], "mission": failed[0]["mission"],
                              "last_errors": errors} if failed else None}


def main() -> None:
    from tqdm import tqdm

    from evaluation.babyai import LevelError, evaluate_babyai, level_id, registered_levels

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default=None, help="comma-separated ids or short names (default: every registered "
                                                   "id with --prefix)")
    ap.add_argument("--prefix", default="BabyAI-", help="which registered ids (BabyAI- or MiniGrid-)")
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1000, help="first seed")
    ap.add_argument("--out", default=None, help="folder for each level's metrics, episodes and report")
    a = ap.parse_args()
    levels = a.levels.split(",") if a.levels else registered_levels(a.prefix)
    for lv in levels:
        try:
            level_id(lv)
        except LevelError as e:
            ap.error(str(e))
    out = Path(a.out or tempfile.mkdtemp(prefix="babyai_levels_"))
    res: dict = {"benchmark": "babyai_levels", "policy": "expert", "view": "topdown", "episodes": a.episodes,
                 "seed": a.seed, "levels": {}}
    t0 = time.time()
    for lv in tqdm(levels, desc="levels", unit="level", file=sys.stderr):
        try:
            m = evaluate_babyai(lv, "expert", a.episodes, out / lv, seed=a.seed, bot=False, strips=0)
        except LevelError as e:
            res["levels"][lv] = {"refused": str(e)}
            continue
        res["levels"][lv] = {"success_rate": round(m["success_rate"], 4), "success_wilson95": m["success_wilson95"],
                             "mean_steps": round(m["mean_steps"], 1), "deadlocks": m["deadlocks"],
                             "invalid_action_rate": round(m["invalid_action_rate"], 4), "wall_s": m["wall_s"],
                             **(why(out / lv) if m["success_rate"] < 1 else {})}
    done = [v for v in res["levels"].values() if "refused" not in v]
    res["summary"] = {"levels": len(levels), "refused": len(levels) - len(done),
                      "expert_ge_0.95": sum(v["success_rate"] >= 0.95 for v in done),
                      "mean_success_of_run_levels": round(sum(v["success_rate"] for v in done) / len(done), 4)
                      if done else None}
    res["wall_s"] = round(time.time() - t0, 1)
    res["out"] = str(out)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
