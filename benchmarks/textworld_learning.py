"""Does the tiny student learn TextWorld? The main job on `recipes/textworld.yaml` once per training seed, then
every stage's student on the recipe's test games.

    python benchmarks/textworld_learning.py                          # seeds 0 1 2, three at a time
    python benchmarks/textworld_learning.py --seeds 0 --jobs 1       # one seed
    python benchmarks/textworld_learning.py --eval-only              # re-measure the students already trained

For each seed S it writes OUT/recipes/NAME-seedS.yaml (the recipe with `name: NAME-seedS` and `seed: S`: the same
games, since the games have their own seed, `textworld.seed`) and runs the main job on it
(`rl/train_gigpo.py RECIPE --quiet`, its log in OUT/NAME-seedS.log; a finished stage is reused, so a killed run is
resumed by running this again). Up to `--jobs` seeds train side by side, each on `--threads` threads. Then it
evaluates the SFT student, the on-policy student and the GiGPO student of each seed on the recipe's test games
(`pipeline.stages.run_eval`, the recipe's `eval.constrained` decoding; OUT/eval/seedS-STAGE) and prints one JSON
object: per seed and stage the games won (with a Wilson 95% interval), by game family, the score ratio and the
invalid-call rate; per stage the mean won rate over seeds with its standard error; the paired gains SFT ->
on-policy -> GiGPO; and each seed's main-job wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = {"sft": "sft/final", "onpolicy": "onpolicy/final", "gigpo": "rl/gigpo/final"}


def seed_recipe(base: Path, seed: int, out: Path, threads: int) -> Path:
    """The recipe at `base` with its own name and training seed (the games are the same), training on `threads`
    threads (`sft.threads`, `rl.threads`: seeds side by side must not each take every core)."""
    data = yaml.safe_load(base.read_text())
    data["name"], data["seed"] = f"{data['name']}-seed{seed}", seed
    data.setdefault("sft", {})["threads"] = threads
    data.setdefault("rl", {})["threads"] = threads
    path = out / "recipes" / f"{data['name']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def train(recipe: Path, log: Path, threads: int) -> dict:
    """The main job on `recipe` in its own process; its wall time and exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    t0 = time.time()
    with log.open("a") as f:
        rc = subprocess.run([sys.executable, str(ROOT / "rl" / "train_gigpo.py"), str(recipe), "--quiet"],
                            cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    return {"recipe": str(recipe), "rc": rc, "minutes": round((time.time() - t0) / 60, 1), "log": str(log)}


def evaluate(recipe_path: Path, model: Path, out: Path) -> dict | None:
    """The student at `model` on the recipe's test games (reused only when done for this very model file, recipe
    and decoding rules)."""
    from pipeline.recipe import load_recipe
    from pipeline.stages import recipe_hash, run_eval
    weights = model / "model.safetensors"
    if not (model / "config.json").is_file() or not weights.is_file():
        return None
    from agent.constrained import RULES
    recipe = load_recipe(recipe_path)
    key = {"model": str(model), "mtime_ns": weights.stat().st_mtime_ns, "recipe": recipe_hash(recipe),
           "decoding": RULES if recipe.eval.constrained else "free"}
    done, key_file = out / "metrics.json", out / "benchmark_key.json"
    if done.is_file() and key_file.is_file() and json.loads(key_file.read_text()) == key:
        return json.loads(done.read_text())
    key_file.unlink(missing_ok=True)
    m = run_eval(recipe, str(model), "test", out, show_progress=False)
    key_file.write_text(json.dumps(key))
    return m


def row(m: dict) -> dict:
    a = m["all"]
    return {"won": a["won"], "games": a["games"], "won_rate": a["won_rate"], "won_wilson95": a["won_wilson95"],
            "score_ratio": a["score_ratio"], "invalid_call_rate": a["invalid_call_rate"],
            "by_family": {k: v["won_rate"] for k, v in m["by_type"].items()}}


def main() -> None:
    from learning import spread   # benchmarks/learning.py: per-seed values, their mean and standard error
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/textworld.yaml")
    ap.add_argument("--out", default="outputs/textworld-learning")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=3, help="seeds trained side by side")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per seed")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the students already trained")
    args = ap.parse_args()
    out = ROOT / args.out
    recipes = {s: seed_recipe(ROOT / args.recipe, s, out, args.threads) for s in args.seeds}
    runs = {}
    if not args.eval_only:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {s: pool.submit(train, r, out / f"{r.stem}.log", args.threads) for s, r in recipes.items()}
            runs = {s: f.result() for s, f in futures.items()}
        failed = {s: r for s, r in runs.items() if r["rc"] != 0}
        if failed:
            logs = ", ".join(r["log"] for r in failed.values())
            sys.exit(f"error: the main job failed for seeds {sorted(failed)}; see {logs}")
    from pipeline.recipe import load_recipe
    per_seed: dict[int, dict] = {}
    for s, r in recipes.items():
        folder = ROOT / "outputs" / load_recipe(r).name
        per_seed[s] = {}
        for stage, rel in STAGES.items():
            m = evaluate(r, folder / rel, out / "eval" / f"seed{s}-{stage}")
            if m is not None:
                per_seed[s][stage] = row(m)
    stages = [st for st in STAGES if all(st in per_seed[s] for s in per_seed)]
    summary = {st: spread([100 * per_seed[s][st]["won_rate"] for s in per_seed]) for st in stages}
    gains = {f"{a}->{b}": spread([100 * (per_seed[s][b]["won_rate"] - per_seed[s][a]["won_rate"]) for s in per_seed])
             for a, b in zip(stages, stages[1:], strict=False)}
    print(json.dumps({"recipe": args.recipe, "seeds": args.seeds, "test_games": next(
        (per_seed[s][st]["games"] for s in per_seed for st in per_seed[s]), None),
        "constrained_decoding": load_recipe(ROOT / args.recipe).eval.constrained,
        "won_rate_points": summary, "paired_gain_points": gains, "per_seed": per_seed, "main_job": runs}, indent=1))


if __name__ == "__main__":
    main()
