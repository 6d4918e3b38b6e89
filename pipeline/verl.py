"""verl's entry points that read a recipe: the worker setup hook and the RL dataset.

    embodistill verl-data recipes/gpu/qwen2.5-1.5b-gigpo.yaml --out data/verl/qwen2.5-1.5b-gigpo
    python -m verl.trainer.main_ppo ... \
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=pipeline.verl.register

`register()` registers `rl.verl_plugin` (the "gigpo" estimator, the sandbox agent loop, the trainer mode) with
verl, giving the agent loop `episode_setup`, which reads its recipe: the plugin itself never reads recipe files.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.recipe import load_recipe
from pipeline.stages import build_tasks, human_factory, make_reward_engine
from rl import verl_plugin
from rl.verl_plugin import EpisodeSetup

ROOT = Path(__file__).resolve().parents[1]


def resolve_recipe(path: str | Path) -> Path:
    """A recipe path as given (absolute, or relative to the working directory), else relative to the project
    root: a Ray worker need not start in the directory the run was launched from."""
    p = Path(path)
    if p.is_file():
        return p.resolve()
    if not p.is_absolute() and (ROOT / p).is_file():
        return ROOT / p
    raise FileNotFoundError(f"{path}: no such recipe (looked in {Path.cwd()} and {ROOT})")


def episode_setup(recipe_path: str | Path) -> EpisodeSetup:
    """What the sandbox agent loop plays episodes with: the recipe's `rl:` settings, seed, judge and persona."""
    recipe = load_recipe(resolve_recipe(recipe_path))
    if recipe.env != "sandbox":
        raise ValueError(f"{recipe_path}: env: {recipe.env}: the verl agent loop plays the sandbox only")
    return EpisodeSetup(config=recipe.rl, seed=recipe.seed, rewarder=make_reward_engine(recipe),
                        human_factory=human_factory(recipe))


def register() -> dict[str, str | None]:
    """`rl.verl_plugin.register` with the recipe-reading episode setup (verl's worker_process_setup_hook)."""
    return verl_plugin.register(setup_loader=episode_setup)


def write_dataset(recipe_path: str | Path, out: str | Path, show_progress: bool = True) -> dict[str, Path]:
    """OUT/train.parquet (the recipe's train tasks at `rl.difficulties`) and OUT/val.parquet (its test tasks, the
    first `rl.eval_tasks`), for verl's `data.train_files` / `data.val_files`."""
    from datasets import Dataset  # 0.6 s to import: only this command needs it

    recipe = load_recipe(recipe_path)
    if recipe.env != "sandbox":
        raise ValueError(f"{recipe_path}: env: {recipe.env}: the verl agent loop plays the sandbox only; train on "
                         "TextWorld with `embodistill rl` (the built-in GiGPO trainer)")
    splits = build_tasks(recipe, show_progress=show_progress)[0]
    diffs = set(recipe.rl.difficulties or ("easy", "medium", "hard"))
    train = [t for t in splits["train"] if t.difficulty in diffs]
    val = splits["test"][: recipe.rl.eval_tasks] if recipe.rl.eval_tasks else splits["test"]
    if not train or not val:
        raise ValueError(f"{recipe_path}: {len(train)} train and {len(val)} test tasks; both must be non-empty")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, tasks in (("train", train), ("val", val)):
        paths[split] = out / f"{split}.parquet"
        rows = verl_plugin.dataset_rows(tasks, split, f"embodistill/{recipe.name}", recipe.rl.memory_size)
        Dataset.from_list(rows).to_parquet(str(paths[split]))
    return paths
