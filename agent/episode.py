"""The one episode loop. The teacher, evaluation, RL rollouts, the verl agent loop and the oracle labeller all
play their episodes through here, with the one prompt builder and the one parser.

    from agent.episode import play
    from agent.policies import ChatPolicy
    played = play(SandboxEnv, ChatPolicy(client), [({"task": t}, seed) for t, seed in zip(tasks, seeds)])
    played.trajectories                     # agent.trajectory.Trajectory, in the order given

One step of one episode (`Episode.request`, then `Episode.record`):

    prompt    agent.prompt.build_step_messages(task, info["known"], memory, observation, steps, budget), the
              task line at the run's instruction granularity (goal, step, visual: `agent.instructions`)
    reply     the policy's answer: text (and token ids and log-probs when the engine has them)
    parse     agent.parser reads the reply once: a skill call, or a parse error
    step      env.step(call) or env.step({"parse_error": message})
    record    a Turn: prompt, reasoning, call, raw text, observation, error, state key, subgoals, state
    memory    the step joins the memory of recent steps the next prompt shows
    end       terminated, truncated (the task's step budget), or the caller's step cap (`max_steps`)

`play` runs many episodes in lockstep: each round asks the policy once for every live episode (one batched
generation), then steps them all. The loop knows nothing of the sandbox: any env whose `reset` info carries
`task` and whose `info` carries the keys below plugs in (see `sandbox.gym_env` for the reference contract):
state_key, steps, step_budget, error, trigger, success, subgoals_met, subgoals_done, subgoals_total, place,
holding, learned, known, human_reply, answer (TextWorld's score and max score are its subgoals done and total).

A policy (`Policy`) answers a batch of `Request`s with `Reply`s, or with a `ModelError` for a request its
backend failed on: an infrastructure failure is never scored as the model's invalid action. The episode
stops there, unrecorded (`Episode.error`); `play` raises it unless `raise_errors=False`.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from agent.instructions import check_granularity, instruction_text
from agent.models import ModelError
from agent.parser import ParseError, ToolCall, parse_action
from agent.prompt import StepMemory, build_step_messages
from agent.trajectory import SubgoalInfo, Trajectory, Turn, TurnState


@dataclass
class Request:
    """One decision a policy is asked for."""

    episode: int               # the episode's index in the `play` call
    seed: int                  # the episode's seed
    step: int                  # steps taken so far in the episode
    observation: str           # the latest observation
    info: dict                 # the env's latest info (known map, place, holdings, ...)
    messages: list[dict]       # the step prompt; empty for a policy that does not read prompts


@dataclass
class Reply:
    """A policy's answer to one request. A model gives `text` (what it wrote), which the loop parses, or also
    `action`, its reply already read by the shared parser (`ChatReply.action()`, for OpenAI tool calls); a
    scripted policy gives `action` (a call dict, or text it wants parsed) and its `reasoning`."""

    text: str | None = None
    action: ToolCall | ParseError | dict | None = None
    reasoning: str | None = None
    prompt_ids: list[int] | None = None      # token in / token out: the ids the policy saw ...
    response_ids: list[int] | None = None    # ... and generated (with the stop token when one came)
    logprobs: list[float] | None = None      # the log-prob of each response id when it was sampled
    stopped: bool = True                     # False: the response was cut at max_new_tokens


def hint_text(steps: int) -> str:
    """The deadlock intervention's note: neutral, it says what happened and not what to do."""
    return f"Note: nothing has changed for {steps} steps."


def episode_seed(seed: int, task_id: str) -> int:
    """The seed of the episode of task `task_id` in a run seeded `seed` (the teacher, evaluation and RL's
    evaluations derive theirs this way): a function of the two alone, so a task plays the same whatever the
    order or subset of the tasks around it."""
    digest = hashlib.sha256(f"{seed}|{task_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class Policy(Protocol):
    name: str
    reads_prompt: bool   # False: the loop builds no step prompt for it (a scripted policy acts on `info`)

    def start(self, episode: int, env: Any, seed: int) -> None:
        """A new episode begins (the env has been reset)."""

    def act(self, requests: list[Request]) -> list[Reply | ModelError]:
        """One reply per request, in order."""


class Episode:
    """One episode in progress: the env, the trajectory being recorded, the memory the prompt shows."""

    def __init__(self, env: Any, policy_name: str, seed: int, options: dict | None = None, memory_size: int = 4,
                 max_steps: int | None = None, deadlock_hint: int | None = None, instructions: str = "goal"):
        if memory_size < 0:
            raise ValueError(f"memory_size must be >= 0, not {memory_size}")
        if deadlock_hint is not None and deadlock_hint < 1:
            raise ValueError(f"deadlock_hint must be >= 1 steps, not {deadlock_hint}")
        # the intervention (PokeGym's): after `deadlock_hint` steps in a row that changed nothing, the next
        # observation the policy reads ends with a neutral note (the trajectory keeps the env's own text)
        self.deadlock_hint, self.still = deadlock_hint, 0
        # how much of the plan the task line gives (`agent.instructions`): goal | step | visual
        self.instructions = check_granularity(instructions)
        obs, info = env.reset(seed=seed, options=options)
        task = info["task"]
        self.procedure = task.get("procedure")
        if instructions != "goal" and not self.procedure:
            raise ValueError(f"instructions {instructions!r}: task {task['id']} has no procedure (the env gives "
                             f"none)")
        self.env, self.observation, self.info = env, obs, info
        self.memory = StepMemory(size=memory_size)
        self.max_steps = max_steps
        self.done = False
        self.error: ModelError | None = None      # the backend failed: the episode stopped, unrecorded
        self.anchors: list[str] = []              # per turn: the state key the step acted from (GiGPO's anchor)
        self.replies: list[Reply] = []            # per turn: what the policy answered (token ids, log-probs)
        self.trajectory = Trajectory(
            task_id=task["id"], instruction=task["instruction"], difficulty=task["difficulty"], scene=task["scene"],
            policy=policy_name, seed=seed, initial_observation=obs, initial_state_key=info["state_key"],
            subgoals_total=info["subgoals_total"], optimal_steps=task["optimal_steps"],
            subgoals=[SubgoalInfo(**g) for g in task["subgoals"]], initial_subgoals_met=list(info["subgoals_met"]))

    def request(self, index: int = 0, with_prompt: bool = True) -> Request:
        """The next decision: the step prompt from the instruction, what the agent knows, its memory and the
        observation."""
        info = self.info
        if not with_prompt:
            messages = []
        else:
            goal = self.trajectory.instruction
            task = None if self.instructions == "goal" else instruction_text(goal, self.procedure,
                                                                              self.instructions, info["known"])
            messages = build_step_messages(goal, info["known"], self.memory, self.observation, info["steps"],
                                           info["step_budget"], task=task)
        return Request(episode=index, seed=self.trajectory.seed, step=info["steps"], observation=self.observation,
                       info=info, messages=messages)

    def record(self, request: Request, reply: Reply) -> Turn:
        """Read the reply (the one parse), step the env, record the turn, update the memory; ends the episode on
        termination, truncation or the step cap."""
        action = reply.action if reply.action is not None else parse_action(reply.text)
        if isinstance(action, ToolCall):
            call, thought = action.as_dict(), action.reasoning
        elif isinstance(action, ParseError):
            call, thought = None, action.reasoning
        else:  # a scripted policy's call, as it wrote it (the env validates it)
            call, thought = action, ""
        if reply.reasoning is not None:
            thought = reply.reasoning
        anchor = self.info["state_key"]
        obs, _reward, terminated, truncated, info = self.env.step(
            call if call is not None else {"parse_error": action.message})
        traj = self.trajectory
        turn = Turn(index=len(traj.turns), prompt=request.messages, reasoning=thought, tool_call=call,
                    raw_output=reply.text, observation=obs, error=info["error"], trigger=info["trigger"],
                    state_key=info["state_key"], subgoals_met=info["subgoals_met"], human_reply=info["human_reply"],
                    state=TurnState(place=info["place"], holding=info["holding"], learned=info["learned"]))
        traj.turns.append(turn)
        self.anchors.append(anchor)
        self.replies.append(reply)
        if info["answer"] is not None:
            traj.final_answer = info["answer"]
        self.memory.add(call, info["error"], obs)
        self.observation, self.info = obs, info
        self.still = self.still + 1 if info["state_key"] == anchor else 0
        if self.deadlock_hint is not None and self.still >= self.deadlock_hint:
            self.observation = f"{obs}\n{hint_text(self.still)}"
        traj.terminated, traj.truncated = terminated, truncated
        if terminated or truncated:
            self.done = True
            traj.success = bool(info["success"])
            traj.subgoals_met = info["subgoals_done"]
        elif self.max_steps is not None and len(traj.turns) >= self.max_steps:
            self.done = traj.truncated = True
            traj.success = False
            traj.subgoals_met = info["subgoals_done"]
        return turn


@dataclass
class Played:
    """What `play` returns: the episodes in the order given, and the (episode, turn) of every step in the order
    the loop played them (round by round: every live episode's first step, then their second, ...)."""

    episodes: list[Episode]
    order: list[tuple[int, int]] = field(default_factory=list)
    policy_seconds: float = 0.0
    env_seconds: float = 0.0

    @property
    def trajectories(self) -> list[Trajectory]:
        return [e.trajectory for e in self.episodes]

    @property
    def errors(self) -> list[tuple[int, ModelError]]:
        return [(i, e.error) for i, e in enumerate(self.episodes) if e.error is not None]


def play(make_env: Callable[[], Any], policy: Policy, starts: Sequence[tuple[dict | None, int]], *,
         batch_size: int | None = None, memory_size: int = 4, max_steps: int | None = None,
         raise_errors: bool = True, on_done: Callable[[int, Episode], None] | None = None,
         deadlock_hint: int | None = None, instructions: str = "goal") -> Played:
    """Play one episode per `(reset options, seed)` in `starts` with `policy`, `batch_size` episodes at a time
    in lockstep (default: all at once), each in a fresh env from `make_env()`.

    `max_steps` caps every episode's steps (RL rollouts; the task's own budget applies anyway). `on_done(i,
    episode)` is called as each episode ends (its trajectory is complete, or `episode.error` says why not).
    A `ModelError` reply is raised at once, or with `raise_errors=False` ends that episode unrecorded.
    `deadlock_hint` (steps): the deadlock intervention (`Episode`). `instructions`: goal | step | visual, how
    much of the plan the task line gives (`agent.instructions`)."""
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, not {batch_size}")
    starts = list(starts)
    size = batch_size or max(len(starts), 1)
    played = Played(episodes=[])
    for lo in range(0, len(starts), size):
        live = []
        for i, (options, seed) in enumerate(starts[lo: lo + size], start=lo):
            env = make_env()
            episode = Episode(env, policy.name, seed, options, memory_size=memory_size, max_steps=max_steps,
                              deadlock_hint=deadlock_hint, instructions=instructions)
            played.episodes.append(episode)
            policy.start(i, env, seed)
            live.append(i)
        while live:
            requests = [played.episodes[i].request(i, policy.reads_prompt) for i in live]
            t0 = time.perf_counter()
            replies = policy.act(requests)
            t1 = time.perf_counter()
            if len(replies) != len(requests):
                raise RuntimeError(f"policy {policy.name}: {len(replies)} replies to {len(requests)} requests")
            still = []
            for i, request, reply in zip(live, requests, replies, strict=True):
                episode = played.episodes[i]
                if isinstance(reply, ModelError):
                    if raise_errors:
                        raise reply
                    episode.error, episode.done = reply, True
                else:
                    episode.record(request, reply)
                    played.order.append((i, len(episode.trajectory.turns) - 1))
                if episode.done:
                    if on_done is not None:
                        on_done(i, episode)
                else:
                    still.append(i)
            played.policy_seconds += t1 - t0
            played.env_seconds += time.perf_counter() - t1
            live = still
    return played
