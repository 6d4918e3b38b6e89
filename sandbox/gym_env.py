"""Gymnasium env `embodistill/Sandbox-v0`: one task per episode, one skill call per step.

    import gymnasium as gym, sandbox
    env = gym.make("embodistill/Sandbox-v0")
    obs, info = env.reset(seed=0, options={"task": task})          # a TaskInstance or its dict
    obs, reward, terminated, truncated, info = env.step({"name": "navigate", "arguments": {"target": "hall"}})

The env is the contract between the sandbox and everything above it: the episode loop (`agent.episode`), its
recorder, the judges and the prompt builder read what they need from `info`; nothing outside `sandbox/`
reaches into the controller.

An action is a skill call `{"name": SKILL, "arguments": {...}}`, which the EnvController validates (a bad call
gets a typed error observation, never an exception), or `{"parse_error": MESSAGE}` when the agent's output held
no readable call: the step counts and the observation says why (the episode loop parses model text once,
with `agent.parser`, and passes one of the two).

`info`, after `reset` and after every `step`:

    state_key        a stable hash of the state that matters (GiGPO's anchor states)
    steps            steps taken so far; `step_budget` the task's budget (the episode is truncated there)
    error, trigger   the error code of the step (None when it worked) and the trigger that fired, if any
    success          whether the task is done (set when the agent calls `finish`)
    subgoals_met     the subgoal ids this step met (after `reset`: those the initial state already meets)
    subgoals_done    how many subgoals are met so far, of `subgoals_total`
    place, holding   where the agent is and what it holds
    learned          the facts the agent's belief gained this step, sorted (`seen:ID`, `locked:ID`, ...)
    known            the agent's belief as the prompt builder renders it (`agent.prompt.render_known`), a
                     mapping computed when first read: read it before the next step
    human_reply      what a person said when the step talked to someone or asked for help, else None
    answer           the answer of a `report` the controller accepted, else None

`reset` adds `task`: id, instruction, difficulty, scene, subgoals ([{id, description, kind}]), optimal_steps,
step_budget: what a trajectory records about its episode; and `procedure`, the plan as steps for the finer
instruction granularities (`task_procedure`, `agent.instructions`). The reward is the sandbox's own signal, 1.0 when
the episode ends in success, else 0.0 (the reward engine adds turn-level rewards on top).
"""

from __future__ import annotations

import string
from typing import Any

import gymnasium as gym
from gymnasium import spaces

from sandbox.controller import EnvController
from sandbox.observation import KnownMap
from sandbox.schema import TaskInstance
from sandbox.skills import HELP_SKILLS, StepResult
from sandbox.text import normalize
from sandbox.world import Compiled

_CHARSET = string.printable


def _says(text: str, phrase: str) -> bool:
    return bool(normalize(phrase)) and f" {normalize(phrase)} " in f" {normalize(text)} "


def _named(task: TaskInstance, eid: str) -> tuple[str, str]:
    """How the instruction names a thing a subgoal is about: (the words a step says, the words to look it up by
    in the known map). An object the instruction names by its owner ("Grandpa Joe's phone") is said so and looked
    up by its kind ("phone": every phone the agent has seen): which phone is his is on its name tag, which the
    agent reads by inspecting it, so neither its colour nor its id may say so."""
    st = task.env_state
    place = next((p.name for p in st.places if p.id == eid), None)
    if place is not None:
        return place, place
    o = next((o for o in st.objects if o.id == eid), None)
    if o is None:                              # a door: the instruction names it as its id reads
        return eid.replace("_", " "), eid
    kind = o.type.replace("_", " ")
    words = next((w for w in (o.name, f"{o.color} {kind}" if o.color else "", kind)
                  if w and _says(task.instruction, w)), kind)
    owner = next((p.name for p in st.people if p.id == o.owner), None)
    if owner and _says(task.instruction, f"{owner}'s {words}"):
        return f"{owner}'s {words}", words
    return f"the {words}", words


def task_procedure(task: TaskInstance) -> list[dict]:
    """The task's plan as ordered steps for `--instructions step|visual`: its subgoals in order, then finish, each
    `{"text", "things"}` (the words of what the step names, which `agent.instructions` looks up in the agent's
    known map for visual anchors). A step names things as the instruction does (a subgoal's description may name
    an object by what only inspecting it shows, such as the colour of Grandpa Joe's phone), and a report's step
    says "report the answer" (its description holds the answer: "report that it is in the west room")."""
    steps = []
    for g in task.subgoals:
        p = g.predicate
        if p.kind == "reported":
            steps.append({"text": "report the answer", "things": []})
            continue
        text, things = g.description, []
        for field in ("object", "other", "place", "door", "location"):
            eid = getattr(p, field, None)
            if not eid:
                continue
            said, words = _named(task, eid)
            o = next((o for o in task.env_state.objects if o.id == eid), None)
            if o is not None and not _says(text, said):
                text = text.replace(f"the {o.name}", said).replace(o.name, said)
            things.append(words)
        steps.append({"text": text, "things": things})
    return steps + [{"text": "finish", "things": []}]


class SandboxEnv(gym.Env):
    """`reset(seed, options={"task": TaskInstance | dict})`; `step(call)`. See the module docstring for `info`."""

    metadata = {"render_modes": ["ansi"]}
    cache_size = 4096  # compiled tasks kept per env (a split cycles through the same tasks)

    def __init__(self, task: TaskInstance | dict | None = None, render_mode: str | None = None,
                 human_factory=None):
        # human_factory(compiled) -> HumanAgent: who answers the agent (default: the rule persona); the
        # LLM-worded persona (agent.llm_persona) plugs in here
        self.human_factory = human_factory
        self.observation_space = spaces.Text(max_length=16_384, charset=_CHARSET)
        self.action_space = spaces.Dict({"name": spaces.Text(max_length=64, charset=_CHARSET),
                                         "arguments": spaces.Dict({})})
        self.render_mode = render_mode
        self._compiled: Compiled | None = None
        self._source: Any = None
        self.ctrl: EnvController | None = None
        self._last_obs = ""
        self.last_result: StepResult | None = None  # the controller's result of the last step (None after reset)
        self._cache: dict[int, tuple] = {}   # id(task) -> (task, Compiled, EnvController)
        self._pending_seed: int | None = None
        self._known: KnownMap | None = None    # the last step's belief map, read lazily
        if task is not None:
            self._use(task)

    def _use(self, task: TaskInstance | dict) -> None:
        if task is self._source and self._compiled is not None:
            return  # same object as last episode: reuse the compiled tables
        if isinstance(task, TaskInstance):
            hit = self._cache.get(id(task))
            if hit is not None and hit[0] is task:  # compiled before (the cache keeps the object alive)
                self._source, self._compiled, self.ctrl = task, hit[1], hit[2]
                return
        if isinstance(task, dict):
            task_obj = TaskInstance.model_validate(task)
        elif isinstance(task, TaskInstance):
            task_obj = task
        else:
            raise TypeError(f"options['task'] must be a TaskInstance or a dict, not {type(task).__name__}")
        self._compiled = Compiled(task_obj)
        self._source = task
        self.ctrl = self._controller(self._compiled)
        if isinstance(task, TaskInstance):
            if len(self._cache) >= self.cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[id(task)] = (task, self._compiled, self.ctrl)

    def _controller(self, compiled: Compiled) -> EnvController:
        human = self.human_factory(compiled) if self.human_factory else None
        return EnvController(compiled, human=human)

    @property
    def task(self) -> TaskInstance:
        if self._compiled is None:
            raise RuntimeError("no task: call reset(options={'task': ...}) first")
        return self._compiled.task

    @property
    def np_random(self):
        # The sandbox itself is deterministic; a seeded generator is only made if someone asks for it
        # (creating one on every reset would cost more than the reset).
        if self._np_random is None:
            from gymnasium.utils import seeding
            self._np_random, self._np_random_seed = seeding.np_random(self._pending_seed)
        return self._np_random

    @np_random.setter
    def np_random(self, value) -> None:
        self._np_random = value

    # ------------------------------------------------------------------ the contract

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self._pending_seed, self._np_random = seed, None
        if options and "task" in options:
            self._use(options["task"])
        if self._compiled is None:
            raise ValueError("SandboxEnv.reset needs options={'task': TaskInstance or dict} the first time")
        if self.ctrl is None or self.ctrl.compiled is not self._compiled:
            self.ctrl = self._controller(self._compiled)
        self._last_obs = self.ctrl.reset()
        self.last_result = None
        task = self.task
        info = self._info(StepResult(ok=True, observation=self._last_obs, subgoals_met=list(self.ctrl.reset_subgoals),
                                     state_key=self.ctrl.state_key()), learned=sorted(self.ctrl.world.learned))
        info["task"] = {"id": task.id, "instruction": task.instruction, "difficulty": task.difficulty,
                        "scene": task.scene, "optimal_steps": task.optimal_steps, "step_budget": task.step_budget,
                        "subgoals": [{"id": g.id, "description": g.description, "kind": g.predicate.kind}
                                     for g in task.subgoals], "procedure": task_procedure(task)}
        return self._last_obs, info

    def step(self, action: dict):
        if self.ctrl is None:
            raise RuntimeError("call reset() before step()")
        ctrl = self.ctrl
        if self._known is not None:
            self._known.expire()   # the world changes now
        before = set(ctrl.world.learned)
        if isinstance(action, dict) and "parse_error" in action and "name" not in action:
            if ctrl.done:
                res = ctrl.step(None)
            else:
                ctrl.steps += 1
                res = StepResult(ok=False, observation=f"I could not read a skill call: {action['parse_error']}.",
                                 error="parse_error", state_key=ctrl.state_key())
        else:
            res = ctrl.step(action)
        self._last_obs = res.observation
        self.last_result = res
        terminated = ctrl.done
        truncated = not terminated and ctrl.steps >= self._compiled.task.step_budget
        reward = 1.0 if (terminated and ctrl.success) else 0.0
        info = self._info(res, learned=sorted(ctrl.world.learned - before))
        name = action.get("name") if isinstance(action, dict) else None
        info["human_reply"] = res.observation if name in HELP_SKILLS and " says: " in res.observation else None
        if name == "report" and res.error is None and isinstance(action.get("arguments"), dict):
            info["answer"] = action["arguments"].get("answer")
        return res.observation, reward, terminated, truncated, info

    def _info(self, res: StepResult, learned: list[str]) -> dict:
        ctrl, world = self.ctrl, self.ctrl.world
        done, total = ctrl.subgoal_progress()
        self._known = KnownMap(world)
        return {"state_key": res.state_key, "steps": ctrl.steps, "step_budget": self._compiled.task.step_budget,
                "error": res.error, "trigger": res.trigger, "success": ctrl.success,
                "subgoals_met": res.subgoals_met, "subgoals_done": done, "subgoals_total": total,
                "place": world.agent_place, "holding": list(world.holding), "learned": learned,
                "known": self._known, "human_reply": None, "answer": None}

    def render(self):
        return self._last_obs
