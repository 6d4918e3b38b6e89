"""Reward engine core: rule checks on real sandbox trajectories, the structured prompt, the verdict cache, the
LLM backend against a loopback server that misbehaves, and the judge CLI."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from agent.episode import play as play_episodes
from agent.policies import ScriptedPolicy
from agent.trajectory import Trajectory, read_jsonl, write_jsonl
from evaluation.sandbox_eval import evaluate
from reward_engine.judge import LLMBackend, RewardEngine, VerdictCache, summarize, turn_content_hashes
from reward_engine.prompt import PromptStore, RewardPrompt, default_prompt, load_prompt
from sandbox.agents import ExpertAgent
from sandbox.gym_env import SandboxEnv
from conftest import ROOT
from fake_openai import Delay, FakeOpenAI, Garbage, Reply, Status

REASON = "the storage door is locked and I need to get the key room open"


def script(calls: list, thought: str = "scripted"):
    """A scripted agent playing a fixed list of calls (or text), then finishing (the sandbox is real; only the
    agent is scripted): a factory for `ScriptedPolicy`."""
    class Script:
        def __init__(self, env, seed):
            self.i = 0

        def act(self, info):
            call = calls[self.i] if self.i < len(calls) else {"name": "finish", "arguments": {}}
            self.i += 1
            return thought, call

        def observe(self, call, info, observation):
            pass
    return Script


def _c(name, **args):
    return {"name": name, "arguments": args}


def play_one(task, agent, name: str = "script") -> Trajectory:
    return play_episodes(SandboxEnv, ScriptedPolicy(agent, name=name), [({"task": task}, 0)]).trajectories[0]


def play(task, calls) -> Trajectory:
    return play_one(task, script(calls))


@pytest.fixture(scope="module")
def engine():
    return RewardEngine()


@pytest.fixture(scope="module")
def expert_and_random(built_tasks):
    tasks = built_tasks[:40]
    _, ex = evaluate(tasks, "expert")
    _, rd = evaluate(tasks, "random")
    return ex, rd


# --------------------------------------------------------------------------- rules on crafted trajectories


def test_recovery_scores_above_blind_retry(task, engine):
    locked = _c("open", target="d_hall_storage")
    recover = play(task, [locked, _c("ask_for_help", person="alice", request="unlock", target="d_hall_storage",
                                     reason=REASON)])
    retry = play(task, [locked, locked])
    assert recover.turns[0].error is not None and recover.turns[1].error is None
    assert retry.turns[1].error == retry.turns[0].error
    vr, vb = engine.score(recover).turns[1], engine.score(retry).turns[1]
    assert vr.label == "useful" and 0 in vr.evidence and "recovered" in vr.rationale
    assert vb.label in ("redundant", "inconsistent")
    assert {"general.blind_retry", "manipulation.known_locked"} <= {v.id for v in vb.violations}
    assert vb.evidence == [0, 1]
    assert vr.score > vb.score + 0.5
    # walking into the door again is caught too (the route is known to be blocked now)
    walk = play(task, [_c("navigate", target="storage"), _c("navigate", target="storage")])
    w = engine.score(walk).turns
    assert w[0].label == "useful" and w[1].label == "inconsistent"
    assert "navigation.known_blocked" in {v.id for v in w[1].violations}


def test_help_without_meeting_the_obstacle_is_an_omission(task, engine):
    help_call = _c("ask_for_help", person="alice", request="unlock", target="d_hall_storage", reason=REASON)
    blind = engine.score(play(task, [help_call])).turns[0]
    checked = engine.score(play(task, [_c("open", target="d_hall_storage"), help_call])).turns[1]
    inspected = engine.score(play(task, [_c("inspect", target="d_hall_storage"), help_call])).turns[1]
    om = [v for v in blind.violations if v.id == "rule.help_after_obstacle"]
    assert om and om[0].omission and om[0].penalty > 0
    assert not checked.violations and not inspected.violations
    assert blind.score < checked.score and blind.score < inspected.score


def test_report_before_observing_and_early_finish_are_penalised(built_tasks, engine):
    task = next(t for t in built_tasks if t.kind == "object_search")
    assert [g.predicate.kind for g in task.subgoals][-1] == "reported"
    expert = play_one(task, ExpertAgent, "expert")
    good_report = next(i for i, u in enumerate(expert.turns) if u.tool_call["name"] == "report")
    v = engine.score(expert)
    assert expert.success and not v.turns[good_report].violations and v.turns[good_report].label == "useful"
    answer = expert.turns[good_report].tool_call["arguments"]["answer"]
    early = play(task, [_c("report", answer=answer), _c("finish")])
    ve = engine.score(early)
    assert early.turns[0].error is None  # the env accepts it: only the judge sees the skipped step
    ids0 = {x.id: x for x in ve.turns[0].violations}
    assert "rule.report_after_observe" in ids0 and ids0["rule.report_after_observe"].omission
    assert "rule.finish_after_subgoals" in {x.id for x in ve.turns[1].violations}
    assert ve.turns[0].score < v.turns[good_report].score - 0.5
    assert ve.episode.score < v.episode.score - 0.5


def test_malformed_and_hallucinated_calls(task, engine):
    calls = ["I think I should go.", _c("fly", to="moon"), _c("navigate", place="kitchen"),
             _c("navigate", target="atlantis"), _c("navigate", target="kitchen")]
    tr = play_one(task, script(calls, thought=""))
    v = engine.score(tr).turns
    assert tr.turns[0].tool_call is None and tr.turns[0].raw_output == "I think I should go."
    assert [x.label for x in v[:5]] == ["malformed", "malformed", "malformed", "inconsistent", "useful"]
    assert v[0].section == "general" and v[4].section == "navigation"
    assert all(x.score == -1.0 for x in v[:3])


def test_expert_scores_far_above_random(expert_and_random, engine):
    ex, rd = expert_and_random
    se = summarize([engine.score(t) for t in ex])
    sr = summarize([engine.score(t) for t in rd])
    assert se["mean_episode_score"] > 0.9 and sr["mean_episode_score"] < 0.25
    # the teacher's own turns break no verifiable rule
    bad = [(t.task_id, u.index, x.id) for t in ex for u in engine.score(t).turns for x in u.violations
           if x.kind in ("verifiable", "rule")]
    assert not bad, bad[:5]
    assert se["labels"]["useful"] / se["turns"] > 0.97
    assert sr["labels"]["useful"] / sr["turns"] < 0.3
    assert se["judge_error"] == 0 and set(se["score_per_skill"]) >= {"navigate", "finish"}


def test_rule_backend_is_deterministic(expert_and_random):
    ex, rd = expert_and_random
    a = [RewardEngine().score(t).model_dump_json() for t in ex + rd]
    b = [RewardEngine().score(t).model_dump_json() for t in ex + rd]
    assert a == b


def test_episode_score_parts(expert_and_random, engine):
    ex, _ = expert_and_random
    for t in ex:
        e = engine.score(t).episode
        assert e.success and e.completeness == 1.0 and e.correctness == 1.0
        assert e.efficiency == pytest.approx(min(1.0, max(t.optimal_steps, 1) / len(t.turns)), abs=1e-4)
        assert 0 <= e.score <= 1


# --------------------------------------------------------------------------- prompt object, snapshots, cache


def test_prompt_components_versions_and_snapshots(tmp_path):
    p = default_prompt()
    ids = [c.id for c in p.components()]
    assert len(ids) == len(set(ids))
    assert {s.id for s in p.sections} == {"general", "navigation", "search", "manipulation", "dialogue",
                                          "reporting", "termination"}
    item = p.get("reporting.unasked")
    p2 = p.with_component(item.model_copy(update={"text": "Reporting although no report was asked for."}))
    assert p2.version == 2 and p2.get("reporting.unasked").version == 2 and p2.parent_hash == p.content_hash()
    assert p2.content_hash() != p.content_hash() and p2.get("navigation").version == 1
    store = PromptStore(tmp_path / "snaps")
    store.save(p)
    store.save(p2)
    assert [v for v, _, _ in store.versions()] == [1, 2]
    assert store.load(1).content_hash() == p.content_hash()
    assert store.load(p2.content_hash()[:8]) == p2
    with pytest.raises(ValueError, match="unknown check"):
        p.with_component(item.model_copy(update={"check": "os.system"}))
    bad = json.loads(p.model_dump_json())
    bad["scoring"]["label_scores"].pop("unsafe")
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="unsafe"):
        load_prompt(tmp_path / "bad.json")
    text = p.render_turn_system("report")
    assert "rule.report_after_observe" in text and "reporting.unasked" in text and '"label"' in text
    assert "navigation.known_blocked" not in text


def test_cache_rejudges_only_turns_whose_rubric_changed(expert_and_random, tmp_path):
    ex, rd = expert_and_random
    trajs = ex + rd
    cache = VerdictCache(tmp_path / "cache.jsonl")
    base = RewardEngine(cache=cache)
    first = [base.score(t) for t in trajs]
    n_turns = sum(len(t.turns) for t in trajs)
    # identical histories (two variants of one instruction, same first moves) share a verdict
    distinct = {h for t in trajs for h in turn_content_hashes(t)}
    assert cache.misses == len(distinct) == len(cache) and cache.hits == n_turns - len(distinct)
    p = default_prompt()
    edited = p.with_component(p.get("reporting.unasked").model_copy(update={"penalty": 0.4}))
    cache.hits = cache.misses = 0
    second = [RewardEngine(edited, cache=cache).score(t) for t in trajs]
    n_report = len({h for t in trajs for u, h in zip(t.turns, turn_content_hashes(t), strict=True)
                    if u.tool_call and u.tool_call["name"] == "report"})
    assert 0 < n_report < len(distinct) and cache.misses == n_report and cache.hits == n_turns - n_report
    # an episode-weight edit re-judges no turn, and unchanged verdicts are identical
    ep = edited.with_component(edited.episode.model_copy(update={"weights": {
        "completeness": 1.0, "correctness": 0.0, "efficiency": 0.0, "consistency": 0.0}}))
    cache.hits = cache.misses = 0
    third = [RewardEngine(ep, cache=cache).score(t) for t in trajs]
    assert cache.misses == 0
    assert [v.turns for v in third] == [v.turns for v in second]
    assert third[0].episode.score == third[0].episode.completeness
    # the cache survives a restart (file) and skips a torn last line
    with open(tmp_path / "cache.jsonl", "a") as f:
        f.write('{"key": "x", "verd')
    reloaded = VerdictCache(tmp_path / "cache.jsonl")
    again = [RewardEngine(cache=reloaded).score(t) for t in trajs]
    assert reloaded.misses == 0 and [a.turns for a in again] == [f.turns for f in first]


# --------------------------------------------------------------------------- LLM backend over loopback HTTP


def _verdict(label="useful", score=0.4, evidence=None, **kw):
    return json.dumps({"label": label, "score": score, "rationale": "fine", "evidence": evidence or [], **kw})


def _turn_index(body) -> int:
    return int(body["messages"][1]["content"].split("Judge this turn (", 1)[1].split(")", 1)[0])


def _client(server, **kw):
    from agent.clients import OpenAIClient
    return OpenAIClient("judge-model", base_url=server.base_url, timeout=kw.pop("timeout", 2.0),
                        max_retries=kw.pop("max_retries", 2), backoff=0.01, max_concurrency=2, **kw)


@pytest.fixture(scope="module")
def small_traj(task):
    return play(task, [_c("open", target="d_hall_storage"),
                       _c("ask_for_help", person="alice", request="unlock", target="d_hall_storage", reason=REASON),
                       _c("navigate", target="storage"), _c("navigate", target="atlantis")])


def test_llm_backend_valid_replies_bounded_by_verified_facts(small_traj):
    with FakeOpenAI(lambda body, n: Reply(_verdict(evidence=[_turn_index(body)]))) as srv:
        be = LLMBackend(_client(srv))
        v = RewardEngine(backend=be).score(small_traj)
        assert v.backend == "llm:judge-model" and v.judge_errors == 0
        assert [u.source for u in v.turns] == ["llm"] * len(small_traj.turns)
        # turn 3 names an unknown place: verified in code, so the model's "useful" cannot stand
        assert v.turns[3].label == "inconsistent" and v.turns[3].score <= -0.6
        assert v.turns[1].label == "useful" and v.turns[1].score == 0.4
        body = srv.requests[0]
        assert body["response_format"] == {"type": "json_object"} and body["temperature"] == 0.0
        assert "Rubric: Every turn" in body["messages"][0]["content"]
        # the prompt is judged per skill: the ask_for_help turn sees the dialogue rubric and its rule
        sys1 = next(b for b in srv.requests if _turn_index(b) == 1)["messages"][0]["content"]
        assert "Dialogue and help" in sys1 and "rule.help_after_obstacle" in sys1


def test_llm_backend_repairs_invalid_json_then_counts_judge_errors(small_traj):
    def responder(body, n):
        t = _turn_index(body)
        repairs = sum(1 for m in body["messages"] if m["role"] == "user" and "Your reply was invalid" in m["content"])
        if t == 0:  # invalid once, then valid: repaired
            return Reply("not json at all") if repairs == 0 else Reply(_verdict())
        if t == 1:  # evidence from the future, then a bad label: never valid
            return Reply(_verdict(evidence=[9])) if repairs == 0 else Reply(_verdict(label="great"))
        if t == 2:
            return Garbage("<html>oops</html>")  # not even a completion object
        return Reply(_verdict())

    with FakeOpenAI(responder) as srv:
        be = LLMBackend(_client(srv, max_retries=1), max_repairs=2)
        v = RewardEngine(backend=be).score(small_traj)
    assert v.turns[0].judge_error is None and v.turns[0].score == 0.4
    assert v.turns[1].judge_error.startswith("invalid_reply") and v.turns[1].score is None
    assert "label" in v.turns[1].judge_error
    assert v.turns[2].judge_error.startswith("model_error") and v.turns[2].score is None
    assert v.judge_errors == 2 and be.stats["judge_errors"] == 2 and be.stats["repairs"] == 3
    s = summarize([v])
    assert s["judge_error"] == 2 and s["mean_episode_score"] is None and s["episodes_with_judge_errors"] == 1
    assert v.turn_rewards[1] is None and v.turn_rewards[0] == 0.4


def test_llm_backend_timeouts_and_5xx_are_retried_then_counted(small_traj):
    calls = {"n": 0}

    def responder(body, n):
        t = _turn_index(body)
        calls["n"] += 1
        attempt = sum(1 for b in srv.requests[:n + 1] if _turn_index(b) == t)
        if t == 0:
            return Status(503) if attempt == 1 else Reply(_verdict())   # one 5xx, then fine
        if t == 1:
            return Delay(1.0, Reply(_verdict())) if attempt <= 1 else Reply(_verdict())  # one timeout
        if t == 2:
            return Status(500)                                             # always down
        return Reply(_verdict())

    with FakeOpenAI(responder) as srv:
        client = _client(srv, timeout=0.4, max_retries=2)
        be = LLMBackend(client)
        cache = VerdictCache()
        v = RewardEngine(backend=be, cache=cache).score(small_traj)
        assert v.turns[0].judge_error is None and v.turns[1].judge_error is None
        assert v.turns[2].judge_error.startswith("model_error:http") and v.turns[2].score is None
        assert client.stats["retries"] >= 1 + 1 + 2
        # the bounded retries: turn 2 was asked exactly 1 + max_retries times, and no repair was attempted
        assert sum(1 for b in srv.requests if _turn_index(b) == 2) == 3
        # a failed verdict is not cached: judging again asks only for that turn
        before = len(srv.requests)
        again = RewardEngine(backend=be, cache=cache).score(small_traj)
        asked = {_turn_index(b) for b in srv.requests[before:]}
    assert asked == {2} and again.judge_errors == 1


# --------------------------------------------------------------------------- CLI and bad input


def test_judge_cli_with_bad_lines(expert_and_random, tmp_path):
    from pipeline.cli import app
    ex, rd = expert_and_random
    path = tmp_path / "trajs.jsonl"
    write_jsonl(path, ex[:3] + rd[:3])
    lines = path.read_text().splitlines()
    broken = json.loads(lines[1])
    del broken["turns"][0]["observation"]
    lines[1] = json.dumps(broken)
    lines.insert(3, "{not json")
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "judge"
    r = CliRunner().invoke(app, ["judge", "--trajectories", str(path), "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["trajectories"] == 5 and s["bad_lines"] == 2
    errs = {e["line"]: e["error"] for e in s["bad_line_errors"]}
    assert "turns.0.observation" in errs[2] and "not JSON" in errs[4]
    assert "trajs.jsonl:2" in r.output and "turns.0.observation" in r.output
    rows = list(read_jsonl(out / "verdicts.jsonl", __import__("reward_engine.judge", fromlist=["x"])
                           .TrajectoryVerdict))
    assert len(rows) == 5 and all(row.prompt_version == 1 and row.backend == "rule" for row in rows)
    assert set(s) >= {"mean_episode_score", "score_per_skill", "labels", "judge_error"}
    assert RewardPrompt.model_validate_json(next((out / "prompts").glob("v0001-*.json")).read_text())
    r2 = CliRunner().invoke(app, ["judge", "--trajectories", str(tmp_path / "missing.jsonl"), "--out", str(out)])
    assert r2.exit_code == 2 and "no such file" in r2.output
    r3 = CliRunner().invoke(app, ["judge", "--trajectories", str(path), "--out", str(out), "--backend", "gpt"])
    assert r3.exit_code == 2 and "--backend" in r3.output


def test_recipe_judge_section(tmp_path, task):
    from pipeline.recipe import load_recipe
    from pipeline.stages import make_reward_engine
    snap = PromptStore(tmp_path / "p").save(default_prompt())
    with FakeOpenAI(lambda body, n: Reply(_verdict(score=0.1))) as srv:
        path = tmp_path / "r.yaml"
        path.write_text(f"name: j\njudge:\n  backend: llm\n  prompt: {snap}\n  model:\n    kind: openai\n"
                        f"    model: judge\n    base_url: {srv.base_url}\n")
        eng = make_reward_engine(load_recipe(path))
        v = eng.score(play(task, [_c("look_around")]))
    assert v.backend == "llm:judge" and v.turns[0].score == 0.1 and v.prompt_hash == default_prompt().content_hash()
    assert make_reward_engine(load_recipe(ROOT / "recipes" / "ci.yaml")).backend.id == "rule"
