"""Tests that close the gaps mutation testing (mutmut, docs/mutation.md) found in sandbox/controller.py.

Every test plays real skill calls on a real EnvController; the worlds are conftest.world_dict plus what the
test needs (the fixture world has a single key, so "any held key opens any lock" passed the whole suite).
"""

from __future__ import annotations

import copy

import pytest

from sandbox.controller import EnvController
from sandbox.schema import (AgentAt, AgentNear, DoorOpen, Holding, Inspected, NextTo, ObjectAt, ObjectStateIs,
                            Observed, Reported, TaskInstance, Told)

from conftest import do, ok, world_dict


def expect(ctrl: EnvController, call: tuple, error: str | None, observation: str, trigger: str | None = None):
    """Play `call` = (skill, {arguments}) and check the whole result; the cached state key must equal one
    computed from scratch (a skill that changes objects must refresh that part of the key)."""
    name, arguments = call
    res = do(ctrl, name, **arguments)
    assert (res.ok, res.error, res.trigger, res.observation) == (error is None, error, trigger, observation), call
    assert res.state_key == ctrl.state_key() == ctrl.world.uncached_key(), call
    return res


def make(data: dict) -> EnvController:
    c = EnvController(TaskInstance.model_validate(data))
    c.reset()
    return c


def two_keys_world() -> dict:
    """world_dict plus what the tests below need; the map gains a second locked door from the hall:

        storage =(d_hall_storage, locked, key_1)= hall =(d_hall_vault, locked, key_2, no trigger)= vault
                                                   | (hidden d_hall_cellar, listed before d_hall_vault)
                                                 cellar

    d_hall_vault is not on the agent's map: the first look in the hall finds it. New things in the hall: key_2, a
    locked and heavy iron chest (key_3, lying in the kitchen, opens it) holding a coin and a ring, a closed
    portable box, a broken radio, an anvil (heavy) and a bowl (fragile) without triggers, a note with an owner
    tag of someone unknown, and Carol (Dan, in the lab, is not on the map). The map is wrong about Bob (seen in
    the hall, he is in the kitchen), about bag_1 (in the kitchen, not the yard), and about a spoon and a fork (in
    the lab, not in the kitchen's cupboard and on its table). bag_2 (in the kitchen) is not on the map; the pens
    in the bags are.
    """
    d = copy.deepcopy(world_dict())
    st = d["env_state"]
    st["places"] += [{"id": "vault", "name": "vault"}, {"id": "cellar", "name": "cellar", "hidden": True}]
    st["connections"] += [{"id": "d_hall_cellar", "a": "hall", "b": "cellar", "kind": "door", "door": "closed",
                           "hidden": True},
                          {"id": "d_hall_vault", "a": "hall", "b": "vault", "kind": "door", "door": "locked"}]
    fixture = {"portable": False, "size": "large"}
    st["objects"] += [
        {"id": "key_2", "type": "key", "name": "vault key", "location": "hall", "opens": "d_hall_vault"},
        {"id": "chest_1", "type": "chest", "name": "iron chest", "location": "hall", **fixture,
         "container": True, "openable": True, "locked": True, "heavy": True},
        {"id": "coin_1", "type": "coin", "name": "gold coin", "location": "chest_1"},
        {"id": "ring_1", "type": "ring", "name": "silver ring", "location": "chest_1"},
        {"id": "key_3", "type": "key", "name": "chest key", "location": "kitchen", "opens": "chest_1"},
        {"id": "box_1", "type": "box", "name": "paper box", "location": "hall", "container": True,
         "openable": True},
        {"id": "radio_1", "type": "radio", "name": "old radio", "location": "hall", **fixture, "device": True,
         "broken": True},
        {"id": "anvil_1", "type": "anvil", "name": "anvil", "location": "hall", "heavy": True},
        {"id": "bowl_1", "type": "bowl", "name": "clay bowl", "location": "hall", "fragile": True},
        {"id": "note_1", "type": "note", "name": "note", "location": "hall", "owner": "dave",
         "details": {"colour": "yellow", "words": "none"}},
        {"id": "bag_1", "type": "bag", "name": "cloth bag", "location": "kitchen", "container": True},
        {"id": "pen_1", "type": "pen", "name": "green pen", "location": "bag_1"},
        {"id": "bag_2", "type": "bag", "name": "leather bag", "location": "kitchen", "container": True},
        {"id": "pen_2", "type": "pen", "name": "black pen", "location": "bag_2"},
        {"id": "spoon_1", "type": "spoon", "name": "spoon", "location": "lab"},
        {"id": "fork_1", "type": "fork", "name": "fork", "location": "lab"},
    ]
    st["people"] += [{"id": "carol", "name": "Carol", "role": "visitor", "place": "hall"},
                     {"id": "dan", "name": "Dan", "role": "gardener", "place": "lab"}]
    view = d["agent_view"]
    view["places"].append({"id": "vault", "name": "vault", "kind": "room", "floor": 0, "landmarks": []})
    seen = {"key_2": "hall", "key_3": "kitchen", "chest_1": "hall", "radio_1": "hall", "bag_1": "yard",
            "pen_1": "bag_1", "pen_2": "bag_2", "spoon_1": "cupboard_1", "fork_1": "table_1"}
    names = {o["id"]: o for o in st["objects"]}
    view["objects"] += [{"id": i, "name": names[i]["name"], "type": names[i]["type"], "color": None,
                         "last_seen": loc} for i, loc in seen.items()]
    view["people"] = [{**p, "last_seen": "hall"} if p["id"] == "bob" else p for p in view["people"]]
    return d


@pytest.fixture
def keys() -> EnvController:
    return make(two_keys_world())


# ============================================================================ _do_open: a key opens its own lock


def test_the_wrong_key_does_not_open_a_locked_door(keys):
    ok(keys, "pick_up", object="key_2")                       # the vault key, not the storage key
    res = do(keys, "open", target="d_hall_storage")
    assert not res.ok and res.error == "trigger_fired" and res.trigger == "t_locked"
    assert "locked" in res.observation
    assert keys.world.door["d_hall_storage"] == "locked" and keys.world.known_door["d_hall_storage"] == "locked"
    assert "locked:d_hall_storage" in keys.world.learned
    # the right key for the other door works, and names itself
    res = ok(keys, "open", target="d_hall_vault")
    assert res.observation == "You unlock the door between hall and vault with the vault key and open it."
    assert keys.world.door["d_hall_vault"] == "open" and keys.world.door["d_hall_storage"] == "locked"
    ok(keys, "navigate", target="vault")
    assert keys.world.agent_place == "vault"


def test_with_two_keys_held_the_matching_one_unlocks(keys):
    ok(keys, "pick_up", object="key_2")
    ok(keys, "pick_up", object="key_1")
    assert keys.world.holding == ["key_2", "key_1"]
    do(keys, "navigate", target="storage")                     # walks into the lock: now known locked
    assert "locked:d_hall_storage" in keys.world.learned
    res = ok(keys, "open", target="d_hall_storage")
    assert "with the storage key" in res.observation          # key_1, though key_2 was picked up first
    assert keys.world.door["d_hall_storage"] == "open" == keys.world.known_door["d_hall_storage"]
    assert "locked:d_hall_storage" not in keys.world.learned  # unlocking forgets the obstacle
    ok(keys, "navigate", target="storage")


def test_the_wrong_key_does_not_open_a_locked_container(keys):
    ok(keys, "pick_up", object="key_1")
    res = do(keys, "open", target="chest_1")
    assert res.error == "precondition_unmet" and res.observation == "The iron chest is locked."
    assert keys.world.obj["chest_1"]["locked"] and not keys.world.obj["chest_1"]["open"]
    assert "seen:coin_1" not in keys.world.learned
    ok(keys, "navigate", target="key_3")
    ok(keys, "pick_up", object="key_3")
    ok(keys, "navigate", target="hall")
    res = ok(keys, "open", target="chest_1")
    assert res.observation == "You open the iron chest. Inside: gold coin [coin_1], silver ring [ring_1]."
    assert keys.world.obj["chest_1"] == {**keys.world.obj["chest_1"], "open": True, "locked": False}
    assert keys.world.known_obj["coin_1"] == "chest_1" and "seen:coin_1" in keys.world.learned
    assert "state:chest_1:open=True" in keys.world.learned and "state:chest_1:open=False" not in keys.world.learned


# ============================================================================ observations, word for word

HALL = ("You are in the hall [hall]. You see: ceiling fan [fan_1], desk lamp [lamp_1], iron chest [chest_1], old radio "
        "[radio_1], storage key [key_1], glass vase [vase_1], wooden crate [crate_1], vault key [key_2], paper box "
        "[box_1], anvil [anvil_1], clay bowl [bowl_1], note [note_1]. People here: Alice [alice], Carol [carol]. "
        "Exits: kitchen [kitchen] via d_hall_kitchen (closed); storage room [storage] via d_hall_storage (closed); "
        "office [office] via p_hall_office; vault [vault] via d_hall_vault (closed).")
KITCHEN = ("You are in the kitchen [kitchen]. You see: cupboard [cupboard_1], kitchen table [table_1], red mug "
           "[mug_1], blue mug [mug_2], chest key [key_3], cloth bag [bag_1], green pen [pen_1] in the cloth bag, "
           "leather bag [bag_2], black pen [pen_2] in the leather bag. People here: Bob [bob]. Exits: hall [hall] via "
           "d_hall_kitchen (open); lab [lab] via p_kitchen_lab; yard [yard] via p_kitchen_yard.")


def test_the_first_look_lists_fixtures_things_people_and_exits_and_what_is_known():
    c = EnvController(TaskInstance.model_validate(two_keys_world()))
    assert c.reset() == HALL
    w = c.world
    # a locked door looks closed until tried; a door missing from the map is found by looking; hidden ones are not
    assert w.known_door["d_hall_storage"] == "closed" and w.known_door["d_hall_vault"] == "closed"
    assert "d_hall_vault" in w.known_conns and "d_hall_cellar" not in w.known_conns
    assert w.known_person["bob"] is None and w.known_person["carol"] == "hall"   # Bob is not where the map says
    assert {"seen:key_1", "seen:box_1", "state:box_1:open=False", "state:chest_1:open=False"} <= w.learned
    assert c.success is False and c.done is False and c.steps == 0


def test_a_locked_door_shows_as_locked_once_tried(keys):
    do(keys, "navigate", target="storage")
    assert ok(keys, "look_around").observation == HALL.replace("d_hall_storage (closed)", "d_hall_storage (locked)")
    ok(keys, "pick_up", object="key_1")
    ok(keys, "pick_up", object="key_2")
    assert ok(keys, "look_around").observation == (
        HALL.replace("storage key [key_1], ", "").replace("vault key [key_2], ", "")
        .replace("d_hall_storage (closed)", "d_hall_storage (locked)")
        + " Holding: storage key [key_1], vault key [key_2].")


def test_things_in_open_containers_and_on_surfaces_are_seen(keys):
    assert ok(keys, "navigate", target="kitchen").observation == KITCHEN
    ok(keys, "open", target="cupboard_1")
    ok(keys, "pick_up", object="key_3")
    ok(keys, "place", object="key_3", target="table_1")
    assert ok(keys, "look_around").observation == (
        KITCHEN.replace("kitchen table [table_1], red mug", "kitchen table [table_1], tea cup [cup_1] in the cupboard, "
                                                             "red mug")
        .replace("chest key [key_3], ", "chest key [key_3] on the kitchen table, "))
    assert keys.world.known_obj["cup_1"] == "cupboard_1" and keys.world.known_obj["key_3"] == "table_1"


def test_beliefs_about_things_that_are_not_where_the_map_says(keys):
    w = keys.world
    assert w.known_obj["book_1"] == "kitchen" and w.known_obj["fork_1"] == "table_1"
    ok(keys, "navigate", target="kitchen")
    # in plain sight (on the floor, on the table) but not there: the belief becomes "unknown"
    assert w.known_obj["book_1"] is None and w.known_obj["fork_1"] is None
    # inside the closed cupboard: the agent cannot tell, the belief stays ...
    assert w.known_obj["spoon_1"] == "cupboard_1"
    ok(keys, "open", target="cupboard_1")
    assert w.known_obj["spoon_1"] == "cupboard_1"
    ok(keys, "look_around")                                   # ... until it looks into the open cupboard
    assert w.known_obj["spoon_1"] is None


def test_a_thing_believed_in_a_closed_container_here_is_not_here_any_more(keys):
    ok(keys, "navigate", target="kitchen")
    expect(keys, ("pick_up", {"object": "spoon_1"}), "precondition_unmet", "The spoon is not here any more.")
    assert keys.world.known_obj["spoon_1"] is None


def test_fixture_and_box_states_learned_when_someone_else_opened_them(keys):
    ok(keys, "navigate", target="kitchen")                    # the cupboard is seen closed
    ok(keys, "navigate", target="hall")
    assert "state:cupboard_1:open=False" in keys.world.learned
    ok(keys, "ask_for_help", person="alice", request="carry", target="key_2", destination="box_1", reason="r")
    ok(keys, "ask_for_help", person="alice", request="carry", target="key_1", destination="cupboard_1", reason="r")
    ok(keys, "look_around")                                   # Alice opened the box to put the key in
    assert "state:box_1:open=True" in keys.world.learned and "state:box_1:open=False" not in keys.world.learned
    res = ok(keys, "navigate", target="kitchen")              # ... and the cupboard
    assert "storage key [key_1] in the cupboard, tea cup [cup_1] in the cupboard" in res.observation
    assert "People here: Alice [alice], Bob [bob]." in res.observation
    learned = keys.world.learned
    assert "state:cupboard_1:open=True" in learned and "state:cupboard_1:open=False" not in learned


# ============================================================================ inspect


def test_inspect_doors_and_paths(keys):
    w = keys.world
    expect(keys, ("inspect", {"target": "d_hall_storage"}), None, "The door between hall and storage room is locked.")
    assert {"locked:d_hall_storage", "state:d_hall_storage:open=False", "state:d_hall_storage:locked=True",
            "inspected:d_hall_storage"} <= w.learned and w.known_door["d_hall_storage"] == "locked"
    expect(keys, ("inspect", {"target": "d_hall_kitchen"}), None, "The door between hall and kitchen is closed.")
    assert {"state:d_hall_kitchen:open=False", "state:d_hall_kitchen:locked=False"} <= w.learned
    assert "locked:d_hall_kitchen" not in w.learned and w.known_door["d_hall_kitchen"] == "closed"
    expect(keys, ("inspect", {"target": "p_hall_office"}), None, "The open between hall and office is open.")
    assert {"state:p_hall_office:open=True", "state:p_hall_office:locked=False"} <= w.learned
    assert w.known_door["p_hall_office"] is None               # no door there: no door state to know
    expect(keys, ("inspect", {"target": "d_hall_cellar"}), "unknown_entity",
           "You don't know any object called 'd_hall_cellar'.")  # hidden
    expect(keys, ("inspect", {"target": "y" * 60}), "unknown_entity", f"You don't know any object called {'y' * 40!r}.")
    expect(keys, ("inspect", {"target": "p_kitchen_yard"}), "precondition_unmet", "You are not next to p_kitchen_yard.")
    ok(keys, "navigate", target="kitchen")
    expect(keys, ("inspect", {"target": "p_kitchen_lab"}), None,
           "The open between kitchen and lab is open. It is blocked.")
    assert "blocked:p_kitchen_lab" in w.learned
    ok(keys, "navigate", target="yard")
    expect(keys, ("inspect", {"target": "p_yard_lab"}), None, "The path between yard and lab is open.")
    assert "blocked:p_yard_lab" not in w.learned


@pytest.mark.parametrize("target, text, facts", [
    ("chest_1", "The iron chest [chest_1] is locked, very heavy.",
     {"state:chest_1:open=False", "state:chest_1:locked=True", "heavy:chest_1"}),
    ("box_1", "The paper box [box_1] is closed.", {"state:box_1:open=False", "state:box_1:locked=False"}),
    ("radio_1", "The old radio [radio_1] is broken: it shows an error.",
     {"state:radio_1:on=False", "state:radio_1:broken=True", "broken:radio_1"}),
    ("fan_1", "The ceiling fan [fan_1] is off.", {"state:fan_1:on=False", "state:fan_1:broken=False"}),
    ("anvil_1", "The anvil [anvil_1] is very heavy.", {"heavy:anvil_1"}),
    ("bowl_1", "The clay bowl [bowl_1] is fragile.", {"fragile:bowl_1"}),
    ("key_1", "The storage key [key_1] looks ordinary.", set()),
    ("note_1", "The note [note_1] looks ordinary. It has a name tag: dave. Colour: yellow. Words: none.",
     {"owner:note_1=dave"}),
])
def test_inspect_objects(keys, target, text, facts):
    expect(keys, ("inspect", {"target": target}), None, text)
    assert facts | {"inspected:" + target} <= keys.world.learned
    assert not any(f.startswith(("heavy:", "fragile:", "broken:")) and not f.endswith(target)
                   for f in keys.world.learned)


def test_inspect_states_that_change(keys):
    ok(keys, "operate", device="fan_1", action="turn_on")
    expect(keys, ("inspect", {"target": "fan_1"}), None, "The ceiling fan [fan_1] is on.")
    ok(keys, "navigate", target="kitchen")
    ok(keys, "open", target="cupboard_1")
    expect(keys, ("inspect", {"target": "cupboard_1"}), None, "The cupboard [cupboard_1] is open.")
    ok(keys, "navigate", target="mug_1")
    expect(keys, ("inspect", {"target": "mug_1"}), None,
           "The red mug [mug_1] looks ordinary. It has a name tag: Alice.")


@pytest.mark.parametrize("skill, arguments, verb", [
    ("inspect", {"target": "mug_1"}, "inspect"), ("pick_up", {"object": "mug_1"}, "pick up"),
    ("open", {"target": "mug_1"}, "open"), ("close", {"target": "mug_1"}, "close"),
    ("operate", {"device": "mug_1", "action": "turn_on"}, "operate"),
])
def test_a_known_thing_elsewhere_is_out_of_reach(keys, skill, arguments, verb):
    expect(keys, (skill, arguments), "precondition_unmet",
           f"The red mug is not within reach here; you cannot {verb} it.")


# ============================================================================ open and close


def test_open_and_close_doors_word_for_word(keys):
    expect(keys, ("open", {"target": "d_hall_vault"}), "precondition_unmet",
           "The door between hall and vault is locked.")            # no trigger on this one
    assert keys.world.known_door["d_hall_vault"] == "locked"
    expect(keys, ("close", {"target": "d_hall_kitchen"}), "precondition_unmet",
           "The door between hall and kitchen is not open.")
    expect(keys, ("open", {"target": "d_hall_kitchen"}), None, "You open the door between hall and kitchen.")
    expect(keys, ("open", {"target": "d_hall_kitchen"}), "precondition_unmet",
           "The door between hall and kitchen is already open.")
    expect(keys, ("close", {"target": "d_hall_kitchen"}), None, "You close the door between hall and kitchen.")
    assert keys.world.door["d_hall_kitchen"] == keys.world.known_door["d_hall_kitchen"] == "closed"
    expect(keys, ("close", {"target": "p_hall_office"}), "precondition_unmet",
           "There is no door p_hall_office next to you.")
    expect(keys, ("open", {"target": "d_hall_cellar"}), "unknown_entity",
           "You don't know any object called 'd_hall_cellar'.")
    expect(keys, ("close", {"target": "d_hall_cellar"}), "unknown_entity",
           "You don't know any object called 'd_hall_cellar'.")
    ok(keys, "navigate", target="yard")
    expect(keys, ("open", {"target": "d_hall_kitchen"}), "precondition_unmet", "You are not next to d_hall_kitchen.")
    ok(keys, "navigate", target="kitchen")
    expect(keys, ("close", {"target": "d_hall_vault"}), "precondition_unmet",
           "There is no door d_hall_vault next to you.")


def test_open_and_close_containers_word_for_word(keys):
    ok(keys, "navigate", target="kitchen")
    expect(keys, ("close", {"target": "cupboard_1"}), "precondition_unmet", "The cupboard is not open.")
    expect(keys, ("close", {"target": "table_1"}), "precondition_unmet", "The kitchen table is not open.")
    expect(keys, ("open", {"target": "cupboard_1"}), None, "You open the cupboard. Inside: tea cup [cup_1].")
    expect(keys, ("open", {"target": "cupboard_1"}), "precondition_unmet", "The cupboard is already open.")
    expect(keys, ("close", {"target": "cupboard_1"}), None, "You close the cupboard.")
    w = keys.world
    assert w.obj["cupboard_1"]["open"] is False
    assert "state:cupboard_1:open=False" in w.learned and "state:cupboard_1:open=True" not in w.learned
    ok(keys, "navigate", target="hall")
    expect(keys, ("open", {"target": "box_1"}), None, "You open the paper box. It is empty.")
    expect(keys, ("open", {"target": "chest_1"}), "precondition_unmet", "The iron chest is locked.")


# ============================================================================ pick up and place


def test_pick_up_refusals_word_for_word(keys):
    expect(keys, ("pick_up", {"object": "anvil_1"}), "precondition_unmet", "The anvil is too heavy to lift alone.")
    expect(keys, ("pick_up", {"object": "crate_1"}), "trigger_fired", "The wooden crate is too heavy to lift alone.",
           "t_heavy")
    expect(keys, ("pick_up", {"object": "chest_1"}), "precondition_unmet", "The iron chest cannot be picked up.")
    ok(keys, "pick_up", object="key_1")
    expect(keys, ("pick_up", {"object": "key_1"}), "precondition_unmet", "You already hold the storage key.")
    expect(keys, ("pick_up", {"object": "bowl_1"}), "precondition_unmet",
           "The clay bowl is fragile: you need both hands free to carry it safely.")
    assert "fragile:bowl_1" in keys.world.learned
    expect(keys, ("pick_up", {"object": "vase_1"}), "trigger_fired",
           "The glass vase is fragile: you need both hands free to carry it safely.", "t_fragile")
    ok(keys, "pick_up", object="key_2")                       # capacity 2: now full
    expect(keys, ("pick_up", {"object": "box_1"}), "precondition_unmet",
           "Your hands are full; put something down first.")
    assert keys.world.holding == ["key_1", "key_2"]


def test_pick_up_names_the_candidates_of_an_ambiguous_target():
    d = two_keys_world()
    for o in d["env_state"]["objects"]:
        if o["id"] in ("mug_1", "mug_2"):
            o["type"] = "coffee_mug"
    c = make(d)
    ok(c, "navigate", target="kitchen")
    expect(c, ("pick_up", {"object": "mug_1"}), "trigger_fired",
           "There are 2 coffee mugs that could be meant; you are not sure which one is the right one.", "t_ambiguous")


def test_pick_up_clears_next_to_and_standing_next_to_it(keys):
    ok(keys, "pick_up", object="key_1")
    ok(keys, "place", object="key_1", target="anvil_1")
    assert keys.world.obj["key_1"]["next_to"] == "anvil_1"
    ok(keys, "pick_up", object="key_1")
    assert keys.world.obj["key_1"]["next_to"] is None
    ok(keys, "navigate", target="key_3")
    assert keys.world.agent_near == "key_3"
    ok(keys, "pick_up", object="key_3")
    assert keys.world.agent_near is None


def test_place_word_for_word(keys):
    long_id = "y" * 60
    expect(keys, ("place", {"object": long_id, "target": "hall"}), "unknown_entity",
           f"You don't know any object called {'y' * 40!r}.")
    ok(keys, "pick_up", object="key_1")
    expect(keys, ("place", {"object": "key_1", "target": "key_1"}), "bad_argument_value",
           "An object cannot be placed on itself.")
    expect(keys, ("place", {"object": "key_1", "target": "mug_1"}), "precondition_unmet", "The red mug is not here.")
    expect(keys, ("place", {"object": "key_1", "target": "kitchen"}), "precondition_unmet",
           "You are not in the kitchen.")
    expect(keys, ("place", {"object": "key_1", "target": "backroom"}), "unknown_entity",
           "You don't know any place or object called 'backroom'.")     # hidden: not on the agent's map
    expect(keys, ("place", {"object": "key_1", "target": long_id}), "unknown_entity",
           f"You don't know any place or object called {'y' * 40!r}.")
    expect(keys, ("place", {"object": "key_1", "target": "box_1"}), "precondition_unmet", "The paper box is closed.")
    assert keys.world.holding == ["key_1"]
    expect(keys, ("place", {"object": "key_1", "target": "anvil_1"}), None,
           "You put the storage key next to the anvil.")
    ok(keys, "navigate", target="kitchen")
    ok(keys, "pick_up", object="key_3")
    expect(keys, ("place", {"object": "key_3", "target": "table_1"}), None,
           "You put the chest key on the kitchen table.")
    ok(keys, "open", target="cupboard_1")
    ok(keys, "pick_up", object="key_3")
    expect(keys, ("place", {"object": "key_3", "target": "cupboard_1"}), None, "You put the chest key in the cupboard.")
    assert keys.world.obj["key_3"]["loc"] == keys.world.known_obj["key_3"] == "cupboard_1"


# ============================================================================ navigate


def test_navigate_stops_word_for_word(keys):
    w = keys.world
    expect(keys, ("navigate", {"target": "vault"}), "precondition_unmet",
           "The door d_hall_vault to the vault is locked.")          # the first hop: the agent has not moved
    assert w.known_door["d_hall_vault"] == "locked" and "locked:d_hall_vault" in w.learned
    expect(keys, ("navigate", {"target": "storage"}), "trigger_fired",
           "The door d_hall_storage to the storage room is locked.", "t_locked")
    expect(keys, ("navigate", {"target": "lab"}), "trigger_fired",
           "You walk to the kitchen [kitchen]. The way from the kitchen to the lab is blocked.", "t_blocked")
    assert w.agent_place == "kitchen" and w.agent_near is None and keys.crossed == ["d_hall_kitchen"]
    expect(keys, ("navigate", {"target": "y" * 60}), "unknown_entity",
           f"You don't know any place or object called {'y' * 40!r}.")
    expect(keys, ("navigate", {"target": "backroom"}), "unknown_entity",
           "You don't know any place or object called 'backroom'.", "t_knowledge")
    ok(keys, "pick_up", object="key_3")
    expect(keys, ("navigate", {"target": "key_3"}), "precondition_unmet", "You are holding the chest key.")


def test_navigate_to_a_thing_in_a_bag_goes_where_the_bag_is_believed_to_be(keys):
    # bag_1 is on the map in the yard (it is in the kitchen): the agent walks to the yard and misses the pen
    res = expect(keys, ("navigate", {"target": "pen_1"}), "precondition_unmet",
                 "The green pen is not where you last saw it. You are in the yard [yard]. You see: book [book_1]. "
                 "Exits: kitchen [kitchen] via p_kitchen_yard; lab [lab] via p_yard_lab.")
    assert keys.world.agent_place == "yard" and keys.world.known_obj["pen_1"] is None and res.trigger is None


def test_navigate_to_a_thing_in_an_unmapped_bag_goes_where_the_bag_is(keys):
    # bag_2 is not on the map at all: the pen is found where the bag really is
    ok(keys, "navigate", target="pen_2")
    assert keys.world.agent_place == "kitchen" and keys.world.agent_near == "pen_2"
    ok(keys, "navigate", target="hall")
    assert keys.world.agent_near is None


# ============================================================================ operate, search, people, finish


def test_operate_word_for_word(keys):
    expect(keys, ("operate", {"device": "radio_1", "action": "turn_on"}), "precondition_unmet",
           "The old radio beeps and shows an error; it does not start.")   # broken, and no trigger
    assert "broken:radio_1" in keys.world.learned
    expect(keys, ("operate", {"device": "fan_1", "action": "turn_off"}), "precondition_unmet",
           "The ceiling fan is already off.")
    expect(keys, ("operate", {"device": "fan_1", "action": "turn_on"}), None, "You turn the ceiling fan on.")
    expect(keys, ("operate", {"device": "fan_1", "action": "turn_on"}), "precondition_unmet",
           "The ceiling fan is already on.")
    expect(keys, ("operate", {"device": "fan_1", "action": "turn_off"}), None, "You turn the ceiling fan off.")


def test_search_word_for_word(keys):
    expect(keys, ("search", {"query": " ?! "}), "bad_argument_value", "search.query has no words.")
    expect(keys, ("search", {"query": "storage"}), None, "You find: storage key [key_1].")   # by name, not type
    assert "seen:key_1" in keys.world.learned
    ok(keys, "navigate", target="kitchen")
    expect(keys, ("search", {"query": "mug"}), None, "You find: red mug [mug_1], blue mug [mug_2].")
    expect(keys, ("search", {"query": "a cup please"}), None, "You find: tea cup [cup_1] in the cupboard [cupboard_1].")
    assert keys.world.known_obj["cup_1"] == "cupboard_1" and "seen:cup_1" in keys.world.learned
    expect(keys, ("search", {"query": "unicorn with a very long name that goes on"}), None,
           "You search the kitchen but find no unicorn with a very long name that goes .")


def test_people_word_for_word(keys):
    expect(keys, ("talk_to", {"person": "dan", "topic": "book_1"}), "unknown_entity",
           "You don't know anyone called 'dan'.")                   # in the game, but never seen
    expect(keys, ("talk_to", {"person": "z" * 60, "topic": "book_1"}), "unknown_entity",
           f"You don't know anyone called {'z' * 40!r}.")
    ok(keys, "navigate", target="kitchen")
    # Carol has no persona, so no assistance rule: she must be here to be asked at all
    expect(keys, ("ask_for_help", {"person": "carol", "request": "carry", "target": "key_3", "reason": "r"}),
           "precondition_unmet", "Carol is not here.")


def test_finish_and_the_episode_over(keys):
    expect(keys, ("finish", {}), None, "You end the task.")
    assert keys.done and keys.success is False and keys.steps == 1
    res = do(keys, "look_around")
    assert (res.ok, res.error, res.observation) == (False, "episode_over", "The episode is over.")
    assert res.state_key == keys.state_key() and keys.steps == 1   # a call after the end is not a step


# ============================================================================ step, reset, success


def test_stepping_without_reset_starts_from_the_initial_world(task):
    c = EnvController(task)
    assert (c.steps, c.fired, c.crossed, c.reset_subgoals, c.done, c.success) == (0, {}, [], [], False, False)
    res = do(c, "navigate", target="storage")
    assert res.trigger == "t_locked" and c.fired == {"t_locked": 1} and c.steps == 1
    do(c, "fly", to="moon")                                        # a rejected call counts as a step too
    ok(c, "navigate", target="kitchen")
    assert c.steps == 3 and c.crossed == ["d_hall_kitchen"] and c.world.agent_place == "kitchen"
    assert c.compiled.initial.agent_place == "hall" and c.done is False and c.success is False


def test_reset_with_a_given_world(task):
    c = EnvController(task)
    first = c.reset()
    ok(c, "navigate", target="kitchen")
    saved = c.world.clone()
    text = c.reset(saved)
    assert text.startswith("You are in the kitchen [kitchen].") and c.world is not saved
    assert c.reset_subgoals == [] and c.steps == 0 and c.success is False
    assert c.reset() == first


def test_success_needs_the_success_predicates_as_well_as_every_subgoal(world_data):
    d = copy.deepcopy(world_data)
    d["subgoals"] = [{"id": "sg0", "description": "go to the kitchen",
                      "predicate": {"kind": "agent_at", "place": "kitchen"}}]
    d["success"] = [{"kind": "agent_at", "place": "hall"}]
    c = make(d)
    res = ok(c, "navigate", target="kitchen")
    assert res.subgoals_met == ["sg0"]
    assert ok(c, "finish").success is False and c.success is False      # the subgoal, but not the success test
    c.reset()
    ok(c, "navigate", target="kitchen")
    ok(c, "navigate", target="hall")
    assert ok(c, "finish").success is True


def test_subgoals_met_at_reset_are_reported_once(world_data):
    d = copy.deepcopy(world_data)
    d["subgoals"] = [{"id": "sg0", "description": "be in the hall", "predicate": {"kind": "agent_at", "place": "hall"}},
                     {"id": "sg1", "description": "see the key", "predicate": {"kind": "observed", "object": "key_1"}},
                     {"id": "sg2", "description": "go to the kitchen",
                      "predicate": {"kind": "agent_at", "place": "kitchen"}}]
    c = make(d)
    assert c.reset_subgoals == ["sg0", "sg1"] and c.subgoal_progress() == (2, 3)
    assert ok(c, "navigate", target="kitchen").subgoals_met == ["sg2"]
    assert ok(c, "look_around").subgoals_met == []


# ============================================================================ predicates


def test_predicates(keys):
    h = keys.holds
    assert h(AgentAt(place="hall")) and not h(AgentAt(place="kitchen"))
    assert h(DoorOpen(door="d_hall_kitchen")) is False
    assert h(ObjectStateIs(object="fan_1", field="on", value=False))
    assert not h(ObjectStateIs(object="fan_1", field="on", value=True))
    assert h(Observed(object="key_1"))
    assert not h(Observed(object="key_3"))              # the map is right about it, but it was never seen
    assert not h(Observed(object="book_1"))             # neither seen nor where the map says
    ok(keys, "pick_up", object="key_1")
    assert h(Holding(object="key_1")) and not h(Holding(object="key_2"))
    assert not h(ObjectAt(object="key_1", location="hall"))          # held things are nowhere
    ok(keys, "place", object="key_1", target="anvil_1")
    assert h(ObjectAt(object="key_1", location="hall")) and not h(ObjectAt(object="key_1", location="kitchen"))
    assert h(NextTo(object="key_1", other="anvil_1")) and not h(NextTo(object="key_1", other="crate_1"))
    ok(keys, "pick_up", object="key_1")
    assert not h(NextTo(object="key_1", other="anvil_1"))
    ok(keys, "inspect", target="radio_1")
    assert h(Inspected(object="radio_1")) and not h(Inspected(object="fan_1"))
    ok(keys, "navigate", target="mug_2")
    assert h(AgentNear(object="mug_2")) and not h(AgentNear(object="mug_1"))
    assert h(DoorOpen(door="d_hall_kitchen")) and not h(DoorOpen(door="d_hall_storage"))
    ok(keys, "place", object="key_1", target="table_1")
    assert h(ObjectAt(object="key_1", location="table_1")) and h(ObjectAt(object="key_1", location="kitchen"))
    assert not h(ObjectAt(object="key_1", location="cupboard_1"))
    assert not h(Told(fact="f_hours"))
    with pytest.raises(ValueError, match=r"^unknown predicate kind 'smell'$"):
        h(type("P", (), {"kind": "smell"})())


def test_reported_predicate_uses_aliases_and_excludes(keys):
    pred = Reported(value="8 pm", aliases=["eight"], excludes=["9 pm"])
    assert not keys.holds(pred)                         # nothing reported yet
    ok(keys, "report", answer="eight")
    assert keys.holds(pred)
    ok(keys, "report", answer="8 pm or 9 pm")
    assert not keys.holds(pred)
    ok(keys, "report", answer="at 8 pm")
    assert keys.holds(pred)
