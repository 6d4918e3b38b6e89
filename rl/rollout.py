"""Lockstep group rollouts, token in / token out: B tasks x G samples through the one episode loop.

Every group plays one task G times from the same initial state (same task, same seed: the sandbox and the rule
persona are deterministic). The episodes play in lockstep through `agent.episode.play`: each round the
policy (`EnginePolicy`) renders every live episode's step prompt with the policy's chat template once
(`prompt_ids`) and generates all responses in one batched call. The generated ids are kept as they are
(`response_ids`, with the stop token when one came), with the log-prob each was sampled with (`logprobs`),
and the trainer scores exactly those ids: nothing is decoded and tokenized again. The decoded text is what
the loop parses and steps; unreadable output gets the env's error observation and, from the judge, the
malformed-action score.

Generation engines (`rl.engines`): transformers `generate` with the KV cache (default), or vLLM when installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from agent.episode import Reply, Request, play
from agent.tools import tool_definitions
from agent.trajectory import Trajectory
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
    samples: list[StepSample] = field(default_factory=list)   # in the order played: round by round
    generate_seconds: float = 0.0
    env_seconds: float = 0.0
    generated_tokens: int = 0
    truncated_responses: int = 0          # responses cut at max_new_tokens without a stop token


class EnginePolicy:
    """A generation engine as the episode loop's policy: prompts through the chat template once, one batched
    generate per round, sampled at `temperature` with the round's seed (`seed * 7919 + step`)."""

    reads_prompt = True

    def __init__(self, engine, temperature: float, max_new_tokens: int, seed: int, name: str = "student"):
        self.engine, self.temperature, self.max_new_tokens, self.seed = engine, temperature, max_new_tokens, seed
        self.name = name
        self.tools = tool_definitions()

    def start(self, episode: int, env: Any, seed: int) -> None:
        pass

    def act(self, requests: list[Request]) -> list[Reply]:
        prompt_ids = [self.engine.encode(r.messages, self.tools) for r in requests]
        out = self.engine.generate(prompt_ids, temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                                   seed=self.seed * 7919 + requests[0].step)
        replies = []
        for p_ids, (r_ids, r_lps) in zip(prompt_ids, out, strict=True):
            text, stopped = self.engine.decode(r_ids)
            replies.append(Reply(text=text, prompt_ids=p_ids, response_ids=r_ids, logprobs=r_lps, stopped=stopped))
        return replies


def group_plan(tasks: list[TaskInstance], group_size: int, seed: int) -> list[tuple[int, TaskInstance, int]]:
    """(group id, task, episode seed) per rollout: each task G times with one seed, so a group shares its
    initial state."""
    return [(g, task, seed * 1_000_003 + g) for g, task in enumerate(tasks) for _ in range(group_size)]


def collect_rollouts(engine, tasks: list[TaskInstance], group_size: int, seed: int, temperature: float,
                     max_new_tokens: int, memory_size: int = 4, max_steps: int | None = None,
                     human_factory=None, policy_name: str = "student",
                     progress: Callable[[int], None] | None = None, make_env: Callable[[], Any] | None = None,
                     tools: list[dict] | None = None) -> RolloutBatch:
    """Play `len(tasks) * group_size` episodes in lockstep with `engine` (see `rl.engines`). Sampling is
    seeded per round from `seed`, so the same seed and weights give the same batch. `make_env` and `tools`:
    another env than the sandbox (TextWorld) and the skills as it offers them."""
    plan = group_plan(tasks, group_size, seed)
    policy = EnginePolicy(engine, temperature, max_new_tokens, seed, name=policy_name)
    if tools is not None:
        policy.tools = tools
    played = play(make_env or (lambda: SandboxEnv(human_factory=human_factory)), policy,
                  [({"task": task}, ep_seed) for _, task, ep_seed in plan], memory_size=memory_size,
                  max_steps=max_steps, on_done=(lambda i, e: progress(1)) if progress else None)
    batch = RolloutBatch(trajectories=played.trajectories, groups=[g for g, _, _ in plan],
                         generate_seconds=played.policy_seconds, env_seconds=played.env_seconds)
    for i, k in played.order:
        episode = played.episodes[i]
        reply = episode.replies[k]
        batch.samples.append(StepSample(traj=i, step=k, anchor=episode.anchors[k], prompt_ids=reply.prompt_ids,
                                        response_ids=reply.response_ids, logprobs=reply.logprobs))
        batch.generated_tokens += len(reply.response_ids)
        batch.truncated_responses += int(not reply.stopped)
    return batch
