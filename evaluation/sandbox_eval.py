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


def start_episode(env: SandboxEnv, task: TaskInstance, seed: int, policy_name: str) -> tuple[Trajectory, str]:
    obs, info = env.reset(seed=seed, options={"task": task})
    traj = Trajectory(task_id=task.id, instruction=task.instruction, difficulty=task.difficulty, scene=task.scene,
                      policy=policy_name, seed=seed, initial_observation=obs, initial_state_key=info["state_key"],
                      subgoals_total=len(task.subgoals), optimal_steps=task.optimal_steps,
                      subgoals=[SubgoalInfo(id=g.id, description=g.description, kind=g.predicate.kind)
                                for g in task.subgoals],
                      initial_subgoals_met=list(env.ctrl.reset_subgoals))
    return traj, obs


def step_episode(env: SandboxEnv, traj: Trajectory, thought: str, action, prompt: list[dict] | None = None,
                 raw: str | None = None) -> tuple[str, dict, dict | None, bool]:
    """Apply one action and record the turn. Returns (observation, info, the call the env read, done)."""
    before = set(env.ctrl.w.learned)
    obs, reward, terminated, truncated, info = env.step(action)
    if isinstance(action, dict):
        call = action
    else:  # model text: the env parsed it; keep the call it read (or None) and the raw text
        from agent.parser import ToolCall, parse_action
        parsed = parse_action(action)
        call = parsed.as_dict() if isinstance(parsed, ToolCall) else None
    name = call.get("name") if isinstance(call, dict) else None
    human = obs if name in ("talk_to", "ask_for_help") and " says: " in obs else None
    traj.turns.append(Turn(index=len(traj.turns), prompt=prompt or [], reasoning=thought, tool_call=call,
                           raw_output=raw if raw is not None else (action if isinstance(action, str) else None),
                           observation=obs, error=info["error"], trigger=info["trigger"],
                           state_key=info["state_key"], subgoals_met=info["subgoals_met"], human_reply=human,
                           state=_state(env, before)))
    if name == "report" and info["error"] is None:
        traj.final_answer = call["arguments"].get("answer")
    done = terminated or truncated
    traj.terminated, traj.truncated = terminated, truncated
    if done:
        traj.success = bool(info["success"])
        traj.subgoals_met = env.ctrl.subgoal_progress()[0]
    return obs, info, call, done


def run_episode(env: SandboxEnv, task: TaskInstance, policy, seed: int) -> Trajectory:
    """Play one episode. `policy.act` returns (thought, action): a tool-call dict, or raw model text that the
    env parses (text it cannot read becomes a `parse_error` turn). Each turn records the env's state history
    (place, holdings, facts learned) for the judges; prompts and raw output are kept when the policy has them."""
    traj, obs = start_episode(env, task, seed, policy.name)
    policy.reset(env, seed)
    done = False
    while not done:
        thought, action = policy.act(env, obs)
        obs, info, call, done = step_episode(env, traj, thought, action, getattr(policy, "last_prompt", None),
                                             getattr(policy, "last_raw", None))
        policy.observe(call, info, obs)
    return traj


def run_model_batched(tasks: list[TaskInstance], client, seeds: list[int], batch_size: int = 16,
                      memory_size: int = 4, name: str | None = None,
                      progress: Callable[[int], None] | None = None, human_factory=None) -> list[Trajectory]:
    """Lockstep episodes for a chat model: up to `batch_size` envs step together and each step's prompts
    (the shared prompt builder) go to the model in one `chat_many` call (batched generation)."""
    from agent.models import ModelError
    from agent.parser import ToolCall
    from agent.prompt import StepMemory, build_step_messages
    from agent.tools import tool_definitions
    tools = tool_definitions()
    name = name or getattr(client, "name", "model")
    out: list[Trajectory] = []
    for lo in range(0, len(tasks), batch_size):
        chunk = list(zip(tasks[lo: lo + batch_size], seeds[lo: lo + batch_size], strict=True))
        envs = [SandboxEnv(human_factory=human_factory) for _ in chunk]
        runs = []
        for env, (task, seed) in zip(envs, chunk, strict=True):
            traj, obs = start_episode(env, task, seed, name)
            runs.append([env, traj, obs, StepMemory(size=memory_size), False])
        while True:
            live = [r for r in runs if not r[4]]
            if not live:
                break
            prompts = [build_step_messages(r[1].instruction, r[0].known(), r[3], r[2], r[0].ctrl.steps,
                                           r[0].task.step_budget) for r in live]
            replies = client.chat_many(prompts, tools=tools, seed=live[0][1].seed + live[0][0].ctrl.steps)
            for r, msgs, reply in zip(live, prompts, replies, strict=True):
                if isinstance(reply, ModelError):
                    raise reply  # an infrastructure failure is not the model's invalid action
                parsed = reply.action()
                action = parsed.as_dict() if isinstance(parsed, ToolCall) else reply.text
                obs, info, call, done = step_episode(r[0], r[1], parsed.reasoning, action, msgs, reply.text)
                r[3].add(call, info["error"], obs)
                r[2], r[4] = obs, done
        out += [r[1] for r in runs]
        if progress:
            progress(len(chunk))
    return out


def evaluate(tasks: list[TaskInstance], policy: str, seed: int = 0,
             progress: Callable[[int], None] | None = None, human_factory=None,
             batch_size: int = 16, constrained: bool = False) -> tuple[dict, list[Trajectory]]:
    """`policy`: expert | random | a local model folder (run in lockstep batches; with `constrained`, its
    decoding can only write well-formed calls over ids its prompt shows: `agent.constrained`)."""
    from pathlib import Path
    if policy not in POLICIES and Path(policy).is_dir():
        from agent.clients import TransformersClient
        client = TransformersClient(policy, max_new_tokens=96, constrained=constrained)
        seeds = [seed * 100_003 + i for i in range(len(tasks))]
        trajs = run_model_batched(tasks, client, seeds, batch_size=batch_size, name=Path(policy).name,
                                  progress=progress, human_factory=human_factory)
        return split_metrics(trajs), trajs
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose {', '.join(POLICIES)} or a model folder")
    env = SandboxEnv(human_factory=human_factory)
    pol = POLICIES[policy]()
    trajs = []
    for i, task in enumerate(tasks):
        trajs.append(run_episode(env, task, pol, seed * 100_003 + i))
        if progress:
            progress(1)
    return split_metrics(trajs), trajs
