"""End-to-end checks of the build and eval stages on the tiny recipe (real sandbox, real expert)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.prompt import StepMemory, build_step_messages, prompt_text, render_known
from pipeline.recipe import RecipeError, load_recipe
from pipeline.stages import build_tasks, load_tasks, run_eval, write_build
from sandbox.builder import BuildConfig, hidden_strings, validate_instance
from sandbox.controller import EnvController
from sandbox.expert import ExpertPlanner
from sandbox.observation import known_map

ROOT = Path(__file__).resolve().parents[1]
CI_RECIPE = ROOT / "recipes" / "ci.yaml"  # the tiny recipe at test size


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("build")
    stats = write_build(load_recipe(CI_RECIPE), out, show_progress=False)
    return out, stats


def _all_tasks(folder):
    return load_tasks(folder, "train") + load_tasks(folder, "test")


def test_build_is_byte_identical(tiny_build, tmp_path):
    out, _ = tiny_build
    write_build(load_recipe(CI_RECIPE), tmp_path, show_progress=False)
    files = sorted(p.name for p in out.glob("*.jsonl"))
    assert len(files) == 6
    for name in files + ["validation.json"]:
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_validation_report(tiny_build):
    _, stats = tiny_build
    for key in ("total", "accepted", "rejected", "rejected_reasons", "by_difficulty", "expert_solved"):
        assert key in stats
    assert stats["accepted"] + stats["rejected"] == stats["total"]
    assert sum(stats["rejected_reasons"].values()) == stats["rejected"]
    for d in ("easy", "medium", "hard"):
        assert stats["by_difficulty"][d]["accepted"] > 0, d


def test_splits_disjoint_in_instructions_and_layouts(tiny_build):
    out, _ = tiny_build
    train, test = load_tasks(out, "train"), load_tasks(out, "test")
    assert train and test
    assert not {t.instruction for t in train} & {t.instruction for t in test}
    assert not {t.layout_id for t in train} & {t.layout_id for t in test}


def test_difficulties_have_the_right_obstacles(tiny_build):
    out, _ = tiny_build
    for t in _all_tasks(out):
        n = len(t.failure_triggers)
        if t.difficulty == "easy":
            assert n == 0, t.id
        elif t.difficulty == "medium":
            assert n == 1, t.id
        else:
            assert n >= 2, t.id
        assert t.optimal_steps <= t.step_budget


def test_expert_solves_every_accepted_instance(tiny_build):
    out, _ = tiny_build
    for t in _all_tasks(out):
        ctrl = EnvController(t)
        ctrl.reset()
        ExpertPlanner(ctrl, privileged=False).run()
        assert ctrl.success, f"teacher failed {t.id}: {t.instruction}"


def test_teacher_meets_obstacles_and_recovers(tiny_build):
    """On medium/hard the teacher hits triggers (it does not know them) and still succeeds."""
    out, _ = tiny_build
    hits = 0
    for t in _all_tasks(out):
        if t.difficulty == "easy":
            continue
        ctrl = EnvController(t)
        ctrl.reset()
        ExpertPlanner(ctrl, privileged=False).run()
        hits += sum(ctrl.fired.values()) > 0
    assert hits > 0


def test_random_policy_does_far_worse(tiny_build, tmp_path):
    out, _ = tiny_build
    r = load_recipe(CI_RECIPE)
    expert = run_eval(r, "expert", "test", tmp_path / "e", out, show_progress=False)
    rand = run_eval(r, "random", "test", tmp_path / "r", out, show_progress=False)
    for d in ("easy", "medium", "hard", "all"):
        for k in ("tsr", "gcr", "mean_steps", "invalid_action_rate", "episodes"):
            assert k in expert[d]
    assert expert["all"]["tsr"] == 1.0
    assert rand["all"]["tsr"] <= 0.1
    assert rand["all"]["gcr"] < expert["all"]["gcr"] - 0.5
    assert rand["all"]["invalid_action_rate"] > expert["all"]["invalid_action_rate"]
    saved = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert saved["all"]["tsr"] == expert["all"]["tsr"]
    # the deadlock taxonomy: the expert never stalls unaware; random play stalls, and its stalls go with failing
    assert expert["deadlocks"]["unaware"] == 0 and rand["deadlocks"]["deadlocks"] > 0
    d = rand["deadlocks"]
    assert d["aware"] + d["unaware"] == d["deadlocks"] and d["failed_episodes"] >= rand["all"]["episodes"] * 0.9


def test_isolation_hidden_fields_never_reach_a_prompt(tiny_build):
    """Trigger details, hidden places and facts' answers are absent from the first prompt; trigger details
    stay absent from every prompt of a whole expert episode."""
    out, _ = tiny_build
    checked = 0
    for t in _all_tasks(out):
        ctrl = EnvController(t)
        obs = ctrl.reset()
        mem = StepMemory()
        first = prompt_text(build_step_messages(t.instruction, known_map(ctrl.world), mem, obs, 0, t.step_budget))
        for s in hidden_strings(t):
            assert s not in first, (t.id, s)
        never = [x for tr in t.failure_triggers for x in (tr.id, tr.condition, tr.effect, *tr.recovery)]
        planner = ExpertPlanner(ctrl, privileged=False)
        while not ctrl.done and ctrl.steps < t.step_budget:
            _, call = planner.act()
            res = ctrl.step(call)
            planner.observe(call, res)
            mem.add(call, res.error, res.observation)
            text = prompt_text(build_step_messages(t.instruction, known_map(ctrl.world), mem, res.observation,
                                                   ctrl.steps, t.step_budget))
            for s in never:
                assert s not in text, (t.id, s)
        checked += 1
    assert checked > 50


def test_prompt_is_compact(tiny_build):
    out, _ = tiny_build
    lengths = []
    for t in _all_tasks(out):
        ctrl = EnvController(t)
        obs = ctrl.reset()
        text = prompt_text(build_step_messages(t.instruction, known_map(ctrl.world), StepMemory(), obs, 0,
                                               t.step_budget))
        lengths.append(len(text.split()))
    # "a few hundred tokens": whitespace words are a lower bound on BPE tokens, so stay well under 300
    assert sorted(lengths)[len(lengths) // 2] < 300


def test_teacher_does_not_read_hidden_state(tiny_build):
    """The teacher's decisions do not change when the true location of a moved object is different:
    before the agent discovers it, the same calls come out."""
    out, _ = tiny_build
    moved = [t for t in _all_tasks(out) if any(tr.kind == "object_moved" for tr in t.failure_triggers)]
    for t in moved[:5]:
        ctrl = EnvController(t)
        ctrl.reset()
        planner = ExpertPlanner(ctrl, privileged=False)
        first_call = planner.act()[1]
        tr = next(x for x in t.failure_triggers if x.kind == "object_moved")
        ctrl2 = EnvController(t)
        ctrl2.reset()
        ctrl2.world.obj[tr.target]["loc"] = next(o.last_seen for o in t.agent_view.objects if o.id == tr.target)
        assert ExpertPlanner(ctrl2, privileged=False).act()[1] == first_call


def test_builder_rejects_an_unsolvable_instance(tiny_build):
    out, _ = tiny_build
    t = next(x for x in load_tasks(out, "train") if x.kind == "navigation" and x.difficulty == "easy"
             and x.goal[0].place)
    data = t.model_dump()
    target = t.goal[0].place
    for c in data["env_state"]["connections"]:
        if target in (c["a"], c["b"]):
            c["blocked"] = True
    data["human_persona"] = []   # and nobody who could clear the way
    from sandbox.schema import TaskInstance
    broken = TaskInstance.model_validate(data)
    inst, reason, _ = validate_instance(broken, BuildConfig())
    assert inst is None and reason == "oracle_failed"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_cli_bad_recipe_exits_2_naming_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsandbox:\n  train_instructions_per_scene: many\n")
    r = _cli("build", str(bad), "--out", str(tmp_path / "o"), "--quiet")
    assert r.returncode == 2
    assert "bad.yaml" in r.stderr and "sandbox.train_instructions_per_scene" in r.stderr
    bad.write_text("name: x\nsurprise: 1\n")
    r = _cli("build", str(bad), "--out", str(tmp_path / "o"), "--quiet")
    assert r.returncode == 2 and "surprise" in r.stderr
    r = _cli("build", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "o"), "--quiet")
    assert r.returncode == 2 and "missing.yaml" in r.stderr


def test_cli_bad_task_file_exits_2(tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "test_easy.jsonl").write_text('{"id": "x", "instruction_id": 3}\n')
    r = _cli("eval", str(CI_RECIPE), "--policy", "expert", "--split", "test", "--out", str(tmp_path / "o"),
             "--tasks", str(tasks), "--quiet")
    assert r.returncode == 2
    assert "test_easy.jsonl:1" in r.stderr


def test_recipe_errors_name_the_field(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("name: r\nsandbox:\n  scenes: [atlantis]\n")
    with pytest.raises(RecipeError, match="sandbox.scenes"):
        load_recipe(p)


def test_build_tasks_in_memory_matches_files(tiny_build):
    out, _ = tiny_build
    splits, _ = build_tasks(load_recipe(CI_RECIPE), show_progress=False)
    assert sorted(t.id for t in splits["test"]) == sorted(t.id for t in load_tasks(out, "test"))


class _BeliefOnly:
    """A view of a World that refuses every true-state field: what the teacher may not read."""

    FORBIDDEN = {"obj", "door", "blocked", "restricted", "hidden", "person_place", "asks", "helped", "visible",
                 "reachable_inside", "place_of", "state_key", "reports", "latched"}

    def __init__(self, world):
        object.__setattr__(self, "_w", world)

    def __getattr__(self, name):
        if name in self.FORBIDDEN:
            raise AssertionError(f"the teacher read true state: World.{name}")
        return getattr(object.__getattribute__(self, "_w"), name)


def test_teacher_reads_only_the_belief(tiny_build):
    """Every teacher decision is computed with the world's true-state fields locked away."""
    out, _ = tiny_build
    for t in _all_tasks(out):
        ctrl = EnvController(t)
        ctrl.reset()
        planner = ExpertPlanner(ctrl, privileged=False)
        while not ctrl.done and ctrl.steps < t.step_budget:
            real = ctrl.world
            ctrl.world = _BeliefOnly(real)
            try:
                _, call = planner.act()
            finally:
                ctrl.world = real
            res = ctrl.step(call)
            planner.observe(call, res)
        assert ctrl.success, t.id


@pytest.fixture(scope="module")
def medium_build():
    """Every scene at the GPU recipe's size (40 train and 10 test instructions per scene)."""
    recipe = load_recipe(ROOT / "recipes" / "gpu" / "qwen2.5-1.5b-gigpo.yaml")
    assert recipe.sandbox.scenes == "all" and recipe.sandbox.train_instructions_per_scene == 40
    return build_tasks(recipe, show_progress=False)


def test_every_scene_builds_at_scale_and_the_teacher_solves_everything(medium_build):
    """All scenes at the GPU recipe's size: ~1,200 candidate instances, every accepted one solved by the teacher."""
    splits, stats = medium_build
    assert stats["accepted"] > 600
    assert stats["expert_solved"] == 1.0
    for d in ("easy", "medium", "hard"):
        assert stats["by_difficulty"][d]["accepted"] > 100, d
    assert not {t.instruction for t in splits["train"]} & {t.instruction for t in splits["test"]}


def test_state_key_caches_match_a_fresh_computation(tiny_build):
    """The cached parts of the state key (objects, sorted sets) never go stale, for expert and random play."""
    import random

    from sandbox.agents import random_call

    out, _ = tiny_build
    rng = random.Random(0)
    for t in _all_tasks(out)[:60]:
        for policy in ("expert", "random"):
            ctrl = EnvController(t)
            ctrl.reset()
            assert ctrl.world.state_key() == ctrl.world.uncached_key()
            planner = ExpertPlanner(ctrl, privileged=False)
            while not ctrl.done and ctrl.steps < t.step_budget:
                if policy == "expert":
                    call = planner.act()[1]
                else:
                    known = known_map(ctrl.world)
                    ids = [p for p, _ in known["places"]] + [o for o, *_ in known["objects"]] + \
                        [c for c, *_ in known["connections"]] + [p for p, *_ in known["people"]]
                    call = random_call(rng, ids)
                res = ctrl.step(call)
                if policy == "expert":
                    planner.observe(call, res)
                assert res.state_key == ctrl.world.uncached_key(), (t.id, call)


def test_prompt_shows_where_objects_are_and_only_doors(tiny_build):
    """An object on or in a landmark names the landmark's place (one look-up to know where to go); links are
    listed only when they are doors, with their ids and states (and the places they join when the id does not
    name them); the observation in the prompt drops its exits; the memory keeps each step's first sentence."""
    out, _ = tiny_build
    seen_on_landmark = 0
    for t in _all_tasks(out)[:40]:
        ctrl = EnvController(t)
        obs = ctrl.reset()
        known = known_map(ctrl.world)
        text = build_step_messages(t.instruction, known, StepMemory(), obs, 0, t.step_budget)[1]["content"]
        where = {lm: p for p, lms in known["landmarks"].items() for lm in lms}
        for oid, _, loc in known["objects"]:
            if loc in where:
                assert f"{oid} " in text and f" at {where[loc]} {loc}" in text
                seen_on_landmark += 1
        doors = [c for c in known["connections"] if c[3]]
        plain = [c for c in known["connections"] if not c[3]]
        for cid, a, b, state in doors:
            assert (f"{cid} {state}" if a in cid and b in cid else f"{cid} {state} ({a}-{b})") in text
        for cid, *_ in plain:
            assert cid not in text.split("Observation:")[0]
        assert "Exits:" in obs and "Exits:" not in text
        assert text.split("Observation: ", 1)[1].startswith(obs.split(" Exits: ", 1)[0])
    assert seen_on_landmark > 5
    text = render_known({"place": "hall", "holding": [], "places": [("hall", "hall"), ("kitchen", "kitchen")],
                         "landmarks": {}, "connections": [("door_x", "hall", "kitchen", "closed")], "objects": [],
                         "people": [], "unvisited": ["kitchen"]})
    assert "Doors: door_x closed (hall-kitchen)" in text and "Unvisited: kitchen" in text
    mem = StepMemory()
    mem.add({"name": "navigate", "arguments": {"target": "kitchen"}}, None,
            "You are in the kitchen [kitchen]. You see: a table [table_1]. Exits: hall [hall].")
    mem.add({"name": "open", "arguments": {"target": "d_1"}}, "trigger_fired", "The door d_1 to the hall is locked.")
    assert mem.steps == [("navigate(kitchen)", "ok: You are in the kitchen [kitchen]"),
                         ("open(d_1)", "trigger_fired: The door d_1 to the hall is locked.")]


def test_task_objects_line_looks_up_what_the_instruction_names():
    from agent.prompt import task_objects
    known = {"place": "room_0_0", "landmarks": {"kitchen": ["kitchen_counter"]},
             "objects": [("blue_key", "blue key", "room_0_0"), ("blue_key_2", "blue key", "room_1_1"),
                         ("red_box", "red box", "held"), ("red_ball", "red ball", "room_0_0"),
                         ("charger_1", "white phone charger", "kitchen_counter")]}
    # in the order the instruction names them, look-alikes too; "(here)" where the agent is; a held one is held
    assert task_objects("Put the red box next to the blue key.", known) == \
        "red_box held; blue_key at room_0_0 (here); blue key blue_key_2 at room_1_1"
    # a numbered id is found by its name or by its id read as words; on a landmark, the landmark's place
    for said in ("Bring me the white phone charger", "Bring me the charger"):
        assert task_objects(said, known) == "white phone charger charger_1 at kitchen kitchen_counter"
    # a thing named but matching nothing known is "not seen", in the order the instruction names it; a place,
    # door or person it names is known, not an object to find; a question put to a person names no object
    assert task_objects("Go to the green ball.", known) == "green ball not seen"
    assert task_objects("Go to the red balloon.", known) == "red balloon not seen"  # words, not substrings
    assert task_objects("Put the purple key next to the red ball, then go to the kitchen.", known) == \
        "purple key not seen; red_ball at room_0_0 (here)"
    assert task_objects("Ask Ann the wifi password and report the answer.", known) == "none seen"
    assert task_objects("Open the red door.", {**known, "connections": [("red_door_a_b", "a", "b", "locked")]}) \
        == "none seen"
    assert task_objects("Go to a ball.", known) == "none seen"  # any ball: the red ball is one
    msgs = build_step_messages("Pick up the red ball.", {**known, "holding": ["red_box"], "places": [
        ("room_0_0", "north-west room")], "connections": [], "people": [], "facts": []}, StepMemory(), "Hi.", 0, 9)
    assert msgs[1]["content"].endswith(
        "Task objects: red_ball at room_0_0 (here)\nTask: Pick up the red ball.\nNext skill call?")


def test_compositional_split_targets_new_type_colour_combinations(medium_build):
    from sandbox.builder import compositional_split, target_combos
    train, test = medium_build[0]["train"], medium_build[0]["test"]
    seen = set().union(*(target_combos(t) for t in train))
    comp = compositional_split(train, test)
    assert comp, "the medium recipe's test split has compositional tasks"
    for t in comp:
        combos = target_combos(t)
        assert combos and not combos & seen and any(c[1] for c in combos)
        assert all(c[1] is None or c[1].lower() in t.instruction.lower() for c in combos)
