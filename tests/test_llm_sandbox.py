"""The LLM builder and the LLM persona against a loopback OpenAI-compatible server (real SDK, real HTTP):
replies are real sandbox JSON and real paraphrases, and everything goes through the real validation,
controller and expert."""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager

import pytest

from agent.clients import OpenAIClient
from sandbox.builder import BuildConfig, BuildStats, ProceduralBuilder
from sandbox.controller import EnvController, report_matches
from sandbox.expert import ExpertPlanner
from agent.llm_builder import LLMBuilder, reply_schema, variant_json
from agent.llm_persona import LLMHumanAgent
from sandbox.scenes import load_scene
from sandbox.world import Compiled

from fake_openai import FakeOpenAI, Reply, Status


def client(server: FakeOpenAI, **kw) -> OpenAIClient:
    kw.setdefault("backoff", 0.0)
    return OpenAIClient("fake-model", base_url=server.base_url, api_key_env="EMBODISTILL_TEST_KEY_UNSET", **kw)


# ============================================================================ LLM builder


@pytest.fixture(scope="module")
def home():
    scene, cfg = load_scene("home"), BuildConfig()
    tasks = ProceduralBuilder(scene, cfg, BuildStats()).build(0, "train")
    assert [t.difficulty for t in tasks] == ["easy", "medium", "hard"]
    return scene, cfg, tasks


def reply_of(tasks, variants: dict | None = None, instruction: str | None = None) -> Reply:
    """A model reply holding the procedural tasks' variants (or the given variant dicts)."""
    variants = variants if variants is not None else {t.difficulty: variant_json(t) for t in tasks}
    return Reply(json.dumps({"instruction": instruction or tasks[0].instruction, "kind": tasks[0].kind,
                             "variants": variants}))


def broken(tasks, easy="schema", medium="leak", hard="unsolvable") -> dict:
    """Variants that fail on purpose: a schema error, a leak, no solution, a miscounted or mistargeted trigger."""
    good = {t.difficulty: variant_json(t) for t in tasks}
    out = copy.deepcopy(good)

    def breaking(kind: str, d: str) -> dict:
        v = copy.deepcopy(good[d])
        if kind == "schema":
            v["env_state"]["agent"]["colour"] = "red"
        elif kind == "leak":  # the agent's map shows what the obstacle is
            v["agent_view"]["objects"][0]["name"] = v["failure_triggers"][0]["condition"]
        elif kind == "unsolvable":  # a success condition nothing can make true (a sofa is no device)
            v["success"].append({"kind": "object_state", "object": "sofa", "field": "on", "value": True})
        elif kind == "wrong_count":
            v = copy.deepcopy(good["medium"])
        elif kind == "bad_target":
            v["failure_triggers"][0]["kind"] = "locked_door"
            v["failure_triggers"][0]["target"] = "sofa"
        return v

    for d, kind in (("easy", easy), ("medium", medium), ("hard", hard)):
        if kind:
            out[d] = breaking(kind, d)
    return out


def test_valid_replies_are_accepted_as_the_procedural_builder_would(home):
    scene, cfg, tasks = home
    with FakeOpenAI(lambda body, n: reply_of(tasks)) as server:
        builder = LLMBuilder(client(server), cfg, [scene])
        out = builder.build(7, "train")
    assert server.errors == [] and len(server.requests) == 1
    assert [t.id for t in out] == ["home-train-llm7-easy", "home-train-llm7-medium", "home-train-llm7-hard"]
    for mine, theirs in zip(out, tasks, strict=True):
        a, b = mine.model_dump(), theirs.model_dump()
        assert {k for k in a if a[k] != b[k]} == {"id", "seed"}   # budget and optimal steps set by validation
    assert builder.stats.to_json()["accepted"] == 3 and builder.stats.to_json()["expert_solved"] == 1.0
    body = server.requests[0]
    assert body["response_format"] == {"type": "json_object"} and body["seed"] == 7
    prompt = body["messages"][1]["content"]
    assert json.dumps(reply_schema(), separators=(",", ":")) in prompt
    assert '"id":"door_hallway_kitchen"' in prompt            # the scene's connection ids
    assert "Example reply (built by the procedural builder" in prompt


def test_rejected_variants_are_asked_for_again_with_the_reasons(home):
    scene, cfg, tasks = home
    first = reply_of(tasks, broken(tasks))
    with FakeOpenAI(lambda body, n: first if n == 0 else reply_of(tasks)) as server:
        builder = LLMBuilder(client(server), cfg, [scene])
        out = builder.build(7, "train")
    assert [t.difficulty for t in out] == ["easy", "medium", "hard"] and len(server.requests) == 2
    assert builder.attempt_reasons == {"schema:('env_state', 'agent')": 1, "leak": 1, "oracle_failed": 1}
    assert builder.stats.to_json()["rejected"] == 0
    retry = server.requests[1]["messages"]
    assert [m["role"] for m in retry] == ["system", "user", "assistant", "user"]
    assert retry[2]["content"] == first.content
    feedback = retry[3]["content"]
    assert "easy: rejected (schema:('env_state', 'agent')): env_state.agent.colour: Extra inputs" in feedback
    condition = tasks[1].failure_triggers[0].condition
    assert "medium: rejected (leak)" in feedback and f"hidden string {condition!r} visible" in feedback
    assert "hard: rejected (oracle_failed)" in feedback


def test_retries_are_bounded_and_every_reason_is_counted(home):
    scene, cfg, tasks = home
    bad = reply_of(tasks, broken(tasks, easy="wrong_count", medium="bad_target", hard="unsolvable"))
    with FakeOpenAI(lambda body, n: bad) as server:
        builder = LLMBuilder(client(server), cfg, [scene], max_attempts=3)
        assert builder.build(7, "train") == []
    assert len(server.requests) == 3
    stats = builder.stats.to_json()
    assert stats["total"] == 3 and stats["rejected"] == 3
    assert stats["rejected_reasons"] == {"bad_reference": 1, "oracle_failed": 1, "trigger_count": 1}
    assert all(v == {"accepted": 0, "rejected": 1} for v in stats["by_difficulty"].values())
    assert builder.attempt_reasons == {"bad_reference": 3, "oracle_failed": 3, "trigger_count": 3}
    assert [a[3] for a in builder.attempts if a[2] == "hard"] == [1, 2, 3]
    feedback = server.requests[1]["messages"][3]["content"]
    assert "an easy variant has no failure_triggers; this one has 1" in feedback
    assert "a locked_door targets a connection, not 'sofa'" in feedback


def test_unreadable_replies_and_endpoint_errors_use_up_attempts(home):
    scene, cfg, tasks = home
    answers = [Reply("Sure! Here is a lovely task."), Status(400), reply_of(tasks)]
    with FakeOpenAI(lambda body, n: answers[n]) as server:
        builder = LLMBuilder(client(server, max_retries=0), cfg, [scene], max_attempts=3)
        out = builder.build(7, "train")
    assert len(out) == 3 and len(server.requests) == 3
    assert builder.attempt_reasons == {"reply_not_json": 3, "model_error:http": 3}
    # after the endpoint error the same request is sent again (there was no reply to answer)
    assert server.requests[2]["messages"] == server.requests[1]["messages"]


def test_accepted_variants_fix_the_instruction_for_the_rest(home):
    scene, cfg, tasks = home
    answers = [reply_of(tasks, broken(tasks, easy=None, medium=None)),
               reply_of(tasks, instruction="Go to the garage."), reply_of(tasks)]
    with FakeOpenAI(lambda body, n: answers[n]) as server:
        builder = LLMBuilder(client(server), cfg, [scene])
        out = builder.build(7, "train")
    assert [t.difficulty for t in out] == ["easy", "medium", "hard"]
    assert {t.instruction for t in out} == {tasks[0].instruction}
    assert builder.attempt_reasons == {"oracle_failed": 1, "instruction_changed": 1}
    assert "Write the variants hard again" in server.requests[1]["messages"][3]["content"]
    assert f"Keep the instruction exactly: {tasks[0].instruction!r}" in server.requests[2]["messages"][3]["content"]


def test_other_split_instructions_and_layouts_are_refused(home):
    scene, cfg, tasks = home
    with FakeOpenAI(lambda body, n: reply_of(tasks)) as server:
        b1 = LLMBuilder(client(server), cfg, [scene], max_attempts=1)
        assert b1.build(7, "test", forbidden_texts={tasks[0].instruction}) == []
        b2 = LLMBuilder(client(server), cfg, [scene], max_attempts=1)
        assert b2.build(7, "test", forbidden_layouts={tasks[0].layout_id}) == []
    assert b1.stats.to_json()["rejected_reasons"] == {"instruction_in_other_split": 3}
    assert b2.stats.to_json()["rejected_reasons"] == {"layout_in_other_split": 3}


def test_same_replies_give_the_same_tasks(home):
    scene, cfg, tasks = home
    first = reply_of(tasks, broken(tasks))
    runs = []
    for _ in range(2):
        with FakeOpenAI(lambda body, n: first if n == 0 else reply_of(tasks)) as server:
            builder = LLMBuilder(client(server), cfg, [scene, load_scene("office")])
            runs.append(([t.model_dump_json() for t in builder.build(4, "train", scene="home")],
                         [r["messages"] for r in server.requests], builder.stats.to_json()))
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="unknown scene 'park'"):
        builder.build(4, "train", scene="park")


# ============================================================================ LLM persona


def paraphrase(body, n):
    """A polite rewording that keeps the line (as a careful model would)."""
    return Reply("Well, let me see. " + body["messages"][1]["content"])


def run_expert(task, human=None):
    ctrl = EnvController(task, human=human)
    ctrl.reset()
    return ctrl, ExpertPlanner(ctrl, privileged=False).run()


def test_paraphrasing_people_keep_every_episode_solvable(built_tasks):
    with FakeOpenAI(paraphrase) as server:
        llm = client(server)
        said = 0
        for t in built_tasks:
            human = LLMHumanAgent(Compiled(t), llm)
            ctrl, steps = run_expert(t, human)
            rule_ctrl, rule_steps = run_expert(t)
            assert ctrl.human is human and human.fallbacks == 0, (t.id, human.fallback_reasons)
            assert ctrl.success and rule_ctrl.success and len(steps) == len(rule_steps), t.id
            said += sum('says: "Well, let me see.' in r.observation for _, _, r in steps)
    assert said > 50 and server.errors == []


@contextmanager
def hand_world(task, responder):
    """The hand-made world (conftest): Alice in the hall knows the visiting hours and where the phone is;
    Bob in the kitchen is busy until asked twice. Yields (server, persona, controller)."""
    with FakeOpenAI(responder) as server:
        human = LLMHumanAgent(task, client(server))
        ctrl = EnvController(task, human=human)
        ctrl.reset()
        yield server, human, ctrl


def test_a_good_paraphrase_is_what_the_person_says(task):
    with hand_world(task, lambda body, n: Reply('"Oh, visiting hours end at 8 pm, dear."')) as (server, human, ctrl):
        res = ctrl.step({"name": "talk_to", "arguments": {"person": "alice", "topic": "f_hours"}})
    assert res.observation == 'Alice says: "Oh, visiting hours end at 8 pm, dear."'
    assert ctrl.world.notes["f_hours"] == "Alice: Oh, visiting hours end at 8 pm, dear."
    assert report_matches("Oh, visiting hours end at 8 pm, dear.", "8 pm", [])
    system = server.requests[0]["messages"][0]["content"]
    assert "Keep these exactly as written: 8 pm." in system and "caretaker" in system and "friendly" in system
    assert human.fallbacks == 0 and human.requests == 1


def test_a_reply_that_drops_what_the_agent_needs_falls_back(task):
    with hand_world(task, lambda body, n: Reply("I'm sorry, I can't help you with that.")) as (_, human, ctrl):
        hours = ctrl.step({"name": "talk_to", "arguments": {"person": "alice", "topic": "f_hours"}})
        phone = ctrl.step({"name": "talk_to", "arguments": {"person": "alice", "topic": "phone_1"}})
        ctrl.step({"name": "navigate", "arguments": {"target": "kitchen"}})
        busy = ctrl.step({"name": "talk_to", "arguments": {"person": "bob", "topic": "book_1"}})
        cannot = ctrl.step({"name": "ask_for_help", "arguments": {"person": "bob", "request": "repair",
                                                                   "target": "lamp_1", "reason": "it is broken"}})
    assert hours.observation == 'Alice says: "Visiting hours end at 8 pm."'
    assert phone.observation == 'Alice says: "The phone is in the back room, through the door from the kitchen."'
    assert busy.observation == 'Bob says: "Busy. Ask again later."' and busy.error == "refused"
    assert cannot.observation == "Bob says: \"I'm sorry, I can't help you with that.\""  # nothing was needed
    assert human.fallbacks == 3
    assert human.fallback_reasons == {"lost_answer": 1, "lost_name": 1, "changed_signal": 1}


def test_model_errors_fall_back_and_never_end_an_episode(built_tasks):
    asking = [t for t in built_tasks if t.kind == "ask_person"][:4]
    assert asking
    asked = 0
    with FakeOpenAI(lambda body, n: Status(500)) as server:
        llm = client(server, max_retries=1)
        for t in asking:
            human = LLMHumanAgent(t, llm)
            ctrl, _ = run_expert(t, human)
            assert ctrl.success, t.id
            assert human.fallbacks == human.requests > 0
            assert set(human.fallback_reasons) == {"model_error:http"}
            asked += human.requests
    assert len(server.requests) == 2 * asked   # each line tried twice (one retry), then the rule line


def test_replies_are_cached_per_person_key_and_content(task):
    with hand_world(task, paraphrase) as (server, human, ctrl):
        for _ in range(2):
            ctrl.step({"name": "talk_to", "arguments": {"person": "alice", "topic": "f_hours"}})
        assert len(server.requests) == 1 and human.requests == 1
        other = LLMHumanAgent(task, human.client, cache=human.cache)   # a shared cache: no new request
        ctrl2 = EnvController(task, human=other)
        ctrl2.reset()
        again = ctrl2.step({"name": "talk_to", "arguments": {"person": "alice", "topic": "f_hours"}})
        assert len(server.requests) == 1 and other.requests == 0
        assert again.observation == 'Alice says: "Well, let me see. Visiting hours end at 8 pm."'
        ctrl.step({"name": "talk_to", "arguments": {"person": "alice", "topic": "phone_1"}})
        assert len(server.requests) == 2   # other content, a new request


# ----------------------------------------------------------------------------- recipe modes


def test_recipe_selects_llm_persona_and_builder(tmp_path, built_tasks):
    from pipeline.recipe import RecipeError, load_recipe
    from pipeline.stages import human_factory, run_eval

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsandbox:\n  persona: llm\n")
    with pytest.raises(RecipeError, match="persona_model"):
        load_recipe(bad)
    bad.write_text("name: x\njudge:\n  backend: llm\n")
    with pytest.raises(RecipeError, match="needs model"):
        load_recipe(bad)
    with FakeOpenAI(paraphrase) as srv:
        path = tmp_path / "r.yaml"
        path.write_text(f"name: llm-persona\nsandbox:\n  scenes: [home]\n  train_instructions_per_scene: 1\n"
                        f"  test_instructions_per_scene: 3\n  persona: llm\n  persona_model:\n    kind: openai\n"
                        f"    model: persona\n    base_url: {srv.base_url}\n")
        r = load_recipe(path)
        assert human_factory(r) is not None
        m = run_eval(r, "expert", "test", tmp_path / "eval", show_progress=False)
        assert m["all"]["tsr"] == 1.0
        asked = len(srv.requests)
    lines = (tmp_path / "eval" / "trajectories.jsonl").read_text()
    assert asked > 0 and "Well, let me see." in lines  # people's words came from the model


def test_recipe_llm_builder_goes_through_validation(tmp_path):
    from pipeline.recipe import load_recipe
    from pipeline.stages import build_tasks

    with FakeOpenAI(lambda body, n: Reply('{"instruction": "Go somewhere.", "variants": []}')) as srv:
        path = tmp_path / "r.yaml"
        path.write_text(f"name: llm-build\nsandbox:\n  scenes: [home]\n  train_instructions_per_scene: 1\n"
                        f"  test_instructions_per_scene: 1\n  builder: llm\n  builder_attempts: 2\n"
                        f"  builder_model:\n    kind: openai\n    model: writer\n    base_url: {srv.base_url}\n")
        splits, stats = build_tasks(load_recipe(path), show_progress=False)
        n = len(srv.requests)
    assert splits == {"train": [], "test": []} and stats["accepted"] == 0
    assert stats["rejected"] == 6 and sum(stats["rejected_reasons"].values()) == 6
    assert n == 4  # two instructions, two bounded attempts each
