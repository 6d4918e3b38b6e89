"""The CUDA path end to end, in one prepared run that downloads nothing: distillation by the expert, SFT of a
student built from a config (~30M parameters), one on-policy round and a few GiGPO iterations, all on the GPU in
bf16, then one JSON object.

    python benchmarks/gpu_check.py                        # needs CUDA; prints {"skipped": ...} and exits 0 without
    python benchmarks/gpu_check.py --allow-cpu --small    # the same code path on a CPU, with a small student

Prints: the GPU's name, per stage its seconds and rate (SFT optimizer steps/s and trained tokens/s; on-policy
and RL generated tokens/s), the student's test TSR after each stage, peak GPU memory (torch's allocator), and
whether the whole run stayed within --budget-minutes (default 10). Everything is written under --out
(default outputs/gpu-check), which is removed first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def recipe_dict(small: bool) -> dict:
    """The check's recipe: the rooms scene at a size the GPU goes through in minutes."""
    student = ({"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                "vocab_size": 600} if small else
               {"hidden_size": 512, "intermediate_size": 1536, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
                "vocab_size": 2048})
    return {
        "name": "gpu-check", "seed": 0,
        "sandbox": {"scenes": ["rooms"], "train_instructions_per_scene": 40 if small else 300,
                    "test_instructions_per_scene": 10 if small else 40},
        "sft": {"student": {"kind": "tiny", "skip_lines": ["Places:"], "short_memory": True, **student},
                "bf16": True, "batch_size": 16 if small else 32, "lr": 1e-3, "epochs": 1.0 if small else 2.0,
                "max_steps": 10 if small else -1, "eval_steps": 10**6, "save_steps": 10**6, "logging_steps": 10},
        "onpolicy": {"rounds": 1, "tasks": "both", "tasks_per_round": 8 if small else 128, "teacher_rows": 200 if small
                     else 2000, "epochs": 1.0, "lr": 3e-4, "takeover_episodes": 4 if small else 32,
                     "batch_size": 8 if small else 64, "max_new_tokens": 32 if small else 96,
                     "eval_tasks": 6 if small else None, "eval_init": not small},
        "rl": {"init": "onpolicy", "iterations": 2 if small else 4, "tasks_per_iteration": 2 if small else 8,
               "group_size": 2 if small else 8, "max_steps": 4 if small else 14, "max_new_tokens": 16 if small else 24,
               "eval_tasks": 4 if small else None, "eval_every": 2 if small else 4, "eval_pool_tasks": 4 if small else
               32, "save_every": 100, "micro_batch_rows": 8 if small else 64, "pool_instructions_per_scene":
               4 if small else 60},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allow-cpu", action="store_true", help="run without CUDA too (a smoke test of the path)")
    ap.add_argument("--small", action="store_true", help="a small student and few tasks (with --allow-cpu)")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "gpu-check"))
    ap.add_argument("--budget-minutes", type=float, default=10.0)
    args = ap.parse_args()

    import torch
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print(json.dumps({"benchmark": "gpu_check", "skipped": "no CUDA device (torch.cuda.is_available() is False)"}))
        return
    from pipeline.main_job import run_main_job

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "gpu-check.yaml").write_text(yaml.safe_dump(recipe_dict(args.small)))
    report: dict = {"benchmark": "gpu_check", "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                    "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    import os
    cwd = os.getcwd()
    os.chdir(out)   # the run writes outputs/gpu-check/ under --out
    t0 = time.time()
    try:
        with contextlib.redirect_stdout(sys.stderr):   # the main job's closing tables: stdout is the JSON's
            summary = run_main_job("gpu-check.yaml", quiet=True)
    finally:
        os.chdir(cwd)
    total = time.time() - t0
    base = out / "outputs" / "gpu-check"
    sft = json.loads((base / "sft" / "metrics.json").read_text())
    op = json.loads((base / "onpolicy" / "metrics.json").read_text())
    rounds = [r for r in op["rounds"] if r["round"] > 0]
    rl_rows = [json.loads(line) for line in (base / "rl" / "gigpo" / "metrics.jsonl").read_text().splitlines()]
    iters = [r for r in rl_rows if r["kind"] == "train"]
    tokens = sum(r["response_tokens"] for r in iters)
    gen_s = sum(r["generate_s"] for r in iters)
    report.update({
        "params": sft["params"], "bf16": sft["bf16"],
        "sft": {"steps": sft["steps"], "seconds": sft["train_seconds"],
                "steps_per_s": round(sft["steps"] / max(sft["train_seconds"], 1e-9), 2),
                "eval_loss": sft["eval_loss"]},
        "onpolicy": {"rows": op["rows"], "seconds": op["seconds"],
                     "round": [{k: r["collect"][k] for k in ("agreement", "student_tsr", "policy_seconds")}
                               for r in rounds]},
        "rl": {"iterations": summary["iterations"], "generated_tokens": tokens,
               "generate_tokens_per_s": round(tokens / gen_s, 1) if gen_s else None},
        "test_tsr": {"sft": op["rounds"][0]["test"]["all"]["tsr"], "onpolicy": rounds[-1]["test"]["all"]["tsr"],
                     "rl": summary["final_eval"]["all"]["tsr"] if summary.get("final_eval") else None},
        "peak_gpu_memory_mb": round(torch.cuda.max_memory_allocated() / 2**20) if cuda else None,
        "seconds": round(total, 1), "within_budget": total <= 60 * args.budget_minutes})
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
