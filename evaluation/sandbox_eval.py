"""Run a policy on sandbox tasks and score it (TSR, GCR, steps, invalid-action rate, help, loops)."""

from __future__ import annotations

from typing import Callable

from agent.trajectory import Trajectory, Turn
from evaluation.policies import POLICIES
from sandbox.gym_env import SandboxEnv
from sandbox.metrics import split_metrics
from sandbox.schema import TaskInstance


def run_episode(env: SandboxEnv, task: TaskInstance, policy, seed: int) -> Trajectory:
    obs, info = env.reset(seed=seed, options={"task": task})
    policy.reset(env, seed)
    traj = Trajectory(task_id=task.id, instruction=task.instruction, difficulty=task.difficulty, scene=task.scene,
                      policy=policy.name, seed=seed, initial_observation=obs, initial_state_key=info["state_key"],
                      subgoals_total=len(task.subgoals), optimal_steps=task.optimal_steps)
    done = False
    while not done:
        thought, call = policy.act(env, obs)
        obs, reward, terminated, truncated, info = env.step(call)
        policy.observe(call, info, obs)
        human = obs if call.get("name") in ("talk_to", "ask_for_help") and " says: " in obs else None
        traj.turns.append(Turn(index=len(traj.turns), reasoning=thought, tool_call=call, observation=obs,
                               error=info["error"], trigger=info["trigger"], state_key=info["state_key"],
                               subgoals_met=info["subgoals_met"], human_reply=human))
        if call.get("name") == "report" and info["error"] is None:
            traj.final_answer = call["arguments"].get("answer")
        done = terminated or truncated
        traj.terminated, traj.truncated = terminated, truncated
    traj.success = bool(info["success"])
    traj.subgoals_met = env.ctrl.subgoal_progress()[0]
    return traj


def evaluate(tasks: list[TaskInstance], policy: str, seed: int = 0,
             progress: Callable[[int], None] | None = None) -> tuple[dict, list[Trajectory]]:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    env = SandboxEnv()
    pol = POLICIES[policy]()
    trajs = []
    for i, task in enumerate(tasks):
        trajs.append(run_episode(env, task, pol, seed * 100_003 + i))
        if progress:
            progress(1)
    return split_metrics(trajs), trajs
