"""Tests that close the gaps mutation testing (mutmut, docs/mutation.md) found in reward_engine/rules.py: each
check's boundaries on small hand-written trajectories, and the exact Hit (rationale, evidence turns) it returns,
since the rationale is what the judge shows and the evidence is what it points at."""

from __future__ import annotations

import pytest

from agent.trajectory import SubgoalInfo, Trajectory, Turn, TurnState
from reward_engine.rules import CHECKS, Hit, History, call_text

START = "You are in the hall [hall]. You see: storage key [key_1]. Exits: kitchen [kitchen] via d_hall_kitchen."


def U(name: str | None = None, *, key: str, obs: str = "Done.", error: str | None = None,
      trigger: str | None = None, learned=(), place: str = "hall", holding=(), met=(), state: bool = True,
      **arguments) -> dict:
    """One turn: a call `name(**arguments)` (None: unreadable output) and what the env recorded after it."""
    return dict(tool_call=None if name is None else {"name": name, "arguments": arguments}, observation=obs,
                error=error, trigger=trigger, state_key=key, subgoals_met=list(met),
                state=TurnState(place=place, holding=list(holding), learned=list(learned)) if state else None)


def traj(*turns: dict, kinds=(), total: int = 0, start: str = START) -> Trajectory:
    return Trajectory(task_id="t", instruction="i", difficulty="easy", scene="s", policy="p", seed=0,
                      initial_observation=start, initial_state_key="k0",
                      turns=[Turn(index=i, **u) for i, u in enumerate(turns)],
                      subgoals=[SubgoalInfo(id=f"sg{i}", description=f"goal {i}", kind=k) for i, k in enumerate(kinds)],
                      subgoals_total=total)


def run(check: str, tr: Trajectory) -> list[Hit | None]:
    """The check at every turn."""
    h = History(tr)
    return [CHECKS[check](h, t) for t in range(len(tr.turns))]


LONG = "x" * 79 + "yz and more words after the eightieth character"  # [:80] ends in "y"

# --------------------------------------------------------------------------- History and helpers


def test_call_text_sorts_arguments_and_marks_unreadable_output():
    assert call_text(Turn(index=0, observation="", state_key="k", tool_call={"name": "open", "arguments":
                                                                             {"target": "d1", "b": 1}})) \
        == 'open({"b": 1, "target": "d1"})'
    assert call_text(Turn(index=0, observation="", state_key="k", tool_call={"name": "finish"})) == "finish({})"
    assert call_text(Turn(index=0, observation="", state_key="k", tool_call=None)) == "(unreadable)"


def test_history_indexes_what_was_known_before_each_turn():
    tr = traj(U("navigate", target="kitchen", key="k1", place="kitchen", learned=["seen:mug_1"]),
              U("pick_up", object="mug_1", key="k2", place="kitchen", holding=["mug_1"],
                learned=["seen:mug_1", "held:mug_1"], met=["sg0"]),
              U(None, key="k2", error="parse_error", obs="Unreadable.", state=False),
              U("look_around", key="k3", place="kitchen", holding=["mug_1"], learned=["held:mug_1", "new"]),
              kinds=("holding", "observed"))
    h = History(tr)
    assert h.n == 4 and h.met_total == 1 and h.sg_kind == ["holding", "observed"]
    assert h.place_before == ["hall", "kitchen", "kitchen", "kitchen"]          # the start from the first text
    assert h.holding_before == [(), (), ("mug_1",), ("mug_1",)]                 # an unrecorded turn keeps them
    assert h.met_before == [0, 0, 1, 1]
    assert h.known_before[0] == frozenset() and h.known_before[2] == {"seen:mug_1", "held:mug_1"}
    assert h.keys_before == [{"k0"}, {"k0", "k1"}, {"k0", "k1", "k2"}, {"k0", "k1", "k2"}]
    assert h.first_learned == {"seen:mug_1": 0, "held:mug_1": 1, "new": 3}
    assert [h.learned(t) for t in range(4)] == [["seen:mug_1"], ["held:mug_1"], [], ["new"]]
    assert [h.prev_key(t) for t in range(4)] == ["k0", "k1", "k2", "k2"]


def test_history_without_a_readable_start_place():
    h = History(traj(U("look_around", key="k1", state=False), start="Somewhere [odd]. You see nothing."))
    assert h.place_before == [None]


def test_mentions_looks_at_earlier_arguments_and_bracketed_ids_only():
    tr = traj(U("inspect", target="box_1", key="k1", obs="The box [box_1] is closed."),
              U(None, key="k1", error="parse_error", obs="The lamp glows near cup_1.", state=False),
              U("navigate", target="yard", key="k2", obs="You see: vase [vase_1]."),
              U("look_around", key="k2", obs="[mug_9]"))
    h = History(tr)
    assert h.mentions(1, "box_1")                       # in an earlier call's arguments (and text)
    assert not h.mentions(0, "box_1")                   # only earlier turns count
    assert h.mentions(3, "yard")                        # arguments alone
    assert h.mentions(3, "vase_1")                      # "[vase_1]" in an earlier observation alone
    assert not h.mentions(3, "cup_1")                   # named without brackets
    assert not h.mentions(3, "mug_9")                   # only in the current turn
    assert not h.mentions(3, "ghost")


# --------------------------------------------------------------------------- verifiable checks


def test_unreadable_is_no_call_or_a_parse_error():
    tr = traj(U(None, key="k0", error="parse_error", state=False),
              U("navigate", target="x", key="k0", error="parse_error"),
              U("navigate", target="x", key="k0", error="unknown_entity"))
    hit = Hit("the output has no readable tool call", (0,))
    assert run("unreadable", tr) == [hit, Hit(hit.rationale, (1,)), None]


def test_bad_arguments_quotes_80_characters_of_the_observation():
    tr = traj(U("navigate", place="x", key="k0", error="missing_argument", obs=LONG),
              U("navigate", target="x", key="k0", error="unknown_entity"))
    assert run("bad_arguments", tr) == [Hit("malformed arguments (missing_argument): " + "x" * 79 + "y", (0,)), None]


def test_after_end():
    tr = traj(U("finish", key="k1"), U("look_around", key="k1", error="episode_over", obs="The episode is over."))
    assert run("after_end", tr) == [None, Hit("the call comes after the episode ended", (1,))]


# --------------------------------------------------------------------------- blind_retry


OPEN = dict(name="open", target="d1")


def test_blind_retry_needs_the_same_call_error_and_text():
    tr = traj(U(**OPEN, key="k0", error="trigger_fired", obs="Locked."),
              U("navigate", target="kitchen", key="k0", error="precondition_unmet", obs="No."),
              U(**OPEN, key="k0", error="trigger_fired", obs="Locked."),          # same as turn 0: a blind retry
              U(**OPEN, key="k0", error="trigger_fired", obs="Locked, still."),   # text differs from turn 2
              U(**OPEN, key="k0"))                                                 # worked
    assert run("blind_retry", tr) == [
        None, None, Hit('open({"target": "d1"}) failed at turn 0 the same way and was repeated unchanged', (0, 2)),
        None, None]


def test_blind_retry_looks_at_the_nearest_earlier_identical_call_only():
    # the nearest identical call is two turns back (the loop must not skip it, nor wrap around to later turns)
    tr = traj(U(**OPEN, key="k0", error="trigger_fired", obs="Locked."),
              U("look_around", key="k0"),
              U(**OPEN, key="k0", error="trigger_fired", obs="Locked."))
    hit = Hit('open({"target": "d1"}) failed at turn 0 the same way and was repeated unchanged', (0, 2))
    assert run("blind_retry", tr) == [None, None, hit]
    # unreadable output twice is not a retry of a call
    tr = traj(U(None, key="k0", error="parse_error", obs="Unreadable.", state=False),
              U(None, key="k0", error="parse_error", obs="Unreadable.", state=False))
    assert run("blind_retry", tr) == [None, None]


def test_blind_retry_after_a_refusal():
    ask = dict(name="talk_to", person="bob", topic="mug_1")
    # "busy, ask again": asking again is what the refusal invites
    again = traj(U(**ask, key="k0", error="refused", obs="Bob is busy; ask again later."),
                 U(**ask, key="k0", error="refused", obs="Bob is busy; ask again later."))
    assert run("blind_retry", again) == [None, None]
    # a refusal that does not invite it, repeated word for word, is a blind retry
    flat = traj(U(**ask, key="k0", error="refused", obs="Bob will not help."),
                U(**ask, key="k0", error="refused", obs="Bob will not help."))
    assert run("blind_retry", flat)[1] == Hit(
        'talk_to({"person": "bob", "topic": "mug_1"}) failed at turn 0 the same way and was repeated unchanged',
        (0, 1))
    # "again" in the text of another error is no invitation
    other = traj(U(**OPEN, key="k0", error="trigger_fired", obs="Locked again."),
                 U(**OPEN, key="k0", error="trigger_fired", obs="Locked again."))
    assert run("blind_retry", other)[1] is not None


# --------------------------------------------------------------------------- no_effect, revisit


def test_no_effect_skips_report_finish_and_turns_that_meet_a_subgoal():
    tr = traj(U("look_around", key="k0"),                    # nothing changed
              U("report", answer="a", key="k0"),
              U("inspect", target="d1", key="k0", met=["sg0"]),
              U("navigate", target="hall", key="k0", error="precondition_unmet"),
              U("navigate", target="kitchen", key="k1"),
              U("finish", key="k1"))
    assert run("no_effect", tr) == [Hit("look_around({}) changed nothing (same state, no new facts)", (0,)),
                                    None, None, None, None, None]


def test_revisit_names_the_earlier_turn_or_the_initial_state():
    tr = traj(U("navigate", target="kitchen", key="k1"),
              U("navigate", target="hall", key="k0"),     # back to the start
              U("navigate", target="kitchen", key="k1"),  # back to turn 0's state
              U("look_around", key="k1"),                 # no change: not a revisit
              U("navigate", target="yard", key="k2"))
    assert run("revisit", tr) == [None, Hit("the agent is back in its initial state", (1,)),
                                  Hit("the agent is back in the state of turn 0", (0, 2)), None, None]


# --------------------------------------------------------------------------- failures that teach nothing


def test_uninformative_failure():
    tr = traj(U("navigate", target="moon", key="k0", error="unreachable", obs=LONG),
              U("open", target="d1", key="k0", error="precondition_unmet", obs="No.", learned=["locked:d1"]),
              U("open", target="d1", key="k0", error="trigger_fired", obs="No.", trigger="t1"),
              U("open", target="d2", key="k0", error="precondition_unmet", obs="No.", trigger="t2"))
    assert run("uninformative_failure", tr) == [
        Hit('navigate({"target": "moon"}) failed (' + "x" * 79 + "y) and revealed nothing new", (0,)),
        None, None, None]


def test_known_constraint_restricted_place():
    restricted = "The office is a restricted area: you need permission to enter."
    tr = traj(U("navigate", target="d9", key="k0", error="trigger_fired", obs="Blocked.", learned=["blocked:p1"]),
              U("navigate", target="office", key="k0", error="trigger_fired", obs=restricted,
                learned=["restricted:office"]),
              U("navigate", target="office", key="k0", error="trigger_fired", obs=restricted),
              U("navigate", target="yard", key="k0", error="unreachable", obs="You know no route."),
              U("open", target="office", key="k0", error="precondition_unmet", obs=restricted),
              U("navigate", target="office", key="k1", obs=restricted))
    assert run("known_constraint", tr) == [
        None, None,
        Hit('navigate({"target": "office"}) heads into office, known to be restricted', (1, 2)),
        None, None, None]
    # with the permit learned, heading there again is no violation
    permitted = traj(U("navigate", target="office", key="k0", error="trigger_fired", obs=restricted,
                       learned=["restricted:office"]),
                     U("talk_to", person="alice", topic="office", key="k1", learned=["permit:office"]),
                     U("navigate", target="office", key="k0", error="trigger_fired", obs=restricted))
    assert run("known_constraint", permitted) == [None, None, None]


def test_known_constraint_fragile_object_with_full_hands():
    fragile = "The glass vase is fragile: you need both hands free to carry it safely."
    tr = traj(U("pick_up", object="key_1", key="k1", holding=["key_1"]),
              U("pick_up", object="vase_1", key="k1", error="trigger_fired", obs=fragile, holding=["key_1"],
                learned=["fragile:vase_1"]),
              U("pick_up", object="vase_1", key="k1", error="trigger_fired", obs=fragile, holding=["key_1"]),
              U("pick_up", key="k1", error="missing_argument", obs="pick_up needs object.", holding=["key_1"]),
              U("inspect", object="vase_1", key="k1", error="bad_arguments", obs="No.", holding=["key_1"]))
    assert run("known_constraint", tr) == [
        None, None, Hit('pick_up({"object": "vase_1"}) lifts a known fragile object with full hands', (1, 2)),
        None, None]
    # hands empty: no violation
    empty = traj(U("pick_up", object="vase_1", key="k0", error="trigger_fired", obs=fragile,
                   learned=["fragile:vase_1"]),
                 U("pick_up", object="vase_1", key="k0", error="trigger_fired", obs=fragile))
    assert run("known_constraint", empty) == [None, None]


def test_already_there_and_known_blocked():
    tr = traj(U("navigate", target="hall", key="k0", error="precondition_unmet", obs="Here."),
              U("inspect", target="hall", key="k0", error="precondition_unmet", obs="already found"),
              U("navigate", target="kitchen", key="k1", place="kitchen"),
              U("navigate", target="kitchen", key="k1", place="kitchen"),
              U("navigate", target="lab", key="k1", place="kitchen", error="unreachable",
                obs="Every route you know to the lab is blocked by an obstacle you already found."),
              U("navigate", target="lab", key="k1", place="kitchen", error="unreachable",
                obs="You know no route to the lab."))
    assert run("already_there", tr) == [Hit("the agent is already in hall", (0,)), None, None,
                                        Hit("the agent is already in kitchen", (3,)), None, None]
    blocked = Hit("every known route is blocked by an obstacle the agent already found", (4,))
    assert run("known_blocked", tr) == [None, None, None, None, blocked, None]
    # no start place known: navigating anywhere is not "already there"
    assert run("already_there", traj(U("navigate", key="k0", error="missing_argument"), start="?")) == [None]


def test_repeat_search_same_place_same_words():
    tr = traj(U("search", query="mug", key="k1", learned=["searched:hall:mug"]),
              U("search", query="cup", key="k2", learned=["searched:hall:cup"]),
              U("search", query=" Mug ", key="k2"),                                  # same words: repeated
              U("search", query="mug", key="k2", state=False),                        # not recorded: skipped
              U("search", query="plate", key="k3", learned=["searched:hall:plate"]),
              U("navigate", target="kitchen", key="k4", place="kitchen"),
              U("search", query="mug", key="k5", place="kitchen", learned=["searched:kitchen:mug"]),
              U("look_around", key="k5", place="kitchen"))
    assert run("repeat_search", tr) == [
        None, None, Hit('search({"query": " Mug "}) repeats the search of turn 0', (0, 2)), None, None, None, None,
        None]


def test_known_locked():
    tr = traj(U("open", key="k0", error="missing_argument", obs="open needs target."),
              U("open", target="d1", key="k0", error="trigger_fired", obs="Locked.", learned=["locked:d1"]),
              U("navigate", target="d1", key="k0"),
              U("inspect", target="d2", key="k0", learned=["state:d2:locked=True"]),
              U("open", target="d2", key="k0", error="precondition_unmet", obs="Locked."),
              U("open", target="d1", key="k0", error="trigger_fired", obs="Locked."),
              U("open", target="d1", key="k1", obs="You unlock it."),
              U("open", target="d3", key="k1", error="trigger_fired", obs="Locked."))
    assert run("known_locked", tr) == [
        None, None, None, None,
        Hit('open({"target": "d2"}): d2 was known to be locked', (3, 4)),
        Hit('open({"target": "d1"}): d1 was known to be locked', (1, 5)),
        None, None]


def test_repeat_question():
    ask = dict(person="bob", topic="mug_1")
    tr = traj(U("talk_to", **ask, key="k0", error="refused", obs="Busy."),
              U("talk_to", **ask, key="k1"),
              U("talk_to", person="bob", topic="book_1", key="k2"),
              U("talk_to", person="alice", topic="mug_1", key="k3"),
              U("ask_for_help", **ask, request="locate", target="mug_1", reason="r", key="k4"),
              U("talk_to", **ask, key="k4"),
              U("navigate", target="kitchen", key="k5"))
    assert run("repeat_question", tr) == [None, None, None, None, None,
                                          Hit("bob already answered about mug_1 at turn 1", (1, 5)), None]
    # another person or topic earlier is no repeat
    assert run("repeat_question", traj(U("ask_for_help", **ask, request="locate", target="mug_1", reason="r",
                                         key="k1"),
                                       U("talk_to", **ask, key="k1"))) == [None, None]


def test_unasked_report():
    report = U("report", answer="8 pm", key="k1")
    hit = Hit("the task asks for no report", (0,))
    assert run("unasked_report", traj(report, kinds=("agent_at",))) == [hit]
    assert run("unasked_report", traj(report, kinds=("observed", "reported"))) == [None]
    assert run("unasked_report", traj(report)) == [None]                          # no subgoal record
    assert run("unasked_report", traj(U("finish", key="k1"), kinds=("agent_at",))) == [None]


# --------------------------------------------------------------------------- temporal preconditions


def test_report_before_observe_with_subgoals():
    tr = traj(U("navigate", target="kitchen", key="k1"),
              U("report", answer="x", key="k2"),
              U("report", answer="x", key="k2", error="bad_arguments"),
              U("inspect", target="mug_1", key="k3", met=["sg0"]),
              U("report", answer="x", key="k4", met=["sg1"]),
              U("report", answer="x", key="k4"),                 # every subgoal met already
              kinds=("inspected", "reported"))
    assert run("report_before_observe", tr) == [
        None, Hit("the report comes before the target was observed (subgoal 0 'goal 0' unmet)", (1,)), None,
        None, None, None]


@pytest.mark.parametrize("fact", ["seen:mug_1", "inspected:mug_1", "told:f_hours", "told_where:mug_1",
                                  "state:d1:open=False"])
def test_report_before_observe_without_subgoals_accepts_any_observation(fact):
    observed = traj(U("look_around", key="k1", learned=[fact]), U("report", answer="x", key="k2"))
    assert run("report_before_observe", observed) == [None, None]


def test_report_before_observe_without_subgoals_and_nothing_observed():
    tr = traj(U("navigate", target="kitchen", key="k1", learned=["locked:d1", "searched:hall:mug"]),
              U("report", answer="x", key="k2"))
    assert run("report_before_observe", tr) == [None, Hit("the report comes before anything was observed", (1,))]


HELP = dict(name="ask_for_help", person="alice", reason="r")


def test_help_before_obstacle_unlock():
    hit = Hit("asked to unlock d1 without meeting or checking that obstacle first", (0,))
    assert run("help_before_obstacle", traj(U(**HELP, request="unlock", target="d1", key="k1"))) == [hit]
    for first in (U("open", target="d1", key="k0", error="trigger_fired", obs="It does not budge."),   # argument
                  U("navigate", target="storage", key="k0", error="trigger_fired",
                    obs="The door d1 to the storage room is locked."),                              # plain name
                  U("open", target="d9", key="k0", error="precondition_unmet", obs="Not [d1] but d9."),
                  U("look_around", key="k1", learned=["locked:d1"]),
                  U("inspect", target="d1", key="k1", learned=["state:d1:locked=True"])):
        assert run("help_before_obstacle", traj(first, U(**HELP, request="unlock", target="d1", key="k1")))[1] \
            is None, first
    # a success on the target, or a failure on something else, is not meeting the obstacle
    for first in (U("inspect", target="d1", key="k1", obs="The door [d1] is closed."),
                  U("open", target="d7", key="k0", error="precondition_unmet", obs="No.")):
        assert run("help_before_obstacle", traj(first, U(**HELP, request="unlock", target="d1", key="k1")))[1] \
            == Hit("asked to unlock d1 without meeting or checking that obstacle first", (1,))


def test_help_before_obstacle_locate():
    ask = U(**HELP, request="locate", target="phone_1", key="k2")
    assert run("help_before_obstacle", traj(ask)) == [Hit("asked where phone_1 is without searching first", (0,))]
    searched = traj(U("search", query="phone", key="k1", learned=["searched:hall:phone"]), ask)
    assert run("help_before_obstacle", searched) == [None, None]
    mentioned = traj(U("talk_to", person="bob", topic="phone_1", key="k1"), ask)
    assert run("help_before_obstacle", mentioned) == [None, None]


def test_help_before_obstacle_missing_or_unknown_request():
    assert run("help_before_obstacle", traj(U(**HELP, target="d1", key="k1", error="missing_argument"))) == [
        Hit("asked to  d1 without meeting or checking that obstacle first", (0,))]
    assert run("help_before_obstacle", traj(U(**HELP, request="unlock", key="k1", error="missing_argument"))) == [
        Hit("asked to unlock  without meeting or checking that obstacle first", (0,))]
    assert run("help_before_obstacle", traj(U(**HELP, request="teleport", target="d1", key="k1"))) == [
        Hit("asked to teleport d1 without meeting or checking that obstacle first", (0,))]
    assert run("help_before_obstacle", traj(U("talk_to", person="alice", topic="d1", key="k1"))) == [None]


def test_finish_before_done():
    tr = traj(U("navigate", target="kitchen", key="k1"),
              U("finish", key="k2", met=["sg0"]),
              kinds=("agent_at", "holding"))
    assert run("finish_before_done", tr) == [None, Hit("finished with 1/2 subgoals met", (1,))]
    done = traj(U("pick_up", object="mug_1", key="k1", met=["sg0"]),
                U("finish", key="k2", met=["sg1"]),                 # the finishing turn meets the last one
                kinds=("agent_at", "holding"))
    assert run("finish_before_done", done) == [None, None]
    # the recorded total counts even without subgoal details
    assert run("finish_before_done", traj(U("finish", key="k1"), total=2)) == [
        Hit("finished with 0/2 subgoals met", (0,))]
    assert run("finish_before_done", traj(U("finish", key="k1", error="episode_over"), total=2)) == [None]
