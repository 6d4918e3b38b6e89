"""`embodistill eval --env textworld:PATH` on games a user made with tw-make (no spec of ours beside them): every
policy plays through the one episode loop, games are reported per type with Wilson intervals, and a folder that
holds no playable game is refused with a message that names what is missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evaluation.textworld import GameFolderError, evaluate_textworld, find_games, game_type
from textworld_env.games import GameSpec, make_game

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def user_games(tmp_path_factory) -> Path:
    """Two games made by tw-make itself, as a user would: no `.spec.json`, only the game and its `.json`."""
    folder = tmp_path_factory.mktemp("user_games")
    tw_make = str(Path(sys.executable).with_name("tw-make"))
    for name, args in (("coins.z8", ["tw-coin_collector", "--level", "3"]),
                       ("house.z8", ["custom", "--world-size", "3", "--nb-objects", "5", "--quest-length", "2"])):
        subprocess.run([tw_make, *args, "--seed", "7", "--output", str(folder / "nested" / name), "-f", "--silent"],
                       check=True, capture_output=True)
    return folder


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, capture_output=True, text=True)


def test_the_cli_evaluates_a_folder_of_user_games(user_games, tmp_path):
    run = _cli("eval", "recipes/tiny.yaml", "--env", f"textworld:{user_games}", "--policy", "expert",
               "--out", str(tmp_path / "expert"), "--quiet")
    assert run.returncode == 0, run.stderr[-2000:]
    printed = json.loads(run.stdout.strip().splitlines()[-1])
    m = json.loads((tmp_path / "expert" / "metrics.json").read_text())
    assert printed["games"] == m["games"] == 2
    assert set(m["by_type"]) == {"coin_collector", "custom"}     # read from the uuid tw-make wrote
    assert m["all"]["won"] == 2 and m["all"]["score_ratio"] == 1.0
    lo, hi = m["all"]["won_wilson95"]
    assert 0.3 < lo < 1.0 and hi == 1.0
    assert (tmp_path / "expert" / "report.md").read_text().startswith("# expert on 2 TextWorld games")
    assert len((tmp_path / "expert" / "trajectories.jsonl").read_text().splitlines()) == 2


def test_random_and_oracle_baselines_play_the_same_games(user_games, tmp_path):
    oracle = evaluate_textworld(user_games, "oracle", tmp_path / "oracle")
    rand = evaluate_textworld(user_games, "random", tmp_path / "random", seed=3)
    assert oracle["all"]["won"] == 2
    assert rand["games"] == 2 and rand["all"]["invalid_call_rate"] == 0.0   # it picks admissible commands only
    again = evaluate_textworld(user_games, "random", tmp_path / "random2", seed=3)
    assert (tmp_path / "random" / "trajectories.jsonl").read_text() == \
        (tmp_path / "random2" / "trajectories.jsonl").read_text() and again["all"] == rand["all"]
    d = rand["deadlocks"]   # the taxonomy, in metrics.json and report.md
    assert d["k"] == 3 and d["aware"] + d["unaware"] == d["deadlocks"] and oracle["deadlocks"]["unaware"] == 0
    assert "Deadlocks (3 calls in a row" in (tmp_path / "random" / "report.md").read_text()


def test_a_student_folder_plays_textworld_through_the_shared_prompt_and_parser(user_games, tmp_path):
    """A real (untrained) tiny student built as `sft` builds one: what it writes is parsed or counted invalid,
    never executed; TextWorld's `operate` actions are in its tools."""
    from evaluation.textworld import make_policy
    from sft.student import StudentConfig, build_tiny_student, train_tokenizer
    tok = train_tokenizer(["navigate kitchen_north pick_up coin operate carrot|eat finish"] * 50, vocab_size=300)
    model = build_tiny_student(StudentConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                             num_kv_heads=1, max_positions=4096), tok)
    model.save_pretrained(tmp_path / "student")
    tok.save_pretrained(tmp_path / "student")
    policy = make_policy(str(tmp_path / "student"))
    operate = next(t for t in policy.tools if t["function"]["name"] == "operate")
    assert "eat" in operate["function"]["parameters"]["properties"]["action"]["enum"]
    games = find_games(user_games)[:1]
    m = evaluate_textworld(games, str(tmp_path / "student"), tmp_path / "eval", batch_size=1)
    traj = json.loads((tmp_path / "eval" / "trajectories.jsonl").read_text().splitlines()[0])
    assert m["games"] == 1 and traj["turns"] and traj["turns"][0]["prompt"]
    assert all(u["tool_call"] is not None or u["error"] == "parse_error" for u in traj["turns"])


def test_a_folder_without_playable_games_is_refused_by_name(user_games, tmp_path):
    with pytest.raises(GameFolderError, match="no TextWorld game"):
        find_games(tmp_path)
    lone = tmp_path / "lone.z8"
    lone.write_bytes((user_games / "nested" / "coins.z8").read_bytes())
    with pytest.raises(GameFolderError, match=r"lone\.z8: no lone\.json beside it"):
        find_games(tmp_path)
    run = _cli("eval", "recipes/tiny.yaml", "--env", f"textworld:{tmp_path / 'nowhere'}", "--out",
               str(tmp_path / "o"))
    assert run.returncode != 0 and "no such game file or folder" in run.stderr + run.stdout
    run = _cli("eval", "recipes/tiny.yaml", "--env", f"textworld:{user_games}", "--policy", "greedy",
               "--out", str(tmp_path / "o"))
    assert run.returncode != 0 and "--policy must be expert, oracle, random" in run.stderr + run.stdout


def test_our_games_are_typed_by_their_spec(tmp_path):
    game = make_game(GameSpec(kind="simple", seed=1, goal="none"), tmp_path)
    assert game_type(game) == ("simple-none", None)
    game = make_game(GameSpec(kind="treasure_hunter", level=2, seed=1), tmp_path)
    assert game_type(game) == ("treasure_hunter", 2)
