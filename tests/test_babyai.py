"""Pixel evaluation on BabyAI: perception checked against the env's grid encoding per level, the isolation of the
policy process, the perception-only expert on the acceptance levels, bad frames and bad names, and a student
model running unchanged through the sandbox's prompt format."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("minigrid")
ROOT = Path(__file__).resolve().parents[1]

from evaluation.babyai import (  # noqa: E402
    LEVELS, LevelError, PolicyProcess, PolicySpec, check_payload, evaluate_babyai, level_id, make_env, quiet_reset,
    render, wilson)
from evaluation.gridworld import GridBelief  # noqa: E402
from evaluation.perception import TYPE_IDX, UNKNOWN, SpriteDetector  # noqa: E402
from evaluation.pixel_agent import (  # noqa: E402
    MissionError, PixelAgent, PixelExpert, Subtask, parse_mission, task_text)


@pytest.fixture(scope="module")
def detector() -> SpriteDetector:
    return SpriteDetector(8)


@pytest.mark.parametrize("level", list(LEVELS))
def test_perception_matches_the_grid_encoding(level, detector):
    """Test-only check: every cell of every frame (topdown) decodes to the env's own grid encoding, and the agent
    sprite to its pose; the highlighted cells are exactly the env's field of view."""
    env = make_env(level)
    rng = np.random.default_rng(0)
    for seed in (0, 1):
        quiet_reset(env, seed)
        u = env.unwrapped
        for _ in range(12):
            p = detector.perceive(render(env, "topdown", 8), "topdown")
            assert p.unknown == 0
            np.testing.assert_array_equal(p.cells, u.grid.encode())
            assert p.agent == (int(u.agent_pos[0]), int(u.agent_pos[1]), int(u.agent_dir))
            # the env's own highlight: the frame rendered without it differs exactly on the highlighted cells
            plain = u.get_frame(highlight=False, tile_size=8)
            fov = (render(env, "topdown", 8) != plain).reshape(u.height, 8, u.width, 8, 3).any(axis=(1, 3, 4)).T
            np.testing.assert_array_equal(p.visible, fov)
            _, _, term, trunc, _ = env.step(int(rng.integers(0, 6)))
            if term or trunc:
                break


def test_a_frame_the_detector_cannot_read_gives_unknown_cells_not_a_crash(detector):
    env = make_env("GoToLocal")
    quiet_reset(env, 3)
    frame = render(env, "topdown", 8).copy()
    frame[8:16, 16:24] = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)  # cell (2, 1)
    p = detector.perceive(frame)
    assert p.cells[2, 1, 0] == UNKNOWN and p.unknown == 1
    # the agent still acts on such frames, and the belief never walks into the unknown cell
    agent = PixelAgent(PixelExpert())
    agent.reset(env.unwrapped.mission, frame)
    assert not agent.b.passable((2, 1))
    out = agent.act(frame)
    assert out["action"] in range(7) or out["finish"]
    junk = detector.perceive(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    assert junk.unknown == 64 and junk.agent is None
    with pytest.raises(ValueError, match="HxWx3 uint8"):
        detector.perceive(np.zeros((64, 64), dtype=np.uint8))
    with pytest.raises(ValueError, match="no agent"):
        PixelAgent(PixelExpert()).reset("go to the red ball", junk_frame := np.zeros((64, 64, 3), dtype=np.uint8))
    assert junk_frame.sum() == 0


def test_egocentric_frames_hide_what_the_agent_cannot_see(detector):
    env = make_env("GoTo")
    quiet_reset(env, 0)
    u = env.unwrapped
    p = detector.perceive(u.get_frame(highlight=True, tile_size=8, agent_pov=True), "egocentric")
    assert p.agent == (3, 6, 3)  # bottom centre, facing up
    grid, vis = u.gen_obs_grid()
    enc = grid.encode(vis)
    seen = vis.astype(bool)
    np.testing.assert_array_equal(p.visible, seen)
    np.testing.assert_array_equal(p.cells[seen], enc[seen])
    assert (p.cells[~seen][:, 0] == TYPE_IDX["unseen"]).all()


def test_the_belief_speaks_the_sandbox_prompt_format(detector):
    from agent.prompt import StepMemory, build_step_messages

    env = make_env("GoTo")
    quiet_reset(env, 0)
    b = GridBelief("topdown-fov")
    b.update(detector.perceive(render(env, "topdown", 8)))
    k = b.known()
    assert [p for p, _ in k["places"]] == [f"room_{r}_{c}" for r in range(3) for c in range(3)]
    assert dict(k["places"])["room_1_1"] == "centre room"
    assert all(d.split("_door_")[0] in ("red", "green", "blue", "purple", "yellow", "grey") for d, *_ in
               k["connections"])
    assert k["place"] in k["places"][0] or k["place"] in dict(k["places"])
    assert k["unvisited"] and k["place"] not in k["unvisited"]
    # only what the field of view showed: objects outside it are not in the belief yet
    truth = sum(1 for c in env.unwrapped.grid.grid if c is not None and c.type in ("key", "ball", "box"))
    assert 0 < len(k["objects"]) < truth
    # ids as the sandbox's rooms scene names them: colour and type (`red_ball`), numbered only for a look-alike
    for oid, name, _ in k["objects"]:
        assert oid == name.replace(" ", "_") or oid.startswith(name.replace(" ", "_") + "_"), (oid, name)
    msgs = build_step_messages(task_text(env.unwrapped.mission), k, StepMemory(), b.describe(), 0, 30)
    user = msgs[1]["content"]
    for line in ("At: room_", "Places: room_0_0 north-west room", "Doors: ", "Unvisited: ", "Objects: ",
                 "Observation: You are in the ", "Task: Go to the "):
        assert line in user


def test_missions_parse_in_the_order_to_do_them():
    assert parse_mission("go to the red ball") == [Subtask("go_to", parse_mission("go to the red ball")[0].obj)]
    seq = parse_mission("go to a key and go to a grey door after you go to a yellow key and go to the green box")
    assert [(s.op, s.obj.color, s.obj.type) for s in seq] == [
        ("go_to", "yellow", "key"), ("go_to", "green", "box"), ("go_to", None, "key"), ("go_to", "grey", "door")]
    put = parse_mission("put the blue ball next to a purple door, then pick up the box")
    assert [(s.op, s.obj.type, s.other and s.other.type) for s in put] == [("put_next", "ball", "door"),
                                                                            ("pick_up", "box", None)]
    assert parse_mission("pick up the grey key on your left")[0].obj.loc == "left"
    with pytest.raises(MissionError, match="cannot read"):
        parse_mission("dance with the red ball")
    assert task_text("go to a red ball, then open the door") == "Go to the red ball, then open the door."


def test_unknown_level_lists_the_short_names_and_the_nearest_ids(tmp_path):
    with pytest.raises(LevelError, match=r"short name \(GoToObj, GoToLocal, GoTo"):
        evaluate_babyai("GoToMoon", "expert", 1, tmp_path)
    with pytest.raises(LevelError, match="did you mean BabyAI-UnlockLocal-v0"):
        level_id("BabyAI-UnlockLokal-v0")
    with pytest.raises(ValueError, match="unknown view"):
        evaluate_babyai("GoTo", "expert", 1, tmp_path, view="isometric")
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0
    lo, hi = wilson(5, 10)
    assert lo < 0.5 < hi and round(lo, 3) == 0.237


def test_the_policy_process_gets_only_frames_and_missions_and_cannot_reach_the_env(tmp_path):
    env = make_env("GoToLocal")
    obs, _ = quiet_reset(env, 0)
    with PolicyProcess(PolicySpec("expert")) as proc:
        assert proc.pid != os.getpid()
        reply = proc.call(op="reset", mission=obs["mission"], frame=render(env, "topdown", 8), seed=0)
        assert set(reply) == {"percept", "pose", "start"}
        reply = proc.call(op="act", frame=render(env, "topdown", 8))
        assert isinstance(reply["action"], int)
        probe = proc.call(op="probe")
        assert probe["env_objects"] == 0 and probe["pid"] == proc.pid
        assert set(proc.sent) <= {("frame", "mission", "op", "seed"), ("frame", "op"), ("op",)}
        for bad in ({"op": "act", "frame": render(env, "topdown", 8), "env": env},
                    {"op": "act", "frame": render(env, "topdown", 8), "state": env.unwrapped.grid.encode()}):
            with pytest.raises(ValueError, match="may not receive"):
                proc.call(**bad)
    with pytest.raises(ValueError, match="uint8"):
        check_payload({"op": "act", "frame": np.zeros((8, 8, 3), dtype=np.float32)})


@pytest.mark.parametrize("level,view", [("GoTo", "topdown"), ("Pickup", "topdown-fov"), ("Open", "topdown"),
                                        ("PutNextLocal", "topdown-fov"), ("GoTo", "egocentric"),
                                        ("Pickup", "egocentric")])
def test_the_perception_only_expert_solves_the_acceptance_levels(level, view, tmp_path):
    m = evaluate_babyai(level, "expert", 4, tmp_path, seed=100, view=view, bot=False, strips=1)
    assert m["success_rate"] == 1.0, json.dumps(m)
    assert m["perception_accuracy"] == 1.0 and m["pose_accuracy"] == 1.0
    # with the field of view only, a way can be blocked by something not yet seen: that call fails and is re-planned
    assert m["invalid_action_rate"] <= (0.0 if view == "topdown" else 0.1)
    assert m["deadlocks"] == 0
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["success_wilson95"] == m["success_wilson95"]
    assert (tmp_path / "strip_0.png").is_file() and "Wilson" in (tmp_path / "report.md").read_text()
    rows = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["skill_calls"] >= 1 for r in rows)


@pytest.mark.parametrize("level", ["BabyAI-UnlockLocal-v0", "OpenDoor", "BabyAI-GoToObjMazeS4-v0",
                                   "MiniGrid-UnlockPickup-v0"])
def test_a_registered_level_outside_the_catalogue_runs(level, tmp_path):
    """Any registered BabyAI id (or its name without prefix and version), and MiniGrid's own ids whose missions
    the grammar reads; the perception-only expert solves these."""
    assert level not in LEVELS
    m = evaluate_babyai(level, "expert", 2, tmp_path, seed=1000, bot=False, strips=0)
    assert m["env_id"] == level_id(level) and m["env_id"].endswith("-v0")
    assert m["success_rate"] == 1.0 and m["perception_accuracy"] == 1.0, json.dumps(m)


def test_a_level_the_skills_cannot_express_is_refused_naming_the_part(tmp_path):
    """A mission outside the grammar names the part it cannot read; a cell no skill acts on is named too; both
    before the policy process starts, and `embodistill eval` exits 2 with the message."""
    from typer.testing import CliRunner

    from minigrid.core.world_object import Lava

    from evaluation.babyai import check_level
    from pipeline.cli import app
    with pytest.raises(LevelError, match="cannot read the mission part 'get to the green goal square'"):
        evaluate_babyai("MiniGrid-Empty-5x5-v0", "expert", 1, tmp_path)
    assert not (tmp_path / "metrics.json").exists()
    env = make_env("BabyAI-GoToObj-v0")
    quiet_reset(env, 0)
    env.unwrapped.grid.set(1, 1, Lava())
    with pytest.raises(LevelError, match="its grid has lava cells"):
        check_level(env, env.unwrapped.mission, 0)
    res = CliRunner().invoke(app, ["eval", str(ROOT / "recipes" / "tiny.yaml"), "--env", "babyai:MiniGrid-Empty-5x5-v0",
                                   "--policy", "expert", "--episodes", "1", "--out", str(tmp_path / "cli")])
    assert res.exit_code == 2 and "get to the green goal square" in res.output


def test_the_expert_gives_up_on_a_key_it_cannot_see_without_recursing(tmp_path):
    """KeyInBox: the only key is inside a box. The plan to unlock the door looked for its key in the room behind
    that very door, whose way needs the key: it recursed until Python stopped it; now the episode ends."""
    m = evaluate_babyai("BabyAI-KeyInBox-v0", "expert", 1, tmp_path, seed=1000, bot=False, strips=0)
    assert m["episodes"] == 1 and sum(m["ends"].values()) == 1


def test_random_policy_and_deadlocks_are_counted(tmp_path):
    m = evaluate_babyai("GoToLocal", "random", 6, tmp_path, seed=0, bot=False, strips=0, deadlock_turns=3)
    assert m["invalid_action_rate"] > 0.1  # random calls are often invalid, and counted as such
    assert m["episodes"] == 6 and sum(m["ends"].values()) == 6
    # a deadlock (3 turns without change) is classified; 4 times as long ends the episode
    t = m["deadlock_taxonomy"]
    assert m["deadlocks"] == t["episodes_with_deadlock"] >= max(1, m["ends"].get("deadlock", 0))
    assert t["aware"] + t["unaware"] == t["deadlocks"] >= m["deadlocks"]
    rows = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert all(r["deadlock"] == bool(r["deadlocks"]) and all(d["length"] >= 3 for d in r["deadlocks"]) for r in rows)
    assert "aware" in (tmp_path / "report.md").read_text()


def test_a_student_checkpoint_runs_unchanged_on_pixels(tmp_path):
    """A real (untrained) tiny student, built the way `sft` builds one, acts through the shared prompt builder and
    parser; whatever it writes is parsed or counted invalid, never executed."""
    from sft.student import StudentConfig, build_tiny_student, train_tokenizer

    texts = ["Go to the red ball. You are in the north-west room [room_0_0]. navigate ( room_0_0) ball_1 key_2"] * 50
    tok = train_tokenizer(texts, vocab_size=300)
    model = build_tiny_student(StudentConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                             num_kv_heads=1, max_positions=2048), tok)
    folder = tmp_path / "student"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    m = evaluate_babyai("GoToObj", str(folder), 2, tmp_path / "eval", bot=False, strips=0, skill_budget=3)
    assert m["episodes"] == 2 and m["skill_calls"] >= 2
    rows = [json.loads(line) for line in (tmp_path / "eval" / "episodes.jsonl").read_text().splitlines()]
    assert all(e["ok"] is False or e["call"] for r in rows for e in r["events"])


def test_a_vision_model_can_do_the_perceiving(tmp_path, monkeypatch):
    """The online option: an OpenAI-compatible vision model gets the frame as a PNG and answers JSON cells. Here
    the 'model' is a real HTTP server whose answer is read off the env's grid; a garbled answer becomes unknown
    cells, never a crash."""
    from agent.clients import OpenAIClient
    from evaluation.perception import VisionPerception, parse_vision_reply
    from fake_openai import FakeOpenAI, Reply

    env = make_env("GoToObj")
    quiet_reset(env, 5)
    u = env.unwrapped

    def answer(body, n):
        parts = body["messages"][0]["content"]
        assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
        assert body["response_format"] == {"type": "json_object"}
        cells, walls = [], []
        for x in range(u.width):
            for y in range(u.height):
                c = u.grid.get(x, y)
                if c is None:
                    continue
                if c.type == "wall":
                    walls.append([x, y])
                else:
                    cells.append({"x": x, "y": y, "type": c.type, "color": c.color,
                                  "state": ("open" if c.is_open else "locked" if c.is_locked else "closed")
                                  if c.type == "door" else None})
        return Reply(json.dumps({"agent": {"x": int(u.agent_pos[0]), "y": int(u.agent_pos[1]),
                                           "dir": int(u.agent_dir)}, "cells": cells, "wall_cells": walls}))

    monkeypatch.setenv("VLM_TEST_KEY", "test")
    with FakeOpenAI(answer) as server:
        vp = VisionPerception(OpenAIClient("vlm", base_url=server.base_url, api_key_env="VLM_TEST_KEY"))
        p = vp.perceive(render(env, "topdown", 8))
    np.testing.assert_array_equal(p.cells, u.grid.encode())
    assert p.agent == (int(u.agent_pos[0]), int(u.agent_pos[1]), int(u.agent_dir))
    bad = parse_vision_reply('{"cells": [{"x": 1, "y": 1, "type": "dragon", "color": "red"}]}', 8, 8)
    assert bad.cells[1, 1, 0] == UNKNOWN and bad.unknown == 1 and bad.agent is None
    assert parse_vision_reply("not json", 8, 8).unknown == 64


def test_first_person_belief_tracks_its_pose_and_keeps_room_ids(detector):
    """From first-person frames alone the belief carries its pose by dead reckoning (checked against the env's
    pose through the start transform) and a room keeps its id as more of it is seen."""
    from evaluation.babyai import world_pose
    from evaluation.egocentric import EgoBelief
    from evaluation.gridworld import FORWARD, LEFT, RIGHT

    env = make_env("GoTo")
    quiet_reset(env, 7)
    u = env.unwrapped
    start = (int(u.agent_pos[0]), int(u.agent_pos[1]), int(u.agent_dir))
    b = EgoBelief()
    b.update(detector.perceive(render(env, "egocentric", 8), "egocentric"))
    first_room = b.place
    assert first_room == "room_1" and b.known()["places"] == [("room_1", "room 1")]
    rng = np.random.default_rng(0)
    for _ in range(60):
        a = int(rng.choice([LEFT, RIGHT, FORWARD, FORWARD]))
        env.step(a)
        b.update(detector.perceive(render(env, "egocentric", 8), "egocentric"), a)
        assert world_pose(b.pose, b.start, start) == (int(u.agent_pos[0]), int(u.agent_pos[1]), int(u.agent_dir))
    assert first_room in dict(b.rooms)  # never renamed
    # everything written on the canvas is what the env holds there (mapped to world coordinates)
    seen = np.argwhere(b.cells[:, :, 0] != TYPE_IDX["unseen"])
    truth = u.grid.encode()
    for cx, cy in seen:
        x, y, _ = world_pose((int(cx), int(cy), 3), b.start, start)
        if (x, y) != (int(u.agent_pos[0]), int(u.agent_pos[1])):
            assert tuple(b.cells[cx, cy]) == tuple(truth[x, y])


def test_the_deadlock_hint_and_the_step_instructions_reach_a_students_prompt(tmp_path):
    """`--deadlock-hint` on pixels: after the deadlock window the evaluator sends the hint's note (and nothing else
    can travel in it); a model policy's next prompt shows it, and its task line is the granularity asked for."""
    from agent.clients import TransformersClient
    from agent.episode import hint_text
    from evaluation.pixel_agent import PixelAgent, PixelModel
    from sft.student import StudentConfig, build_tiny_student, train_tokenizer

    m = evaluate_babyai("GoToLocal", "random", 6, tmp_path / "random", seed=0, bot=False, strips=0,
                        deadlock_turns=3, deadlock_hint=True)
    assert m["deadlock_taxonomy"]["hint"] is True and m["deadlocks"] >= 1
    assert ["frame", "note", "op"] in m["payload_keys"]          # the note went out, after a deadlock
    check_payload({"op": "act", "note": hint_text(7)})
    with pytest.raises(ValueError, match="the deadlock hint's text"):
        check_payload({"op": "act", "note": "Note: the red ball is behind the grey door."})

    texts = ["Go to the red ball. You are in the north-west room [room_0_0]. navigate ( room_0_0) ball_1 key_2"] * 50
    tok = train_tokenizer(texts, vocab_size=300)
    model = build_tiny_student(StudentConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                             num_kv_heads=1, max_positions=2048), tok)
    model.save_pretrained(tmp_path / "student")
    tok.save_pretrained(tmp_path / "student")
    env = make_env("GoToLocal")
    obs, _ = quiet_reset(env, 0)
    agent = PixelAgent(PixelModel(TransformersClient(str(tmp_path / "student"), max_new_tokens=8),
                                  instructions="step"))
    agent.reset(obs["mission"], render(env, "topdown", 8), 0)
    reply = agent.act(render(env, "topdown", 8), note=hint_text(16))
    user = reply["events"][0]["prompt"][-1]["content"]              # the first decision after the note
    assert "Note: nothing has changed for 16 steps." in user
    assert "Steps: 1. go to the " in user
