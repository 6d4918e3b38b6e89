"""Bad input and interrupted runs, as a hostile but fair user tries them: ill-typed and duplicate recipe keys, a
recipe name that climbs out of outputs/, bytes that are not UTF-8, truncated gzip files, out-of-range trajectory
fields, a judge whose every call fails, a distillation that fails after an earlier one succeeded, leftover temp
folders, and episode seeds that must not depend on the order of the tasks."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from agent.trajectory import DataFileError, Trajectory, read_jsonl, read_jsonl_lenient, write_jsonl
from pipeline.cli import JUDGE_ERRORS_EXIT, app, main
from pipeline.recipe import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / "recipes" / "ci.yaml"


def _recipe(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_bytes(text.encode() if isinstance(text, str) else text)
    return p


def _ci_with(tmp_path: Path, old: str, new: str) -> Path:
    text = CI.read_text()
    assert text.count(old) == 1, old
    return _recipe(tmp_path, text.replace(old, new))


# ------------------------------------------------------------------------------------------------ recipes


@pytest.mark.parametrize("old,new,where", [
    ("  iterations: 2\n", '  iterations: "2"\n', "rl.iterations: Input should be a valid integer"),
    ("  iterations: 2\n", "  iterations: true\n", "rl.iterations: Input should be a valid integer"),
    ("  batch_size: 8\n", '  batch_size: "8"\n', "sft.batch_size: Input should be a valid integer"),
    ("  lr: 0.001\n", '  lr: "1e-3"\n', "rl.lr: Input should be a valid number"),
    # a count given as a boolean names the type, not a range it happens to fail (true == 1 < 2)
    ("  group_size: 2\n", "  group_size: true\n", "rl.group_size: Input should be a valid integer"),
    ("  hidden_size: 48\n", "  hidden_size: 48.0\n", "sft.student.hidden_size: Input should be a valid integer"),
    ("  seed: 0\nsft:", "  seed: 0\n  constrained: 'yes'\nsft:", "eval.constrained: Input should be a valid"),
])
def test_ill_typed_recipe_values_are_rejected_naming_file_line_and_field(tmp_path, old, new, where):
    path = _ci_with(tmp_path, old, new)
    text = path.read_text()
    changed = next(ln for ln in new.splitlines() if ln not in old.splitlines())
    line = text[:text.index(changed + "\n")].count("\n") + 1
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert str(e.value).startswith(f"{path}:{line}: {where}"), str(e.value)


def test_a_teacher_client_spec_is_strict_too(tmp_path):
    path = _ci_with(tmp_path, "eval:\n", "distill:\n  teacher: {kind: openai, model: m, timeout: \"5\"}\neval:\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    # one line, about the timeout: not also about the spec not being the string "expert" (the union's other member)
    assert str(e.value) == f"{path}:12: distill.teacher.timeout: Input should be a valid number"
    with pytest.raises(RecipeError) as e:
        load_recipe(_ci_with(tmp_path, "  batch_size: 8\n", "  batch_size: 8\n  bf16: 'yes'\n"))
    assert str(e.value).endswith("sft.bf16: Input should be a valid boolean; or Input should be 'auto'")
    ok = load_recipe(_ci_with(tmp_path, "eval:\n", "distill:\n  teacher: {kind: openai, model: m, timeout: 5}\n"
                                                   "eval:\n"))
    assert ok.distill.teacher.timeout == 5.0   # an integer is a fine number


def test_numbers_in_e_notation_are_numbers_and_quoted_ones_are_not(tmp_path):
    r = load_recipe(_ci_with(tmp_path, "  lr: 0.001\n", "  lr: 1e-3\n"))   # YAML 1.1 (PyYAML) reads a string here
    assert r.rl.lr == 0.001 and isinstance(r.rl.lr, float)
    with pytest.raises(RecipeError, match="rl.lr"):
        load_recipe(_ci_with(tmp_path, "  lr: 0.001\n", "  lr: '1e-3'\n"))


def test_a_duplicate_key_is_an_error_naming_both_lines(tmp_path):
    path = _recipe(tmp_path, "name: dup\nseed: 1\nrl:\n  iterations: 2\n  iterations: 3\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert str(e.value) == f"{path}:5: not a valid recipe: duplicate key 'iterations' (first on line 4)"
    with pytest.raises(RecipeError, match="duplicate key 'seed'"):
        load_recipe(_recipe(tmp_path, "name: dup\nseed: 1\nseed: 2\n"))


@pytest.mark.parametrize("name", ["../../tmp/escape", "/abs", "a/b", "..", ".hidden", "", "x" * 65, "a b"])
def test_a_recipe_name_cannot_leave_outputs(tmp_path, name):
    with pytest.raises(RecipeError, match="name: Value error, the recipe name"):
        load_recipe(_recipe(tmp_path, yaml.safe_dump({"name": name})))


def test_the_rl_command_refuses_an_escaping_name_before_writing_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    path = _recipe(tmp_path, "name: ../../escape\n")
    assert main(["rl", str(path)]) == 2
    assert "the recipe name" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml", "work"]
    assert list((tmp_path / "work").iterdir()) == []


def test_recipe_bytes_not_utf8_and_a_bom(tmp_path):
    bad = _recipe(tmp_path, b"name: ci\nseed: 0\nsandbox:\n  scenes: [r\xffooms]\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(bad)
    assert str(e.value) == f"{bad}:4: not UTF-8 (byte 0xff at column 13)"
    bom = _recipe(tmp_path, b"\xef\xbb\xbfname: bom\nseed: 3\n", "bom.yaml")
    r = load_recipe(bom)
    assert r.name == "bom" and r.seed == 3


def test_a_directory_or_a_missing_file_as_recipe(tmp_path):
    with pytest.raises(RecipeError, match="is a directory, not a recipe file"):
        load_recipe(tmp_path)
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "nope.yaml")


@pytest.mark.parametrize("which,needle", [
    ("bad", "rl.iterations: Input should be a valid integer"),
    ("dir", "is a directory, not a recipe file"),
    ("missing", "no such recipe file"),
    ("utf8", "not UTF-8"),
    (None, "no recipe given"),
])
def test_the_main_job_exits_2_with_one_line(tmp_path, capsys, which, needle):
    from rl.train_gigpo import main as train_main
    paths = {"bad": _ci_with(tmp_path, "  iterations: 2\n", '  iterations: "2"\n'), "dir": tmp_path,
             "missing": tmp_path / "missing.yaml", "utf8": _recipe(tmp_path, b"name: \xff\n", "u.yaml")}
    assert train_main([str(paths[which])] if which else []) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines


def test_the_main_job_script_exits_2_in_its_own_process(tmp_path):
    """`python rl/train_gigpo.py` (the process `accelerate launch` starts) exits 2 with one line on stderr."""
    bad = _ci_with(tmp_path, "  iterations: 2\n", '  iterations: "2"\n')
    r = subprocess.run([sys.executable, str(ROOT / "rl" / "train_gigpo.py"), str(bad)], capture_output=True,
                       text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: {bad}:28: rl.iterations: Input should be a valid integer"], r.stderr


# ------------------------------------------------------------------------------------------------ data files


def _trajs(built_tasks, n=3) -> list[Trajectory]:
    from evaluation.sandbox_eval import evaluate
    return evaluate(built_tasks[:n], "expert")[1]


@pytest.fixture(scope="module")
def trajs(built_tasks):
    return _trajs(built_tasks)


def test_one_bad_byte_costs_one_line_named_by_number(tmp_path, trajs):
    path = tmp_path / "t.jsonl"
    write_jsonl(path, trajs)
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b'"instruction":"', b'"instruction":"\xff', 1)
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines))   # and a BOM before line 1
    rows, errors = read_jsonl_lenient(path, Trajectory)
    assert [i for i, _ in rows] == [1, 3]
    assert errors == [{"line": 2, "error": "not UTF-8 (byte 0xff at column " +
                       str(lines[1].index(b"\xff") + 1) + ")"}]
    with pytest.raises(DataFileError, match=r"t\.jsonl:2: not UTF-8"):
        list(read_jsonl(path, Trajectory))
    out = tmp_path / "judge"
    r = CliRunner().invoke(app, ["judge", "--trajectories", str(path), "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "summary.json").read_text())["trajectories"] == 2
    assert f"{path}:2: not UTF-8" in r.output


def test_a_truncated_gzip_names_the_file_and_where(tmp_path, trajs):
    path = tmp_path / "t.jsonl.gz"
    write_jsonl(path, trajs)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(DataFileError, match=r"t\.jsonl\.gz: a corrupt or truncated gzip file, unreadable after "
                                            r"line \d+"):
        read_jsonl_lenient(path, Trajectory)
    r = CliRunner().invoke(app, ["judge", "--trajectories", str(path), "--out", str(tmp_path / "j"), "--quiet"])
    assert r.exit_code == 2 and "truncated gzip" in r.output and "Aborted" not in r.output


def test_a_task_file_with_a_bad_byte_names_file_and_line(tmp_path):
    from pipeline.stages import load_tasks, write_build
    write_build(load_recipe(CI), tmp_path / "b", show_progress=False)
    f = tmp_path / "b" / "train_easy.jsonl"
    lines = f.read_bytes().split(b"\n")
    lines[2] = b"\xfe" + lines[2]
    f.write_bytes(b"\n".join(lines))
    with pytest.raises(RecipeError) as e:
        load_tasks(tmp_path / "b", "train")
    assert str(e.value) == f"{f}:3: not UTF-8 (byte 0xfe at column 1)"
    r = CliRunner().invoke(app, ["eval", str(CI), "--tasks", str(tmp_path / "b"), "--split", "train", "--out",
                                 str(tmp_path / "e"), "--quiet"])
    assert r.exit_code == 2 and "train_easy.jsonl:3: not UTF-8" in r.output


@pytest.mark.parametrize("field,value,message", [
    ("subgoals_met", 1e30, "subgoals_met"),
    ("subgoals_met", -1, "subgoals_met"),
    ("optimal_steps", -5, "optimal_steps"),
    ("subgoals_total", -2, "subgoals_total"),
])
def test_trajectory_numbers_are_bounded(trajs, field, value, message):
    row = json.loads(trajs[0].model_dump_json())
    row[field] = value
    with pytest.raises(ValueError, match=message):
        Trajectory.model_validate_json(json.dumps(row))


@pytest.mark.parametrize("call", [{"name": 5, "arguments": {}}, {"name": "go_to", "arguments": "notadict"}])
def test_a_tool_call_has_a_string_name_and_object_arguments(tmp_path, trajs, call):
    row = json.loads(trajs[0].model_dump_json())
    row["turns"][0]["tool_call"] = call
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n" + trajs[1].model_dump_json() + "\n")
    rows, errors = read_jsonl_lenient(path, Trajectory)
    assert len(rows) == 1 and errors[0]["line"] == 1 and "turns.0.tool_call" in errors[0]["error"]


def test_episode_scores_stay_in_range_on_what_validation_accepts(trajs):
    from reward_engine.judge import RewardEngine
    engine = RewardEngine()
    for t in trajs:
        v = engine.score(t)
        assert 0.0 <= v.episode.score <= 1.0 and 0.0 <= v.episode.completeness <= 1.0


# ------------------------------------------------------------------------------------------------ the judge


def _unusable_judge():
    """A real endpoint whose every reply is prose where the judge asks for JSON: each turn judgment fails after
    its repairs (a judge_error)."""
    from fake_openai import FakeOpenAI, Reply
    return FakeOpenAI(lambda body, n: Reply("I think the agent did fine."))


def test_the_judge_exits_3_when_its_calls_fail_and_gives_no_episode_score(tmp_path, trajs, monkeypatch):
    from reward_engine.judge import TrajectoryVerdict
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    path = tmp_path / "t.jsonl"
    write_jsonl(path, trajs[:2])
    out = tmp_path / "j"
    with _unusable_judge() as srv:
        args = ["judge", "--trajectories", str(path), "--out", str(out), "--backend", "openai", "--model", "m",
                "--base-url", srv.base_url, "--quiet"]
        r = CliRunner().invoke(app, args)
        assert r.exit_code == JUDGE_ERRORS_EXIT == 3, r.output
        s = json.loads((out / "summary.json").read_text())
        assert s["judge_error"] == s["turns"] > 0 and s["judge_error_share"] == 1.0
        assert s["mean_episode_score"] is None and "more than --max-error-share 0.0" in r.output
        for v in read_jsonl(out / "verdicts.jsonl", TrajectoryVerdict):
            assert v.episode.score is None and v.episode.consistency is None and v.judge_errors == len(v.turns)
        assert CliRunner().invoke(app, [*args, "--max-error-share", "1"]).exit_code == 0
        r = CliRunner().invoke(app, [*args, "--max-error-share", "1.5"])
        assert r.exit_code == 2 and "--max-error-share" in r.output


def test_a_file_with_no_readable_trajectory_is_bad_input(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("{not json\n")
    r = CliRunner().invoke(app, ["judge", "--trajectories", str(path), "--out", str(tmp_path / "j"), "--quiet"])
    assert r.exit_code == 2 and "no trajectory to judge" in r.output and "line 1: not JSON" in r.output


# ------------------------------------------------------------------------------------------------ stale outputs


def _small_distill(tmp_path: Path, judge: str = "") -> Path:
    text = CI.read_text().replace("eval:\n", "distill:\n  tasks_per_difficulty: 2\n" + judge + "eval:\n", 1)
    return _recipe(tmp_path, text, "small.yaml")


def test_a_failed_distillation_leaves_no_stale_outputs_and_sft_refuses_it(tmp_path, monkeypatch):
    from distill.dataset import DatasetBuildError
    from pipeline.stages import DISTILL_OUTPUTS, check_dataset, distill_complete, run_distill_stage, run_sft_stage
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    out = tmp_path / "distill"
    good = load_recipe(_small_distill(tmp_path))
    run_distill_stage(good, out, show_progress=False)
    assert distill_complete(out) and all((out / n).exists() for n in DISTILL_OUTPUTS)
    # the same tasks judged by an endpoint whose every judgment fails: every trajectory is rejected (judge_error)
    with _unusable_judge() as srv:
        bad = load_recipe(_small_distill(tmp_path, "judge:\n  backend: llm\n  model: {kind: openai, model: m, "
                                                   f"base_url: '{srv.base_url}'}}\n"))
        with pytest.raises(DatasetBuildError) as e:
            run_distill_stage(bad, out, show_progress=False)
    assert "no trajectory passed the filter" in str(e.value) and "judge_error" in str(e.value)
    assert str(out / "decisions.jsonl") in str(e.value) and "metrics.json" not in str(e.value)
    # nothing of the first run is left beside the second's decisions
    assert (out / "decisions.jsonl").is_file() and not distill_complete(out)
    for gone in ("manifest.json", "metrics.json", "dataset"):
        assert not (out / gone).exists(), gone
    with pytest.raises(FileNotFoundError, match="no dataset there"):
        run_sft_stage(good, out / "dataset", tmp_path / "sft", show_progress=False)
    # a dataset written by a run that died before its manifest is refused too
    (out / "dataset").mkdir()
    (out / "dataset" / "README.md").write_text("---\n---\n")
    with pytest.raises(DatasetBuildError, match="did not complete"):
        check_dataset(out / "dataset")
    # the teacher's episodes were kept: the next good run replays nothing
    again = run_distill_stage(good, out, show_progress=False)
    assert again["ran"] == 0 and distill_complete(out)
    assert not (out / "teacher" / "trajectories.partial.jsonl").exists()


def test_leftover_temp_dataset_folders_are_swept(tmp_path):
    from distill.dataset import write_artifact
    from pipeline.stages import run_distill_stage
    out = tmp_path / "distill"
    (out / ".dataset.k1ll3d.tmp" / "step").mkdir(parents=True)
    (out / ".dataset.old").mkdir()
    run_distill_stage(load_recipe(_small_distill(tmp_path)), out, show_progress=False)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert write_artifact   # the sweep lives in write_artifact, which every dataset write goes through


# ------------------------------------------------------------------------------------------------ seeds


def test_episode_seeds_come_from_the_task_id_not_its_position(built_tasks, tmp_path):
    from distill.teacher import run_teacher
    from evaluation.sandbox_eval import evaluate
    tasks = built_tasks[:12]
    _, forward = evaluate(tasks, "random", seed=5)
    _, backward = evaluate(tasks[::-1], "random", seed=5)
    by_id = {t.task_id: t for t in backward}
    assert all(t.model_dump() == by_id[t.task_id].model_dump() for t in forward)
    assert len({t.seed for t in forward}) == len(tasks)
    full = run_teacher(tasks, "expert", tmp_path / "a", recipe_seed=2, show_progress=False).trajectories
    some = run_teacher(tasks[5:9], "expert", tmp_path / "b", recipe_seed=2, show_progress=False).trajectories
    assert [t.model_dump() for t in some] == [t.model_dump() for t in full[5:9]]


def test_the_eval_command_with_a_task_folder_plays_the_same_episodes(tmp_path):
    """`--tasks DIR` reads the tasks in another order than a fresh build; the episodes are the same."""
    from pipeline.stages import write_build
    write_build(load_recipe(CI), tmp_path / "b", show_progress=False)
    for name, extra in (("built", []), ("read", ["--tasks", str(tmp_path / "b")])):
        r = CliRunner().invoke(app, ["eval", str(CI), "--policy", "random", "--out", str(tmp_path / name),
                                     "--quiet", *extra])
        assert r.exit_code == 0, r.output
    a = {t.task_id: t.model_dump() for t in read_jsonl(tmp_path / "built" / "trajectories.jsonl", Trajectory)}
    b = {t.task_id: t.model_dump() for t in read_jsonl(tmp_path / "read" / "trajectories.jsonl", Trajectory)}
    assert a == b and len(a) > 20


def test_gzip_written_files_still_read(tmp_path, trajs):
    path = tmp_path / "t.jsonl.gz"
    write_jsonl(path, trajs)
    assert [t.task_id for t in read_jsonl(path, Trajectory)] == [t.task_id for t in trajs]
    with gzip.open(path, "rt") as f:
        assert len(f.read().splitlines()) == len(trajs)


# ------------------------------------------------------------------------------------------------ client specs


def test_eval_plays_a_policy_behind_a_client_spec_file(tmp_path, monkeypatch):
    from fake_openai import FakeOpenAI, Reply
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    with FakeOpenAI(lambda body, n: Reply(tool_calls=[{"name": "finish", "arguments": {"summary": "done"}}])) as srv:
        spec = _recipe(tmp_path, f"kind: openai\nmodel: m\nbase_url: '{srv.base_url}'\n", "spec.yaml")
        r = CliRunner().invoke(app, ["eval", str(CI), "--policy", str(spec), "--out", str(tmp_path / "e"), "--quiet"])
        assert r.exit_code == 0, r.output
        m = json.loads((tmp_path / "e" / "metrics.json").read_text())
        assert m["policy"] == "openai:m" and m["all"]["episodes"] == len(srv.requests) > 20
        assert all(len(t.turns) == 1 and t.turns[0].tool_call["name"] == "finish"
                   for t in read_jsonl(tmp_path / "e" / "trajectories.jsonl", Trajectory))
    bad = _recipe(tmp_path, "kind: openai\nmodel: m\nmax_retries: '1'\n", "bad.yaml")
    r = CliRunner().invoke(app, ["eval", str(CI), "--policy", str(bad), "--out", str(tmp_path / "b"), "--quiet"])
    assert r.exit_code == 2 and f"{bad}:3: max_retries: Input should be a valid integer" in r.output
