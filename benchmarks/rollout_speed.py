"""Where an RL iteration's and an on-policy round's time goes, and how much of raw `generate` throughput the
rollout loop keeps.

    python benchmarks/rollout_speed.py                                  # the main job's student and recipe
    python benchmarks/rollout_speed.py --model outputs/medium/sft/final --iterations 3 --tasks 64

Prints one JSON object:
- `rl_iteration`: for --iterations GiGPO iterations of the recipe (`GiGPOTrainer.iteration`, no evaluations), the
  median seconds and share of an iteration spent generating, stepping the envs, judging and updating;
- `onpolicy_round`: one round of on-policy play and labelling on --tasks tasks (`distill.onpolicy.collect`):
  seconds and shares of the student's generation, the teacher's labels and the env steps; and the training of a
  round (`sft.train.run_sft` from the student on the aggregate, --train-steps steps, scaled to the recipe's round
  size by its rows, batch and epochs);
- `throughput`: generated tokens per second of the rollout loop (an RL rollout batch, wall time of the whole loop:
  prompts, generation, decoding, parsing, env steps) against raw batched `generate` calls over the very same
  prompts (the same batches, as the loop formed them); `loop_share_of_raw` is the ratio (goal >= 0.70).

The three parts run one after the other on the same machine; each ratio comes from one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "medium.yaml"))
    ap.add_argument("--model", default=None, help="default: outputs/<recipe>/onpolicy/final, else sft/final")
    ap.add_argument("--iterations", type=int, default=3, help="RL iterations timed")
    ap.add_argument("--tasks", type=int, default=64, help="tasks of the timed on-policy round")
    ap.add_argument("--train-steps", type=int, default=20, help="SFT steps timed for a round's training")
    args = ap.parse_args()

    import torch
    from pipeline.recipe import load_recipe
    recipe = load_recipe(args.recipe)
    base = ROOT / "outputs" / recipe.name
    model = Path(args.model) if args.model else next(
        (p for p in (base / "onpolicy" / "final", base / "sft" / "final") if (p / "config.json").is_file()), None)
    if model is None:
        raise SystemExit(f"no student: pass --model, or run the main job first ({base}/sft/final is missing)")
    report = {"benchmark": "rollout_speed", "recipe": recipe.name, "model": str(model),
              "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        report["rl_iteration"], batch_prompts = rl_iteration(recipe, model, Path(tmp), args.iterations)
        report["throughput"] = throughput(model, batch_prompts, recipe.rl.max_new_tokens)
        report["onpolicy_round"] = onpolicy_round(recipe, model, Path(tmp), args.tasks, args.train_steps)
    report["acceptance"] = {"loop_keeps_ge_70pct_of_raw": report["throughput"]["loop_share_of_raw"] >= 0.70}
    print(json.dumps(report, indent=2))


def _shares(parts: dict[str, float]) -> dict:
    total = sum(parts.values())
    return {k: {"seconds": round(v, 2), "share": round(v / total, 4) if total else None} for k, v in parts.items()}


def rl_iteration(recipe, model: Path, out: Path, iterations: int):
    """GiGPO iterations (rollout -> rewards -> advantages -> update) without evaluations; the last iteration's
    rollout batch prompts (per loop round) for the throughput comparison."""
    from pipeline.stages import make_rl_trainer
    from rl.rollout import collect_rollouts
    trainer = make_rl_trainer(recipe, out / "rl", model, iterations=iterations, show_progress=False)
    trainer.setup()
    rows = []
    for it in range(iterations):
        m = trainer.iteration(it)
        rows.append(m)
    trainer.bar.close()
    keys = {"generate": "generate_s", "env": "env_s", "judge": "judge_s", "update": "update_s"}
    med = {k: statistics.median(r[v] for r in rows) for k, v in keys.items()}
    whole = statistics.median(r["iteration_s"] for r in rows)
    med["other"] = max(0.0, whole - sum(med.values()))
    # one more rollout batch, timed as a whole loop, for the throughput comparison
    cfg = trainer.cfg
    tasks = trainer.tasks_for(iterations)
    t0 = time.perf_counter()
    batch = collect_rollouts(trainer.engine, tasks, cfg.group_size, seed=12345, temperature=cfg.temperature,
                             max_new_tokens=cfg.max_new_tokens, memory_size=cfg.memory_size, max_steps=cfg.max_steps)
    wall = time.perf_counter() - t0
    rounds: dict[int, list[list[int]]] = {}
    for s in batch.samples:
        rounds.setdefault(s.step, []).append(s.prompt_ids)
    return ({"iterations": iterations, "median_iteration_seconds": round(whole, 2), "parts": _shares(med),
             "episodes_per_iteration": cfg.tasks_per_iteration * cfg.group_size},
            {"rounds": [rounds[k] for k in sorted(rounds)], "loop_seconds": wall,
             "loop_tokens": batch.generated_tokens, "engine": trainer.engine, "temperature": cfg.temperature})


def throughput(model: Path, loop: dict, max_new_tokens: int) -> dict:
    """Raw `generate` over the loop's own prompt batches (sampling, the same settings), tokens per second."""
    engine = loop["engine"]
    tokens, t0 = 0, time.perf_counter()
    for i, prompts in enumerate(loop["rounds"]):
        for ids, _ in engine.generate(prompts, temperature=loop["temperature"], max_new_tokens=max_new_tokens,
                                      seed=777 + i):
            tokens += len(ids)
    raw = time.perf_counter() - t0
    loop_tps = loop["loop_tokens"] / loop["loop_seconds"]
    raw_tps = tokens / raw
    return {"loop_tokens": loop["loop_tokens"], "loop_seconds": round(loop["loop_seconds"], 2),
            "loop_tokens_per_s": round(loop_tps, 1), "raw_tokens": tokens, "raw_seconds": round(raw, 2),
            "raw_tokens_per_s": round(raw_tps, 1), "loop_share_of_raw": round(loop_tps / raw_tps, 4),
            "generate_calls": len(loop["rounds"])}


def onpolicy_round(recipe, model: Path, out: Path, n_tasks: int, train_steps: int) -> dict:
    """One round of play and labelling on `n_tasks` tasks, with the student's generation timed apart from the
    teacher's labels; and the seconds per training step on the aggregate, scaled to the recipe's round."""
    from agent.clients import TransformersClient
    from agent.policies import ChatPolicy
    from distill.onpolicy import collect, make_labeller, round_tasks
    from pipeline.stages import build_tasks
    from sandbox.gym_env import SandboxEnv
    from sft.train import run_sft

    cfg = recipe.onpolicy
    tasks = round_tasks(build_tasks(recipe, show_progress=False)[0]["train"], n_tasks, recipe.seed, 1)
    client = TransformersClient(model, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                batch_size=cfg.batch_size)
    timed = {"student": 0.0}
    chat_many = client.chat_many

    def timed_chat_many(*a, **k):
        t = time.perf_counter()
        try:
            return chat_many(*a, **k)
        finally:
            timed["student"] += time.perf_counter() - t
    client.chat_many = timed_chat_many
    t0 = time.perf_counter()
    got = collect(SandboxEnv, ChatPolicy(client), make_labeller(cfg.teacher), tasks, recipe.seed, 1,
                  batch_size=cfg.batch_size)
    wall = time.perf_counter() - t0
    teacher = got.played.policy_seconds - timed["student"]
    parts = {"student_generation": timed["student"], "teacher_labels": teacher, "env": got.played.env_seconds}
    parts["other"] = max(0.0, wall - sum(parts.values()))
    # training: seconds per step on this round's rows beside the teacher's, from the student
    dataset = ROOT / "outputs" / recipe.name / "distill" / "dataset"
    train = {}
    if (dataset / "README.md").is_file():
        from pipeline.stages import write_onpolicy_dataset
        rows = got.rows["train"] + got.rows["validation"]
        about = json.loads((dataset.parent / "card.json").read_text())
        write_onpolicy_dataset(recipe, dataset, out / "dataset", rows, set(), about, [], None)
        sft_cfg = recipe.sft.model_copy(update={"max_steps": train_steps, "lr": cfg.lr, "lm_epochs": 0.0,
                                                "eval_steps": 10**6, "save_steps": 10**6})
        m = run_sft(sft_cfg, out / "dataset", out / "sft", seed=0, show_progress=False, config=("step", "onpolicy"),
                    init=model, rows_per_config={"step": cfg.teacher_rows} if cfg.teacher_rows is not None else None)
        per_step = m["train_seconds"] / max(m["steps"], 1)
        rows_per_round = len(rows) * cfg.tasks_per_round / max(len(tasks), 1)
        steps = cfg.epochs * ((cfg.teacher_rows or 10_000) + rows_per_round) / recipe.sft.batch_size
        train = {"seconds_per_step": round(per_step, 3), "steps_per_round_estimate": round(steps),
                 "round_train_seconds_estimate": round(per_step * steps, 1)}
    scale = cfg.tasks_per_round / max(len(tasks), 1)
    return {"tasks": len(tasks), "states": got.stats["states"], "play_seconds": round(wall, 2),
            "parts": _shares(parts), "round_play_seconds_estimate": round(wall * scale, 1), "training": train}


if __name__ == "__main__":
    main()
