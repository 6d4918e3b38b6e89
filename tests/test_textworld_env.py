"""TextWorld behind the env contract: games built here as tw-make builds them (no game file in the repo), the
walkthrough of each kind re-expressed in skills wins, the agent's map holds only what it saw, and bad calls are
typed errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agent.prompt import render_known
from textworld_env.env import TextWorldEnv, call_for_command
from textworld_env.games import GameSpec, Maker, make_game

SPECS = {
    "simple": GameSpec(kind="simple", seed=1, goal="brief"),
    "coin": GameSpec(kind="coin_collector", level=5, seed=3),
    "treasure": GameSpec(kind="treasure_hunter", level=5, seed=4),
    "custom": GameSpec(kind="custom", world_size=4, nb_objects=6, quest_length=3, seed=2),
}


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    folder = tmp_path_factory.mktemp("games")
    with Maker() as maker:                     # one maker process for all four, as `build_games` uses it
        return {name: make_game(spec, folder, maker) for name, spec in SPECS.items()}


def _play_walkthrough(env: TextWorldEnv):
    info = None
    for command in env._state["extra.walkthrough"]:
        call = call_for_command(command, env.belief)
        if call is None or (call["name"] == "open" and env.belief.doors.get(call["arguments"]["target"]) == "open"):
            continue   # `unlock X` became open(X), which opened it too
        _, _, terminated, _, info = env.step(call)
        assert info["error"] is None, (command, call, env.render())
        if terminated:
            break
    return info


@pytest.mark.parametrize("name", list(SPECS))
def test_every_kind_of_game_is_won_by_its_walkthrough_in_skills(games, name):
    env = TextWorldEnv()
    obs, info = env.reset(options={"task": {"id": name, "game": str(games[name])}})
    assert info["task"]["instruction"] and info["task"]["optimal_steps"] > 0
    assert set(info) >= {"state_key", "steps", "step_budget", "error", "success", "place", "holding", "known"}
    info = _play_walkthrough(env)
    assert info["success"] and env.won and env.done
    assert info["subgoals_done"] == info["subgoals_total"] > 0   # the score reached the game's maximum


def test_a_game_is_built_once_per_spec_and_the_same_spec_gives_the_same_game(games, tmp_path):
    again = make_game(SPECS["custom"], games["custom"].parent)
    assert again == games["custom"]
    other = make_game(SPECS["custom"], tmp_path)
    assert other.read_bytes() == games["custom"].read_bytes()          # tw-make is seeded
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{SPECS['custom'].key}{s}"
                                                           for s in (".json", ".spec.json", ".z8")]
    assert make_game(GameSpec(kind="custom", world_size=4, nb_objects=6, quest_length=3, seed=5), tmp_path) != other


@pytest.mark.parametrize("name", ["treasure", "custom"])
def test_the_maker_builds_byte_for_byte_what_tw_make_builds(games, tmp_path, name):
    """The long-lived maker made these games one after another in one process; `tw-make` itself, one process
    for the one game, makes the same bytes (the custom game checks the options the maker sets as tw-make does,
    and that nothing carries over from the games the maker built before)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    out = tmp_path / "game.z8"
    cmd = [str(Path(sys.executable).with_name("tw-make")), *SPECS[name].command(out)[1:]]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    assert out.read_bytes() == games[name].read_bytes()
    assert out.with_suffix(".json").read_bytes() == games[name].with_suffix(".json").read_bytes()


def test_a_build_over_its_time_stops_the_maker_and_a_split_skips_that_seed_for_good(tmp_path):
    """A build past the maker's time kills the maker (the next build starts another); a split skips such a seed
    as one with no quest and marks it, so that no later build waits on it again."""
    from textworld_env.games import BuildTimeout, _try_make
    with Maker(timeout=0.5) as maker:
        with pytest.raises(BuildTimeout, match=r"simple-\w+ \(as `tw-make tw-simple .*took over 0 s"):
            make_game(SPECS["simple"], tmp_path, maker)
        assert list(tmp_path.iterdir()) == []              # nothing left that looks like a game
        assert _try_make(SPECS["treasure"], tmp_path, maker) is None
        assert [p.name for p in tmp_path.iterdir()] == [f"{SPECS['treasure'].key}.skip"]
        maker.timeout = 120
        assert _try_make(SPECS["treasure"], tmp_path, maker) is None          # marked: skipped at once
        assert make_game(SPECS["simple"], tmp_path, maker).is_file()          # a new maker process builds


_PROMPTS_OF_THE_TEACHER = """
import hashlib, sys
from agent.episode import play
from agent.policies import ScriptedPolicy
from textworld_env.env import TextWorldEnv
from textworld_env.teacher import Teacher
starts = [({"task": {"id": str(i), "game": g}}, 0) for i, g in enumerate(sys.argv[1:])]
played = play(TextWorldEnv, ScriptedPolicy(lambda env, seed: Teacher(env), "teacher", as_text=True), starts)
text = "".join(m["content"] for t in played.trajectories for turn in t.turns for m in turn.prompt)
print(hashlib.sha256(text.encode()).hexdigest(), sum(len(t.turns) for t in played.trajectories))
"""


def test_the_same_games_give_the_same_prompts_whatever_the_hash_seed(games):
    """Python hashes strings differently in every process (PYTHONHASHSEED), and TextWorld's facts and the sets read
    from them came in that order: the prompts listed the things of a room in an order that changed from run to
    run, and so did a dataset distilled from the same recipe and seed. Two processes, two hash seeds, the
    teacher's episodes on every kind of game: the same prompts."""
    import os
    import subprocess
    import sys
    runs = {subprocess.run([sys.executable, "-c", _PROMPTS_OF_THE_TEACHER, *map(str, games.values())],
                           check=True, capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "3")}
    assert len(runs) == 1, runs


def test_specs_name_what_is_wrong():
    with pytest.raises(ValidationError, match="needs level"):
        GameSpec(kind="coin_collector", seed=0)
    with pytest.raises(ValidationError, match="needs world_size"):
        GameSpec(kind="custom", seed=0, world_size=3)
    with pytest.raises(ValidationError, match="extra"):
        GameSpec(kind="simple", seed=0, size=3)


def test_the_map_holds_only_what_the_agent_saw(games):
    env = TextWorldEnv()
    _, info = env.reset(options={"task": {"id": "simple", "game": str(games["simple"])}})
    known = render_known(info["known"])
    rooms = {a.name for p in env._state.facts for a in p.arguments if a.type == "r"}
    here = next(p.arguments[1].name for p in env._state.facts if p.name == "at" and p.arguments[0].type == "P")
    for room in rooms - {here}:
        assert room.replace(" ", "_").lower() not in known     # no room beyond is named before it is visited
    # the old key lies in the closed trunk: not known until the trunk is opened
    assert "old_key" not in known
    _, _, _, _, info = env.step({"name": "open", "arguments": {"target": "antique_trunk"}})
    assert "old_key" in render_known(info["known"])


def test_bad_calls_are_typed_errors_and_the_budget_truncates(games):
    env = TextWorldEnv()
    _, info = env.reset(options={"task": {"id": "coin", "game": str(games["coin"]), "step_budget": 6}})
    key, room = info["state_key"], env.belief.place
    cases = [({"name": "pick_up", "arguments": {"object": "dragon"}}, "unknown_entity"),
             ({"name": "navigate", "arguments": {"target": "moon"}}, "unknown_entity"),
             ({"name": "pick_up", "arguments": {"object": room}}, "unknown_entity"),    # a room is no thing
             ({"name": "inspect", "arguments": {"target": room}}, None),                # looks around it
             ({"name": "talk_to", "arguments": {"person": "x", "topic": "y"}}, "precondition_unmet"),
             ({"parse_error": "no tool call"}, "parse_error")]
    for step, (call, error) in enumerate(cases, 1):
        _, reward, terminated, truncated, info = env.step(call)
        assert info["error"] == error and reward == 0.0 and not terminated
        assert truncated == (step == 6)
    assert info["state_key"] == key          # nothing happened in the game


def test_the_state_key_is_the_game_state(games):
    """GiGPO anchors: the same state reached by two paths has one key; another state another."""
    env = TextWorldEnv()
    _, info = env.reset(options={"task": {"id": "coin", "game": str(games["coin"])}})
    start = info["state_key"]
    _, _, _, _, info = env.step({"name": "navigate", "arguments": {"target": "shower_north"}})
    assert info["state_key"] != start
    _, _, _, _, info = env.step({"name": "navigate", "arguments": {"target": "shower"}})
    assert info["state_key"] == start


def test_the_one_episode_loop_plays_textworld_with_the_shared_prompt_and_parser(games):
    """`agent.episode.play` runs TextWorld games as it runs the sandbox: the oracle answers as a model would
    (text with a tool call, parsed by the shared parser), every step's prompt is the shared builder's."""
    from agent.episode import play
    from agent.policies import ScriptedPolicy
    from textworld_env.env import OracleAgent
    from textworld_env.objective import goal_steps, step_things
    policy = ScriptedPolicy(OracleAgent, "oracle", as_text=True)
    starts = [({"task": {"id": name, "game": str(path)}}, i) for i, (name, path) in enumerate(sorted(games.items()))]
    played = play(TextWorldEnv, policy, starts)
    assert [t.success for t in played.trajectories] == [True] * len(games)
    for traj in played.trajectories:
        first = traj.turns[0]
        prompt = first.prompt[-1]["content"] if isinstance(first.prompt, list) else str(first.prompt)
        assert "Task: " + traj.instruction in prompt and "At: " in prompt
        # the task's things, as its steps name them; not the nouns of its prose ("textworld today", "trip east")
        line = next(ln for ln in prompt.splitlines() if ln.startswith("Task objects: "))
        unseen = [e.removesuffix(" not seen") for e in line.removeprefix("Task objects: ").split("; ")
                  if e.endswith(" not seen")]
        assert unseen and set(unseen) <= set(step_things(goal_steps(traj.instruction))), (line, traj.instruction)
        assert all(t.error is None for t in traj.turns)
        assert len(traj.turns) <= traj.optimal_steps + 1


def test_the_objective_reads_into_steps():
    from textworld_env.objective import Step, goal_steps
    text = ("Hey, thanks for coming over to the TextWorld today, there is something I need you to do for me. First "
            "of all, you could, like, look and see that the antique trunk inside the bedroom is opened. Then, recover "
            "the old key from the antique trunk. Then, make absolutely sure that the wooden door inside the bedroom "
            "is unlocked. After unlocking the wooden door, open the wooden door in the bedroom. Then, try to head "
            "east. Then, attempt to go to the south. Having taken the milk, attempt to travel north. That done, rest "
            "the milk on the stove inside the kitchen. Then, pick up the coin from the floor of the laundromat. And "
            "then, lock the safe with the latchkey. Then, place the lettuce on the stove inside the kitchen. And if "
            "you do that, you're the winner!  Then, assure the cake scented safe within the parlor is locked.")
    assert goal_steps(text) == [Step("open", "antique trunk"), Step("take", "old key", "antique trunk"),
                                Step("unlock", "wooden door"), Step("open", "wooden door"), Step("go", "east"),
                                Step("go", "south"), Step("go", "north"), Step("put", "milk", "stove"),
                                Step("take", "coin", "laundromat"), Step("lock", "safe", "latchkey"),
                                Step("put", "lettuce", "stove"), Step("lock", "cake scented safe")]
    assert goal_steps("The dinner is almost ready! It's only missing a grilled carrot.") == [
        Step("take", "carrot"), Step("put", "carrot", "stove")]
    assert goal_steps("") == []
    assert goal_steps("Then, insert the old key into the wooden door's lock to unlock it. After that, Deposit the "
                      "latchkey into the safe within the studio to lock it. Next, insert the American style passkey "
                      "into the American style box in the canteen's lock to unlock it.") == [
        Step("unlock", "wooden door", "old key"), Step("lock", "safe", "latchkey"),
        Step("unlock", "american style box", "american style passkey")]


@pytest.mark.parametrize("name", list(SPECS))
def test_the_teacher_wins_from_what_the_agent_saw(games, name):
    """The teacher reads the objective (or, for a brief one, explores) and never the game's plan: it wins every
    kind of game here, within the budget."""
    from agent.episode import play
    from agent.policies import ScriptedPolicy
    from textworld_env.teacher import Teacher
    env_calls = []

    class Watched(TextWorldEnv):
        def oracle_commands(self):          # the oracle's plan: the teacher must not read it
            env_calls.append(1)
            return super().oracle_commands()

    played = play(Watched, ScriptedPolicy(lambda env, seed: Teacher(env), "teacher", as_text=True),
                  [({"task": {"id": name, "game": str(games[name])}}, 0)])
    traj = played.trajectories[0]
    assert traj.success and len(traj.turns) <= 2 * traj.optimal_steps and not env_calls


def test_the_teacher_labelling_a_wandering_student_names_only_what_the_agent_knows(games):
    """On-policy distillation asks the teacher for a label wherever the student stands. A detailed objective's
    "go east" is east of where the route has reached, not of where a wandering student happens to be: the
    teacher used to label `navigate backyard_east` at a backyard with no east exit (up to 4.4% of a round's labels).
    A student that takes the teacher's call half the time and else walks anywhere it knows: every label names
    only ids the agent's map holds, and a student that follows the labels from there still wins."""
    import random

    from agent.prompt import known_ids
    from textworld_env.teacher import Teacher
    game = make_game(GameSpec(kind="simple", seed=4, goal="detailed"), games["custom"].parent)
    for run in range(3):
        env = TextWorldEnv()
        _, info = env.reset(options={"task": {"id": "wander", "game": str(game), "step_budget": 80}})
        teacher, rng = Teacher(env), random.Random(run)
        for step in range(80):
            _, label = teacher.act(info)
            ids, here = known_ids(render_known(info["known"]))
            named = [v for k, v in label["arguments"].items() if k in ("target", "object", "device")]
            assert all(n in ids for n in named), (run, step, label, sorted(ids))
            wander = step < 12 and rng.random() < 0.5
            call = {"name": "navigate", "arguments": {"target": rng.choice(sorted(ids - {here}))}} if wander else label
            obs, _, terminated, truncated, info = env.step(call)
            teacher.observe(call, info, obs)
            if terminated or truncated:
                break
        assert env.won, run


def test_a_cooking_game_is_won_by_its_walkthrough_in_skills(tmp_path):
    """Cooking verbs go through `operate`, including the one whose thing does not exist before it: "prepare
    meal" (it was `unknown_entity`, so even the game's own plan lost every cooking game)."""
    env = TextWorldEnv()
    env.reset(options={"task": {"id": "cook", "game": str(make_game(GameSpec(kind="cooking", recipe=1, seed=9000),
                                                                     tmp_path))}})
    assert "prepare meal" in env._state["extra.walkthrough"]
    info = _play_walkthrough(env)
    assert info["success"] and env.won


def test_a_game_that_ends_on_unlocking_is_won_by_open(tmp_path):
    """`open` unlocks first when the key is held; when unlocking wins the game (the quest wants the safe unlocked,
    not opened), the env stops there: nothing is sent to a finished game, whose next state would say "not won"."""
    from agent.episode import play
    from agent.policies import ScriptedPolicy
    from textworld_env.teacher import Teacher
    game = make_game(GameSpec(kind="custom", world_size=4, nb_objects=9, quest_length=5, seed=2003), tmp_path)
    traj = play(TextWorldEnv, ScriptedPolicy(lambda env, seed: Teacher(env), "teacher"),
                [({"task": {"id": "unlock-last", "game": str(game)}}, 0)]).trajectories[0]
    assert traj.success and traj.turns[-1].tool_call["name"] == "open", [u.tool_call for u in traj.turns]


def test_a_seed_that_admits_no_quest_is_told_apart_from_a_failure(tmp_path):
    """tw-make cannot place a quest of treasure hunter level 10 with seed 300: a property of the spec that a split
    skips, not a crash, and nothing is left behind that looks like a game."""
    from textworld_env.games import GameBuildError, NoQuestError, _try_make
    spec = GameSpec(kind="treasure_hunter", level=10, seed=300)
    with Maker() as maker:
        with pytest.raises(NoQuestError, match="QuestGenerationError"):
            make_game(spec, tmp_path, maker)
        assert issubclass(NoQuestError, GameBuildError) and list(tmp_path.iterdir()) == []
        assert _try_make(spec, tmp_path, maker) is None                       # a split skips it, and marks it
    assert "QuestGenerationError" in (tmp_path / f"{spec.key}.skip").read_text()


def test_the_teacher_takes_over_from_a_random_players_state(games, tmp_path):
    """On-policy distillation labels, and takes over from, states the teacher did not choose: after up to 8
    random admissible calls (containers opened and closed again, a note's neighbour inspected, a key taken),
    the teacher still wins every game the game's own oracle wins from the same state."""
    from agent.episode import play
    from agent.policies import ScriptedPolicy
    from distill.onpolicy import takeover
    from textworld_env.env import OracleAgent, RandomAgent
    from textworld_env.games import GameTask
    from textworld_env.teacher import Teacher
    specs = {**SPECS, "none": GameSpec(kind="simple", seed=5, goal="none"),
             "detailed": GameSpec(kind="simple", seed=6, goal="detailed")}
    paths = {**games, **{n: make_game(specs[n], tmp_path) for n in ("none", "detailed")}}
    tasks = {n: GameTask(id=n, game=str(paths[n]), spec=s, family=n) for n, s in specs.items()}
    starts = [({"task": t}, seed) for t in tasks.values() for seed in range(3)]
    played = play(TextWorldEnv, ScriptedPolicy(lambda env, s: RandomAgent(env, s), "random"), starts, max_steps=8)
    r = takeover(TextWorldEnv, played.trajectories, tasks, 0, len(starts), expert=lambda env, s: Teacher(env),
                 oracle=lambda env, s: OracleAgent(env))
    assert r["episodes"] == 18 and r["oracle_success"] == 1.0
    assert r["expert_success"] == 1.0, r["lost_when_solvable"]


def test_constrained_decoding_admits_every_call_of_the_teacher_and_the_oracle(games):
    """A constrained student can write every call the teacher and the game's own plan make (cooking verbs
    included: `operate`'s actions are TextWorld's tools', not the sandbox's turn_on/turn_off), replayed token by
    token through `CallConstraint` on the tiny template's prompt; the same calls with the sandbox's tools, or a
    walk to the room the agent is in, are cut. The one exception is the plan's `operate(meal|prepare)`: the meal
    is no id the agent has seen until it is made (the teacher does not play cooking games)."""
    from agent.constrained import CallConstraint, _State
    from agent.episode import play
    from agent.parser import render_compact
    from agent.policies import ScriptedPolicy
    from agent.tools import tool_definitions
    from sft.student import corpus_texts, train_tokenizer
    from textworld_env.env import OPERATE_VERBS, OracleAgent
    from textworld_env.teacher import Teacher
    cooking = make_game(GameSpec(kind="cooking", recipe=1, seed=9000), games["custom"].parent)
    starts = [({"task": {"id": name, "game": str(path)}}, 0) for name, path in [*games.items(), ("cook", cooking)]]
    turns = []
    for policy in (ScriptedPolicy(lambda env, seed: Teacher(env), "teacher", as_text=True),
                   ScriptedPolicy(OracleAgent, "oracle", as_text=True)):
        turns += [t for traj in play(TextWorldEnv, policy, starts).trajectories for t in traj.turns]
    rows = [{"messages": [*t.prompt, {"role": "assistant", "content": "", "tool_calls": [{"function": t.tool_call}]}]}
            for t in turns]
    tok = train_tokenizer(corpus_texts(rows), 800, skip_lines=["Observation:"])
    cc, tools = CallConstraint(tok), tool_definitions(OPERATE_VERBS)

    def replay(prompt: str, body: str, tools=None) -> bool:
        ids, st = cc.ids_trie(prompt, tools), _State(0)
        for t in tok(f"<tool_call>{body}</tool_call>", add_special_tokens=False)["input_ids"]:
            if t not in cc.allowed(st, ids):
                return False
            st = cc.step(st, t, ids)
        return set(cc.allowed(st, ids)) == cc.end_ids

    verbs, cut = set(), []
    for t in turns:
        prompt = tok.apply_chat_template(t.prompt, add_generation_prompt=True, tokenize=False)
        args = {k: v for k, v in t.tool_call["arguments"].items() if v is not None}
        if not replay(prompt, render_compact(t.tool_call["name"], args), tools):
            cut.append(render_compact(t.tool_call["name"], args))
        if t.tool_call["name"] == "operate":
            verbs.add(args["action"])
            assert not replay(prompt, render_compact("operate", args))          # the sandbox's actions
        here = next(ln for ln in prompt.splitlines() if ln.startswith("At: "))[4:].split(".")[0]
        assert not replay(prompt, f"navigate {here}", tools)
    assert cut == ["operate meal|prepare"], cut
    assert {"prepare", "eat"} <= verbs, verbs        # verbs the sandbox's operate does not take
