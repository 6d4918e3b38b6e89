"""Which of the SFT run's inputs change the student it trains: the thread count, the precision, the data order,
the initial weights?

    python benchmarks/sft_sources.py                          # the medium recipe's data and SFT settings, 100 steps
    python benchmarks/sft_sources.py --steps 300 --dataset outputs/medium/distill/dataset

The SFT student's test TSR moves by up to 25 points between runs of the same recipe (docs/results.md, "SFT seed
and precision variance"). This benchmark trains the recipe's tiny student for --steps assistant-only steps of
TRL's `SFTTrainer` (the medium recipe's batch, learning rate and schedule) from one set of initial weights, once
as the reference and once per changed input, each in a fresh process:

- `repeat`: nothing changed (is one machine deterministic?);
- `threads_1`: one torch thread instead of all cores;
- `precision`: float32 where the reference trains in bf16 autocast (or the reverse);
- `data_order`: the trainer's seed (data order, and every random draw of training) 1 instead of 0;
- `init`: initial weights built with seed 1 instead of 0, trainer seed 0.

For each it prints the final training loss, the validation loss, and how far the trained weights are from the
reference's: `identical` (bit for bit), the largest absolute difference and the relative L2 distance
||w - w_ref|| / ||w_ref||. A change that leaves the weights identical is not a source of the swing; one that does
not starts a different run, whose end (and test TSR) is another draw.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {  # name: (threads, flip precision, trainer seed, init seed)
    "reference": (None, False, 0, 0),
    "repeat": (None, False, 0, 0),
    "threads_1": (1, False, 0, 0),
    "precision": (None, True, 0, 0),
    "data_order": (None, False, 1, 0),
    "init": (None, False, 0, 1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "medium.yaml"))
    ap.add_argument("--dataset", default=None, help="a distilled dataset (default: outputs/<recipe>/distill/dataset, "
                                                    "made when missing)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)   # one training, in a child process
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from pipeline.recipe import load_recipe
    recipe = load_recipe(args.recipe)
    dataset = Path(args.dataset) if args.dataset else ROOT / "outputs" / recipe.name / "distill" / "dataset"
    if args.variant:
        return train_one(recipe, dataset, args.variant, args.steps, Path(args.out))
    if not (dataset / "README.md").is_file():
        from pipeline.stages import run_distill_stage
        run_distill_stage(recipe, dataset.parent, show_progress=False)
    from learning import _cpu   # benchmarks/learning.py: the CPU model and its bf16 support
    report = {"benchmark": "sft_sources", "recipe": recipe.name, "dataset": str(dataset), "steps": args.steps,
              "cpu": _cpu(), "cores": len(os.sched_getaffinity(0)), "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in VARIANTS:
            t0 = time.time()
            # a fresh process per run: torch's thread pool and autocast state start clean every time
            subprocess.run([sys.executable, __file__, "--recipe", args.recipe, "--dataset", str(dataset), "--steps",
                            str(args.steps), "--variant", name, "--out", str(Path(tmp) / name)], check=True)
            got = json.loads((Path(tmp) / name / "result.json").read_text())
            got["seconds"] = round(time.time() - t0, 1)
            if name != "reference":
                got.update(_distance(Path(tmp) / "reference" / "model.safetensors",
                                     Path(tmp) / name / "model.safetensors"))
            report["variants"][name] = got
            print(json.dumps({name: got}), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))


def train_one(recipe, dataset: Path, name: str, steps: int, out: Path) -> None:
    import torch
    from transformers import set_seed

    from agent.progress import StageBar
    from sft.train import _train_phase, make_student, training_splits, use_bf16
    threads, flip, train_seed, init_seed = VARIANTS[name]
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    bf16 = use_bf16(recipe.sft.bf16) != flip
    cfg = recipe.sft.model_copy(update={"max_steps": steps, "bf16": bf16, "eval_steps": 10 ** 9,
                                        "save_steps": 10 ** 9, "max_eval_samples": 256})
    train, val = training_splits(dataset, recipe.distill.sample_format, 0)   # the same rows for every variant
    val = val.select(range(min(cfg.max_eval_samples, len(val))))
    set_seed(init_seed)
    model, tok, _ = make_student(cfg.student, train, init_seed)
    set_seed(train_seed)
    trainer, m = _train_phase(cfg, model, tok, None, train, val, out / "checkpoints", train_seed, [], {}, None,
                              StageBar("sft", enabled=False), assistant_only=True)
    out.mkdir(parents=True, exist_ok=True)
    trainer.model.save_pretrained(out)
    (out / "result.json").write_text(json.dumps({
        "threads": torch.get_num_threads(), "bf16": bf16, "trainer_seed": train_seed, "init_seed": init_seed,
        "train_loss": round(m["train_loss"], 5), "eval_loss": round(m["eval_loss"], 5)}))


def _distance(ref: Path, other: Path) -> dict:
    from safetensors.torch import load_file
    a, b = load_file(str(ref)), load_file(str(other))
    identical = a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a) ** 0.5
    norm = sum(float(a[k].double().pow(2).sum()) for k in a) ** 0.5
    return {"identical": identical, "max_abs_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
            "relative_l2": round(diff / norm, 6)}


if __name__ == "__main__":
    main()
