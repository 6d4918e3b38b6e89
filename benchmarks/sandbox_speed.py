"""Throughput of the text sandbox next to MiniGrid/BabyAI, measured in one process, in one run.

    python benchmarks/sandbox_speed.py            # ~3 s per measurement
    python benchmarks/sandbox_speed.py --quick    # 0.5 s per measurement (smoke run)
    python benchmarks/sandbox_speed.py --seconds 5

Prints one JSON object on stdout; progress goes to stderr.

Measurements
1. Expert replay: the teacher (`ExpertPlanner(privileged=False)`) is run once per task, untimed, and its dict
   tool calls are recorded; then only replaying those calls through `gymnasium.make("embodistill/Sandbox-v0")`
   is timed (reset + steps; resets are not counted as steps but their time is included). The same replay on a
   bare `EnvController` is reported as a secondary number.
2. Random replay: pre-generated random tool calls (about 10 % malformed: unknown tools, wrong argument types,
   missing/extra arguments, raw text through the parser), reset on terminated or truncated.
3. MiniGrid BabyAI with random actions from the seeded action space, default dict observation.
4. The expert end to end (planner + env), for honesty: the replay numbers exclude the planner.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import copy
import json
import platform
import random
import statistics
import sys
import time
from typing import Any

import gymnasium as gym

import sandbox  # noqa: F401  (registers embodistill/Sandbox-v0)
from agent.parser import ToolCall, parse_action
from sandbox.agents import ExpertAgent, random_call
from pipeline.recipe import load_recipe
from pipeline.stages import build_tasks
from sandbox.controller import EnvController
from sandbox.expert import ExpertPlanner
from sandbox.schema import TaskInstance
from sandbox.skills import SKILLS
from sandbox.world import Compiled

SANDBOX_ID = "embodistill/Sandbox-v0"
MINIGRID_WANTED = ("BabyAI-GoToLocal-v0", "BabyAI-PutNextLocal-v0")
GOAL = {"min_steps_per_s": 20_000, "min_ratio": 4}
SEED = 0
RANDOM_ACTIONS_PER_TASK = 512
MINIGRID_PREGEN_ACTIONS = 65_536

perf = time.perf_counter


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- tasks and expert recordings


def load_tasks(recipe_path: str) -> list[TaskInstance]:
    splits, _ = build_tasks(load_recipe(recipe_path), show_progress=False)
    return list(splits["train"]) + list(splits["test"])


def record_expert(tasks: list[TaskInstance]) -> list[dict]:
    """Run the teacher once per task on a bare controller; keep its calls and the outcome to check replays."""
    out = []
    for task in tasks:
        ctrl = EnvController(task)
        ctrl.reset()
        planner = ExpertPlanner(ctrl, privileged=False)
        steps = planner.run()
        out.append({"task": task, "actions": [copy.deepcopy(call) for _, call, _ in steps],
                    "success": ctrl.success, "done": ctrl.done, "state_key": ctrl.state_key()})
    return out


def verify_replay(recs: list[dict]) -> int:
    """Replay through the gym env once (untimed): the sandbox is deterministic, so outcomes must match."""
    env = gym.make(SANDBOX_ID)
    mismatches = 0
    for r in recs:
        env.reset(seed=SEED, options={"task": r["task"]})
        info: dict = {}
        for a in r["actions"]:
            _, _, term, trunc, info = env.step(a)
        ok = (bool(info.get("success")) == r["success"] and info.get("state_key") == r["state_key"])
        mismatches += not ok
    env.close()
    return mismatches


# ----------------------------------------------------------------------------- timed loops


def _replay(recs: list[dict], seconds: float, start) -> dict:
    """Replay each task's recorded calls, cycling over tasks until `seconds` have elapsed.

    `start(i, rec)` resets for episode i and returns the step function; its time counts as reset time.
    """
    steps = episodes = 0
    reset_time = 0.0
    t0 = perf()
    while True:
        for i, r in enumerate(recs):
            tr = perf()
            step = start(i, r)
            reset_time += perf() - tr
            for a in r["actions"]:
                step(a)
            steps += len(r["actions"])
            episodes += 1
        elapsed = perf() - t0
        if elapsed >= seconds:
            break
    return {"steps": steps, "episodes": episodes, "elapsed_s": elapsed, "steps_per_s": steps / elapsed,
            "episodes_per_s": episodes / elapsed, "reset_time_fraction": reset_time / elapsed}


def time_replay_env(env, recs: list[dict], seconds: float) -> dict:
    """Replay through the Gymnasium env (reset + steps)."""
    def start(i: int, r: dict):
        env.reset(seed=SEED, options={"task": r["task"]})
        return env.step
    return _replay(recs, seconds, start)


def time_replay_controller(recs: list[dict], seconds: float, precompiled: bool) -> dict:
    """The same replay on a bare EnvController.

    precompiled=False mirrors a task switch without a cache (compile the task, new controller, reset);
    precompiled=True keeps one controller per task and only resets it (the floor for reset cost).
    """
    ctrls = [EnvController(Compiled(r["task"])) for r in recs] if precompiled else None

    def start(i: int, r: dict):
        ctrl = ctrls[i] if precompiled else EnvController(Compiled(r["task"]))
        ctrl.reset()
        return ctrl.step
    return _replay(recs, seconds, start)


# ----------------------------------------------------------------------------- random actions

_GARBAGE_TEXT = (
    "",
    "I think I should go to the kitchen.",
    "<tool_call>{not json at all</tool_call>",
    "<tool_call>{\"arguments\": {}}</tool_call>",
    "<tool_call>[1, 2, 3]</tool_call>",
    "navigate(kitchen)",
    "}}}{{{",
    "<think>hmm</think> no call here",
)


def _view_ids(task: TaskInstance) -> list[str]:
    v = task.agent_view
    return [p.id for p in v.places] + [o.id for o in v.objects] + [c.id for c in v.connections] + \
        [p.id for p in v.people]


def _malformed_call(rng: random.Random, ids: list[str]) -> Any:
    kind = rng.randrange(7)
    some_id = rng.choice(ids) if ids else "x"
    if kind == 0:  # unknown tool name
        return {"name": rng.choice(["fly", "teleport", "Navigate", "pickup", "", "open_door"]),
                "arguments": {"target": some_id}}
    if kind == 1:  # wrong argument type
        name = rng.choice(["navigate", "inspect", "open", "pick_up"])
        pname = SKILLS[name].params[0].name
        return {"name": name, "arguments": {pname: rng.choice([42, None, [some_id], {"id": some_id}, 3.5])}}
    if kind == 2:  # missing required argument
        return {"name": rng.choice(["navigate", "place", "operate", "talk_to", "ask_for_help"]), "arguments": {}}
    if kind == 3:  # extra argument / non-object arguments / no name
        return rng.choice([{"name": "look_around", "arguments": {"target": some_id}},
                           {"name": "navigate", "arguments": some_id},
                           {"arguments": {"target": some_id}}])
    if kind == 4:  # raw garbage text through the parser
        return rng.choice(_GARBAGE_TEXT)
    if kind == 5:  # well-formed text through the parser (the model's usual form)
        call = random_call(rng, ids)
        return "<think>try something</think>\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
    return rng.choice([None, 17, ["navigate"], {"tool_calls": []}])  # not a call at all


def make_random_actions(tasks: list[TaskInstance], n: int, seed: int, malformed_rate: float = 0.1) -> list[list]:
    out = []
    for i, task in enumerate(tasks):
        rng = random.Random(seed * 1_000_003 + i)
        ids = _view_ids(task)
        out.append([_malformed_call(rng, ids) if rng.random() < malformed_rate else random_call(rng, ids)
                    for _ in range(n)])
    return out


def env_action(output) -> dict:
    """What the episode loop passes the env for a model's output: the call the parser reads, or the parse error."""
    if isinstance(output, dict) and "tool_calls" not in output:
        return output  # a call as a structured action (the env validates it)
    parsed = parse_action(output)
    return parsed.as_dict() if isinstance(parsed, ToolCall) else {"parse_error": parsed.message}


def time_random(env, tasks: list[TaskInstance], actions: list[list], seconds: float) -> dict:
    """One episode per task in turn; each task's action list is consumed cyclically across its episodes. Text
    outputs are read by the shared parser inside the timed loop, as the episode loop reads them."""
    steps = episodes = 0
    reset_time = 0.0
    cursor = [0] * len(tasks)
    reset, step = env.reset, env.step
    errors: dict[str, int] = {}
    t0 = perf()
    while True:
        for i, task in enumerate(tasks):
            tr = perf()
            reset(seed=SEED, options={"task": task})
            reset_time += perf() - tr
            acts, j, n = actions[i], cursor[i], len(actions[i])
            while True:
                _, _, term, trunc, info = step(env_action(acts[j]))
                j = j + 1 if j + 1 < n else 0
                steps += 1
                e = info["error"]
                if e is not None:
                    errors[e] = errors.get(e, 0) + 1
                if term or trunc:
                    break
            cursor[i] = j
            episodes += 1
        elapsed = perf() - t0
        if elapsed >= seconds:
            break
    return {"steps": steps, "episodes": episodes, "elapsed_s": elapsed, "steps_per_s": steps / elapsed,
            "episodes_per_s": episodes / elapsed, "mean_episode_steps": steps / episodes,
            "reset_time_fraction": reset_time / elapsed,
            "error_rate": sum(errors.values()) / steps, "errors": dict(sorted(errors.items()))}


# ----------------------------------------------------------------------------- expert end to end


def time_expert_end_to_end(env, tasks: list[TaskInstance], seconds: float) -> dict:
    base = env.unwrapped
    steps = episodes = successes = 0
    t0 = perf()
    while True:
        for i, task in enumerate(tasks):
            obs, info = env.reset(seed=SEED, options={"task": task})
            expert = ExpertAgent(base, SEED + i)
            done = False
            while not done:
                _, call = expert.act(info)
                obs, _, term, trunc, info = env.step(call)
                expert.observe(call, info, obs)
                steps += 1
                done = term or trunc
            successes += bool(info["success"])
            episodes += 1
        elapsed = perf() - t0
        if elapsed >= seconds:
            break
    return {"steps": steps, "episodes": episodes, "elapsed_s": elapsed, "steps_per_s": steps / elapsed,
            "episodes_per_s": episodes / elapsed, "success_rate": successes / episodes}


# ----------------------------------------------------------------------------- MiniGrid


def pick_minigrid_ids() -> tuple[list[str], dict[str, str]]:
    import minigrid  # noqa: F401  (registers MiniGrid and BabyAI ids)
    chosen, subs = [], {}
    reg = list(gym.registry)
    for want in MINIGRID_WANTED:
        if want in gym.registry:
            chosen.append(want)
            continue
        stem = want.split("-")[1]  # e.g. GoToLocal
        alts = sorted(k for k in reg if k.startswith("BabyAI-") and stem in k)
        alts = alts or sorted(k for k in reg if k.startswith("BabyAI-"))
        if alts:
            chosen.append(alts[0])
            subs[want] = alts[0]
    return chosen, subs


class _LineCounter:
    """Swallows what MiniGrid/BabyAI print on stdout ("Sampling rejected: ...") so stdout stays one JSON object."""

    def __init__(self) -> None:
        self.lines = 0

    def write(self, s: str) -> int:
        self.lines += s.count("\n")
        return len(s)

    def flush(self) -> None:
        pass


def time_minigrid(env_id: str, seconds: float, seed: int) -> dict:
    sink = _LineCounter()
    with contextlib.redirect_stdout(sink):
        res = _time_minigrid(env_id, seconds, seed)
    res["stdout_lines_swallowed"] = sink.lines
    return res


def _time_minigrid(env_id: str, seconds: float, seed: int) -> dict:
    env = gym.make(env_id)
    env.action_space.seed(seed)
    acts = [int(env.action_space.sample()) for _ in range(MINIGRID_PREGEN_ACTIONS)]
    n = len(acts)
    reset, step = env.reset, env.step
    obs, _ = reset(seed=seed)
    # warm-up (untimed)
    for k in range(2_000):
        _, _, term, trunc, _ = step(acts[k])
        if term or trunc:
            reset()
    obs, _ = reset(seed=seed)
    steps = episodes = 0
    j = 0
    t0 = perf()
    while True:
        for _ in range(1024):
            _, _, term, trunc, _ = step(acts[j])
            j = j + 1 if j + 1 < n else 0
            steps += 1
            if term or trunc:
                episodes += 1
                reset()
        elapsed = perf() - t0
        if elapsed >= seconds:
            break
    obs_keys = sorted(obs.keys()) if isinstance(obs, dict) else type(obs).__name__
    env.close()
    return {"steps": steps, "episodes": episodes, "elapsed_s": elapsed, "steps_per_s": steps / elapsed,
            "observation_keys": obs_keys}


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0,
                    help="wall time per measurement, split over the rounds (default 5.0)")
    ap.add_argument("--quick", action="store_true", help="0.5 s per measurement (smoke run)")
    ap.add_argument("--recipe", default="recipes/ci.yaml")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved sandbox/MiniGrid rounds (medians reported)")
    args = ap.parse_args(argv)
    seconds = 0.5 if args.quick else args.seconds

    random.seed(SEED)
    try:
        import numpy as np
        np.random.seed(SEED)
    except ImportError:  # pragma: no cover
        pass

    log(f"building tasks from {args.recipe} ...")
    t = perf()
    tasks = load_tasks(args.recipe)
    log(f"  {len(tasks)} tasks in {perf() - t:.1f} s")

    log("recording expert (teacher) actions ...")
    recs = record_expert(tasks)
    n_actions = sum(len(r["actions"]) for r in recs)
    mism = verify_replay(recs)
    log(f"  {n_actions} actions; replay mismatches: {mism}")

    env = gym.make(SANDBOX_ID)
    log("warm-up ...")
    time_replay_env(env, recs, 0.0)

    # Interleaved rounds: the machine is shared and noisy, so each round measures the sandbox and MiniGrid
    # back to back and the medians of the per-round rates (and ratios) are reported.
    rand_actions = make_random_actions(tasks, RANDOM_ACTIONS_PER_TASK, SEED)
    time_random(env, tasks, rand_actions, 0.0)  # warm-up
    # Setup data (tasks, recordings, pre-generated actions) is long-lived: move it out of the cyclic GC's
    # reach so neither environment pays for scanning it during the timed loops (applies to both equally).
    gc.collect()
    gc.freeze()
    mg_ids, mg_subs = pick_minigrid_ids()
    per = seconds / args.rounds
    rounds = []
    for rnd in range(args.rounds):
        row = {"expert": time_replay_env(env, recs, per), "random": time_random(env, tasks, rand_actions, per),
               "minigrid": {env_id: time_minigrid(env_id, per, SEED + k) for k, env_id in enumerate(mg_ids)}}
        row["minigrid_mean"] = sum(v["steps_per_s"] for v in row["minigrid"].values()) / max(1, len(mg_ids))
        rounds.append(row)
        log(f"[round {rnd + 1}/{args.rounds}] expert {row['expert']['steps_per_s']:.0f}, random "
            f"{row['random']['steps_per_s']:.0f}, minigrid {row['minigrid_mean']:.0f} steps/s")
    med = statistics.median
    exp_env = {"steps_per_s": med(r["expert"]["steps_per_s"] for r in rounds),
               "reset_time_fraction": med(r["expert"]["reset_time_fraction"] for r in rounds),
               "rounds": [r["expert"]["steps_per_s"] for r in rounds]}
    rand = {"steps_per_s": med(r["random"]["steps_per_s"] for r in rounds),
            "rounds": [r["random"]["steps_per_s"] for r in rounds]}
    mg = {env_id: {"steps_per_s": med(r["minigrid"][env_id]["steps_per_s"] for r in rounds),
                   "rounds": [r["minigrid"][env_id]["steps_per_s"] for r in rounds]} for env_id in mg_ids}
    mg_mean = med(r["minigrid_mean"] for r in rounds) if mg else float("nan")
    round_ratio_exp = [r["expert"]["steps_per_s"] / r["minigrid_mean"] for r in rounds] if mg else []
    round_ratio_rand = [r["random"]["steps_per_s"] / r["minigrid_mean"] for r in rounds] if mg else []

    log("[1b] expert replay on a bare EnvController ...")
    exp_ctrl = time_replay_controller(recs, seconds / 2, precompiled=False)
    exp_ctrl_pre = time_replay_controller(recs, seconds / 2, precompiled=True)

    log("[4] expert end to end (planner + env) ...")
    time_expert_end_to_end(env, tasks[:2], 0.0)  # warm-up
    e2e = time_expert_end_to_end(env, tasks, seconds)
    log(f"    {e2e['steps_per_s']:.0f} steps/s, {e2e['episodes_per_s']:.1f} episodes/s")
    env.close()

    ratio_exp = med(round_ratio_exp) if mg else None
    ratio_rand = med(round_ratio_rand) if mg else None
    checks = {
        "expert_steps": exp_env["steps_per_s"] >= GOAL["min_steps_per_s"],
        "random_steps": rand["steps_per_s"] >= GOAL["min_steps_per_s"],
        "expert_ratio": ratio_exp is not None and ratio_exp >= GOAL["min_ratio"],
        "random_ratio": ratio_rand is not None and ratio_rand >= GOAL["min_ratio"],
    }
    r1 = lambda x: round(x, 1)  # noqa: E731
    result = {
        "sandbox_expert_steps_per_s": r1(exp_env["steps_per_s"]),
        "sandbox_expert_controller_steps_per_s": r1(exp_ctrl["steps_per_s"]),
        "sandbox_expert_controller_precompiled_steps_per_s": r1(exp_ctrl_pre["steps_per_s"]),
        "sandbox_random_steps_per_s": r1(rand["steps_per_s"]),
        "minigrid": {k: r1(v["steps_per_s"]) for k, v in mg.items()},
        "minigrid_mean_steps_per_s": r1(mg_mean),
        "ratio_expert_vs_minigrid": round(ratio_exp, 3) if ratio_exp is not None else None,
        "ratio_random_vs_minigrid": round(ratio_rand, 3) if ratio_rand is not None else None,
        "expert_policy_end_to_end_steps_per_s": r1(e2e["steps_per_s"]),
        "expert_policy_end_to_end_episodes_per_s": r1(e2e["episodes_per_s"]),
        "goal": {**GOAL, "rule": "meets_goal = expert and random replay each >= min_steps_per_s and each >= "
                                 "min_ratio x the MiniGrid mean"},
        "goal_checks": checks,
        "meets_goal": all(checks.values()),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "versions": {"gymnasium": gym.__version__, "minigrid": _version("minigrid")},
        "tasks": len(tasks),
        "seconds_per_measurement": seconds,
        "details": {
            "expert_replay_env": _round(exp_env),
            "expert_replay_controller": _round(exp_ctrl),
            "expert_replay_controller_precompiled": _round(exp_ctrl_pre),
            "expert_recorded_actions": n_actions,
            "expert_mean_episode_steps": round(n_actions / len(recs), 2),
            "expert_replay_mismatches": mism,
            "random": _round(rand),
            "random_actions_per_task": RANDOM_ACTIONS_PER_TASK,
            "random_malformed_rate": 0.1,
            "expert_end_to_end": _round(e2e),
            "minigrid": {k: _round(v) for k, v in mg.items()},
            "minigrid_substitutions": mg_subs,
            "minigrid_observation": "default gym.make observation: dict (image = 7x7x3 uint8 grid encoding, "
                                    "direction, mission); no wrappers added",
            "minigrid_actions": "env.action_space.sample() after action_space.seed(seed), pre-generated",
            "sandbox_observation": "text (the env's default); actions are dict tool calls (random: ~10% malformed "
                                   "incl. raw text through agent.parser)",
            "rounds": args.rounds,
            "gc": "gc.collect(); gc.freeze() after setup, before the timed rounds (both environments)",
            "round_ratios_expert": [round(x, 3) for x in round_ratio_exp],
            "round_ratios_random": [round(x, 3) for x in round_ratio_rand],
            "notes": "resets are not counted as steps; their time is included. Rates are medians of interleaved "
                     "rounds; ratios are medians of per-round ratios. The gym env caches compiled tasks, the bare "
                     "controller number without precompilation compiles the task every episode.",
        },
    }
    print(json.dumps(result, indent=2))
    return result


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:  # pragma: no cover
        return None


def _round(d: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


if __name__ == "__main__":
    main()
