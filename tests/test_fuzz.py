"""Property tests: the controller, the Gymnasium env and the parser never raise on model input."""

from __future__ import annotations

import json

import gymnasium
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import sandbox
from agent.episode import Episode, Reply
from agent.parser import ParseError, ToolCall, parse_action, parse_text, render_tool_call
from sandbox.controller import EnvController, StepResult
from sandbox.schema import ERROR_CODES, HELP_REQUESTS
from sandbox.skills import SKILL_NAMES, SKILLS
from sandbox.world import Compiled

FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

VALIDATION_ERRORS = {"unknown_tool", "bad_arguments", "missing_argument", "extra_argument",
                     "bad_argument_type", "bad_argument_value", "unknown_entity", "episode_over"}

# ----------------------------------------------------------------------------- strategies

# ints stay below 4300 digits: a longer one breaks json itself (see test_bug_parse_text_huge_integer)
scalars = (st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False)
           | st.text(max_size=30))
json_values = st.recursive(
    scalars, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=10), ch, max_size=4),
    max_leaves=12)
huge_text = st.builds(lambda s, n: s * n, st.text(min_size=1, max_size=3), st.integers(150, 5000))
anything = (json_values | huge_text | st.floats() | st.tuples(st.integers(), st.text(max_size=5))
            | st.binary(max_size=8))


def entity_ids(comp: Compiled) -> dict[str, list[str]]:
    """Argument pools per parameter kind; "all" mixes every id, type, name and knowledge key of the task."""
    t = comp.task
    things = sorted(set(comp.place) | set(comp.obj) | set(comp.conn))
    topics = set(comp.obj) | set(comp.fact) | set(comp.place) | {o.type for o in t.env_state.objects}
    for h in t.human_persona:
        topics |= set(h.knowledge)
    pools = {"things": things, "people": sorted(comp.person) or ["nobody"], "topics": sorted(topics),
             "reasons": ["please", "I need it for my task", "so that I can finish the job", ""]}
    every = set(things) | set(comp.person) | topics | {p.name for p in t.env_state.places}
    pools["all"] = sorted(every | set(HELP_REQUESTS) | {"turn_on", "turn_off"})
    return pools


POOL_OF = {"target": "things", "object": "things", "device": "things", "destination": "things",
           "person": "people", "topic": "topics", "query": "topics", "reason": "reasons", "answer": "topics",
           "message": "reasons", "summary": "reasons"}


def arg_value(ids: dict[str, list[str]]):
    return st.one_of(st.sampled_from(ids["all"]), st.sampled_from(ids["all"]), st.sampled_from(ids["all"]),
                     st.text(max_size=20), huge_text, anything)


@st.composite
def skill_call(draw, ids: dict[str, list[str]]):
    name = draw(st.sampled_from(SKILL_NAMES))
    args = {}
    for p in SKILLS[name].params:
        if draw(st.integers(0, 9)) == 0:
            continue  # sometimes a missing argument
        args[p.name] = draw(arg_value(ids))
    if draw(st.integers(0, 14)) == 0:
        args[draw(st.text(max_size=8) | st.integers())] = draw(anything)
    return {"name": name, "arguments": args}


@st.composite
def well_formed_call(draw, ids: dict[str, list[str]]):
    """Right shape, string arguments over the task's ids: these reach obstacles, helpers and deep states."""
    names = [n for n in SKILL_NAMES if n != "finish"]
    name = draw(st.sampled_from(names) if draw(st.integers(0, 40)) else st.just("finish"))
    args = {}
    for p in SKILLS[name].params:
        if not p.required and draw(st.booleans()):
            continue
        pool = list(p.enum) if p.enum else ids[POOL_OF.get(p.name, "all")]
        args[p.name] = draw(st.sampled_from(pool) if draw(st.integers(0, 9)) else st.text(max_size=12))
    return {"name": name, "arguments": args}


def any_call(ids: dict[str, list[str]]):
    random_shape = st.fixed_dictionaries(
        {"name": st.one_of(st.sampled_from(SKILL_NAMES), st.text(max_size=12), anything),
         "arguments": st.one_of(st.dictionaries(st.text(max_size=10), anything, max_size=4), anything)})
    return st.one_of(well_formed_call(ids), skill_call(ids), skill_call(ids), random_shape, anything,
                     st.none(),
                     st.dictionaries(st.text(max_size=8), anything, max_size=3))


def dumps(value) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def as_text(call) -> str:
    return f"<think>hm</think><tool_call>{dumps(call)}</tool_call>"


def _openai(call, content, as_str: bool) -> dict:
    name = call.get("name") if isinstance(call, dict) else call
    args = call.get("arguments") if isinstance(call, dict) else call
    return {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": dumps(args) if as_str
                                                             else args}}]}


def model_outputs(ids: dict[str, list[str]]):
    """What a model might send the env: raw text, tool-call text, dict calls, OpenAI messages."""
    openai = st.builds(_openai, any_call(ids), st.one_of(st.none(), st.text(max_size=20)), st.booleans())
    return st.one_of(st.text(), st.text(alphabet="<>{}\":/ tool_call", max_size=40),
                     any_call(ids).map(as_text), any_call(ids), openai,
                     st.fixed_dictionaries({"tool_calls": anything, "content": anything}),
                     st.dictionaries(st.text(max_size=8), json_values, max_size=4))


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def fuzz_tasks(task, sample_tasks) -> list[Compiled]:
    return [Compiled(task)] + [Compiled(t) for t in sample_tasks]


@pytest.fixture(scope="session")
def fuzz_ids(fuzz_tasks) -> dict[int, dict[str, list[str]]]:
    return {id(c): entity_ids(c) for c in fuzz_tasks}


@pytest.fixture(scope="session")
def gym_env():
    assert sandbox.ENV_ID == "embodistill/Sandbox-v0"
    env = gymnasium.make(sandbox.ENV_ID)
    yield env
    env.close()


def settle(ctrl: EnvController) -> None:
    """Nothing to do any more: reset() latches subgoals already true and leaves a fresh state key."""


def check_result(ctrl: EnvController, res, before: str) -> None:
    assert isinstance(res, StepResult)
    event(f"error={res.error}")
    assert res.error is None or res.error in ERROR_CODES, res.error
    assert res.ok == (res.error is None), res
    assert isinstance(res.observation, str) and res.observation
    assert res.trigger is None or res.trigger in {t.id for t in ctrl.compiled.triggers}
    key = ctrl.state_key()
    assert res.state_key == key
    ctrl.world.touch()
    assert ctrl.state_key() == key, "cached state_key out of date"
    if res.error in VALIDATION_ERRORS:
        assert key == before, f"{res.error} changed the state"


# ----------------------------------------------------------------------------- (a) the controller


@FUZZ
@given(data=st.data())
def test_controller_step_never_raises(fuzz_tasks, fuzz_ids, data):
    comp = data.draw(st.sampled_from(fuzz_tasks), label="task")
    ctrl = EnvController(comp)
    ctrl.reset()
    settle(ctrl)
    calls = data.draw(st.lists(any_call(fuzz_ids[id(comp)]), min_size=1, max_size=15), label="calls")
    for call in calls:
        before = ctrl.state_key()
        res = ctrl.step(call)
        check_result(ctrl, res, before)


@FUZZ
@given(data=st.data())
def test_controller_well_formed_calls_explore_deep_states(fuzz_tasks, fuzz_ids, data):
    """Mostly valid calls over known ids reach deeper states (doors opened, people asked, items moved)."""
    comp = data.draw(st.sampled_from(fuzz_tasks), label="task")
    ids = fuzz_ids[id(comp)]
    ctrl = EnvController(comp)
    ctrl.reset()
    settle(ctrl)
    one = st.one_of(well_formed_call(ids), well_formed_call(ids), well_formed_call(ids), skill_call(ids))
    calls = st.lists(one, min_size=5, max_size=40)
    for call in data.draw(calls, label="calls"):
        before = ctrl.state_key()
        res = ctrl.step(call)
        check_result(ctrl, res, before)
        w = ctrl.world
        assert w.agent_place in comp.place
        assert len(w.holding) <= w.capacity and len(set(w.holding)) == len(w.holding)
        for oid in comp.obj:  # containment stays acyclic and ends in a place
            assert w.place_of(oid) in comp.place
        assert set(w.person_place.values()) <= set(comp.place)
    assert ctrl.done or ctrl.steps >= 5


# ----------------------------------------------------------------------------- (b) the Gymnasium env


@FUZZ
@given(data=st.data())
def test_the_episode_loop_never_raises_on_model_output(gym_env, fuzz_tasks, fuzz_ids, data):
    """Whatever a model sends (raw text, tool-call text, dict calls, OpenAI messages), the episode loop reads it
    once with the parser and the env answers with an observation and a typed error, never an exception."""
    comp = data.draw(st.sampled_from(fuzz_tasks), label="task")
    episode = Episode(gym_env, "fuzz", 0, {"task": comp.task})
    assert {"state_key", "error", "subgoals_met", "success", "known"} <= set(episode.info)
    outputs = data.draw(st.lists(model_outputs(fuzz_ids[id(comp)]), min_size=1, max_size=10), label="outputs")
    for output in outputs:
        if episode.done:
            break
        reply = Reply(text=output) if isinstance(output, str) else Reply(action=parse_action(output))
        turn = episode.record(episode.request(), reply)
        info = episode.info
        assert isinstance(turn.observation, str) and turn.error == info["error"]
        assert info["error"] is None or info["error"] in ERROR_CODES
        assert isinstance(info["subgoals_met"], list) and isinstance(info["success"], bool)
        assert info["state_key"] == gym_env.unwrapped.ctrl.state_key()
        assert (turn.tool_call is None) == (info["error"] == "parse_error")


def test_the_known_map_is_this_steps_and_never_a_later_ones(gym_env, world_data):
    """info["known"] is computed when first read: read before the next step it is that step's belief map; a map
    left unread until after the next step is an error, not the newer map."""
    from sandbox.observation import known_map
    _, info = gym_env.reset(options={"task": world_data})
    first = dict(info["known"])                                   # read now: kept
    assert first == known_map(gym_env.unwrapped.ctrl.world) and first["place"] == "hall"
    _, _, _, _, moved = gym_env.step({"name": "navigate", "arguments": {"target": "kitchen"}})
    assert dict(info["known"]) == first                           # still the reset's map
    gym_env.step({"name": "look_around", "arguments": {}})        # `moved` was never read before this step
    with pytest.raises(RuntimeError, match="earlier step"):
        moved["known"]["place"]


def test_gym_env_reset_accepts_a_task_dict(gym_env, world_data):
    obs, info = gym_env.reset(options={"task": world_data})
    assert "hall" in obs and info["error"] is None
    obs, reward, terminated, truncated, info = gym_env.step({"name": "navigate", "arguments": {"target": "kitchen"}})
    assert info["error"] is None and "kitchen" in obs and info["place"] == "kitchen"
    # what the episode loop passes when the agent's text held no readable call: the step counts, and says why
    obs, reward, terminated, truncated, info = gym_env.step({"parse_error": "no <tool_call> block in the output"})
    assert info["error"] == "parse_error" and info["steps"] == 2
    assert obs == "I could not read a skill call: no <tool_call> block in the output."
    obs, reward, terminated, truncated, info = gym_env.step({"name": "finish", "arguments": {}})
    assert terminated and reward == 0.0


# ----------------------------------------------------------------------------- (c) the parser


def parser_inputs():
    tool_text = st.builds(
        lambda pre, body, close: pre + "<tool_call>" + body + ("</tool_call>" if close else ""),
        st.text(max_size=20), json_values.map(json.dumps) | st.text(max_size=30), st.booleans())
    openai = st.fixed_dictionaries({"tool_calls": st.lists(anything | st.fixed_dictionaries(
        {"function": st.fixed_dictionaries({"name": anything,
                                            "arguments": anything | st.text(max_size=30)})}),
        max_size=2) | anything, "content": anything})
    return st.one_of(anything, st.text(), tool_text, openai, st.dictionaries(st.text(max_size=10), anything),
                     st.builds(ToolCall, st.text(min_size=1), st.dictionaries(st.text(), json_values)))


@FUZZ
@given(parser_inputs())
def test_parse_action_never_raises(value):
    res = parse_action(value)
    assert isinstance(res, (ToolCall, ParseError))
    if isinstance(res, ToolCall):
        assert isinstance(res.name, str) and res.name and isinstance(res.arguments, dict)
    else:
        assert res.code == "parse_error" and isinstance(res.message, str)


def _no_close_tag(v) -> bool:
    if isinstance(v, str):
        return "</tool_call>" not in v
    if isinstance(v, list):
        return all(map(_no_close_tag, v))
    if isinstance(v, dict):
        return all(_no_close_tag(k) and _no_close_tag(x) for k, x in v.items())
    return True


round_trip_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False) | st.text(),
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=10), ch, max_size=4),
    max_leaves=12)


@FUZZ
@given(name=st.sampled_from(SKILL_NAMES) | st.text(min_size=1),
       arguments=st.dictionaries(st.text(), round_trip_values, max_size=5))
def test_render_then_parse_round_trip(name, arguments):
    # a literal "</tool_call>" inside a value is a known bug (test_bug_round_trip_close_tag_in_value)
    if not (_no_close_tag(name) and _no_close_tag(arguments)):
        return
    text = render_tool_call(name, arguments)
    res = parse_text(text)
    assert isinstance(res, ToolCall), res
    assert res.name == name and res.arguments == arguments
    assert parse_action(text) == res


def test_bug_parse_text_huge_integer():
    res = parse_text("<tool_call>" + "7" * 5000 + "</tool_call>")
    assert isinstance(res, ParseError)


def test_bug_parse_action_openai_huge_integer_arguments():
    msg = {"tool_calls": [{"function": {"name": "navigate", "arguments": "9" * 5000}}]}
    assert isinstance(parse_action(msg), ParseError)


def test_bug_gym_env_step_huge_integer(gym_env, task):
    gym_env.reset(options={"task": task})
    parsed = parse_action("<tool_call>" + "1" * 4400 + "</tool_call>")
    assert isinstance(parsed, ParseError)
    obs, reward, terminated, truncated, info = gym_env.step({"parse_error": parsed.message})
    assert info["error"] == "parse_error"


def test_bug_round_trip_close_tag_in_value():
    args = {"answer": "the sign says </tool_call>"}
    assert parse_text(render_tool_call("report", args)) == ToolCall("report", args)
