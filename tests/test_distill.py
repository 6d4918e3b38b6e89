"""Distillation on the tiny recipe with the real sandbox, the real expert, the rule judge and real `datasets`:
the stage's outputs, determinism, resume after an interruption, the dataset card, an API teacher over
real HTTP (FakeOpenAI), the filter's reasons, and push-dataset's checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fake_openai import Delay, FakeOpenAI, Reply

from agent.prompt import SYSTEM_PROMPT, StepMemory, build_step_messages
from agent.tools import tool_definitions
from agent.trajectory import Trajectory, read_jsonl
from distill.card import CardError, validate_artifact
from distill.dataset import DatasetBuildError
from distill.teacher import PARTIAL, TeacherError, run_teacher
from pipeline.recipe import load_recipe
from pipeline.stages import build_tasks, distill_tasks, run_distill_stage

ROOT = Path(__file__).resolve().parents[1]
CI_RECIPE = ROOT / "recipes" / "ci.yaml"  # the tiny recipe at test size


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(CI_RECIPE)


@pytest.fixture(scope="module")
def train_tasks(recipe):
    return distill_tasks(recipe, build_tasks(recipe, show_progress=False)[0]["train"])


@pytest.fixture(scope="module")
def distilled(recipe, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill")
    return run_distill_stage(recipe, out, show_progress=False), out


def _load(out: Path, config: str):
    from datasets import load_dataset
    return load_dataset(str(out / "dataset"), config)


def test_stage_writes_trajectories_verdicts_dataset_and_metrics(distilled, train_tasks):
    m, out = distilled
    trajs = list(read_jsonl(out / "teacher" / "trajectories.jsonl", Trajectory))
    assert [t.task_id for t in trajs] == [t.id for t in train_tasks]
    assert m["episodes"] == len(trajs) == m["kept"] + m["rejected"]
    assert m["kept"] > 0.9 * m["episodes"]  # the expert is coherent; the judge keeps it
    assert {"easy", "medium", "hard"} <= set(m["filter"]["by_difficulty"])
    assert sum(m["filter"]["rejected_reasons"].values()) == m["rejected"]
    assert set(m["filter"]["criteria"]) >= {"task_completion", "obstacle_handling", "loop_avoidance",
                                            "tool_feasibility", "embodiment_constraints"}
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["rows"] == m["rows"] and saved["rows"]["step"]["train"] > saved["rows"]["conversation"]["train"]
    assert len((out / "verdicts.jsonl").read_text().splitlines()) == len(trajs)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "distill" and set(manifest["dataset_sha256"]) == {
        "conversation/train-00000-of-00001.parquet", "conversation/validation-00000-of-00001.parquet",
        "step/train-00000-of-00001.parquet", "step/validation-00000-of-00001.parquet"}


def test_conversation_rows_keep_the_interaction_structure(distilled):
    _, out = distilled
    ds = _load(out, "conversation")
    assert set(ds) == {"train", "validation"} and len(ds["train"]) and len(ds["validation"])
    assert not set(ds["train"]["instruction_id"]) & set(ds["validation"]["instruction_id"])
    failures = helps = 0
    for row in ds["train"]:
        msgs = row["messages"]
        assert row["tools"] == tool_definitions()
        assert msgs[0] == {"role": "system", "content": SYSTEM_PROMPT, "tool_calls": None, "tool_call_id": None,
                           "name": None}
        assert msgs[1]["role"] == "user" and "\nTask: " in msgs[1]["content"] \
            and msgs[1]["content"].endswith("\nNext skill call?")
        body = msgs[2:]
        assert [m["role"] for m in body] == ["assistant", "tool"] * (len(body) // 2)
        for a, t in zip(body[::2], body[1::2], strict=True):
            (call,) = a["tool_calls"]
            assert call["type"] == "function" and isinstance(call["function"]["arguments"], dict)
            assert t["tool_call_id"] == call["id"] and t["name"] == call["function"]["name"]
            helps += call["function"]["name"] == "ask_for_help"
            failures += t["content"].startswith(("The door", "The way", "You can't", "It is locked")) or \
                "locked" in t["content"]
        assert body[-2]["tool_calls"][0]["function"]["name"] == "finish"
    assert helps > 0 and failures > 0  # failed attempts and help requests are kept, not only clean runs


def test_step_rows_are_exactly_what_rl_rollouts_show(distilled, train_tasks):
    """A step row's prompt is the shared builder's output for that step, rebuilt here from the env."""
    from sandbox.agents import ExpertAgent
    from sandbox.gym_env import SandboxEnv
    _, out = distilled
    rows = [r for r in _load(out, "step")["train"]]
    by_task: dict[str, list[dict]] = {}
    for r in rows:
        by_task.setdefault(r["task_id"], []).append(r)
    task = next(t for t in train_tasks if t.id in by_task and t.difficulty == "medium")
    env, mem = SandboxEnv(), StepMemory()
    obs, info = env.reset(seed=0, options={"task": task})
    expert = ExpertAgent(env, 0)
    for r in sorted(by_task[task.id], key=lambda r: r["step"]):
        msgs = build_step_messages(task.instruction, info["known"], mem, obs, info["steps"], task.step_budget)
        assert [{"role": m["role"], "content": m["content"]} for m in r["messages"][:2]] == msgs
        assert r["messages"][2]["role"] == "assistant"
        _, call = expert.act(info)
        gold = r["messages"][2]["tool_calls"][0]["function"]
        assert {"name": gold["name"], "arguments": gold["arguments"]} == call
        obs, _, _, _, info = env.step(call)
        expert.observe(call, info, obs)
        mem.add(call, info["error"], obs)


def test_same_recipe_and_seed_give_the_same_bytes(distilled, recipe, tmp_path):
    _, out = distilled
    run_distill_stage(recipe, tmp_path / "again", show_progress=False)
    files = sorted(str(p.relative_to(out)) for p in (out / "dataset").rglob("*") if p.is_file())
    assert len(files) == 5
    for f in files + ["teacher/trajectories.jsonl", "verdicts.jsonl", "decisions.jsonl"]:
        assert (out / f).read_bytes() == (tmp_path / "again" / f).read_bytes(), f


def test_interrupted_distillation_resumes_without_duplicates(distilled, recipe, train_tasks, tmp_path):
    _, out = distilled
    folder = tmp_path / "run"
    seen = []

    def stop_after_7(n):
        seen.append(n)
        if len(seen) == 7:
            raise Stop

    with pytest.raises(Stop):
        run_teacher(train_tasks, "expert", folder / "teacher", recipe_seed=recipe.seed, progress=stop_after_7,
                    show_progress=False)
    partial = folder / "teacher" / PARTIAL
    assert len(partial.read_text().splitlines()) == 7
    with open(partial, "a") as f:   # a crash in the middle of writing the next row
        f.write('{"task_id": "half a ro')
    m = run_distill_stage(recipe, folder, show_progress=False)
    assert m["resumed"] == 7 and m["ran"] == len(train_tasks) - 7
    # the run is complete: the final file holds every task once, and the partial file is gone
    assert not partial.exists()
    ids = [json.loads(ln)["task_id"] for ln in (folder / "teacher" / "trajectories.jsonl").read_text().splitlines()]
    assert ids == [t.id for t in train_tasks]
    for f in ("teacher/trajectories.jsonl", "dataset/step/train-00000-of-00001.parquet", "dataset/README.md"):
        assert (folder / f).read_bytes() == (out / f).read_bytes(), f
    # a rerun plays nothing (it resumes from the complete run) and leaves no partial file
    again = run_distill_stage(recipe, folder, show_progress=False)
    assert again["ran"] == 0 and again["resumed"] == len(train_tasks) and not partial.exists()
    # another recipe seed does not reuse these episodes: it plays every task again
    other = run_teacher(train_tasks, "expert", folder / "teacher", recipe_seed=1, show_progress=False)
    assert other.ran == len(train_tasks) and other.resumed == 0
    assert all(t.seed != o.seed for t, o in zip(other.trajectories, again_trajs(folder, out), strict=True))
    # ... and a partial run of one seed is never continued with another
    seen.clear()
    with pytest.raises(Stop):
        run_teacher(train_tasks, "expert", folder / "t2", recipe_seed=1, progress=stop_after_7, show_progress=False)
    with pytest.raises(TeacherError, match="other inputs"):
        run_teacher(train_tasks, "expert", folder / "t2", recipe_seed=2, show_progress=False)


def again_trajs(folder, out):
    """The seed-0 run's episodes (the fixture's)."""
    return list(read_jsonl(out / "teacher" / "trajectories.jsonl", Trajectory))


def test_the_card_metadata_validates_and_tampering_is_named(distilled, tmp_path):
    import shutil

    from huggingface_hub import DatasetCard
    _, out = distilled
    meta = validate_artifact(out / "dataset")
    card = DatasetCard((out / "dataset" / "README.md").read_text())
    data = card.data.to_dict()
    assert data["license"] == "apache-2.0" and "text-generation" in data["task_categories"]
    assert {"embodied-ai", "tool-calling"} <= set(data["tags"]) and data["size_categories"] == ["n<1K"]
    assert [c["config_name"] for c in data["configs"]] == ["conversation", "step"]
    assert next(c for c in data["configs"] if c["config_name"] == "step").get("default") is True
    assert {i.config_name for i in meta.dataset_info} == {"conversation", "step"}
    text = card.text
    for needle in ("Teacher: `expert`", "Judge: backend `rule`", "### Filter statistics", "Difficulties:",
                   "Scenes:"):
        assert needle in text, needle
    bad = tmp_path / "bad"
    shutil.copytree(out / "dataset", bad)
    readme = bad / "README.md"
    readme.write_text(readme.read_text().replace("license: apache-2.0", "license: my-own"))
    with pytest.raises(CardError, match="license"):
        validate_artifact(bad)
    shutil.copytree(out / "dataset", bad, dirs_exist_ok=True)
    (bad / "step" / "validation-00000-of-00001.parquet").unlink()
    with pytest.raises(CardError, match="step.validation"):
        validate_artifact(bad)
    with pytest.raises(CardError, match="no README.md"):
        validate_artifact(tmp_path)


def test_an_api_teacher_runs_concurrently_over_http(distilled, recipe, train_tasks, tmp_path):
    """An OpenAI-compatible teacher that answers each step prompt with the expert's recorded reply plays the
    same episodes as the expert, with requests in flight at once, and its data equals the expert's."""
    from agent.clients import ClientSpec
    _, out = distilled
    expert = list(read_jsonl(out / "teacher" / "trajectories.jsonl", Trajectory))
    replies = {u.prompt[1]["content"]: u.raw_output for t in expert for u in t.turns}
    tasks = train_tasks[:12]

    def responder(body, n):
        assert body["tools"] == tool_definitions() and body["messages"][0]["content"] == SYSTEM_PROMPT
        return Delay(0.005, Reply(replies[body["messages"][1]["content"]]))   # a server that takes a moment

    with FakeOpenAI(responder) as server:
        spec = ClientSpec(kind="openai", model="teacher-model", base_url=server.base_url, api_key_env="NO_SUCH_KEY")
        run = run_teacher(tasks, spec, tmp_path / "api", recipe_seed=recipe.seed, concurrency=4,
                          show_progress=False)
        assert server.max_in_flight > 1
    assert run.ran == len(tasks) and run.client_stats["requests"] == sum(len(t.turns) for t in expert[:12])
    for a, b in zip(run.trajectories, expert[:12], strict=True):
        assert a.policy == "teacher-model"
        assert a.model_dump(exclude={"policy"}) == b.model_dump(exclude={"policy"})


def test_a_teacher_that_fails_every_task_is_filtered_out_with_reasons(recipe, train_tasks, tmp_path):
    from agent.clients import ClientSpec
    from distill.filter import FilterThresholds, filter_stats, judge_and_filter
    from pipeline.stages import make_reward_engine
    with FakeOpenAI(lambda body, n: Reply('<tool_call>{"name": "finish", "arguments": {}}</tool_call>')) as srv:
        spec = ClientSpec(kind="openai", model="quitter", base_url=srv.base_url, api_key_env="NO_SUCH_KEY")
        run = run_teacher(train_tasks[:6], spec, tmp_path / "t", concurrency=3, show_progress=False)
    th = FilterThresholds(min_episode_score=0.6, max_bad_turn_share=0.1, max_loop_share=0.25)
    verdicts, decisions = judge_and_filter(run.trajectories, make_reward_engine(recipe), th)
    stats = filter_stats(decisions, verdicts, th)
    assert stats["kept"] == 0 and stats["rejected_reasons"]["not_successful"] == 6
    assert stats["reasons_all"]["low_score"] == 6
    from distill.dataset import build_rows
    with pytest.raises(DatasetBuildError, match="no trajectory passed the filter"):
        build_rows([], {t.id: t for t in train_tasks}, {}, "quitter", 0.05, 0)


def _cli(*args, env=None):
    import os
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=e)


def test_push_dataset_checks_before_it_touches_the_network(distilled, tmp_path):
    _, out = distilled
    ds = str(out / "dataset")
    r = _cli("push-dataset", ds, "--repo", "not a repo", env={"HF_TOKEN": "hf_secret_value"})
    assert r.returncode == 2 and "ORG/NAME" in r.stderr
    r = _cli("push-dataset", str(tmp_path), "--repo", "org/name", env={"HF_TOKEN": "hf_secret_value"})
    assert r.returncode == 2 and "no README.md" in r.stderr
    r = _cli("push-dataset", ds, "--repo", "org/name", env={"HF_TOKEN": ""})
    assert r.returncode == 2 and "HF_TOKEN is not set" in r.stderr
    # a Hub that cannot be reached (a closed loopback port): a clear error, and the token never printed
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    r = _cli("push-dataset", ds, "--repo", "org/name",
             env={"HF_TOKEN": "hf_secret_value", "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_OFFLINE": "0"})
    assert r.returncode == 2 and "pushing" in r.stderr and "org/name" in r.stderr
    assert "hf_secret_value" not in r.stderr + r.stdout


def test_distill_cli_runs_and_rejects_bad_recipes(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndistill:\n  min_episode_score: 2\n")
    r = _cli("distill", str(bad), "--out", str(tmp_path / "o"), "--quiet")
    assert r.returncode == 2 and "distill.min_episode_score" in r.stderr
    bad.write_text("name: x\ndistill:\n  teachr: expert\n")
    r = _cli("distill", str(bad), "--out", str(tmp_path / "o"), "--quiet")
    assert r.returncode == 2 and "distill.teachr" in r.stderr
    small = tmp_path / "small.yaml"
    import yaml
    data = yaml.safe_load(CI_RECIPE.read_text())
    data.setdefault("distill", {})["tasks_per_difficulty"] = 4
    small.write_text(yaml.safe_dump(data))
    r = _cli("distill", str(small), "--out", str(tmp_path / "o"), "--quiet")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["episodes"] == 12 and summary["kept"] + summary["rejected"] == 12


def test_the_teacher_explores_in_the_order_its_prompt_shows(distilled):
    """A teacher navigation to a place it has not visited, while its target is not on the known map, goes to the
    first place of the prompt's `Unvisited:` line: the student can read where the teacher looks next."""
    _, out = distilled
    rows = list(_load(out, "step")["train"])
    explored = 0
    for r in rows:
        prompt = r["messages"][1]["content"]
        call = r["messages"][2]["tool_calls"][0]["function"]
        args = json.loads(call["arguments"]) if isinstance(call["arguments"], str) else call["arguments"]
        line = next((ln for ln in prompt.splitlines() if ln.startswith("Unvisited: ")), None)
        if call["name"] != "navigate" or line is None:
            continue
        unvisited = line.removeprefix("Unvisited: ").split(", ")
        if args["target"] in unvisited and "haven't searched" in (r["messages"][2]["content"] or ""):
            assert args["target"] == unvisited[0], (prompt, args)
            explored += 1
    assert explored >= 20


def test_the_teacher_walks_straight_up_to_a_task_object_it_has_seen_elsewhere(distilled):
    """When the object a task names was seen lying in another room, the teacher's call names the object
    (`navigate yellow_box`), not the room it is in: the argument is on the `Task objects` line and in the
    instruction's words, so the student copies it instead of looking its room up."""
    _, out = distilled
    straight = 0
    for r in _load(out, "step")["train"]:
        prompt = r["messages"][1]["content"]
        call = r["messages"][2]["tool_calls"][0]["function"]
        args = json.loads(call["arguments"]) if isinstance(call["arguments"], str) else call["arguments"]
        line = next(ln for ln in prompt.splitlines() if ln.startswith("Task objects: "))
        entries = line.removeprefix("Task objects: ").split("; ")
        if call["name"] == "navigate" and any(e.split(" ")[0] == args["target"] and "(here)" not in e
                                              for e in entries):
            straight += 1
    assert straight >= 3  # the ci recipe has few such steps; the teacher made none before it did this
