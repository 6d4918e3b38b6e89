"""Gymnasium env `embodistill/Sandbox-v0`: one task per episode, actions are tool calls or model text."""

from __future__ import annotations

import string
from typing import Any

import gymnasium as gym
from gymnasium import spaces

from sandbox.controller import EnvController, StepResult
from sandbox.observation import known_map
from sandbox.schema import TaskInstance
from sandbox.world import Compiled

_CHARSET = string.printable


class SandboxEnv(gym.Env):
    """`reset(seed, options={"task": TaskInstance | dict})`; `step(action)` with a dict tool call or raw text.

    The observation is the text the agent may see this step; `known()` gives the agent's belief map for the
    prompt builder. `info` carries `state_key`, `error` (None or a code), `subgoals_met`, `success`.
    Reward is the sandbox's own signal: 1.0 when the episode ends in success, else 0.0 (the reward engine
    adds turn-level rewards on top).
    """

    metadata = {"render_modes": ["ansi"]}
    cache_size = 4096  # compiled tasks kept per env (a split cycles through the same tasks)

    def __init__(self, task: TaskInstance | dict | None = None, render_mode: str | None = None,
                 human_factory=None):
        # human_factory(compiled) -> HumanAgent: who answers the agent (default: the rule persona); the
        # LLM-worded persona (sandbox.llm_persona) plugs in here
        self.human_factory = human_factory
        self.observation_space = spaces.Text(max_length=16_384, charset=_CHARSET)
        self.action_space = spaces.Text(max_length=4_096, charset=_CHARSET)
        self.render_mode = render_mode
        self._compiled: Compiled | None = None
        self._source: Any = None
        self.ctrl: EnvController | None = None
        self._last_obs = ""
        self.last_result: StepResult | None = None  # the controller's result of the last step (None after reset)
        self._cache: dict[int, tuple] = {}
        self._pending_seed: int | None = None   # id(task) -> (task, Compiled, EnvController)
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
        info = {"state_key": self.ctrl.state_key(), "error": None, "subgoals_met": [], "success": False,
                "steps": 0}
        return self._last_obs, info

    def step(self, action: Any):
        if self.ctrl is None:
            raise RuntimeError("call reset() before step()")
        ctrl = self.ctrl
        if isinstance(action, dict) and "tool_calls" not in action:
            res = ctrl.step(action)
        else:
            from agent.parser import ParseError, parse_action
            parsed = parse_action(action)
            if isinstance(parsed, ParseError):
                if ctrl.done:
                    res = ctrl.step(None)
                else:
                    ctrl.steps += 1
                    res = StepResult(ok=False, observation=f"I could not read a skill call: {parsed.message}.",
                                     error="parse_error", state_key=ctrl.state_key())
            else:
                res = ctrl.step(parsed.as_dict())
        self._last_obs = res.observation
        self.last_result = res
        terminated = ctrl.done
        truncated = not terminated and ctrl.steps >= self._compiled.task.step_budget
        reward = 1.0 if (terminated and ctrl.success) else 0.0
        info = {"state_key": res.state_key, "error": res.error, "subgoals_met": res.subgoals_met,
                "success": ctrl.success, "steps": ctrl.steps, "trigger": res.trigger}
        return res.observation, reward, terminated, truncated, info

    def known(self) -> dict:
        """The agent's belief: known map, last-known positions, learned facts (what the prompt shows)."""
        return known_map(self.ctrl.w)

    def render(self):
        return self._last_obs
