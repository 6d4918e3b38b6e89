"""Self-evolving reward engine, measured on oracle labels from the sandbox (prints JSON).

    python benchmarks/reward_evolution.py [--recipe recipes/ci.yaml] [--tasks N] [--out DIR]

1. Oracle label set: the recipe's tasks played by the expert, the noisy expert and the random policy; every
   turn labelled from the sandbox's ground truth (`reward_engine.oracle`; these are not human labels).
   Split by task into validation (the loop's) and held-out (never read by the loop).
2. Meta-Judge: planted bad verdicts (flipped sign, missed omission, evidence citing a turn that does not
   exist, wrong rubric applied) among the embedded prompt's verdicts: recall per kind and false alarms on
   clean verdicts.
3. Evolution from the draft prompt (`reward_engine.prompt.draft_prompt`) and from the embedded default: the
   starting and final prompt's held-out agreement and kappa, every accepted edit's validation delta (none may
   be negative), edits tried, accepted and rolled back, judge calls spent, and the calls the verdict cache
   saved (the same loop with every candidate judged on the whole validation set).
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

from pipeline.recipe import load_recipe  # noqa: E402
from pipeline.stages import build_tasks  # noqa: E402
from reward_engine.audit import bootstrap_kappa  # noqa: E402
from reward_engine.evolve import Judging, LabelledSet, evolve, select_final, split_by_task  # noqa: E402
from reward_engine.judge import RewardEngine  # noqa: E402
from reward_engine.meta_judge import MetaJudge, measure, planted_cases  # noqa: E402
from reward_engine.oracle import build_oracle_set  # noqa: E402
from reward_engine.prompt import default_prompt, draft_prompt  # noqa: E402


def run_loop(name, start, val, held, out: Path) -> dict:
    judging = Judging()
    t0 = time.perf_counter()
    res = evolve(start, val, out / name, judging=judging)
    loop_s = time.perf_counter() - t0
    loop_calls = judging.calls
    final, held_scores = select_final(res, out / name / "prompts", held, judging)
    sel_calls = judging.calls - loop_calls
    first, last = held_scores[0], next(h for h in held_scores if h["prompt_hash"] == final.content_hash())
    tried = len(res.log)
    accepted = [r for r in res.log if r["accepted"]]
    deltas = [r["deltas"]["agreement"] for r in accepted]
    # without the cache every evaluation (the start and each tried candidate) re-judges every validation turn
    uncached = (1 + sum("deltas" in r for r in res.log)) * sum(len(t.turns) for t in val.trajs)
    ev_first = judging.evaluate(start, held)
    ev_final = judging.evaluate(final, held)
    return {
        "start_prompt": name,
        "held_out": {
            "start": {"agreement": first["agreement"], "kappa": first["kappa"],
                      "kappa_ci": list(bootstrap_kappa([lb.label for lb in held.labels],
                                                       [ev_first.pred[lb.case_id] or "-" for lb in held.labels]))},
            "final": {"prompt_version": final.version, "prompt_hash": final.content_hash(),
                      "agreement": last["agreement"], "kappa": last["kappa"],
                      "kappa_ci": list(bootstrap_kappa([lb.label for lb in held.labels],
                                                       [ev_final.pred[lb.case_id] or "-" for lb in held.labels]))},
            "per_version": [{"version": h["prompt_version"], "agreement": h["agreement"], "kappa": h["kappa"]}
                            for h in held_scores]},
        "validation": {"start": {k: res.start[k] for k in ("agreement", "kappa", "meta_quality")},
                       "final": {k: res.versions[-1][k] for k in ("agreement", "kappa", "meta_quality")}},
        "edits": {"tried": tried, "accepted": len(accepted), "rolled_back": tried - len(accepted),
                  "accepted_validation_deltas": deltas,
                  "any_accepted_edit_lowered_validation_agreement": any(d < 0 for d in deltas),
                  "accepted_edits": [f"{r['edit']['op']} {r['edit']['target']}"
                               + (f" ({r['edit']['component'].get('check')} -> {r['edit']['component'].get('label')})"
                                  if r["edit"].get("component") else "") for r in accepted]},
        "stopped": res.stopped,
        "judge_calls": {"loop": loop_calls, "held_out_selection": sel_calls,
                        "loop_without_cache": uncached,
                        "cache_saving": round(uncached / loop_calls, 2) if loop_calls else None},
        "loop_seconds": round(loop_s, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "ci.yaml"))
    ap.add_argument("--tasks", type=int, default=None, help="first N tasks (default: all of the recipe)")
    ap.add_argument("--held-out", type=float, default=0.4)
    ap.add_argument("--out", default=None, help="keep the runs' prompts and edit logs here")
    args = ap.parse_args()
    recipe = load_recipe(Path(args.recipe))
    splits, _ = build_tasks(recipe, show_progress=False)
    tasks = splits["train"] + splits["test"]
    tasks = tasks[:args.tasks] if args.tasks else tasks
    t0 = time.perf_counter()
    trajs, labels = build_oracle_set(tasks, seed=recipe.seed)
    oracle_s = time.perf_counter() - t0
    data = LabelledSet(trajs, labels)
    val, held = split_by_task(data, args.held_out)

    prompt = default_prompt()
    eng = RewardEngine(prompt)
    verdicts = [eng.score(t) for t in trajs]
    cases = planted_cases(prompt, trajs, verdicts, per_kind=200, clean=1000)
    meta = measure(MetaJudge(), prompt, trajs, cases)

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="reward-evolution-"))
    counts: dict[str, int] = {}
    for lb in labels:
        counts[lb.label] = counts.get(lb.label, 0) + 1
    result = {
        "labels": {"source": "oracle (sandbox ground truth; not human labels)", "recipe": recipe.name,
                   "tasks": len(tasks), "trajectories": len(trajs), "turns": len(labels),
                   "validation_turns": len(val.labels), "held_out_turns": len(held.labels),
                   "label_counts": dict(sorted(counts.items())), "seconds": round(oracle_s, 2)},
        "meta_judge": {"backend": "rule", "verdicts_from": f"embedded prompt v{prompt.version}", **meta},
        "evolution": [run_loop("draft", draft_prompt(), val, held, out),
                      run_loop("default", default_prompt(), val, held, out)],
        "out": str(out),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
