"""Pixel evaluation on BabyAI, side by side: the perception-only expert, the random policy and a sandbox-trained
student on the same levels and seeds, from RGB frames only (`evaluation.babyai`). Prints one JSON object.

    python benchmarks/babyai_eval.py --student outputs/tiny/sft/final --episodes 50

The acceptance levels for the expert are GoTo, Pickup and Open (at least 95% success); the student's figures are
reported beside the random policy's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEYS = ("success_rate", "success_wilson95", "mean_steps", "step_ratio_to_bot", "invalid_action_rate", "deadlocks",
        "perception_accuracy", "pose_accuracy", "skill_calls", "wall_s")


def main() -> None:
    from evaluation.babyai import LevelError, evaluate_babyai, level_id

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="GoToObj,GoToLocal,GoTo,Open,Pickup,PutNextLocal,Unlock,GoToSeq,Synth")
    ap.add_argument("--policies", default="expert,random,student")
    ap.add_argument("--student", default="outputs/tiny/sft/final", help="a model folder (save_pretrained)")
    ap.add_argument("--episodes", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1000, help="first seed (episodes use seed .. seed+episodes-1)")
    ap.add_argument("--views", default="topdown,topdown-fov,egocentric")
    ap.add_argument("--out", default=None, help="folder for each run's metrics, report and strips")
    ap.add_argument("--no-bot", action="store_true", help="skip BabyAI's bot reference")
    ap.add_argument("--constrained", action="store_true",
                    help="the student's decoding writes only well-formed calls over ids its prompt shows")
    a = ap.parse_args()
    levels = a.levels.split(",")
    for lv in levels:   # a short name or any registered BabyAI id
        try:
            level_id(lv)
        except LevelError as e:
            ap.error(str(e))
    policies = a.policies.split(",")
    if "student" in policies and not (Path(a.student) / "config.json").is_file():
        ap.error(f"--student {a.student}: not a model folder (train one: embodistill sft recipes/tiny.yaml)")
    out = Path(a.out or tempfile.mkdtemp(prefix="babyai_eval_"))
    res: dict = {"episodes": a.episodes, "seed": a.seed, "student": a.student if "student" in policies else None,
                 "constrained": a.constrained,
                 "results": {}}
    t0 = time.time()
    for view in a.views.split(","):
        for lv in levels:
            for pol in policies:
                path = a.student if pol == "student" else pol
                m = evaluate_babyai(lv, path, a.episodes, out / view / lv / pol, seed=a.seed, view=view,
                                    bot=not a.no_bot and pol == "expert", constrained=a.constrained)
                res["results"].setdefault(view, {}).setdefault(lv, {})[pol] = {k: m[k] for k in KEYS}
                print(f"{view} {lv} {pol}: {m['success_rate']:.3f}", file=sys.stderr, flush=True)
    res["wall_s"] = round(time.time() - t0, 1)
    res["out"] = str(out)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
