"""On-policy distillation (DAgger): the student drives, the teacher labels every state it reaches.

One round of it, as `pipeline.stages.run_onpolicy_stage` runs it (then the student trains on the aggregate and
the next round starts from the new student):

    policy = DAggerPolicy(ChatPolicy(student_client), ExpertLabels(), beta=0.0, seed=seed)
    played = play(SandboxEnv, policy, starts, batch_size=32)        # the one episode loop: the student plays ...
    rows = label_rows(played, policy, tasks, round=1, ...)          # ... and every state it reached is labelled

At every state the student answers its step prompt, and the teacher answers from the same state:
* the expert (`ExpertLabels`, the embedded default): `sandbox.agents.ExpertAgent(takeover=True)` plans from the
  agent's belief at that point, its memory brought up to date with every call the student actually made and
  what it saw (a report or operation it would not have made does not count as its own progress);
* a chat model (`ModelLabels`: an OpenAI-compatible endpoint or a local model): asked with the very prompt the
  student saw.
With probability `beta` (the DAgger mixture, Ross, Gordon and Bagnell, AISTATS 2011, eq. pi_i = beta_i pi* +
(1 - beta_i) pi_hat_i) the teacher's action is executed instead of the student's; the coin is a function of the
episode seed and the step alone. Every state with a readable teacher label becomes a row of the dataset's
`onpolicy` config: the student's step prompt, the teacher's thought and call, the `round`, what the student
wrote (`student_action`) and whether its call was the teacher's (`agreed`). A teacher call that fails, or a
model teacher's unreadable reply, is counted (`teacher_errors`, `teacher_unreadable`) and gives no row: never a
silent label.

`takeover` measures how recoverable the student's states are: at a random step of a student episode the expert
takes over (the student's calls replayed, the expert told each one, as when it labels) and plays to the end;
the privileged oracle, from the same state, says whether the task was still solvable there.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agent.clients import ClientSpec
from agent.episode import Played, Reply, Request, play
from agent.models import ModelError
from agent.parser import ToolCall, parse_action, render_tool_call
from agent.policies import ChatPolicy, ScriptedPolicy
from agent.tools import tool_definitions
from agent.trajectory import Trajectory
from distill.dataset import SPLITS, call_message, step_prompt
from sandbox.agents import ExpertAgent, ReplayAgent
from sandbox.schema import TaskInstance
from sandbox.skills import same_call


class OnPolicyConfig(BaseModel):
    """Recipe `onpolicy:` (the stage runs when `rl.init` is `onpolicy`, or with `embodistill onpolicy`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    rounds: int = Field(default=2, ge=1, le=100)
    # what the student plays each round: the train split's tasks, the fresh RL pool's (the "rl" split RL plays,
    # `rl.pool_instructions_per_scene`), or both
    tasks: Literal["train", "pool", "both"] = "both"
    tasks_per_round: int = Field(default=256, ge=1)
    # DAgger's beta: the probability that the teacher's action is executed instead of the student's; one value
    # for every round, or one per round (for example [0.5, 0.0])
    beta: float | list[float] = 0.0
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)   # the student's sampling (0: greedy, as evaluated)
    max_new_tokens: int = Field(default=96, ge=1)
    batch_size: int = Field(default=32, ge=1)                 # episodes in lockstep
    teacher: Literal["expert"] | ClientSpec = "expert"
    max_teacher_error_share: float = Field(default=0.0, ge=0.0, le=1.0)   # of labelled states; above it the round fails
    # each round's training set: every on-policy row so far plus this many of the teacher's `step` rows (a seeded
    # sample; None: all of them, DAgger's full aggregate), for `epochs` passes at learning rate `lr`
    teacher_rows: int | None = Field(default=None, ge=0)
    epochs: float = Field(default=1.0, gt=0)
    lr: float = Field(default=3e-4, gt=0, le=1.0)
    # sft: TRL's SFTTrainer on the aggregate; gkd: TRL's GKDTrainer (Agarwal et al., ICLR 2024) on the collected
    # student prompts, with a model teacher that shares the student's tokenizer (`teacher: {kind: transformers}`)
    loss: Literal["sft", "gkd"] = "sft"
    gkd_lmbda: float = Field(default=0.5, ge=0.0, le=1.0)    # GKD: the share of student-generated completions
    gkd_beta: float = Field(default=0.5, ge=0.0, le=1.0)     # GKD: the generalized JSD's interpolation
    eval_tasks: int | None = Field(default=None, ge=1)       # test tasks evaluated after each round (None: all)
    eval_init: bool = True                                   # also evaluate the starting student (round 0)
    takeover_episodes: int = Field(default=64, ge=0)         # student episodes per round the expert takes over

    @field_validator("beta")
    @classmethod
    def _betas(cls, v):
        for b in v if isinstance(v, list) else [v]:
            if not 0.0 <= b <= 1.0:
                raise ValueError(f"beta is a probability in [0, 1], not {b}")
        return v

    @model_validator(mode="after")
    def _per_round(self):
        if isinstance(self.beta, list) and len(self.beta) != self.rounds:
            raise ValueError(f"beta lists one value per round: {len(self.beta)} values for {self.rounds} rounds")
        if self.loss == "gkd" and (isinstance(self.teacher, str) or self.teacher.kind != "transformers"):
            raise ValueError("loss: gkd needs a local model teacher sharing the student's tokenizer "
                             "(teacher: {kind: transformers, model: FOLDER})")
        return self

    def beta_for(self, round_no: int) -> float:
        """Beta of round `round_no` (1-based)."""
        return self.beta[round_no - 1] if isinstance(self.beta, list) else self.beta


# ----------------------------------------------------------------------------- which tasks, which seeds


def round_tasks(candidates: list[TaskInstance], n: int, seed: int, round_no: int) -> list[TaskInstance]:
    """The tasks of round `round_no`: the next `n` of one seeded ordering of the candidates (every candidate is
    played once before any is played again), so rounds see new tasks and the choice depends on the seed alone."""
    order = sorted(candidates, key=lambda t: hashlib.sha256(f"{seed}|{t.id}".encode()).hexdigest())
    if not order:
        return []
    start = (round_no - 1) * n
    return [order[(start + i) % len(order)] for i in range(min(n, len(order)))]


def round_seed(seed: int, round_no: int, task_id: str) -> int:
    """The episode seed of a task in a round (a new episode of the same task each round)."""
    digest = hashlib.sha256(f"onpolicy|{seed}|{round_no}|{task_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


# ----------------------------------------------------------------------------- teachers


@dataclass
class TeacherLabel:
    """The teacher's answer at one state: its thought and call (None: it wrote nothing readable), as text."""

    reasoning: str
    call: dict | None
    text: str


def sandbox_expert(env: Any, seed: int) -> ExpertAgent:
    """The sandbox's expert as a teacher that may take over from any state (the labeller's default)."""
    return ExpertAgent(env, seed, takeover=True)


def sandbox_oracle(env: Any, seed: int) -> ExpertAgent:
    """The sandbox's privileged expert: from a state, is the task still solvable?"""
    return ExpertAgent(env, seed, takeover=True, privileged=True)


class ExpertLabels:
    """The expert as the labeller: one agent per episode (`expert(env, seed)`: the sandbox's
    `ExpertAgent(takeover=True)`, or another env's teacher), told every call made."""

    name = "expert"

    def __init__(self, expert: Callable[[Any, int], Any] = sandbox_expert):
        self.expert = expert
        self.agents: dict[int, Any] = {}

    def start(self, episode: int, env: Any, seed: int) -> None:
        self.agents[episode] = self.expert(env, seed)

    def observe(self, episode: int, call: dict | None, info: dict, observation: str) -> None:
        self.agents[episode].observe(call, info, observation)

    def label(self, requests: list[Request]) -> list[TeacherLabel | ModelError]:
        out = []
        for r in requests:
            thought, call = self.agents[r.episode].act(r.info)
            out.append(TeacherLabel(thought, call, thought + "\n" + render_tool_call(call["name"], call["arguments"])))
        return out


class ModelLabels:
    """A chat model as the labeller, asked with the prompt the student saw (one batched call per round)."""

    def __init__(self, client, name: str | None = None, tools: list[dict] | None = None):
        self.policy = ChatPolicy(client, name=name, tools=tools)
        self.name = self.policy.name

    def start(self, episode: int, env: Any, seed: int) -> None:
        pass

    def observe(self, episode: int, call: dict | None, info: dict, observation: str) -> None:
        pass

    def label(self, requests: list[Request]) -> list[TeacherLabel | ModelError]:
        out = []
        for reply in self.policy.act(requests):
            if isinstance(reply, ModelError):
                out.append(reply)
                continue
            action = reply.action if reply.action is not None else parse_action(reply.text)
            call = action.as_dict() if isinstance(action, ToolCall) else None
            out.append(TeacherLabel(action.reasoning, call, reply.text or ""))
        return out


def make_labeller(teacher: str | ClientSpec, client=None, expert: Callable[[Any, int], Any] = sandbox_expert,
                  tools: list[dict] | None = None):
    """The labeller a recipe names: `expert` (made by `expert(env, seed)`), or a client spec (`client` overrides
    the client it would build; `tools`: the skills as the env offers them)."""
    if teacher == "expert":
        return ExpertLabels(expert)
    from agent.clients import make_client
    from distill.teacher import teacher_name
    return ModelLabels(client if client is not None else make_client(teacher), name=teacher_name(teacher),
                       tools=tools)


# ----------------------------------------------------------------------------- the student drives


@dataclass
class Label:
    """One state the student reached: its prompt, what the student wrote, and the teacher's label there."""

    episode: int
    step: int
    messages: list[dict]
    student_text: str
    student_call: dict | None
    teacher: TeacherLabel | None      # None: the teacher's call failed (`error` says how)
    error: str | None
    executed: Literal["student", "teacher"]

    @property
    def agreed(self) -> bool:
        return self.teacher is not None and same_call(self.student_call, self.teacher.call)


def _call_of(reply: Reply) -> dict | None:
    action = reply.action if reply.action is not None else parse_action(reply.text)
    if isinstance(action, ToolCall):
        return action.as_dict()
    return action if isinstance(action, dict) else None


class DAggerPolicy:
    """The episode loop's policy for on-policy distillation: the student answers every state; the teacher
    labels it; with probability `beta` the teacher's action is executed instead. `labels` collects one `Label`
    per state, in the order played."""

    reads_prompt = True

    def __init__(self, student, teacher, beta: float = 0.0, seed: int = 0, name: str = "student"):
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta is a probability in [0, 1], not {beta}")
        self.student, self.teacher, self.beta, self.seed, self.name = student, teacher, beta, seed, name
        self.labels: list[Label] = []
        self.executed: dict[int, dict | None] = {}   # per episode: the call the env read last (told to the teacher)

    def start(self, episode: int, env: Any, seed: int) -> None:
        self.student.start(episode, env, seed)
        self.teacher.start(episode, env, seed)
        self.executed.pop(episode, None)

    def _teacher_acts(self, request: Request) -> bool:
        """DAgger's coin for one state: a function of the run seed, the episode seed and the step alone."""
        if self.beta <= 0.0:
            return False
        digest = hashlib.sha256(f"beta|{self.seed}|{request.seed}|{request.step}".encode()).digest()
        return int.from_bytes(digest[:8], "little") / 2**64 < self.beta

    def act(self, requests: list[Request]) -> list[Reply | ModelError]:
        for r in requests:
            if r.episode in self.executed:   # what the last call did, before the teacher labels this state
                self.teacher.observe(r.episode, self.executed[r.episode], r.info, r.observation)
        student = self.student.act(requests)
        teacher = self.teacher.label(requests)
        out: list[Reply | ModelError] = []
        for r, s, t in zip(requests, student, teacher, strict=True):
            if isinstance(s, ModelError):       # the student's backend failed: the episode stops, unrecorded
                out.append(s)
                continue
            label = t if isinstance(t, TeacherLabel) else None
            error = None if label is not None else f"{type(t).__name__}: {str(t)[:200]}"
            if label is not None and label.call is None:
                error = "unreadable: the teacher's reply has no readable call"
            use_teacher = error is None and self._teacher_acts(r)
            reply = Reply(text=label.text) if use_teacher else s
            self.labels.append(Label(episode=r.episode, step=r.step, messages=r.messages, student_text=s.text or "",
                                     student_call=_call_of(s), teacher=label, error=error,
                                     executed="teacher" if use_teacher else "student"))
            self.executed[r.episode] = label.call if use_teacher else _call_of(s)
            out.append(reply)
        return out


@dataclass
class Collected:
    """What one round of play and labelling gave."""

    played: Played
    labels: list[Label]
    rows: dict[str, list[dict]]                 # {split: rows of the `onpolicy` config}
    stats: dict = field(default_factory=dict)


def collect(make_env: Callable[[], Any], student, labeller, tasks: list[TaskInstance], seed: int, round_no: int,
            beta: float = 0.0, batch_size: int = 32, validation: set[str] | None = None, teacher_name: str = "expert",
            max_error_share: float = 0.0, progress: Callable[[int], None] | None = None) -> Collected:
    """Round `round_no`: the student policy plays every task once (episode seeds from `round_seed`) while the
    labeller labels every state; returns the episodes, the labels and the `onpolicy` rows. Rows of tasks whose
    instruction is in `validation` go to the validation split. Raises `OnPolicyError` when more than
    `max_error_share` of the labels failed."""
    policy = DAggerPolicy(student, labeller, beta=beta, seed=seed)
    starts = [({"task": t}, round_seed(seed, round_no, t.id)) for t in tasks]
    played = play(make_env, policy, starts, batch_size=batch_size,
                  on_done=(lambda i, e: progress(1)) if progress else None)
    labels = policy.labels
    errors = sum(lb.error is not None and not lb.error.startswith("unreadable") for lb in labels)
    unreadable = sum(lb.error is not None and lb.error.startswith("unreadable") for lb in labels)
    if labels and (errors + unreadable) / len(labels) > max_error_share:
        first = next(lb.error for lb in labels if lb.error)
        raise OnPolicyError(f"round {round_no}: {errors + unreadable} of {len(labels)} teacher labels failed (first: "
                            f"{first}); onpolicy.max_teacher_error_share is {max_error_share}")
    rows = label_rows(played, labels, tasks, round_no, teacher_name, validation or set(),
                      tools=getattr(student, "tools", None))
    trajs = played.trajectories
    labelled = [lb for lb in labels if lb.teacher is not None and lb.teacher.call is not None]
    stats = {"round": round_no, "beta": beta, "episodes": len(trajs), "states": len(labels),
             "rows": {s: len(v) for s, v in rows.items()},
             "agreement": round_(sum(lb.agreed for lb in labelled) / max(len(labelled), 1)),
             "student_unreadable": round_(sum(lb.student_call is None for lb in labels) / max(len(labels), 1)),
             "teacher_steps": sum(lb.executed == "teacher" for lb in labels),
             "teacher_errors": errors, "teacher_unreadable": unreadable,
             "student_tsr": round_(sum(t.success for t in trajs) / max(len(trajs), 1)),
             "policy_seconds": round_(played.policy_seconds, 2), "env_seconds": round_(played.env_seconds, 2)}
    return Collected(played=played, labels=labels, rows=rows, stats=stats)


def round_(x: float, n: int = 4) -> float:
    return round(float(x), n)


class OnPolicyError(RuntimeError):
    """A round cannot go on (too many failed teacher labels, inputs that changed under a resume)."""


def label_rows(played: Played, labels: list[Label], tasks: list[TaskInstance], round_no: int, teacher: str,
               validation: set[str], tools: list[dict] | None = None) -> dict[str, list[dict]]:
    """The `onpolicy` rows of a round, {split: rows} in task order then step (whatever the batching): one per
    state with a readable teacher label (the columns of the `step` config, plus `round`, `student_action` and
    `agreed`). `tools`: the skills as the env offers them (default: the sandbox's)."""
    tools = tool_definitions() if tools is None else tools
    rows: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for lb in sorted(labels, key=lambda x: (x.episode, x.step)):
        if lb.teacher is None or lb.teacher.call is None:
            continue
        traj = played.episodes[lb.episode].trajectory
        task = tasks[lb.episode]
        prompt = step_prompt(lb.messages, f"round {round_no} task {task.id} step {lb.step}")
        split = "validation" if task.instruction_id in validation else "train"
        rows[split].append({
            "messages": prompt + [call_message(lb.teacher.reasoning, lb.teacher.call, lb.step)], "tools": tools,
            "task_id": task.id, "instruction_id": task.instruction_id, "difficulty": task.difficulty,
            "scene": task.scene, "kind": task.kind, "teacher": teacher, "episode_score": float(traj.success),
            "step": lb.step, "round": round_no, "student_action": lb.student_text, "agreed": lb.agreed})
    return rows


# ----------------------------------------------------------------------------- how recoverable are its states


class _PerEpisode(ScriptedPolicy):
    """A scripted policy whose agent for episode i comes from `factories[i]`."""

    def __init__(self, factories: list[Callable], name: str):
        super().__init__(None, name)
        self.factories = factories

    def start(self, episode: int, env: Any, seed: int) -> None:
        self.agents[episode] = self.factories[episode](env, seed)
        self.pending.pop(episode, None)


def replayed_calls(traj: Trajectory, upto: int) -> list:
    """The first `upto` calls of an episode as the env read them: call dicts, or the unreadable text."""
    return [t.tool_call if t.tool_call is not None else (t.raw_output or "") for t in traj.turns[:upto]]


def takeover(make_env: Callable[[], Any], trajectories: list[Trajectory], tasks: dict[str, TaskInstance],
             seed: int, episodes: int, batch_size: int = 64, expert: Callable[[Any, int], Any] = sandbox_expert,
             oracle: Callable[[Any, int], Any] = sandbox_oracle) -> dict:
    """At a random step of up to `episodes` student episodes (seeded), the expert takes over and plays to the
    end of the task's budget; the privileged oracle does the same from the same state. Returns the expert's
    success rate, the oracle's (the share of states from which the task was still solvable), the expert's among
    the solvable ones, and the cases the expert lost although the oracle won. `expert(env, seed)` and
    `oracle(env, seed)` make them (the sandbox's by default; TextWorld's teacher and the game's own plan)."""
    rng = random.Random(seed)
    picked = sorted(rng.sample(range(len(trajectories)), min(episodes, len(trajectories))))
    cases = []
    for i in picked:
        traj = trajectories[i]
        cases.append((traj, rng.randint(0, max(len(traj.turns) - 1, 0))))
    if not cases:
        return {"episodes": 0}
    starts = [({"task": tasks[t.task_id]}, t.seed) for t, _ in cases]

    def runs(privileged: bool) -> list[bool]:
        then = oracle if privileged else expert
        factories = [(lambda env, s, c=replayed_calls(t, k): ReplayAgent(env, s, c, then=then)) for t, k in cases]
        played = play(make_env, _PerEpisode(factories, "oracle" if privileged else "expert"), starts,
                      batch_size=batch_size)
        return [t.success for t in played.trajectories]

    expert, oracle = runs(False), runs(True)
    solvable = [e for e, o in zip(expert, oracle, strict=True) if o]
    lost = [{"task_id": t.task_id, "seed": t.seed, "step": k}
            for (t, k), e, o in zip(cases, expert, oracle, strict=True) if o and not e]
    return {"episodes": len(cases), "expert_success": round_(sum(expert) / len(cases)),
            "oracle_success": round_(sum(oracle) / len(cases)),
            "expert_success_when_solvable": round_(sum(solvable) / max(len(solvable), 1)),
            "solvable": len(solvable), "lost_when_solvable": lost}
