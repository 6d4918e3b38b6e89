"""Instruction granularity (goal / step / visual): the task line says what the plan is and, for visual, where the
agent has seen its things, and never more than the agent could know at that point: each env's hidden state (the
sandbox's unseen places, objects and answers; TextWorld's unseen rooms and where things are taken from; BabyAI's
objects the agent has not perceived) is checked against every rendered line of real episodes."""

from __future__ import annotations

import json
import re

import pytest

from agent.episode import Episode, play
from agent.instructions import anchors, instruction_text
from agent.policies import ScriptedPolicy
from sandbox.agents import ExpertAgent, RandomAgent
from sandbox.gym_env import SandboxEnv
from sandbox.text import normalize


def _task_line(messages: list[dict]) -> str:
    return next(line for line in messages[-1]["content"].splitlines() if line.startswith("Task: "))[6:]


def _says(text: str, name: str) -> bool:
    n = normalize(name)
    return bool(n) and f" {n} " in f" {normalize(text)} "


def _known_names(known: dict) -> set[str]:
    names = {known["place"]} | set(known["holding"])
    for pid, name in known["places"]:
        names |= {pid, name}
    for pid, marks in known.get("landmarks", {}).items():
        names |= {pid, *marks}
    names |= {x for o in known["objects"] for x in o} | {c[0] for c in known["connections"]}
    names |= {x for p in known["people"] for x in p[:2]}
    return {n for n in names if n}


def _sandbox_lines(task, policy_cls, granularity: str, seed: int = 0):
    """(task line, known map) at every decision of one episode."""
    env = SandboxEnv()
    ep = Episode(env, policy_cls.__name__, seed, {"task": task}, instructions=granularity)
    policy = ScriptedPolicy(policy_cls, name="p")
    policy.start(0, env, seed)
    while not ep.done:
        req = ep.request()
        yield _task_line(req.messages), req.info["known"]
        ep.record(req, policy.act([req])[0])


@pytest.mark.parametrize("granularity", ["step", "visual"])
def test_sandbox_lines_never_name_what_the_agent_has_not_seen_nor_the_answer(built_tasks, granularity):
    checked = 0
    for task in built_tasks:
        st = task.env_state
        world = [(p.id, p.name) for p in st.places] + [(o.id, o.name) for o in st.objects] + \
                [(p.id, p.name) for p in st.people] + [(c.id, c.id) for c in st.connections]
        answers = [v for g in task.subgoals if g.predicate.kind == "reported"
                   for v in [g.predicate.value, *g.predicate.aliases]]
        for policy_cls in (ExpertAgent, RandomAgent):
            for line, known in _sandbox_lines(task, policy_cls, granularity):
                assert line.startswith(task.instruction) and "Steps: 1. " in line
                seen = _known_names(known)
                for eid, name in world:
                    if eid in seen or name in seen or _says(task.instruction, name) or _says(task.instruction, eid):
                        continue
                    assert not _says(line, name) and not _says(line, eid), (task.id, eid, line)
                # the answer only once the known map holds it: where the agent saw the thing
                marks = {m: pid for pid, ms in known.get("landmarks", {}).items() for m in ms}
                located = {x for _, _, loc in known["objects"] for x in (loc, marks.get(loc)) if x}
                located |= {name for pid, name in known["places"] if pid in located}
                for answer in answers:
                    if not _says(task.instruction, answer) and answer not in located:
                        assert not _says(line, answer), (task.id, answer, line)
                checked += 1
    assert checked > 100


def test_the_sandbox_step_line_is_the_subgoals_then_finish_and_visual_adds_only_what_was_seen(built_tasks):
    task = next(t for t in built_tasks if any(g.predicate.kind == "reported" for g in t.subgoals))
    env = SandboxEnv()
    _, info = env.reset(seed=0, options={"task": task})
    proc = info["task"]["procedure"]
    assert [s["text"] for s in proc] == [("report the answer" if g.predicate.kind == "reported" else g.description)
                                         for g in task.subgoals] + ["finish"]
    goal = instruction_text(task.instruction, proc, "goal", info["known"])
    step = instruction_text(task.instruction, proc, "step", info["known"])
    visual = instruction_text(task.instruction, proc, "visual", info["known"])
    assert goal == task.instruction
    assert step == f"{task.instruction} Steps: " + "; ".join(f"{i}. {s['text']}" for i, s in enumerate(proc, 1)) + "."
    # visual: the same steps, each thing either anchored in the known map or "not seen yet"
    assert re.sub(r" \((?:seen: [^()]*(?:\([^()]*\)[^()]*)*|not seen yet)\)", "", visual) == step
    # a known object is anchored by where the known map has it, an unknown one is not
    known = {"place": "hall", "holding": [], "places": [("hall", "hall")], "landmarks": {"hall": ["table_1"]},
             "connections": [], "objects": [("mug_1", "red mug", "table_1")], "people": [], "facts": []}
    assert anchors("mug_1", known) == anchors("red mug", known) == ["red mug mug_1 at hall table_1 (here)"]
    assert anchors("ball", known) == [] and anchors("hall", known) == ["hall with table_1"]


def test_goal_is_the_default_and_a_bad_granularity_or_a_missing_plan_is_refused(built_tasks):
    task = built_tasks[0]
    ep = Episode(SandboxEnv(), "expert", 0, {"task": task})
    assert _task_line(ep.request().messages) == task.instruction
    with pytest.raises(ValueError, match="instructions must be one of goal, step, visual, not 'detailed'"):
        Episode(SandboxEnv(), "expert", 0, {"task": task}, instructions="detailed")

    class NoPlan(SandboxEnv):
        def reset(self, **kw):
            obs, info = super().reset(**kw)
            info["task"].pop("procedure")
            return obs, info

    with pytest.raises(ValueError, match="has no procedure"):
        Episode(NoPlan(), "expert", 0, {"task": task}, instructions="step")
    # the goal granularity needs no plan, and the trajectory keeps the task's own instruction
    played = play(NoPlan, ScriptedPolicy(ExpertAgent, name="expert"), [({"task": task}, 0)])
    assert played.trajectories[0].instruction == task.instruction


def test_sandbox_evaluation_records_the_granularity_and_the_expert_does_not_read_it(built_tasks):
    from evaluation.sandbox_eval import evaluate
    tasks = built_tasks[:6]
    m_goal, t_goal = evaluate(tasks, "expert")
    m_visual, t_visual = evaluate(tasks, "expert", instructions="visual")
    assert (m_goal["instructions"], m_visual["instructions"]) == ("goal", "visual")
    assert [t.success for t in t_goal] == [t.success for t in t_visual]     # it acts on the env's state
    assert t_visual[0].turns[0].prompt == []      # a scripted agent is given no prompt to read


# ----------------------------------------------------------------------------- TextWorld


def test_the_walkthrough_reads_into_steps_without_routes_or_where_things_are_taken_from():
    from textworld_env.objective import walkthrough_procedure
    steps = walkthrough_procedure(["go east", "open antique trunk", "take old key from antique trunk", "look",
                                   "unlock wooden door with old key", "go north", "insert apple into fridge",
                                   "put carrot on stove", "eat apple", "prepare meal"])
    assert [s["text"] for s in steps] == ["open the antique trunk", "take the old key",
                                          "unlock the wooden door with the old key", "insert the apple into the fridge",
                                          "put the carrot on the stove", "eat the apple", "prepare the meal"]
    assert steps[1]["things"] == ["old key"] and steps[2]["things"] == ["wooden door", "old key"]


@pytest.fixture(scope="module")
def tw_games(tmp_path_factory):
    pytest.importorskip("textworld")
    from textworld_env.games import GameSpec, make_game
    folder = tmp_path_factory.mktemp("games")
    return [make_game(GameSpec(kind="simple", seed=1, goal="brief"), folder),
            make_game(GameSpec(kind="custom", world_size=4, nb_objects=6, quest_length=3, seed=2), folder)]


def test_textworld_lines_never_name_an_unseen_room_a_route_or_where_a_thing_is_taken_from(tw_games):
    from textworld_env.env import TextWorldEnv, call_for_command
    checked = 0
    for game in tw_games:
        infos = dict((k, v) for k, v in json.loads(game.with_suffix(".json").read_text())["infos"])
        rooms = [v["name"] for v in infos.values() if v["type"] == "r"]
        env = TextWorldEnv()
        ep = Episode(env, "walkthrough", 0, {"task": {"id": game.stem, "game": str(game)}}, instructions="visual")
        walk = list(env._state["extra.walkthrough"])
        sources = {c.split(" from ", 1)[1] for c in walk if c.startswith("take ") and " from " in c}
        plan_things = {t for s in ep.procedure for t in s["things"]}
        while not ep.done and walk:
            req = ep.request()
            line, known = _task_line(req.messages), req.info["known"]
            steps = line.split(" Steps: ", 1)[1]
            plain = re.sub(r" \((?:seen: [^()]*(?:\([^()]*\)[^()]*)*|not seen yet)\)", "", steps)
            assert not re.search(r"\b(?:north|south|east|west)\b", plain), plain      # no route
            seen = _known_names(known)
            for room in rooms:
                if room not in seen and room.replace(" ", "_") not in seen:
                    assert not _says(steps, room), (room, line)
            for source in sources - plan_things:
                if not any(_says(n, source) for n in seen):
                    assert not _says(steps, source), (source, line)
            checked += 1
            call = None
            while walk and call is None:
                call = call_for_command(walk.pop(0), env.belief)
            if call is None:
                break
            ep.record(req, type("R", (), {"action": call, "text": None, "reasoning": ""})())
        assert ep.trajectory.turns
    assert checked >= 5


# ----------------------------------------------------------------------------- BabyAI


def test_babyai_steps_follow_the_mission_grammar():
    pytest.importorskip("minigrid")
    from evaluation.pixel_agent import mission_procedure
    assert [s["text"] for s in mission_procedure("pick up a red ball, then open the blue door")] == \
        ["go to the red ball", "pick up the red ball", "go to the blue door", "open the blue door"]
    assert [s["text"] for s in mission_procedure("put the key on your left next to a grey box after you go to "
                                                 "the ball")] == \
        ["go to the ball", "pick up the key on your left", "put it next to the grey box"]
    assert mission_procedure("put the purple key next to the door behind you")[-1] == \
        {"text": "put it next to the door behind you", "things": ["door"]}


def test_babyai_visual_lines_anchor_only_objects_the_agent_has_perceived():
    pytest.importorskip("minigrid")
    from evaluation.babyai import make_env, quiet_reset, render
    from evaluation.pixel_agent import PixelAgent, PixelExpert, mission_procedure, task_text
    checked = hidden_seen = 0
    for level, seed in (("BabyAI-GoTo-v0", 1), ("BabyAI-Pickup-v0", 2), ("BabyAI-Open-v0", 3)):
        env = make_env(level)
        obs, _ = quiet_reset(env, seed)
        mission = obs["mission"]
        agent = PixelAgent(PixelExpert(), view="egocentric")
        agent.reset(mission, render(env, "egocentric", 8), seed)
        for _ in range(40):
            known = agent.b.known()
            line = instruction_text(task_text(mission), mission_procedure(mission), "visual", known)
            # every object id the line anchors is one the agent's belief holds; the env has more
            named = set(re.findall(r"\b[a-z]+_(?:ball|key|box)(?:_\d+)?\b", line))
            assert named <= {o[0] for o in known["objects"]}, (named, line)
            grid = [c for c in env.unwrapped.grid.grid if c is not None and c.type in ("ball", "key", "box")]
            hidden_seen += len(grid) > len(known["objects"])
            checked += 1
            reply = agent.act(render(env, "egocentric", 8))
            if reply["finish"] or reply["action"] is None:
                break
            _, _, term, trunc, _ = env.step(reply["action"])
            if term or trunc:
                break
    assert checked > 10 and hidden_seen > 0    # the egocentric agent did not see everything at first


def test_the_cli_takes_instructions_and_refuses_what_it_cannot_do(tmp_path):
    from pathlib import Path

    from typer.testing import CliRunner

    from pipeline.cli import app
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "ci.yaml")
    res = CliRunner().invoke(app, ["eval", recipe, "--policy", "random", "--instructions", "visual", "--quiet",
                                   "--out", str(tmp_path / "ev")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["instructions"] == "visual"
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["instructions"] == "visual"
    bad = CliRunner().invoke(app, ["eval", recipe, "--instructions", "detailed", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--instructions must be one of goal, step, visual, not 'detailed'" in bad.output
    browser = CliRunner().invoke(app, ["eval", recipe, "--env", "browser:click-button", "--instructions", "step",
                                       "--out", str(tmp_path / "y")])
    assert browser.exit_code == 2 and "not browser tasks" in browser.output


def test_the_deadlock_window_is_an_option(tmp_path, built_tasks):
    from pathlib import Path

    from typer.testing import CliRunner

    from evaluation.sandbox_eval import evaluate
    from pipeline.cli import app
    tasks = built_tasks[:8]
    m3, _ = evaluate(tasks, "random")
    m6, _ = evaluate(tasks, "random", deadlock_k=6)
    assert (m3["deadlocks"]["k"], m6["deadlocks"]["k"]) == (3, 6)
    assert m6["deadlocks"]["deadlocks"] < m3["deadlocks"]["deadlocks"]     # a longer window finds fewer
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "ci.yaml")
    res = CliRunner().invoke(app, ["eval", recipe, "--policy", "random", "--deadlock-window", "5", "--quiet",
                                   "--out", str(tmp_path / "ev")])
    assert res.exit_code == 0 and json.loads(res.output.strip().splitlines()[-1])["deadlocks"]["k"] == 5
    bad = CliRunner().invoke(app, ["eval", recipe, "--deadlock-window", "1", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--deadlock-window must be >= 2" in bad.output
