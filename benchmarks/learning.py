"""Does the tiny student learn? Distill + SFT a recipe on this machine, then measure the student.

    python benchmarks/learning.py                       # recipes/tiny.yaml, outputs under outputs/bench-learning
    python benchmarks/learning.py --skip-train          # re-measure an existing OUT/sft/final

Prints one JSON object:
- `distill_seconds`, `sft_seconds`, `distill_plus_sft_minutes` (wall time on this machine) and the SFT learning
  curve (train loss, eval loss and eval next-token accuracy by step);
- `next_action`: teacher-forced next-action exact match (skill and arguments equal to the teacher's; free-text
  arguments such as a reason are not compared) on held-out steps: `validation` (steps of the validation
  instructions of the distilled dataset) and `test` (every step of the expert's episodes on the test split:
  new layouts, instruction strings never seen in training);
- `student`, `expert` and `random`: sandbox metrics on the test split per difficulty (TSR, GCR, steps, invalid-action
  rate), the student run closed-loop in lockstep batches through the shared prompt builder and parser;
- `compositional`: the test tasks whose target (type, colour) combination was never a target in training
  (both words were), for the student and the expert;
- `acceptance`: the issue's thresholds, checked.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KEYS = ("tsr", "gcr", "mean_steps", "invalid_action_rate", "episodes")


def _table(m: dict) -> dict:
    return {d: {k: m[d][k] for k in KEYS} for d in ("easy", "medium", "hard", "all")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "tiny.yaml"))
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench-learning"))
    ap.add_argument("--skip-train", action="store_true", help="measure an existing OUT/sft/final")
    ap.add_argument("--batch", type=int, default=32, help="episodes stepped together at evaluation")
    ap.add_argument("--max-validation-steps", type=int, default=600)
    args = ap.parse_args()

    from agent.clients import TransformersClient
    from distill.dataset import step_samples
    from distill.teacher import run_teacher
    from evaluation.sandbox_eval import evaluate
    from pipeline.recipe import load_recipe
    from pipeline.stages import build_tasks, run_distill_stage, run_sft_stage
    from sandbox.metrics import split_metrics
    from sft.metrics import compositional_split, next_action_exact_match
    from sft.train import load_sft_dataset

    recipe = load_recipe(args.recipe)
    out = Path(args.out)
    report: dict = {"benchmark": "learning", "recipe": recipe.name, "machine_cores": _cores()}
    splits = build_tasks(recipe, show_progress=False)[0]
    t0 = time.time()  # distillation builds the tasks again: that is part of its time
    if not args.skip_train:
        t1 = time.time()
        dm = run_distill_stage(recipe, out / "distill", restart=True, show_progress=False)
        report["distill_seconds"] = round(time.time() - t1, 1)
        report["distill"] = {k: dm.get(k) for k in ("episodes", "kept", "rejected", "rows")}
        t1 = time.time()
        sm = run_sft_stage(recipe, out / "distill" / "dataset", out / "sft", show_progress=False)
        report["sft_seconds"] = round(time.time() - t1, 1)
        report["sft"] = {k: sm[k] for k in ("train_samples", "params", "steps", "epochs", "train_loss", "eval_loss",
                                           "train_seconds")}
        report["distill_plus_sft_minutes"] = round((time.time() - t0) / 60, 2)
        report["curve"] = sm["curve"]
    final = out / "sft" / "final"
    client = TransformersClient(final, max_new_tokens=96, batch_size=args.batch)
    t1 = time.time()
    test = splits["test"]
    # the expert as the teacher plays (ModelPolicy over the scripted expert): each turn keeps its step prompt
    expert_trajs = run_teacher(test, "expert", out / "test_expert", recipe_seed=recipe.eval.seed, restart=True,
                               show_progress=False).trajectories
    m_exp = split_metrics(expert_trajs)
    m_rnd, _ = evaluate(test, "random", seed=recipe.eval.seed)
    m_stu, trajs = evaluate(test, str(final), seed=recipe.eval.seed, batch_size=args.batch)
    report["student"], report["expert"], report["random"] = _table(m_stu), _table(m_exp), _table(m_rnd)
    report["easy_gcr_vs_expert"] = round(m_stu["easy"]["gcr"] / max(m_exp["easy"]["gcr"], 1e-9), 4)
    comp_ids = {t.id for t in compositional_split(splits["train"], test)}
    if comp_ids:
        report["compositional"] = {
            "student": _table(split_metrics([tr for tr in trajs if tr.task_id in comp_ids]))["all"],
            "expert": _table(split_metrics([tr for tr in expert_trajs if tr.task_id in comp_ids]))["all"]}
    else:
        report["compositional"] = {"episodes": 0}
    report["eval_seconds"] = round(time.time() - t1, 1)
    (out / "learning_partial.json").write_text(json.dumps(report, indent=2))  # kept should a later part fail
    # teacher forcing on held-out steps: the validation instructions, and the expert's own test episodes
    val = load_sft_dataset(out / "distill" / "dataset", "step")["validation"]
    val_rows = [r for r in val if r["messages"][-1].get("tool_calls")][: args.max_validation_steps]
    test_rows = [{"messages": msgs} for tr in expert_trajs for _, msgs in step_samples(tr)]
    report["next_action"] = {"validation": next_action_exact_match(client, val_rows, batch_size=args.batch),
                             "test": next_action_exact_match(client, test_rows, batch_size=args.batch)}
    report["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    report["acceptance"] = {
        "easy_tsr_ge_0.6": m_stu["easy"]["tsr"] >= 0.6,
        "easy_gcr_ge_0.8_of_expert": report["easy_gcr_vs_expert"] >= 0.8,
        "distill_plus_sft_le_20_min": (report["distill_plus_sft_minutes"] <= 20) if not args.skip_train else None}
    print(json.dumps(report, indent=2))


def _cores() -> int:
    import os
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
