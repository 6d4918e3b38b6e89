"""Evaluate a policy on sandbox tasks: TSR, GCR, steps, invalid-action rate, help requests, loops, and the
deadlock taxonomy (aware / unaware / recovered: `agent.metrics.find_deadlocks`).

    from evaluation.sandbox_eval import evaluate
    metrics, trajectories = evaluate(tasks, "outputs/medium/sft/final")   # or "expert", "random"
    metrics, trajectories = evaluate(tasks, ClientSpec(kind="openai", model="m", base_url="http://127.0.0.1:8000/v1"))

Every policy plays through the one episode loop (`agent.episode.play`), `batch_size` episodes in lockstep.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from agent.clients import ClientSpec, TransformersClient, make_client
from agent.episode import episode_seed, play
from agent.metrics import DEADLOCK_K, split_metrics, trajectories_deadlock_report
from agent.policies import ChatPolicy, ScriptedPolicy
from agent.trajectory import Trajectory
from sandbox.agents import ExpertAgent, RandomAgent
from sandbox.gym_env import SandboxEnv
from sandbox.schema import TaskInstance

SCRIPTED = {"expert": ExpertAgent, "random": RandomAgent}


def make_policy(policy: str | ClientSpec, constrained: bool = False, tools: list[dict] | None = None):
    """expert | random | a local model folder (with `constrained`, its decoding can only write well-formed calls
    over ids its prompt shows: `agent.constrained`) | a client spec (any OpenAI-compatible endpoint). `tools`:
    the skills a model is shown (default: the sandbox's)."""
    if isinstance(policy, ClientSpec):
        return ChatPolicy(make_client(policy), name=policy.model, tools=tools)
    if policy in SCRIPTED:
        return ScriptedPolicy(SCRIPTED[policy], name=policy)
    if not Path(policy).is_dir():
        raise ValueError(f"unknown policy {policy!r}: choose {', '.join(SCRIPTED)} or a model folder")
    return ChatPolicy(TransformersClient(policy, max_new_tokens=96, constrained=constrained), name=Path(policy).name,
                      tools=tools)


def evaluate(tasks: list[TaskInstance], policy: str | ClientSpec, seed: int = 0,
             progress: Callable[[int], None] | None = None, human_factory=None, batch_size: int = 16,
             constrained: bool = False, make_env: Callable | None = None,
             tools: list[dict] | None = None, deadlock_hint: bool = False, instructions: str = "goal",
             deadlock_k: int = DEADLOCK_K) -> tuple[dict, list[Trajectory]]:
    """Play every task once (greedy for a model) and score the split: metrics per difficulty and "all".
    `make_env` and `tools`: a model (not the sandbox's expert or random agent) in another env, such as
    TextWorld's (`evaluation.textworld` has that env's own baselines and report). `deadlock_k`: the deadlock
    window, steps in a row that change nothing (default `agent.metrics.DEADLOCK_K`); `deadlock_hint`: after that
    many the next observation says so (`agent.episode.hint_text`).
    `instructions`: the task line a model reads, goal | step | visual (`agent.instructions`; the expert and random
    agents act on the env's state, not on a task line)."""
    if make_env is not None and policy in SCRIPTED:
        raise ValueError(f"{policy!r} is the sandbox's agent: in another env, evaluate a model")
    make_env = make_env or (lambda: SandboxEnv(human_factory=human_factory))
    played = play(make_env, make_policy(policy, constrained, tools),
                  [({"task": t}, episode_seed(seed, t.id)) for t in tasks],
                  batch_size=batch_size, on_done=(lambda i, e: progress(1)) if progress else None,
                  deadlock_hint=deadlock_k if deadlock_hint else None, instructions=instructions)
    metrics = split_metrics(played.trajectories)
    metrics["deadlocks"] = {**trajectories_deadlock_report(played.trajectories, deadlock_k), "hint": deadlock_hint}
    metrics["instructions"] = instructions
    return metrics, played.trajectories
