"""Does the tiny student learn? Distill + SFT a recipe on this machine, then measure the student.

    python benchmarks/learning.py                       # recipes/tiny.yaml, outputs under outputs/bench-learning
    python benchmarks/learning.py --skip-train          # re-measure an existing OUT/sft/final
    python benchmarks/learning.py --stage onpolicy      # recipes/medium.yaml: SFT vs on-policy distillation, 3 seeds
    python benchmarks/learning.py --stage rl            # recipes/medium.yaml: SFT student vs GiGPO vs GRPO

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

With `--stage onpolicy` (default recipe `recipes/medium.yaml`): the distillation (cached under OUT), then for each
seed SFT of the recipe's student with that seed (OUT/sft-seedS, `--bf16` overrides `sft.bf16`) and the recipe's
on-policy rounds from it with the same seed (OUT/onpolicy-seedS; finished parts are reused, `--jobs` runs seeds in
parallel processes). Prints per seed and round the test TSR (per difficulty, `seen` and `compositional`), the
agreement with the teacher, the student's success on the round's own tasks, the expert's takeover success, rows
added and the seconds of each part; then per block the mean and standard error over seeds for the SFT student
(round 0) and the last round's student, the paired gain, and with `--constrained` both students' TSR under
constrained decoding.

With `--stage rl` (default recipe `recipes/medium.yaml`; when `rl.init` is `onpolicy`, RL starts from the on-policy
student, made under OUT/onpolicy): the upstream stages (cached under OUT), then for each
seed a GiGPO run and a GRPO run from the same SFT checkpoint with the same rollout budget (same iterations,
tasks and group size; only the advantage differs), and prints the test TSR/GCR of the SFT student and of each
final policy per seed and averaged, the gains, how far apart the seeds are (`seed_spread`: per-seed gains and the
standard error of their mean; GiGPO minus GRPO paired by seed), the wall time of the main job's parts (distill +
SFT + one GiGPO run) and the peak memory of this process. Where the test TSR comes from: `test_tsr_by_combination`
(`compositional`: the test tasks whose targets were never targets in training, as in the SFT stage; `seen`: the
others) and, with `rl.eval_pool_tasks`, `rl_pool_tsr` (the same greedy play on a fixed sample of the RL pool, the
distribution RL practises on).
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
    ap.add_argument("--stage", choices=("sft", "onpolicy", "rl"), default="sft")
    ap.add_argument("--recipe", default=None, help="default recipes/tiny.yaml (sft), recipes/medium.yaml (rl)")
    ap.add_argument("--out", default=None, help="default outputs/bench-learning[-rl]")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                    help="RL seeds (--stage rl); SFT and on-policy seeds (--stage onpolicy)")
    ap.add_argument("--iterations", type=int, default=None, help="override rl.iterations (--stage rl)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once (--stage rl, onpolicy), each in its own process with cores // jobs threads")
    ap.add_argument("--skip-train", action="store_true", help="measure an existing OUT/sft/final")
    ap.add_argument("--batch", type=int, default=32, help="episodes stepped together at evaluation")
    ap.add_argument("--max-validation-steps", type=int, default=600)
    ap.add_argument("--bf16", choices=("auto", "true", "false"), default=None,
                    help="--stage onpolicy: override sft.bf16 (SFT and the on-policy rounds)")
    ap.add_argument("--student", nargs="+", default=None, metavar="FIELD=VALUE",
                    help="--stage onpolicy: override sft.student fields, e.g. hidden_size=256 num_layers=6 "
                         "intermediate_size=768 (the student-size table; use its own --out)")
    ap.add_argument("--constrained", action="store_true",
                    help="--stage onpolicy: also evaluate the SFT and the last student with constrained decoding")
    args = ap.parse_args()
    if args.stage == "rl":
        return rl_stage(args)
    if args.stage == "onpolicy":
        return onpolicy_stage(args)
    args.recipe = args.recipe or str(ROOT / "recipes" / "tiny.yaml")
    args.out = args.out or str(ROOT / "outputs" / "bench-learning")

    from agent.clients import TransformersClient
    from distill.dataset import step_samples
    from distill.teacher import run_teacher
    from evaluation.sandbox_eval import evaluate
    from pipeline.recipe import load_recipe
    from pipeline.stages import build_tasks, run_distill_stage, run_sft_stage
    from agent.metrics import split_metrics
    from sandbox.builder import compositional_split
    from sft.metrics import next_action_exact_match
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
    # the expert as the teacher plays (answering as a model would): each turn keeps its step prompt
    expert_trajs = run_teacher(test, "expert", out / "test_expert", recipe_seed=recipe.eval.seed, restart=True,
                               show_progress=False).trajectories
    m_exp = split_metrics(expert_trajs)
    m_rnd, _ = evaluate(test, "random", seed=recipe.eval.seed)
    m_stu, trajs = evaluate(test, str(final), seed=recipe.eval.seed, batch_size=args.batch)
    report["student"], report["expert"], report["random"] = _table(m_stu), _table(m_exp), _table(m_rnd)
    report["easy_gcr_vs_expert"] = round(m_stu["easy"]["gcr"] / max(m_exp["easy"]["gcr"], 1e-9), 4)
    # the same student with decoding constrained to well-formed calls over ids its prompt shows (the recipe's
    # `eval.constrained` says which of the two `embodistill eval` runs)
    t2 = time.time()
    m_con, trajs_con = evaluate(test, str(final), seed=recipe.eval.seed, batch_size=args.batch, constrained=True)
    report["student_constrained"] = _table(m_con)
    report["easy_gcr_vs_expert_constrained"] = round(m_con["easy"]["gcr"] / max(m_exp["easy"]["gcr"], 1e-9), 4)
    report["constrained_eval_seconds"] = round(time.time() - t2, 1)
    comp_ids = {t.id for t in compositional_split(splits["train"], test)}
    if comp_ids:
        report["compositional"] = {
            "student": _table(split_metrics([tr for tr in trajs if tr.task_id in comp_ids]))["all"],
            "student_constrained": _table(split_metrics([tr for tr in trajs_con if tr.task_id in comp_ids]))["all"],
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
        "constrained_easy_tsr_ge_0.6": m_con["easy"]["tsr"] >= 0.6,
        "constrained_easy_gcr_ge_0.8_of_expert": report["easy_gcr_vs_expert_constrained"] >= 0.8,
        "distill_plus_sft_le_20_min": (report["distill_plus_sft_minutes"] <= 20) if not args.skip_train else None}
    print(json.dumps(report, indent=2))


def _rss_mb() -> dict:
    return {"self": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "children": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)}


def rl_stage(args) -> None:
    """SFT student vs GiGPO vs GRPO on the test split, over seeds, at equal rollout budget."""
    from pipeline.recipe import load_recipe
    from pipeline.stages import run_distill_stage, run_sft_stage

    recipe = load_recipe(args.recipe or ROOT / "recipes" / "medium.yaml")
    out = Path(args.out or ROOT / "outputs" / "bench-learning-rl")
    report: dict = {"benchmark": "learning", "stage": "rl", "recipe": recipe.name, "machine_cores": _cores(),
                    "cpu": _cpu(), "seeds": args.seeds, "rl_init_stage": recipe.rl.init}
    t0 = time.time()
    dataset = out / "distill" / "dataset"
    cached = []
    if not (dataset / "README.md").is_file():
        run_distill_stage(recipe, out / "distill", show_progress=False)
    else:
        cached.append("distill")
    report["distill_seconds"] = round(time.time() - t0, 1)
    t1 = time.time()
    init = out / "sft" / "final"
    if not (init / "config.json").is_file():
        run_sft_stage(recipe, dataset, out / "sft", show_progress=False)
    else:
        cached.append("sft")
    report["sft_seconds"] = round(time.time() - t1, 1)
    if recipe.rl.init == "onpolicy":   # RL starts from the on-policy distilled student, as in the main job
        from pipeline.stages import run_onpolicy_stage
        t1 = time.time()
        if (out / "onpolicy" / "manifest.json").is_file() and (out / "onpolicy" / "final" / "config.json").is_file():
            cached.append("onpolicy")
        else:
            run_onpolicy_stage(recipe, dataset, init, out / "onpolicy", show_progress=False)
        init = out / "onpolicy" / "final"
        report["onpolicy_seconds"] = round(time.time() - t1, 1)
    report["rl_init"] = str(init)
    # every run's start is evaluated (once: runs from one checkpoint share the cached evaluation)
    recipe = _override(recipe, "rl", eval_start=True)
    report["cached_stages"] = cached
    runs: dict[str, list[dict]] = {"gigpo": [], "grpo": []}
    plan = [(seed, alg) for seed in args.seeds for alg in ("gigpo", "grpo")]
    for seed, alg in plan:
        if (out / "rl" / f"{alg}-seed{seed}" / "checkpoints").is_dir():
            cached.append(f"{alg}-seed{seed} (resumed)")
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    jobs = min(args.jobs, len(plan))
    if jobs > 1 and recipe.rl.threads is None:  # share the cores: each run's trainer would take them all
        threads = max(1, _cores() // jobs)
        recipe = _override(recipe, "rl", threads=threads)
    report["jobs"], report["torch_threads_per_run"] = jobs, recipe.rl.threads or _cores()
    call = [(recipe, out / "rl" / f"{alg}-seed{seed}", init, alg, seed, args.iterations) for seed, alg in plan]
    if jobs == 1:
        results = map(_rl_run, call)
    else:  # runs are independent processes (spawned: no torch state is forked); results come back in plan order
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
        results = pool.map(_rl_run, call)
    for (_seed, alg), res in zip(plan, results, strict=True):
        runs[alg].append(res)
        print(json.dumps({alg: res}), file=sys.stderr, flush=True)
        (out / "learning_rl_partial.json").write_text(json.dumps({**report, "runs": runs}, indent=2))
    if jobs > 1:
        pool.shutdown()
    report["runs"] = runs

    def mean(alg: str, when: str, key: str = "tsr", diff: str = "all") -> float:
        vals = [r[when][diff][key] for r in runs[alg] if r[when] and diff in r[when]]
        return round(sum(vals) / len(vals), 4) if vals else float("nan")

    # "start": the RL runs' common starting student (rl.init: the SFT or the on-policy distilled student)
    start_tsr = mean("gigpo", "initial")
    report["test_tsr"] = {"start": start_tsr, "gigpo": mean("gigpo", "final"), "grpo": mean("grpo", "final")}
    report["test_gcr"] = {"start": mean("gigpo", "initial", "gcr"), "gigpo": mean("gigpo", "final", "gcr"),
                          "grpo": mean("grpo", "final", "gcr")}
    report["test_tsr_by_difficulty"] = {
        alg: {d: mean(alg, "final", "tsr", d) for d in ("easy", "medium", "hard")} for alg in ("gigpo", "grpo")}
    report["test_tsr_by_difficulty"]["start"] = {d: mean("gigpo", "initial", "tsr", d)
                                               for d in ("easy", "medium", "hard")}
    # where the test TSR comes from: the compositional test tasks and the others (`seen`); and the same
    # greedy play on a fixed sample of the RL pool (the tasks' distribution RL practises on)
    first_eval = runs["gigpo"][0]["initial"] if runs["gigpo"] and runs["gigpo"][0]["initial"] else {}
    groups = [g for g in ("seen", "compositional") if g in first_eval]
    if groups:
        report["test_tsr_by_combination"] = {
            "episodes": {g: first_eval[g]["episodes"] for g in groups},
            "start": {g: mean("gigpo", "initial", "tsr", g) for g in groups},
            **{alg: {g: mean(alg, "final", "tsr", g) for g in groups} for alg in ("gigpo", "grpo")}}
    if "pool" in first_eval:
        report["rl_pool_tsr"] = {"episodes": first_eval["pool"]["episodes"],
                                 "start": mean("gigpo", "initial", "tsr", "pool"),
                                 **{alg: mean(alg, "final", "tsr", "pool") for alg in ("gigpo", "grpo")}}
    gain = round(100 * (report["test_tsr"]["gigpo"] - start_tsr), 1)
    over = round(100 * (report["test_tsr"]["gigpo"] - report["test_tsr"]["grpo"]), 1)
    report["gigpo_gain_over_start_points"], report["gigpo_over_grpo_points"] = gain, over
    # how far apart the seeds are: per-seed points and the standard error of their mean (n - 1 in the variance);
    # GiGPO and GRPO runs of one seed are paired (same SFT start, same tasks per iteration)
    final = {alg: {r["seed"]: r["final"]["all"]["tsr"] for r in runs[alg] if r["final"]} for alg in runs}
    paired = sorted(set(final["gigpo"]) & set(final["grpo"]))
    report["seed_spread"] = {
        "gigpo_gain_over_start_points": spread([100 * (t - start_tsr) for t in final["gigpo"].values()]),
        "grpo_gain_over_start_points": spread([100 * (t - start_tsr) for t in final["grpo"].values()]),
        "gigpo_over_grpo_points_paired": spread([100 * (final["gigpo"][s] - final["grpo"][s]) for s in paired])}
    # the main job's parts, when this invocation ran them all (nothing cached or resumed)
    first = runs["gigpo"][0]["seconds"] if runs["gigpo"] else 0.0
    # (not with --jobs > 1: a run sharing the cores with others does not time the main job)
    report["main_job_minutes"] = None if cached or jobs > 1 else \
        round((report["distill_seconds"] + report["sft_seconds"] + report.get("onpolicy_seconds", 0) + first) / 60, 2)
    report["peak_rss_mb"] = _rss_mb()
    paired_mean = report["seed_spread"]["gigpo_over_grpo_points_paired"]["mean"]
    report["acceptance"] = {"gigpo_over_grpo_ge_3_points_paired": paired_mean is not None and paired_mean >= 3,
                            "stretch_gigpo_tsr_ge_0.92": report["test_tsr"]["gigpo"] >= 0.92,
                            "main_job_le_45_min": None if report["main_job_minutes"] is None
                            else report["main_job_minutes"] <= 45,
                            "peak_memory_le_6_gb": max(report["peak_rss_mb"].values()) <= 6144,
                            "seeds_ge_3": len(args.seeds) >= 3}
    print(json.dumps(report, indent=2))


def onpolicy_stage(args) -> None:
    """SFT student vs the same student after on-policy distillation, per seed (the SFT seed and the on-policy
    seed are the same), on the recipe's test split."""
    from pipeline.recipe import load_recipe
    from pipeline.stages import run_distill_stage

    recipe = load_recipe(args.recipe or ROOT / "recipes" / "medium.yaml")
    if args.bf16 is not None:
        recipe = _override(recipe, "sft", bf16={"auto": "auto", "true": True, "false": False}[args.bf16])
    if args.student:
        recipe = _override(recipe, "sft", student={**recipe.sft.student.model_dump(), **_fields(args.student)})
    # the SFT-only baseline is round 0: each seed's SFT student evaluated on the same test split
    recipe = _override(recipe, "onpolicy", eval_init=True)
    out = Path(args.out or ROOT / "outputs" / "bench-learning-onpolicy")
    report: dict = {"benchmark": "learning", "stage": "onpolicy", "recipe": recipe.name, "machine_cores": _cores(),
                    "cpu": _cpu(), "seeds": args.seeds, "sft_bf16": recipe.sft.bf16,
                    "student": recipe.sft.student.model_dump(mode="json"),
                    "onpolicy": recipe.onpolicy.model_dump(mode="json")}
    dataset = out / "distill" / "dataset"
    if not (out / "distill" / "manifest.json").is_file():
        t0 = time.time()
        run_distill_stage(recipe, out / "distill", show_progress=False)
        report["distill_seconds"] = round(time.time() - t0, 1)
    jobs = max(1, min(args.jobs, len(args.seeds)))
    threads = max(1, _cores() // jobs)
    call = [(recipe, dataset, out, seed, threads, args.constrained) for seed in args.seeds]
    if jobs == 1:
        results = list(map(_onpolicy_chain, call))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_onpolicy_chain, call))
    report["jobs"], report["torch_threads_per_run"] = jobs, threads
    report["runs"] = results
    blocks = ("easy", "medium", "hard", "all", "seen", "compositional")

    def tsr(run: dict, when: int, block: str):
        return run["rounds"][when]["test"].get(block, {}).get("tsr")

    first, last = 0, -1
    report["test_episodes"] = {b: results[0]["rounds"][0]["test"][b]["episodes"] for b in blocks
                               if b in results[0]["rounds"][0]["test"]}
    report["test_tsr"] = {
        "sft": {b: spread([100 * tsr(r, first, b) for r in results if tsr(r, first, b) is not None])
                for b in blocks},
        "onpolicy": {b: spread([100 * tsr(r, last, b) for r in results if tsr(r, last, b) is not None])
                     for b in blocks}}
    report["gain_points_paired"] = spread([100 * (tsr(r, last, "all") - tsr(r, first, "all")) for r in results])
    report["acceptance"] = {"onpolicy_tsr_ge_0.85": report["test_tsr"]["onpolicy"]["all"]["mean"] is not None and
                            report["test_tsr"]["onpolicy"]["all"]["mean"] >= 85,
                            "seeds_ge_3": len(args.seeds) >= 3,
                            "test_episodes_ge_300": report["test_episodes"].get("all", 0) >= 300}
    report["peak_rss_mb"] = _rss_mb()
    print(json.dumps(report, indent=2))


def _onpolicy_chain(job: tuple) -> dict:
    """SFT with one seed, then the recipe's on-policy rounds from that student with the same seed (each part
    reused when its folder holds a finished run)."""
    import torch
    from pipeline.stages import run_onpolicy_stage
    from sft.train import run_sft
    recipe, dataset, out, seed, threads, constrained = job
    torch.set_num_threads(threads)
    sft_dir = out / f"sft-seed{seed}"
    _same_sft_section(sft_dir, recipe.sft.model_dump(mode="json"))
    t0 = time.time()
    if not ((sft_dir / "manifest.json").is_file() and (sft_dir / "final" / "config.json").is_file()):
        run_sft(recipe.sft, dataset, sft_dir, seed=seed, show_progress=False, config=recipe.distill.sample_format)
    sft_s = time.time() - t0
    sft_m = json.loads((sft_dir / "metrics.json").read_text())
    t1 = time.time()
    m = run_onpolicy_stage(recipe, dataset, sft_dir / "final", out / f"onpolicy-seed{seed}", seed=seed,
                           show_progress=False)
    res = {"seed": seed, "student_params": sft_m.get("params"), "sft_seconds": round(sft_s, 1),
           "sft_bf16": sft_m.get("bf16"),
           "sft_train_seconds": sft_m.get("train_seconds"), "onpolicy_seconds": round(time.time() - t1, 1),
           "rounds": [{"round": r["round"], "test": r["test"],
                       **({"agreement": r["collect"]["agreement"], "student_tsr_on_its_tasks":
                           r["collect"]["student_tsr"], "takeover": {k: v for k, v in r["collect"]["takeover"].items()
                                                                     if k != "lost_when_solvable"},
                           "rows_added": sum(r["collect"]["rows"].values()), "seconds": r["seconds"],
                           "collect_seconds": r["collect"]["seconds"], "train_seconds": r["train_seconds"],
                           "eval_seconds": r["eval_seconds"]} if r["round"] > 0 else
                          {"eval_seconds": r.get("eval_seconds")})} for r in m["rounds"]]}
    if constrained:
        from evaluation.sandbox_eval import evaluate
        from pipeline.stages import build_tasks
        test = build_tasks(recipe, show_progress=False)[0]["test"]
        res["constrained_tsr"] = {}
        for name, folder in (("sft", sft_dir / "final"), ("onpolicy", Path(m["final"]))):
            cm, _ = evaluate(test, str(folder), seed=recipe.eval.seed, batch_size=32, constrained=True)
            res["constrained_tsr"][name] = {d: cm[d]["tsr"] for d in ("easy", "medium", "hard", "all") if d in cm}
    return res


def _same_sft_section(sft_dir: Path, section: dict) -> None:
    """Refuse to reuse (or resume) an SFT folder trained with another `sft` section (another student size or
    precision under the same --out): its student would be reported as this one."""
    manifest = sft_dir / "manifest.json"
    if not manifest.is_file():
        return
    old = json.loads(manifest.read_text()).get("config", {})
    diff = sorted(k for k in set(old) | set(section) if old.get(k) != section.get(k))
    if diff:
        raise SystemExit(f"{manifest}: trained with another sft section (fields {', '.join(diff)} differ); "
                         "give this variant its own --out")


def _cpu() -> str:
    """The CPU model and whether it computes bf16 natively (what decides SFT's speed and precision here)."""
    name = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    kind = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else \
        "AVX2 only" if "avx2" in flags else "?"
    return f"{name} ({kind})"


def _rl_run(job: tuple) -> dict:
    """One RL run of the benchmark (resumed when its folder holds checkpoints); a top-level function, so that
    --jobs can run it in a child process."""
    from pipeline.stages import make_rl_trainer
    recipe, run_dir, init, alg, seed, iterations = job
    t1 = time.time()
    s = make_rl_trainer(recipe, run_dir, init, algorithm=alg, seed=seed, iterations=iterations, resume=True,
                        show_progress=False).train()
    return {"seed": seed, "seconds": round(time.time() - t1, 1), "rollout_episodes": s["rollout_episodes"],
            "initial": _tsr_gcr(s["initial_eval"]), "final": _tsr_gcr(s["final_eval"]),
            "train_success_first": s["train_success_first"], "train_success_last": s["train_success_last"],
            "peak_rss_mb": s["peak_rss_mb"]}


def _override(recipe, section: str, **values):
    """The recipe with some fields of one section replaced, validated as the recipe file's would be."""
    old = getattr(recipe, section)
    return recipe.model_copy(update={section: type(old).model_validate({**old.model_dump(), **values})})


def _fields(pairs: list[str]) -> dict:
    """`FIELD=VALUE` words as a dict, each value read as JSON where it parses (256, true) and as text otherwise."""
    out = {}
    for pair in pairs:
        field, sep, value = pair.partition("=")
        if not sep or not field:
            raise SystemExit(f"--student {pair!r}: expected FIELD=VALUE, e.g. hidden_size=256")
        try:
            out[field] = json.loads(value)
        except json.JSONDecodeError:
            out[field] = value
    return out


def spread(points: list[float]) -> dict:
    """Per-seed values, their mean and the standard error of the mean (None with fewer than two seeds)."""
    import statistics
    n = len(points)
    return {"per_seed": [round(p, 1) for p in points], "mean": round(statistics.fmean(points), 1) if n else None,
            "stderr": round(statistics.stdev(points) / n ** 0.5, 1) if n > 1 else None}


def _tsr_gcr(ev: dict | None) -> dict | None:
    """TSR and GCR of each block of an evaluation row (difficulties, all, and seen / compositional / pool when the
    run has them)."""
    if not ev:
        return None
    from rl.trainer import EVAL_GROUPS
    return {d: {"tsr": ev[d]["tsr"], "gcr": ev[d]["gcr"], "episodes": ev[d]["episodes"]}
            for d in EVAL_GROUPS if d in ev}


def _cores() -> int:
    import os
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
