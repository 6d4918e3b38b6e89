"""The pipeline on TextWorld, unchanged: a recipe with `env: textworld` builds disjoint splits of games, and the
main job (distill -> SFT -> on-policy distillation -> GiGPO) runs on them with TextWorld's teacher, skills and
env, and the judge's general checks only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.recipe import RecipeError, load_recipe
from textworld_env.games import GameFamily, build_games, split_seed

ROOT = Path(__file__).resolve().parents[1]

RECIPE = """\
name: twci
env: textworld
seed: 0
textworld:
  games:
    - {kind: custom, world_size: [2, 4], nb_objects: [3, 8], quest_length: [1, 3]}
    - {kind: coin_collector, level: [1, 4]}
  train_games_per_family: 3
  test_games_per_family: 2
  pool_games_per_family: 2
  folder: GAMES
sft:
  student: {hidden_size: 48, intermediate_size: 96, num_layers: 2, num_heads: 2, num_kv_heads: 1, vocab_size: 600}
  max_steps: 4
  batch_size: 8
  eval_steps: 4
  save_steps: 4
  logging_steps: 2
  max_eval_samples: 8
onpolicy: {rounds: 1, tasks: both, tasks_per_round: 4, teacher_rows: 40, max_new_tokens: 16, eval_tasks: 4,
           eval_init: false, takeover_episodes: 2}
rl: {iterations: 1, tasks_per_iteration: 2, group_size: 2, max_steps: 4, max_new_tokens: 16, eval_tasks: 4,
     eval_every: 1, save_every: 1, micro_batch_rows: 8, lr: 0.001, init: onpolicy}
"""


@pytest.fixture(scope="module")
def games_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("games")


def test_a_textworld_recipe_is_checked_by_field_and_line(tmp_path, games_folder):
    good = tmp_path / "tw.yaml"
    good.write_text(RECIPE.replace("GAMES", str(games_folder)))
    r = load_recipe(good)
    assert r.env == "textworld" and [f.label for f in r.textworld.games] == ["custom", "coin_collector"]
    cases = {"level: [1, 4]": ("level: [4, 1]", "lo <= hi"),
             "world_size: [2, 4]": ('world_size: "3"', "world_size"),
             "train_games_per_family: 3": ("train_games_per_family: 0", "train_games_per_family")}
    for old, (new, says) in cases.items():
        bad = tmp_path / "bad.yaml"
        bad.write_text(good.read_text().replace(old, new, 1))
        with pytest.raises(RecipeError, match=says) as e:
            load_recipe(bad)
        assert str(bad) in str(e.value)
    bare = tmp_path / "bare.yaml"
    bare.write_text("name: bare\nenv: textworld\n")
    with pytest.raises(RecipeError, match="needs a textworld: section"):
        load_recipe(bare)
    sandbox = tmp_path / "sb.yaml"
    sandbox.write_text(good.read_text().replace("env: textworld\n", ""))
    with pytest.raises(RecipeError, match="needs env: textworld"):
        load_recipe(sandbox)


def test_splits_never_share_a_game_and_do_not_depend_on_the_workers(games_folder):
    families = [GameFamily(kind="custom", world_size=[2, 3], nb_objects=[3, 5], quest_length=[1, 2])]
    train = build_games(families, "train", 2, games_folder, workers=2)
    test = build_games(families, "test", 2, games_folder, workers=1)
    assert [t.id for t in build_games(families, "train", 2, games_folder, workers=1)] == [t.id for t in train]
    assert not {t.game for t in train} & {t.game for t in test}
    assert len({split_seed(s, 0, 0, i) for s in ("train", "test", "rl") for i in range(100)}) == 300
    assert all(Path(t.game).is_file() and t.difficulty == "custom" for t in train + test)


def test_the_main_job_runs_on_textworld_games(tmp_path, games_folder):
    """distill -> SFT -> on-policy -> GiGPO on a TextWorld recipe, through the same command as the sandbox's."""
    recipe = tmp_path / "tw.yaml"
    recipe.write_text(RECIPE.replace("GAMES", str(games_folder)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pipeline.cli", "rl", str(recipe), "--quiet"], cwd=tmp_path,
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "outputs" / "twci"
    # distill: the TextWorld teacher won its games, and its trajectories are TextWorld's
    m = json.loads((out / "distill" / "metrics.json").read_text())
    assert m["episodes"] == 6 and m["teacher_metrics"]["all"]["tsr"] == 1.0
    assert set(m["teacher_metrics"]) == {"custom", "coin_collector", "all"}
    verdicts = (out / "distill" / "verdicts.jsonl").read_text()
    for check in ("help_before_obstacle", "report_before_observe", "repeat_question"):   # sandbox-only
        assert check not in verdicts
    import pandas as pd
    rows = pd.read_parquet(next((out / "distill" / "dataset" / "step").glob("train*.parquet")))
    operate = next(t for t in json.loads(rows.iloc[0]["tools"]) if t["function"]["name"] == "operate")
    assert "eat" in operate["function"]["parameters"]["properties"]["action"]["enum"]
    assert set(rows["kind"]) <= {"custom", "coin_collector"}
    # on-policy: the student played TextWorld games, the teacher labelled them, the expert took over
    op = json.loads((out / "onpolicy" / "round-1" / "collect.json").read_text())
    assert op["takeover"]["episodes"] == 2 and sum(op["rows"].values()) > 0
    played = [json.loads(x) for x in (out / "onpolicy" / "round-1" / "trajectories.jsonl").read_text().splitlines()]
    assert played and all(t["task_id"].startswith(("train-", "rl-")) for t in played)
    # RL: one GiGPO iteration in TextWorld, evaluated per game family
    rows = [json.loads(x) for x in (out / "rl" / "gigpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and {"custom", "coin_collector", "all"} <= set(evals[-1])
    assert (out / "rl" / "gigpo" / "final" / "config.json").is_file()
