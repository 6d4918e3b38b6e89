"""Shared fixtures: one hand-made world that holds every obstacle kind, and the real tasks of `recipes/ci.yaml`
(the tiny recipe at test size)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from sandbox.controller import EnvController
from sandbox.schema import TaskInstance

ROOT = Path(__file__).resolve().parents[1]


def _fixture(oid, type_, name, place, **kw):
    return {"id": oid, "type": type_, "name": name, "location": place, "portable": False, "size": "large",
            **kw}


def _trigger(tid, kind, target, skills, candidates=()):
    return {"id": tid, "kind": kind, "target": target, "skills": skills, "condition": f"{kind} condition",
            "effect": f"{kind} effect", "recovery": [f"{kind} recovery"], "candidates": list(candidates)}


def do(ctrl: EnvController, name: str, **arguments):
    """One skill call on the controller."""
    return ctrl.step({"name": name, "arguments": arguments})


def ok(ctrl: EnvController, name: str, **arguments):
    """One skill call that must succeed."""
    res = do(ctrl, name, **arguments)
    assert res.ok and res.error is None, (name, arguments, res)
    return res


def world_dict() -> dict:
    """A compact TaskInstance dict.

    Map:  office(restricted) - hall - storage (locked door, key_1 in the hall opens it)
                                |  (closed door)
          backroom(hidden) - kitchen - lab (blocked; detour kitchen - yard - lab)
                                |
                               yard
    """
    places = [
        {"id": "hall", "name": "hall"},
        {"id": "kitchen", "name": "kitchen"},
        {"id": "yard", "name": "yard", "kind": "outdoor"},
        {"id": "lab", "name": "lab"},
        {"id": "storage", "name": "storage room"},
        {"id": "office", "name": "office", "restricted": True},
        {"id": "backroom", "name": "back room", "hidden": True},
    ]
    conns = [  # order matters: the blocked kitchen-lab link is the shortest known route to the lab
        {"id": "d_hall_kitchen", "a": "hall", "b": "kitchen", "kind": "door", "door": "closed"},
        {"id": "p_kitchen_lab", "a": "kitchen", "b": "lab", "blocked": True},
        {"id": "p_kitchen_yard", "a": "kitchen", "b": "yard"},
        {"id": "p_yard_lab", "a": "yard", "b": "lab", "kind": "path"},
        {"id": "d_hall_storage", "a": "hall", "b": "storage", "kind": "door", "door": "locked"},
        {"id": "p_hall_office", "a": "hall", "b": "office"},
        {"id": "d_kitchen_back", "a": "kitchen", "b": "backroom", "kind": "door", "door": "closed",
         "hidden": True},
    ]
    objects = [
        _fixture("fan_1", "fan", "ceiling fan", "hall", device=True),
        _fixture("lamp_1", "lamp", "desk lamp", "hall", device=True, broken=True),
        _fixture("cupboard_1", "cupboard", "cupboard", "kitchen", container=True, openable=True),
        _fixture("table_1", "table", "kitchen table", "kitchen", surface=True),
        {"id": "key_1", "type": "key", "name": "storage key", "location": "hall", "opens": "d_hall_storage"},
        {"id": "vase_1", "type": "vase", "name": "glass vase", "location": "hall", "fragile": True},
        {"id": "crate_1", "type": "crate", "name": "wooden crate", "location": "hall", "heavy": True,
         "size": "large"},
        {"id": "cup_1", "type": "cup", "name": "tea cup", "location": "cupboard_1"},
        {"id": "mug_1", "type": "mug", "name": "red mug", "color": "red", "location": "kitchen",
         "owner": "alice"},
        {"id": "mug_2", "type": "mug", "name": "blue mug", "color": "blue", "location": "kitchen",
         "owner": "bob"},
        {"id": "book_1", "type": "book", "name": "book", "location": "yard"},  # the map says: kitchen
        {"id": "phone_1", "type": "phone", "name": "phone", "location": "backroom",
         "details": {"colour": "black"}},
    ]
    people = [{"id": "alice", "name": "Alice", "role": "caretaker", "place": "hall"},
              {"id": "bob", "name": "Bob", "role": "cook", "place": "kitchen"}]
    facts = [{"id": "f_hours", "question": "when visiting hours end", "answer": "8 pm"}]
    personas = [
        {"person": "alice", "role": "caretaker", "style": "friendly",
         "capabilities": ["unlock", "carry", "repair", "permission", "clear", "locate"],
         "knowledge": {"phone_1": "The phone is in the back room, through the door from the kitchen.",
                       "mug_1": "Mine is the red mug [mug_1].",
                       "f_hours": "Visiting hours end at 8 pm."},
         "reveals": {"phone_1": ["backroom", "d_kitchen_back"]},
         "policy": [{"request": "unlock"}, {"request": "carry"}, {"request": "repair"},
                    {"request": "permission", "requires_reason": True}, {"request": "clear", "once": True},
                    {"request": "locate"}]},
        {"person": "bob", "role": "cook", "style": "terse", "capabilities": ["unlock"],
         "knowledge": {"book_1": "I saw the book in the yard."}, "policy": [{"request": "unlock"}],
         "busy_until_asked": 1},
    ]
    triggers = [
        _trigger("t_locked", "locked_door", "d_hall_storage", ["navigate", "open"]),
        _trigger("t_blocked", "blocked_path", "p_kitchen_lab", ["navigate"]),
        _trigger("t_moved", "object_moved", "book_1", ["navigate", "pick_up", "inspect"]),
        _trigger("t_malfunction", "device_malfunction", "lamp_1", ["operate"]),
        _trigger("t_fragile", "fragile_item", "vase_1", ["pick_up"]),
        _trigger("t_heavy", "too_heavy", "crate_1", ["pick_up"]),
        _trigger("t_restricted", "restricted_area", "office", ["navigate"]),
        _trigger("t_ambiguous", "ambiguous_target", "mug_1", ["pick_up"], candidates=["mug_1", "mug_2"]),
        _trigger("t_knowledge", "person_knowledge", "phone_1", ["search", "navigate"]),
        _trigger("t_busy", "person_busy", "bob", ["talk_to", "ask_for_help"]),
    ]
    hidden = {"backroom", "d_kitchen_back"}
    fixtures = [o for o in objects if o.get("portable", True) is False]
    view_places = [{"id": p["id"], "name": p["name"], "kind": p.get("kind", "room"), "floor": 0,
                    "landmarks": [f["id"] for f in fixtures if f["location"] == p["id"]]}
                   for p in places if p["id"] not in hidden]
    view_conns = [{"id": c["id"], "a": c["a"], "b": c["b"], "kind": c.get("kind", "open"),
                   "door": "closed" if c.get("door") == "locked" else c.get("door")}
                  for c in conns if c["id"] not in hidden]
    shown = {"fan_1": "hall", "lamp_1": "hall", "cupboard_1": "kitchen", "table_1": "kitchen",
             "key_1": "hall",
             "vase_1": "hall", "crate_1": "hall", "mug_1": "kitchen", "mug_2": "kitchen", "book_1": "kitchen"}
    by_id = {o["id"]: o for o in objects}
    view_objects = [{"id": i, "name": by_id[i]["name"], "type": by_id[i]["type"],
                     "color": by_id[i].get("color"), "last_seen": loc} for i, loc in shown.items()]
    view_people = [{"id": p["id"], "name": p["name"], "role": p["role"], "last_seen": p["place"]}
                   for p in people]
    return {
        "id": "hand-train-0-hard", "instruction_id": "hand0", "instruction": "Bring the phone to the hall.",
        "kind": "fetch_place", "difficulty": "hard", "scene": "hand", "layout_id": "hand-layout",
        "split": "train",
        "env_state": {"places": places, "connections": conns, "objects": objects,
                      "agent": {"place": "hall", "holding": [], "capacity": 2}, "people": people,
                      "facts": facts},
        "failure_triggers": triggers, "human_persona": personas,
        "goal": [{"op": "fetch", "object": {"type": "phone"}, "place": "hall"}],
        "subgoals": [{"id": "sg0", "description": "find the phone",
                      "predicate": {"kind": "observed", "object": "phone_1"}},
                     {"id": "sg1", "description": "put it in the hall",
                      "predicate": {"kind": "object_at", "object": "phone_1", "location": "hall"}}],
        "success": [{"kind": "object_at", "object": "phone_1", "location": "hall"}],
        "agent_view": {"places": view_places, "connections": view_conns, "objects": view_objects,
                       "people": view_people},
        "step_budget": 60, "optimal_steps": 9, "seed": 0,
    }


@pytest.fixture(scope="session")
def world_data() -> dict:
    return world_dict()


@pytest.fixture(scope="session")
def task(world_data) -> TaskInstance:
    return TaskInstance.model_validate(copy.deepcopy(world_data))


@pytest.fixture
def ctrl(task) -> EnvController:
    c = EnvController(task)
    c.reset()
    return c


@pytest.fixture(scope="session")
def built_tasks() -> list[TaskInstance]:
    from pipeline.recipe import load_recipe
    from pipeline.stages import build_tasks
    splits, _ = build_tasks(load_recipe(ROOT / "recipes" / "ci.yaml"), show_progress=False)
    return splits["train"] + splits["test"]


@pytest.fixture(scope="session")
def sample_tasks(built_tasks) -> list[TaskInstance]:
    """A few real tasks: one per difficulty, plus the ones with the most obstacles."""
    picked = {}
    for t in built_tasks:
        picked.setdefault(t.difficulty, t)
    most = sorted(built_tasks, key=lambda t: (-len(t.failure_triggers), t.id))[:2]
    out = list(picked.values()) + [t for t in most if t not in picked.values()]
    return out
