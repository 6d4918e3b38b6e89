"""Run a policy on sandbox tasks and score it (TSR, GCR, steps, invalid-action rate, help, loops)."""

from __future__ import annotations

from typing import Callable

from agent.trajectory import SubgoalInfo, Trajectory, Turn, TurnState
from evaluation.policies import POLICIES
from sandbox.gym_env import SandboxEnv
from sandbox.metrics import split_metrics
from sandbox.schema import TaskInstance


def _state(env: SandboxEnv, before: set[str]) -> TurnState:
    w = env.ctrl.w
    return TurnState(place=w.agent_place, holding=list(w.holding), learned=sorted(w.learned - before))


def run_episode(env: SandboxEnv, task: TaskInstance, policy, seed: int) -> Trajectory:
    """Play one episode. `policy.act` returns (thought, action): a tool-call dict, or raw model text that the
    env parses (text it cannot read becomes a `parse_error` turn). Each turn records the env's state history
    (place, holdings, facts learned) for the judges; prompts and raw output are kept when the policy has them."""
    obs, info = env.reset(seed=seed, options={"task": task})
    policy.reset(env, seed)
    traj = Trajectory(task_id=task.id, instruction=task.instruction, difficulty=task.difficulty, scene=task.scene,
                      policy=policy.name, seed=seed, initial_observation=obs, initial_state_key=info["state_key"],
                      subgoals_total=len(task.subgoals), optimal_steps=task.optimal_steps,
                      subgoals=[SubgoalInfo(id=g.id, description=g.description, kind=g.predicate.kind)
                                for g in task.subgoals],
                      initial_subgoals_met=list(env.ctrl.reset_subgoals))
    done = False
    while not done:
        thought, action = policy.act(env, obs)
        before = set(env.ctrl.w.learned)
        obs, reward, terminated, truncated, info = env.step(action)
        if isinstance(action, dict):
            call = action
        else:  # model text: the env parsed it; keep the call it read (or None) and the raw text
            from agent.parser import ToolCall, parse_action
            parsed = parse_action(action)
            call = parsed.as_dict() if isinstance(parsed, ToolCall) else None
        policy.observe(call, info, obs)
        name = call.get("name") if isinstance(call, dict) else None
        human = obs if name in ("talk_to", "ask_for_help") and " says: " in obs else None
        prompt = getattr(policy, "last_prompt", None) or []
        raw = getattr(policy, "last_raw", None)
        traj.turns.append(Turn(index=len(traj.turns), prompt=prompt, reasoning=thought, tool_call=call,
                               raw_output=raw if raw is not None else (action if isinstance(action, str) else None),
                               observation=obs, error=info["error"], trigger=info["trigger"],
                               state_key=info["state_key"], subgoals_met=info["subgoals_met"], human_reply=human,
                               state=_state(env, before)))
        if name == "report" and info["error"] is None:
            traj.final_answer = call["arguments"].get("answer")
        done = terminated or truncated
        traj.terminated, traj.truncated = terminated, truncated
    traj.success = bool(info["success"])
    traj.subgoals_met = env.ctrl.subgoal_progress()[0]
    return traj


def evaluate(tasks: list[TaskInstance], policy: str, seed: int = 0,
             progress: Callable[[int], None] | None = None, human_factory=None) -> tuple[dict, list[Trajectory]]:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    env = SandboxEnv(human_factory=human_factory)
    pol = POLICIES[policy]()
    trajs = []
    for i, task in enumerate(tasks):
        trajs.append(run_episode(env, task, pol, seed * 100_003 + i))
        if progress:
            progress(1)
    return split_metrics(trajs), trajs
