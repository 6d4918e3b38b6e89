"""On-policy distillation (`distill.onpolicy`, `embodistill onpolicy`): the student drives, the teacher labels every
state it reaches, the rows join the dataset as its `onpolicy` config, the student trains on the aggregate; rounds
resume after a kill; a model teacher is asked with the student's own prompt."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from agent.episode import play
from agent.policies import ScriptedPolicy
from distill.onpolicy import (DAggerPolicy, ExpertLabels, ModelLabels, OnPolicyConfig, OnPolicyError, _PerEpisode,
                              collect, replayed_calls, round_seed, round_tasks, takeover)
from sandbox.agents import ExpertAgent, ReplayAgent
from sandbox.gym_env import SandboxEnv
from sandbox.oracle import NoisyExpertAgent

ROOT = Path(__file__).resolve().parents[1]


def noisy_student(rate: float = 0.5):
    """A student that makes mistakes: the expert with seeded typed mistakes, answering as a model would (text)."""
    return ScriptedPolicy(lambda env, seed: NoisyExpertAgent(env, seed, rate=rate), name="noisy", as_text=True)


def expert_from(task, seed: int, calls: list, upto: int) -> dict:
    """The expert's call at step `upto` of an episode whose first `upto` calls were `calls` (replayed, the
    expert told each, as a labeller is): played from a fresh env, independently of the labelling run."""
    factory = lambda env, s: ReplayAgent(env, s, calls[:upto], then=lambda e, s2: ExpertAgent(e, s2, takeover=True))  # noqa
    played = play(SandboxEnv, _PerEpisode([factory], "check"), [({"task": task}, seed)], max_steps=upto + 1)
    return played.trajectories[0].turns[upto].tool_call


def test_labels_are_the_experts_action_at_each_state_the_student_reached(built_tasks):
    tasks = built_tasks[:12]
    got = collect(SandboxEnv, noisy_student(0.5), ExpertLabels(), tasks, seed=3, round_no=1, batch_size=5)
    assert got.stats["states"] == sum(len(t.turns) for t in got.played.trajectories) > 50
    assert 0.2 < got.stats["agreement"] < 1.0          # the student's mistakes disagree with the teacher
    by_ep = {}
    for lb in got.labels:
        by_ep.setdefault(lb.episode, []).append(lb)
    checked = 0
    for i, labels in by_ep.items():
        traj = got.played.trajectories[i]
        calls = replayed_calls(traj, len(traj.turns))
        assert [lb.step for lb in labels] == list(range(len(traj.turns)))
        for lb in labels[:: max(1, len(labels) // 4)]:   # a spread of states per episode
            assert lb.teacher.call == expert_from(tasks[i], traj.seed, calls, lb.step), (traj.task_id, lb.step)
            checked += 1
        # the student drove (beta 0): every executed call is the student's
        assert all(lb.executed == "student" for lb in labels)
        assert [t.tool_call for t in traj.turns] == [lb.student_call for lb in labels]
    assert checked >= 30
    rows = got.rows["train"] + got.rows["validation"]
    assert len(rows) == got.stats["states"]
    r = rows[0]
    assert r["round"] == 1 and r["messages"][-1]["role"] == "assistant" and r["student_action"]
    assert r["messages"][:2] == [{"role": m["role"], "content": m["content"], "tool_calls": None,
                                  "tool_call_id": None, "name": None} for m in got.labels[0].messages]
    assert sum(x["agreed"] for x in rows) == sum(lb.agreed for lb in got.labels)


def test_a_round_is_deterministic_per_seed(built_tasks):
    tasks = built_tasks[:6]
    a = collect(SandboxEnv, noisy_student(), ExpertLabels(), tasks, seed=5, round_no=2, beta=0.3, batch_size=4)
    b = collect(SandboxEnv, noisy_student(), ExpertLabels(), tasks, seed=5, round_no=2, beta=0.3, batch_size=6)
    assert a.rows == b.rows and a.stats["teacher_steps"] == b.stats["teacher_steps"] > 0
    c = collect(SandboxEnv, noisy_student(), ExpertLabels(), tasks, seed=6, round_no=2, beta=0.3, batch_size=4)
    assert c.rows != a.rows


def test_beta_one_plays_the_expert_teachers_own_episode(built_tasks):
    """With beta = 1 every executed call is the teacher's: the episode is the expert teacher's, call for call."""
    tasks = built_tasks[:8]
    got = collect(SandboxEnv, noisy_student(0.9), ExpertLabels(), tasks, seed=0, round_no=1, beta=1.0)
    teacher = play(SandboxEnv, ScriptedPolicy(ExpertAgent, name="expert", as_text=True),
                   [({"task": t}, round_seed(0, 1, t.id)) for t in tasks])
    for mine, ref in zip(got.played.trajectories, teacher.trajectories, strict=True):
        assert [t.tool_call for t in mine.turns] == [t.tool_call for t in ref.turns]
        assert mine.success == ref.success
    assert all(lb.executed == "teacher" for lb in got.labels)


def test_a_wrong_report_by_the_student_is_not_the_experts_progress(built_tasks):
    """The student reports a wrong answer: the expert, told of it, does not take its own report stage as done;
    it goes on to report the right answer and the task succeeds."""
    task = next(t for t in built_tasks if t.kind == "object_search" and t.difficulty == "easy")
    calls = [{"name": "report", "arguments": {"answer": "nowhere"}}]
    factory = lambda env, s: ReplayAgent(env, s, calls, then=lambda e, s2: ExpertAgent(e, s2, takeover=True))  # noqa
    played = play(SandboxEnv, _PerEpisode([factory], "x"), [({"task": task}, 1)])
    traj = played.trajectories[0]
    assert traj.success and [t.tool_call["name"] for t in traj.turns].count("report") == 2
    # without the takeover mode the expert would take the student's report as its own and stop short
    plain = lambda env, s: ReplayAgent(env, s, calls, then=lambda e, s2: ExpertAgent(e, s2))  # noqa
    assert not play(SandboxEnv, _PerEpisode([plain], "x"), [({"task": task}, 1)]).trajectories[0].success


def test_the_expert_takes_over_from_the_states_of_a_student_that_errs(built_tasks):
    tasks = built_tasks
    played = play(SandboxEnv, noisy_student(0.6), [({"task": t}, 11) for t in tasks])
    res = takeover(SandboxEnv, played.trajectories, {t.id: t for t in tasks}, seed=0, episodes=len(tasks))
    assert res["episodes"] == len(tasks) and res["solvable"] >= len(tasks) - 1
    assert res["expert_success_when_solvable"] == 1.0, res["lost_when_solvable"]


def test_a_model_teacher_is_asked_with_the_prompt_the_student_saw(built_tasks):
    from fake_openai import FakeOpenAI, Reply
    from agent.clients import OpenAIClient
    tasks = built_tasks[:3]
    answer = Reply("I look around first.", tool_calls=[{"name": "look_around", "arguments": {}}])
    with FakeOpenAI(lambda body, n: answer) as server:
        labeller = ModelLabels(OpenAIClient("teacher-m", base_url=server.base_url, api_key_env="NO_KEY_HERE"))
        got = collect(SandboxEnv, noisy_student(0.3), labeller, tasks, seed=0, round_no=1, teacher_name="openai:m")
        asked = [b["messages"] for b in server.requests]
    assert len(asked) == len(got.labels)
    assert sorted(json.dumps(m) for m in asked) == sorted(json.dumps(lb.messages) for lb in got.labels)
    rows = got.rows["train"] + got.rows["validation"]
    assert rows and all(r["messages"][-1]["tool_calls"][0]["function"]["name"] == "look_around" for r in rows)
    assert all(r["teacher"] == "openai:m" for r in rows)


def test_a_local_model_teacher_that_writes_no_call_is_counted_never_a_silent_label(built_tasks, tmp_path):
    """A local transformers teacher (built from a config, untrained): its replies hold no readable call, so no
    state gets a row, every one is counted, and the round fails above the allowed share."""
    from agent.clients import TransformersClient
    from sft.student import StudentConfig, build_tiny_student, train_tokenizer
    texts = [m["content"] for lb in collect(SandboxEnv, noisy_student(), ExpertLabels(), built_tasks[:2], seed=0,
                                              round_no=1).labels for m in lb.messages]
    tok = train_tokenizer(texts, vocab_size=300)
    model = build_tiny_student(StudentConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                             num_kv_heads=1, vocab_size=300), tok)
    model.save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    labeller = ModelLabels(TransformersClient(tmp_path / "teacher", max_new_tokens=8))
    tasks = built_tasks[:2]
    with pytest.raises(OnPolicyError, match=r"teacher labels failed .*unreadable"):
        collect(SandboxEnv, noisy_student(), labeller, tasks, seed=0, round_no=1)
    got = collect(SandboxEnv, noisy_student(), labeller, tasks, seed=0, round_no=1, max_error_share=1.0)
    assert got.stats["teacher_unreadable"] == got.stats["states"] > 0
    assert got.rows == {"train": [], "validation": []}


def test_round_tasks_cover_the_candidates_before_repeating(built_tasks):
    a, b = round_tasks(built_tasks, 10, 0, 1), round_tasks(built_tasks, 10, 0, 2)
    assert len(a) == len(b) == 10 and not {t.id for t in a} & {t.id for t in b}
    assert round_tasks(built_tasks, 10, 0, 1) == a and round_tasks(built_tasks, 10, 1, 1) != a


def test_the_recipe_section_is_checked():
    with pytest.raises(ValueError, match="one value per round"):
        OnPolicyConfig(rounds=2, beta=[0.5])
    with pytest.raises(ValueError, match="probability"):
        OnPolicyConfig(beta=1.5)
    with pytest.raises(ValueError, match="loss: gkd needs a local model teacher"):
        OnPolicyConfig(loss="gkd")
    assert OnPolicyConfig(rounds=2, beta=[0.5, 0.0]).beta_for(2) == 0.0
    with pytest.raises(ValueError, match="beta"):
        DAggerPolicy(noisy_student(), ExpertLabels(), beta=-0.1)


# ----------------------------------------------------------------------------- the stage, end to end


def _recipe(folder: Path, **onpolicy) -> Path:
    r = yaml.safe_load((ROOT / "recipes" / "ci.yaml").read_text())
    r["rl"]["pool_instructions_per_scene"] = 2
    r["onpolicy"] = {"rounds": 2, "tasks_per_round": 6, "beta": [0.5, 0.0], "takeover_episodes": 4,
                     "max_new_tokens": 16, "batch_size": 8, "eval_tasks": 4, **onpolicy}
    (folder / "op.yaml").write_text(yaml.safe_dump(r))
    return folder / "op.yaml"


def _cli(folder: Path, *args, **kw):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=folder, capture_output=True, text=True,
                          timeout=900, **kw)


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    folder = tmp_path_factory.mktemp("onpolicy")
    _recipe(folder)
    r = _cli(folder, "onpolicy", "op.yaml", "--quiet")
    assert r.returncode == 0, r.stderr[-4000:]
    return folder, json.loads(r.stdout.strip().splitlines()[-1])


def test_the_stage_runs_rounds_and_writes_the_onpolicy_config(stage):
    from datasets import load_dataset
    from distill.card import validate_artifact
    folder, printed = stage
    out = folder / "outputs" / "ci" / "onpolicy"
    m = json.loads((out / "metrics.json").read_text())
    assert [r["round"] for r in m["rounds"]] == [0, 1, 2] and printed["rows"] == m["rows"]
    assert (out / "final" / "config.json").is_file() and (out / "manifest.json").is_file()
    meta = validate_artifact(out / "dataset")
    assert [c.config_name for c in meta.configs] == ["conversation", "step", "onpolicy"]
    op = load_dataset(str(out / "dataset"), "onpolicy")
    n = len(op["train"]) + len(op["validation"])
    per_round = [sum(r["collect"]["rows"].values()) for r in m["rounds"][1:]]
    assert n == m["rows"] == sum(per_round) > 0
    assert sorted(set(op["train"]["round"]) | set(op["validation"]["round"])) == [1, 2]
    for r in m["rounds"][1:]:
        c = r["collect"]
        assert c["takeover"]["episodes"] == 4 and 0 <= c["agreement"] <= 1 and c["teacher_errors"] == 0
        assert r["train"]["steps"] > 0 and "all" in r["test"]
    assert m["rounds"][1]["collect"]["teacher_steps"] > 0 == m["rounds"][2]["collect"]["teacher_steps"]  # beta
    card = (out / "dataset" / "README.md").read_text()
    assert "## The `onpolicy` config" in card and "on-policy-distillation" in card


def test_a_killed_round_resumes_without_duplicate_rows(stage, tmp_path):
    folder, _ = stage
    _recipe(tmp_path)
    # the distillation and SFT are reused from the finished run; only the on-policy stage starts over here
    for d in ("distill", "sft"):
        subprocess.run(["cp", "-r", str(folder / "outputs" / "ci" / d), str(tmp_path / "outputs" / "ci" / d)]
                       if (tmp_path / "outputs" / "ci").is_dir() else
                       ["bash", "-c", f"mkdir -p {tmp_path}/outputs/ci && cp -r {folder}/outputs/ci/{d} "
                                      f"{tmp_path}/outputs/ci/"], check=True)
    out = tmp_path / "outputs" / "ci" / "onpolicy"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "onpolicy", "op.yaml", "--quiet"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 600
    while not (out / "round-2" / "rows.jsonl").is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before round 2 was collected"
    proc.send_signal(signal.SIGKILL)   # killed in round 2, after its play, before its training finished
    proc.wait()
    assert not (out / "round-2" / "metrics.json").is_file() and not (out / "manifest.json").is_file()
    r = _cli(tmp_path, "onpolicy", "op.yaml", "--quiet")
    assert r.returncode == 0, r.stderr[-4000:]
    from datasets import load_dataset
    op = load_dataset(str(out / "dataset"), "onpolicy")
    keys = [(t, rd, s) for split in ("train", "validation")
            for t, rd, s in zip(op[split]["task_id"], op[split]["round"], op[split]["step"], strict=True)]
    assert len(keys) == len(set(keys))   # no state labelled twice
    fresh = json.loads((folder / "outputs" / "ci" / "onpolicy" / "metrics.json").read_text())
    resumed = json.loads((out / "metrics.json").read_text())
    assert resumed["rows"] == fresh["rows"] == len(keys)
    assert (out / "round-1" / "rows.jsonl").read_bytes() == \
        (folder / "outputs" / "ci" / "onpolicy" / "round-1" / "rows.jsonl").read_bytes()


def test_other_inputs_discard_the_finished_rounds(stage, tmp_path):
    """A finished round made from another starting student or recipe is never reused as if current."""
    folder, _ = stage
    out = folder / "outputs" / "ci" / "onpolicy"
    key = json.loads((out / "key.json").read_text())
    assert key["init_sha256"] and key["inputs_sha256"]
    _recipe(folder, tasks_per_round=4, rounds=1, beta=0.0)
    r = _cli(folder, "onpolicy", "op.yaml", "--quiet", "--out", "outputs/ci/onpolicy")
    assert r.returncode == 0, r.stderr[-4000:]
    m = json.loads((out / "metrics.json").read_text())
    assert [x["round"] for x in m["rounds"]] == [0, 1] and not (out / "round-2").exists()
    assert m["rounds"][1]["collect"]["episodes"] == 4


def test_gkd_trains_a_student_on_collected_prompts_against_a_teacher_sharing_its_tokenizer(built_tasks, tmp_path):
    """`onpolicy.loss: gkd`: TRL's GKDTrainer between two small local models built from configs (one tokenizer)."""
    from distill.card import card_metadata
    from distill.dataset import write_artifact
    from sft.student import StudentConfig, build_tiny_student, corpus_texts, train_tokenizer
    from sft.train import SFTSection, run_gkd
    got = collect(SandboxEnv, noisy_student(), ExpertLabels(), built_tasks[:4], seed=0, round_no=1)
    rows = got.rows["train"] + got.rows["validation"]
    split = {"train": rows[: len(rows) - 4], "validation": rows[-4:]}

    def card(sizes, files):
        return "---\n" + card_metadata(sizes, "apache-2.0", "t", "onpolicy", files).card_data().to_yaml() + "\n---\n"
    write_artifact(tmp_path / "data", {"onpolicy": split}, card)
    tok = train_tokenizer(corpus_texts(split["train"]), vocab_size=400)
    small = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=400)
    for name, seed, layers in (("student", 0, 1), ("teacher", 1, 2)):
        m = build_tiny_student(StudentConfig(**{**small, "num_layers": layers}), tok, seed)
        m.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    cfg = SFTSection(student=StudentConfig(**small), max_steps=2, batch_size=2, lr=1e-3, logging_steps=1)
    m = run_gkd(cfg, tmp_path / "data", tmp_path / "out", init=tmp_path / "student", teacher=tmp_path / "teacher",
                max_new_tokens=8, config="onpolicy")
    assert m["steps"] == 2 and m["loss"] == "gkd" and (tmp_path / "out" / "final" / "config.json").is_file()
    from safetensors.torch import load_file
    before, after = load_file(str(tmp_path / "student" / "model.safetensors")), \
        load_file(str(tmp_path / "out" / "final" / "model.safetensors"))
    assert any(not before[k].equal(after[k]) for k in before)   # the student moved
    other = train_tokenizer(list(corpus_texts(split["train"]))[:20], vocab_size=300)
    other.save_pretrained(tmp_path / "teacher")
    with pytest.raises(ValueError, match="does not share the student's tokenizer"):
        run_gkd(cfg, tmp_path / "data", tmp_path / "out2", init=tmp_path / "student", teacher=tmp_path / "teacher",
                config="onpolicy")


def test_gkd_batches_carry_the_prompt_the_student_sees_at_play_tools_included(built_tasks):
    """A Hub model's template lists the tools: GKD's prompts must be rendered with the row's `tools`, exactly as
    `TransformersClient.render_prompt` renders them when the student plays (they were once left out)."""
    from agent.clients import TransformersClient
    from sft.student import StudentConfig, build_tiny_student, corpus_texts, train_tokenizer
    from sft.train import PromptCompletionCollator
    rows = collect(SandboxEnv, noisy_student(), ExpertLabels(), built_tasks[:2], seed=0, round_no=1).rows["train"]
    tok = train_tokenizer(corpus_texts(rows), vocab_size=400)
    tok.chat_template = ("{%- if tools %}<|user|>Tools: {{ tools | map(attribute='function') | "
                         "map(attribute='name') | join(', ') }}<|end|>{% endif -%}" + tok.chat_template)
    small = StudentConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    client = TransformersClient(build_tiny_student(small, tok, 0), tok, device="cpu")
    batch = PromptCompletionCollator(tok, max_length=4096)(rows[:3])
    for i, row in enumerate(rows[:3]):
        at_play = client.render_prompt(row["messages"][:-1], row["tools"])
        assert "Tools: navigate, " in at_play
        ids = batch["prompts"][i][batch["prompt_attention_mask"][i].bool()].tolist()
        assert ids == tok(at_play, add_special_tokens=False)["input_ids"]
