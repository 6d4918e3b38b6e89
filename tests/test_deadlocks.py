"""The deadlock taxonomy (PokeGym's Unaware / Aware deadlocks, and recovery) on hand-made episodes."""

from __future__ import annotations

import pytest

from agent.metrics import Decision, deadlock_report, find_deadlocks, trajectory_deadlocks
from agent.trajectory import Trajectory, Turn


def call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


PICK = call("pick_up", object="red_key")


def test_the_same_call_again_and_again_with_no_word_of_it_is_unaware():
    steps = [Decision("s1", call("navigate", target="kitchen"))] + [Decision("s1", PICK, "I pick up the key.")] * 3
    (d,) = find_deadlocks("s0", steps, k=3)
    assert (d.start, d.length, d.aware, d.signals, d.recovered) == (1, 3, False, (), False)
    assert find_deadlocks("s0", steps[:3], k=3) == []          # two decisions without change: not yet


@pytest.mark.parametrize("window,signal", [
    ([Decision("s", PICK), Decision("s", call("open", target="red_box")), Decision("s", PICK)], "switched"),
    ([Decision("s", PICK), Decision("s", call("ask_for_help", question="where is it?")),
      Decision("s", call("ask_for_help", question="where is it?"))], "help"),
    ([Decision("s", PICK), Decision("s", PICK, "This is not working; I am stuck."), Decision("s", PICK)], "thought"),
    ([Decision("s", PICK), Decision("s", PICK), Decision("s", call("finish", summary="I could not reach it"))],
     "reported_failure"),
])
def test_an_agent_that_shows_it_knows_it_is_stuck_is_aware(window, signal):
    (d,) = find_deadlocks("s", window, k=3)
    assert d.aware and signal in d.signals


def test_a_deadlock_followed_by_progress_is_recovered_and_each_window_is_its_own():
    steps = [Decision("s0", PICK)] * 3 + [Decision("s1", call("open", target="red_box"), progress=True)] + \
        [Decision("s1", PICK)] * 4
    first, second = find_deadlocks("s0", steps, k=3)
    assert (first.start, first.length, first.recovered) == (0, 3, True)
    assert (second.start, second.length, second.recovered) == (4, 4, False)
    with pytest.raises(ValueError, match="k must be >= 1"):
        find_deadlocks("s0", steps, k=0)


def test_a_trajectory_reads_its_state_keys_calls_thoughts_and_subgoals():
    turns = [Turn(index=i, observation="...", state_key=key, tool_call=c, reasoning=th, subgoals_met=met)
             for i, (key, c, th, met) in enumerate([("a", PICK, "", []), ("a", PICK, "", []), ("a", PICK, "", []),
                                                     ("b", call("navigate", target="hall"), "", ["at_hall"])])]
    t = Trajectory(task_id="t", instruction="i", difficulty="easy", scene="rooms", policy="p", seed=0,
                   initial_observation="o", initial_state_key="a", turns=turns, success=True, subgoals_total=1,
                   subgoals_met=1)
    (d,) = trajectory_deadlocks(t)
    assert (d.start, d.length, d.aware, d.recovered) == (0, 3, False, True)


def test_the_report_counts_kinds_shares_of_failures_recovery_and_the_correlation_with_failure():
    unaware = find_deadlocks("s", [Decision("s", PICK)] * 3, k=3)
    aware_recovered = find_deadlocks("s", [Decision("s", PICK), Decision("s", call("look_around")),
                                           Decision("s", PICK), Decision("t", PICK, progress=True)], k=3)
    r = deadlock_report([(unaware, False), (unaware, False), (aware_recovered, True), ([], True), ([], True),
                         ([], False)])
    assert (r["deadlocks"], r["aware"], r["unaware"], r["recovered"]) == (3, 1, 2, 1)
    assert r["failed_episodes"] == 3 and r["failed_with_unaware"] == pytest.approx(2 / 3, abs=1e-4)
    assert r["failed_with_aware"] == 0.0 and r["recovery_rate"] == pytest.approx(1 / 3, abs=1e-4)
    # has a deadlock: 1 1 1 0 0 0; failed: 1 1 0 0 0 1 -> phi = 1/3
    assert r["phi_deadlock_failure"] == pytest.approx(1 / 3, abs=1e-4)
    assert deadlock_report([([], True)])["phi_deadlock_failure"] is None


def test_the_hint_tells_a_stuck_agent_after_k_steps_and_the_trajectory_keeps_the_envs_text(task):
    """The deadlock intervention, in the one episode loop: a policy that repeats a call the env refuses changes
    nothing; from the third such step on, its next observation (and so its prompt) ends with the neutral note."""
    from agent.episode import Reply, hint_text, play
    from agent.metrics import DEADLOCK_K
    from sandbox.gym_env import SandboxEnv

    class Stubborn:   # a real policy: it reads the prompt and keeps asking for a thing that is not there
        name, reads_prompt = "stubborn", True

        def __init__(self):
            self.seen: list[str] = []

        def start(self, episode, env, seed):
            pass

        def act(self, requests):
            self.seen += [r.observation for r in requests]
            return [Reply(action={"name": "pick_up", "arguments": {"object": "no_such_thing"}}) for _ in requests]

    runs = {}
    for hint in (None, DEADLOCK_K):
        policy = Stubborn()
        traj = play(SandboxEnv, policy, [({"task": task}, 0)], max_steps=5, deadlock_hint=hint).trajectories[0]
        runs[hint] = (policy.seen, traj)
    seen, traj = runs[DEADLOCK_K]
    assert ["nothing has changed" in o for o in seen] == [False, False, False, True, True]
    assert seen[3].endswith(hint_text(3)) and seen[4].endswith(hint_text(4))
    assert hint_text(3) in traj.turns[3].prompt[-1]["content"]
    assert all("nothing has changed" not in u.observation for u in traj.turns)
    plain_seen, plain = runs[None]
    assert not any("nothing has changed" in o for o in plain_seen)
    assert [u.observation for u in plain.turns] == [u.observation for u in traj.turns]
