"""GiGPO online RL of the SFT student in the sandbox: the main job.

    accelerate launch rl/train_gigpo.py recipes/medium.yaml             # GiGPO, outputs/medium/rl/gigpo
    accelerate launch rl/train_gigpo.py recipes/medium.yaml --algorithm grpo
    python rl/train_gigpo.py recipes/medium.yaml --resume                # one process works too
    torchrun --nproc_per_node 2 rl/train_gigpo.py recipes/ci.yaml        # two CPU processes (gloo DDP)

When the recipe's starting checkpoint (`rl.init: sft`, i.e. outputs/<recipe>/sft/final) is missing, the upstream
stages run first on the main process (`embodistill sft RECIPE`, which distills first when the dataset is
missing; each stage resumes and is skipped when its output exists), while the other processes wait.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `accelerate launch rl/train_gigpo.py` runs this file as a script
    sys.path.insert(0, str(ROOT))

_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_CPU")


def resolve_init(recipe, init: str | None) -> tuple[Path, bool]:
    """(model folder, whether this recipe's own SFT stage makes it)."""
    spec = init or recipe.rl.init
    if spec == "sft":
        return Path("outputs") / recipe.name / "sft" / "final", True
    return Path(spec), False


def ensure_upstream(recipe_path: Path, recipe, init: Path, own_sft: bool) -> None:
    """Make the SFT checkpoint when it is missing (main process only), in a clean single-process child: the
    SFT stage runs its own trainer and must not join this run's process group."""
    if (init / "config.json").is_file():
        return
    if not own_sft:
        from rl.trainer import RLError
        raise RLError(f"{init}: no model checkpoint there (no config.json). A student comes from "
                      f"`embodistill sft {recipe_path}` (outputs/<recipe>/sft/final) or an earlier RL run "
                      "(OUT/final); `rl.init: sft` makes it on the fly")
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    # `accelerate launch` sets OMP_NUM_THREADS=1 on machines where psutil counts one physical core; the SFT
    # stage runs alone meanwhile, so it gets every core this process may use
    env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    print(f"[train_gigpo] {init} is missing: running `embodistill sft {recipe_path}` first", file=sys.stderr,
          flush=True)
    cmd = [sys.executable, "-m", "pipeline.cli", "sft", str(recipe_path), "--out", str(init.parent)]
    r = subprocess.run(cmd, env=env, cwd=os.getcwd())
    if r.returncode != 0 or not (init / "config.json").is_file():
        from rl.trainer import RLError
        raise RLError(f"the SFT stage failed (exit {r.returncode}); run `{' '.join(cmd[2:])}` to see why")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GiGPO online RL of the SFT student in the sandbox")
    ap.add_argument("recipe", type=Path, help="recipe YAML (its rl: section)")
    ap.add_argument("--algorithm", choices=("gigpo", "grpo"), default=None, help="override rl.algorithm")
    ap.add_argument("--init", default=None, help="starting model folder (default: rl.init of the recipe)")
    ap.add_argument("--out", type=Path, default=None, help="default outputs/<recipe>/rl/<algorithm>")
    ap.add_argument("--seed", type=int, default=None, help="override the recipe seed for this run")
    ap.add_argument("--iterations", type=int, default=None, help="override rl.iterations")
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUT")
    ap.add_argument("--restart", action="store_true", help="discard OUT and start over")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    from pipeline.recipe import RecipeError, load_recipe
    from rl.trainer import GiGPOTrainer, RLError
    try:
        recipe = load_recipe(args.recipe)   # unknown or ill-typed keys fail here, before any work
        init, own_sft = resolve_init(recipe, args.init)
        rank = int(os.environ.get("RANK", "0"))
        algorithm = args.algorithm or recipe.rl.algorithm
        out = args.out or Path("outputs") / recipe.name / "rl" / (algorithm + ("" if args.seed is None
                                                                                else f"-seed{args.seed}"))
        failed = init.parent / "upstream_failed.txt"
        if rank == 0:
            failed.unlink(missing_ok=True)
            try:
                ensure_upstream(args.recipe, recipe, init, own_sft)
            except Exception as e:
                if own_sft:
                    failed.parent.mkdir(parents=True, exist_ok=True)
                    failed.write_text(str(e))
                raise
        else:  # wait for the main process's upstream stages (they may take a while)
            import time
            while not (init / "config.json").is_file():
                if failed.is_file():
                    raise RLError(f"the main process could not make {init}: {failed.read_text()}")
                time.sleep(2)
        trainer = GiGPOTrainer(recipe, out, init, algorithm=args.algorithm, seed=args.seed,
                               iterations=args.iterations, resume=args.resume, restart=args.restart,
                               show_progress=not args.quiet)
        summary = trainer.train()
    except (RecipeError, RLError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if summary:
        keys = ("algorithm", "iterations", "rollout_episodes", "seconds_this_session", "peak_rss_mb", "final")
        print(json.dumps({**{k: summary[k] for k in keys},
                          "initial_test_tsr": (summary["initial_eval"] or {}).get("all", {}).get("tsr"),
                          "final_test_tsr": (summary["final_eval"] or {}).get("all", {}).get("tsr")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
