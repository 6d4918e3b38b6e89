"""Lockstep multi-turn rollouts: B tasks x G samples, token in / token out.

Every group plays one task G times from the same initial state (same task, same seed: the sandbox and the rule
persona are deterministic). All live episodes step together: each step's prompts come from the shared prompt
builder (`agent.prompt.build_step_messages`: task, memory of recent steps, current observation), go through the
policy's chat template once (`prompt_ids`), and are generated in one batched call. The generated token ids are
kept as they are (`response_ids`, with the stop token when one came) with the log-prob each was sampled with
(`logprobs`), and the trainer scores exactly those ids: nothing is decoded and tokenized again. The decoded
text goes to the sandbox, which parses it; unreadable output gets the sandbox's error observation and, from the
judge, the malformed-action score.

Generation engines (`rl.engines`): transformers `generate` with the KV cache (default), or vLLM when installed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from agent.parser import ToolCall, parse_action
from agent.prompt import StepMemory, build_step_messages
from agent.tools import tool_definitions
from agent.trajectory import Trajectory
from evaluation.sandbox_eval import start_episode, step_episode
from sandbox.gym_env import SandboxEnv
from sandbox.schema import TaskInstance


@dataclass
class StepSample:
    """One decision: the exact ids the policy saw and produced, and where it acted from."""

    traj: int                 # index into RolloutBatch.trajectories
    step: int                 # 0-based turn index
    anchor: str               # the env state key the step acted from (GiGPO's anchor state)
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]     # the engine's log-prob of each response id when it was sampled (old log-probs)


@dataclass
class RolloutBatch:
    trajectories: list[Trajectory]
    groups: list[int]                     # per trajectory: its episode group (one task, one initial state)
    samples: list[StepSample] = field(default_factory=list)
    generate_seconds: float = 0.0
    env_seconds: float = 0.0
    generated_tokens: int = 0
    truncated_responses: int = 0          # responses cut at max_new_tokens without a stop token


def group_plan(tasks: list[TaskInstance], group_size: int, seed: int) -> list[tuple[int, TaskInstance, int]]:
    """(group id, task, episode seed) per rollout: each task G times with one seed, so a group shares its
    initial state."""
    return [(g, task, seed * 1_000_003 + g) for g, task in enumerate(tasks) for _ in range(group_size)]


def collect_rollouts(engine, tasks: list[TaskInstance], group_size: int, seed: int, temperature: float,
                     max_new_tokens: int, memory_size: int = 4, max_steps: int | None = None,
                     human_factory=None, policy_name: str = "student",
                     progress: Callable[[int], None] | None = None) -> RolloutBatch:
    """Play `len(tasks) * group_size` episodes in lockstep with `engine` (see `rl.engines`). Sampling is
    seeded per step from `seed`, so the same seed and weights give the same batch."""
    tools = tool_definitions()
    plan = group_plan(tasks, group_size, seed)
    envs = [SandboxEnv(human_factory=human_factory) for _ in plan]
    batch = RolloutBatch(trajectories=[], groups=[g for g, _, _ in plan])
    live: list[list] = []   # [index, env, observation, memory, state key before the step]
    for i, (env, (_g, task, ep_seed)) in enumerate(zip(envs, plan, strict=True)):
        traj, obs = start_episode(env, task, ep_seed, policy_name)
        batch.trajectories.append(traj)
        live.append([i, env, obs, StepMemory(size=memory_size), traj.initial_state_key])
    step = 0
    while live:
        prompts = [build_step_messages(batch.trajectories[i].instruction, env.known(), mem, obs, env.ctrl.steps,
                                       env.task.step_budget) for i, env, obs, mem, _ in live]
        t0 = time.perf_counter()
        prompt_ids = [engine.encode(m, tools) for m in prompts]
        responses = engine.generate(prompt_ids, temperature=temperature, max_new_tokens=max_new_tokens,
                                    seed=seed * 7919 + step)
        batch.generate_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        still = []
        for run, msgs, p_ids, r_ids in zip(live, prompts, prompt_ids, responses, strict=True):
            i, env, obs, mem, anchor = run
            r_ids, r_lps = r_ids
            text, stopped = engine.decode(r_ids)
            batch.generated_tokens += len(r_ids)
            batch.truncated_responses += int(not stopped)
            traj = batch.trajectories[i]
            batch.samples.append(StepSample(traj=i, step=len(traj.turns), anchor=anchor, prompt_ids=p_ids,
                                            response_ids=r_ids, logprobs=r_lps))
            parsed = parse_action(text)
            action = parsed.as_dict() if isinstance(parsed, ToolCall) else text
            obs, info, call, done = step_episode(env, traj, parsed.reasoning, action, msgs, text)
            mem.add(call, info["error"], obs)
            if not done and max_steps is not None and len(traj.turns) >= max_steps:
                done = traj.truncated = True
                traj.success = False
                traj.subgoals_met = env.ctrl.subgoal_progress()[0]
            if done:
                if progress:
                    progress(1)
                continue
            run[2], run[4] = obs, info["state_key"]
            still.append(run)
        batch.env_seconds += time.perf_counter() - t0
        live = still
        step += 1
    return batch
