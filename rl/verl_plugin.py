"""GiGPO on verl (the `verl` extra, verl 0.9.x): the project's estimator, sandbox agent loop and trainer mode,
registered through verl's own registries.

    embodistill verl-data recipes/gpu/qwen2.5-1.5b-gigpo.yaml --out data/verl/qwen2.5-1.5b-gigpo
    python -m verl.trainer.main_ppo algorithm.adv_estimator=gigpo trainer.v1.trainer_mode=embodistill_gigpo \\
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=pipeline.verl.register ...

(the full, commented command line is in recipes/gpu/README.md). `register(setup_loader)` adds, idempotently:

  adv estimator "gigpo"               `verl.trainer.ppo.core_algos.register_adv_est`
                                      -> `compute_gigpo_advantage` (an adapter to `rl.gigpo`)
  agent loop "embodistill_sandbox"    `verl.experimental.agent_loop.agent_loop.register`
                                      -> `SandboxAgentLoop` (one sandbox episode, one output row per step)
  v1 trainer mode "embodistill_gigpo" `verl.trainer.ppo.v1.register_trainer`
                                      -> `VerlGiGPOTrainer` (verl's sync trainer + the per-step inputs)

Rows. The project's agent acts step by step from a fresh prompt (`agent.prompt.build_step_messages`: task,
memory, observation), so a verl row is one decision: the step prompt's ids and the generated ids, exactly as the
policy saw and wrote them (token in / token out, tokenized as `rl.engines` does, never re-tokenized). The agent
loop returns the episode's rows as a list, which verl's v1 (TransferQueue) agent-loop worker stores under the keys
`{uid}_{session_id}_{step}`: uid is the prompt (one task, one initial state: the episode group), session_id one
of the `rollout.n` episodes played from it.

Why a trainer mode. verl 0.9.1 hands a registered estimator only token_level_rewards, response_mask, index (the
uid) and config (`verl.trainer.ppo.ray_trainer.compute_advantage`), and the v1 trainer's `_compute_advantage`
fetches a fixed list of fields. GiGPO also needs, per row, its trajectory, step index, anchor state and step
reward. `VerlGiGPOTrainer` is verl's `PPOTrainerSync` whose `_compute_advantage` reads them (trajectory and step
from the row keys, anchor and step reward from the rows' `extra_fields`), publishes them for the estimator and
then runs verl's own `_compute_advantage` unchanged; nothing else differs from `trainer_mode=sync`.

Rewards. verl copies the last row's `reward_score` onto every row of a trajectory, so each row's
token_level_rewards sum to the episode return R(tau) (the episode-level signal, as in verl's GRPO); the step
reward r_t travels in `extra_fields["step_reward"]`. Both follow `rl.trainer.rollout_rewards` and the recipe's
`rl.reward` mix, so they are the numbers the project's own trainer uses.

verl is imported only inside functions here (and when `SandboxAgentLoop` / `VerlGiGPOTrainer` are first looked
up), so importing this module, and every other module of the project, works without it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import numpy as np

from agent.episode import Episode, Reply
from agent.tools import tool_definitions
from rl.config import GiGPOConfig
from rl.engines import ChatTokens
from rl.gigpo import anchor_state_groups, compute_gigpo_advantages
from rl.rollout import RolloutBatch, StepSample
from rl.trainer import rollout_rewards
from sandbox.gym_env import SandboxEnv
from sandbox.schema import TaskInstance

logger = logging.getLogger(__name__)

ESTIMATOR_NAME = "gigpo"
AGENT_LOOP_NAME = "embodistill_sandbox"
TRAINER_MODE = "embodistill_gigpo"
MIN_VERL = "0.9.1"

# The per-row inputs GiGPO needs beyond verl's own tensors: the names of the estimator's keyword arguments, of the
# `non_tensor_batch` columns it reads, and of the `extra_fields` keys the agent loop writes.
STEP_FIELDS = ("traj_uid", "step_idx", "anchor_key", "step_reward")

_PUBLISHED: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "embodistill_gigpo_step_inputs", default=None)


# ------------------------------------------------------------------------------------------------ verl imports


def _verl(module: str) -> Any:
    """Import a verl module, or say how to install verl."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"rl.verl_plugin needs verl>={MIN_VERL} ({module} could not be imported: {e}). Install "
                          "the verl extra: pip install -e '.[verl]' (and, for training, verl's own `vllm` extra; "
                          "see recipes/gpu/README.md)") from e
    version = getattr(importlib.import_module("verl"), "__version__", None)
    if version is not None:
        from packaging.version import Version
        if Version(version) < Version(MIN_VERL):
            raise ImportError(f"rl.verl_plugin needs verl>={MIN_VERL}, found {version}: pip install -e '.[verl]'")
    return mod


# ------------------------------------------------------------------------------------------------ the estimator


def _setting(config: Any, key: str) -> Any:
    """config[key] for verl's algorithm config (a DictConfig or an AlgoConfig) or a dict; None when absent."""
    if config is None:
        return None
    get = getattr(config, "get", None)
    if callable(get):
        return get(key, None)
    return getattr(config, key, None)


def gigpo_settings(config: Any = None, gamma: float | None = None, step_weight: float | None = None,
                   normalize: str | None = None, eps: float | None = None) -> dict[str, Any]:
    """The GiGPO settings of a call: explicit arguments (the estimator's, else those published by
    `VerlGiGPOTrainer` from verl's top-level `gigpo:` config section), else verl's `algorithm` config, else the
    project's defaults (`rl.config.GiGPOConfig`).

        gamma        algorithm.gamma                       (verl's discount factor; the recipe sets 0.95)
        normalize    algorithm.norm_adv_by_std_in_grpo     (True: "mean_std", False: "mean", as in verl's GRPO)
        step_weight  gigpo.step_weight                     (omega)
        eps          gigpo.eps

    step_weight and eps live in their own top-level section, not in `algorithm`, because verl's `AlgoConfig`
    dataclass refuses keys it does not know.
    """
    defaults = GiGPOConfig.model_fields
    if gamma is None:
        gamma = _setting(config, "gamma")
        gamma = defaults["gamma"].default if gamma is None else gamma
    if normalize is None:
        by_std = _setting(config, "norm_adv_by_std_in_grpo")
        normalize = defaults["normalize"].default if by_std is None else ("mean_std" if by_std else "mean")
    step_weight = defaults["step_weight"].default if step_weight is None else step_weight
    eps = 1e-6 if eps is None else eps
    return {"gamma": float(gamma), "step_weight": float(step_weight), "normalize": str(normalize), "eps": float(eps)}


def _column(values: Any, name: str, n: int) -> np.ndarray:
    """One entry per row as a 1-D numpy array; strings become a unicode array (not object), which
    `rl.gigpo` codes fastest (16-digit hex state keys are parsed, not sorted)."""
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.dtype == object:
        arr = np.asarray([v.item() if isinstance(v, np.generic) else v for v in arr.tolist()])
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"gigpo: {name} must have one entry per row ({n} rows), got shape {arr.shape}")
    return arr


@contextlib.contextmanager
def published_step_inputs(inputs: Mapping[str, Any], step_weight: float | None = None,
                          eps: float | None = None) -> Iterator[None]:
    """Within the block, `compute_gigpo_advantage` takes the per-row inputs it was not given from `inputs`
    (a mapping with the `STEP_FIELDS`), and step_weight / eps when given here. This is how `VerlGiGPOTrainer`
    reaches the estimator through verl's `compute_advantage`, which passes it only verl's own tensors."""
    missing = [f for f in STEP_FIELDS if f not in inputs]
    if missing:
        raise ValueError(f"published_step_inputs: missing {missing}; need {list(STEP_FIELDS)}")
    token = _PUBLISHED.set({"rows": {f: np.asarray(inputs[f]) for f in STEP_FIELDS},
                            "settings": {"step_weight": step_weight, "eps": eps}})
    try:
        yield
    finally:
        _PUBLISHED.reset(token)


def compute_gigpo_advantage(token_level_rewards, response_mask, index=None, config=None, *, traj_uid=None,
                            step_idx=None, anchor_key=None, step_reward=None, non_tensor_batch=None,
                            gamma=None, step_weight=None, normalize=None, eps=None, reward_baselines=None):
    """GiGPO advantages for a verl batch whose rows are agent steps; registered with verl as "gigpo".

    A(a_t^(i)) = A^E(tau_i) + omega * A^S(a_t^(i)) (Feng et al., arXiv:2505.10978), computed by
    `rl.gigpo.compute_gigpo_advantages` on one entry per row, then broadcast over the row's response tokens and
    masked, as verl's other outcome estimators return it.

    Inputs (B rows, L response tokens):
        token_level_rewards  (B, L) verl's rewards; a row's sum is the episode return R(tau) of its trajectory
                             (equal on all rows of a trajectory: `SandboxAgentLoop` sets every row's
                             reward_score to R(tau); with `algorithm.use_kl_in_reward` the sums would differ,
                             use the actor's KL loss instead)
        response_mask        (B, L) 1 on the tokens the policy generated
        index                (B,) the episode group of each row: verl's `uid`, one prompt = one task and initial
                             state, played `rollout.n` times
        config               verl's `algorithm` config (gamma, norm_adv_by_std_in_grpo; see `gigpo_settings`);
                             explicit gamma / step_weight / normalize / eps arguments override it
        traj_uid             (B,) the trajectory of each row ("{uid}_{session_id}" in verl's v1 keys)
        step_idx             (B,) the row's step index within its trajectory (ints)
        anchor_key           (B,) the env state key the step acted from (`info["state_key"]` before the step)
        step_reward          (B,) r_t, the step's reward (the judge's turn score mix; the last step adds the
                             terminal reward), discounted with gamma into the step return R_t
    Each of traj_uid, step_idx, anchor_key, step_reward is taken from, in order: the keyword argument, the
    `non_tensor_batch` column of that name (with `uid` there standing in for `index`), or the inputs published by
    `published_step_inputs` (what `VerlGiGPOTrainer` does). `reward_baselines` is accepted, as verl may pass it,
    and not used.

    Returns (advantages, returns): (B, L) tensors of token_level_rewards' dtype and device, the row's advantage
    on its response tokens and 0 elsewhere (returns = advantages, as in verl's GRPO).
    """
    import torch

    if token_level_rewards.dim() != 2 or tuple(response_mask.shape) != tuple(token_level_rewards.shape):
        raise ValueError(f"gigpo: token_level_rewards and response_mask must both be (B, L); got "
                         f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}")
    n = int(token_level_rewards.shape[0])
    published = _PUBLISHED.get()
    given = {"traj_uid": traj_uid, "step_idx": step_idx, "anchor_key": anchor_key, "step_reward": step_reward}
    rows: dict[str, np.ndarray] = {}
    for name, value in given.items():
        if value is None and non_tensor_batch is not None and name in non_tensor_batch:
            value = non_tensor_batch[name]
        if value is None and published is not None:
            value = published["rows"][name]
        if value is None:
            raise ValueError(
                f"gigpo: no {name!r} for the {n} rows. GiGPO needs per-row {list(STEP_FIELDS)}, which verl "
                f"{MIN_VERL}'s compute_advantage does not pass to a registered estimator: train with "
                f"trainer.v1.trainer_mode={TRAINER_MODE} (rl.verl_plugin.VerlGiGPOTrainer, which supplies them "
                f"from the {AGENT_LOOP_NAME} agent loop's rows), or pass them as keyword arguments")
        rows[name] = _column(value, name, n)
    if index is None and non_tensor_batch is not None:
        index = non_tensor_batch.get("uid")
    if index is None:
        raise ValueError("gigpo: no index (the episode group of each row: verl's uid)")
    groups = _column(index, "index", n)
    if published is not None:
        step_weight = published["settings"]["step_weight"] if step_weight is None else step_weight
        eps = published["settings"]["eps"] if eps is None else eps
    settings = gigpo_settings(config, gamma, step_weight, normalize, eps)
    with torch.no_grad():
        episode_returns = token_level_rewards.detach().sum(dim=-1).double().cpu().numpy()
    try:
        adv = compute_gigpo_advantages(groups, rows["traj_uid"], rows["step_idx"], rows["anchor_key"],
                                       rows["step_reward"], episode_returns, **settings)
    except ValueError as e:
        raise ValueError(f"gigpo on verl: {e} (per row: index = verl's uid, traj_uid, step_idx, anchor_key, "
                         "step_reward; the episode return is the row's token_level_rewards sum, which must be "
                         "equal on all rows of a trajectory: keep algorithm.use_kl_in_reward=False)") from e
    per_row = torch.as_tensor(adv, dtype=token_level_rewards.dtype, device=token_level_rewards.device)
    advantages = per_row.unsqueeze(-1) * response_mask.to(token_level_rewards.dtype)
    return advantages, advantages.clone()


# ------------------------------------------------------------------------------------------------ v1 batch rows


def step_inputs_from_rows(keys: Sequence[str], extra_fields: Sequence[Any]) -> dict[str, np.ndarray]:
    """Per-row GiGPO inputs of a verl v1 batch, aligned with `keys`.

    `traj_uid` ("{uid}_{session_id}"), `step_idx` and the episode group `uid` come from the TransferQueue keys
    `{uid}_{session_id}_{index}` (verl's own format; its synthetic padding rows follow it too, each its own
    trajectory in its own group); `anchor_key` and `step_reward` from each row's `extra_fields`, as
    `SandboxAgentLoop` writes them (TransferQueue may hand a dict back wrapped, with the dict in `.data`).
    """
    if len(keys) != len(extra_fields):
        raise ValueError(f"{len(keys)} keys but {len(extra_fields)} extra_fields")
    uid, traj, step, anchor, reward = [], [], [], [], []
    for key, extra in zip(keys, extra_fields, strict=True):
        parts = str(key).rsplit("_", 2)
        if len(parts) != 3 or not parts[2].isdigit():
            raise ValueError(f"row key {key!r} is not verl's {{uid}}_{{session_id}}_{{index}}")
        extra = getattr(extra, "data", extra)
        if not isinstance(extra, Mapping) or "anchor_key" not in extra or "step_reward" not in extra:
            raise ValueError(f"row {key}: its extra_fields have no anchor_key / step_reward; GiGPO needs an agent "
                             f"loop that records them per step (the {AGENT_LOOP_NAME} agent loop does)")
        uid.append(parts[0])
        traj.append(f"{parts[0]}_{parts[1]}")
        step.append(int(parts[2]))
        anchor.append(str(extra["anchor_key"]))
        reward.append(float(extra["step_reward"]))
    return {"uid": np.asarray(uid), "traj_uid": np.asarray(traj), "step_idx": np.asarray(step, dtype=np.int64),
            "anchor_key": np.asarray(anchor), "step_reward": np.asarray(reward, dtype=np.float64)}


def anchor_metrics(inputs: Mapping[str, np.ndarray]) -> dict[str, float]:
    """How much step-level signal a batch has: anchor-state step groups and the share of size-1 groups."""
    if len(inputs["uid"]) == 0:
        return {}
    _, stats = anchor_state_groups(inputs["uid"], inputs["anchor_key"])
    return {"gigpo/num_step_groups": float(stats["num_step_groups"]),
            "gigpo/mean_step_group_size": float(stats["mean_group_size"]),
            "gigpo/frac_size1_step_groups": float(stats["frac_size1_groups"]),
            "gigpo/frac_rows_in_size1_step_groups": float(stats["frac_rows_in_size1_groups"])}


def _build_trainer_class() -> type:
    trainer_base = _verl("verl.trainer.ppo.v1.trainer_base")
    v1 = _verl("verl.trainer.ppo.v1")
    from omegaconf import open_dict

    class VerlGiGPOTrainer(v1.PPOTrainerSync):
        """verl's synchronous PPO trainer (`trainer_mode=sync`), plus the per-step GiGPO inputs.

        Selected with `trainer.v1.trainer_mode=embodistill_gigpo`; the config then reads `sync` again, since
        verl's v1 trainer and replay buffer branch on the mode's name. With `algorithm.adv_estimator=gigpo`,
        `_compute_advantage` reads each row's key and extra_fields, publishes `step_inputs_from_rows` (and
        `gigpo.step_weight` / `gigpo.eps` of the config) for the estimator, logs the anchor-group statistics
        (gigpo/*) and runs verl's own `_compute_advantage`.
        """

        def __init__(self, config):
            with open_dict(config):
                config.trainer.v1.trainer_mode = "sync"
            super().__init__(config)

        def _compute_advantage(self, batch, metrics: dict):
            if str(self.config.algorithm.adv_estimator) != ESTIMATOR_NAME:
                return super()._compute_advantage(batch, metrics)
            data = trainer_base.tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                                select_fields=["extra_fields"])
            inputs = step_inputs_from_rows(list(batch.keys), list(data["extra_fields"]))
            metrics.update(anchor_metrics(inputs))
            section = self.config.get("gigpo", None) or {}
            with published_step_inputs(inputs, step_weight=section.get("step_weight", None),
                                       eps=section.get("eps", None)):
                return super()._compute_advantage(batch, metrics)

    VerlGiGPOTrainer.__module__ = __name__
    VerlGiGPOTrainer.__qualname__ = "VerlGiGPOTrainer"
    return VerlGiGPOTrainer


# ------------------------------------------------------------------------------------------------ the agent loop


@dataclass
class EpisodeSetup:
    """What every episode of one run shares in a worker process: the RL settings (memory, step cap, reward
    mix), the seed, the judge (`score(trajectory)`) and who answers the agent (`human_factory`)."""

    config: GiGPOConfig
    seed: int
    rewarder: Any
    human_factory: Any = None


# `register(setup_loader)` sets it: recipe path -> EpisodeSetup (`pipeline.verl.episode_setup` reads a recipe)
_SETUP_LOADER: Callable[[str], EpisodeSetup] | None = None


@functools.lru_cache(maxsize=8)
def _episode_setup(recipe_path: str) -> EpisodeSetup:
    if _SETUP_LOADER is None:
        raise RuntimeError(f"{AGENT_LOOP_NAME}: no episode setup registered in this process; start verl's workers "
                           "with +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=pipeline.verl.register")
    return _SETUP_LOADER(recipe_path)


@functools.lru_cache(maxsize=8)
def _generation_eos_ids(model_path: str) -> tuple[int, ...]:
    """The model's generation_config eos ids (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>), () if unreadable."""
    try:
        from transformers import GenerationConfig
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):
        return ()
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


def episode_seed(task_id: str, index: int, global_steps: int, recipe_seed: int) -> int:
    """The sandbox seed of an episode: equal for all `rollout.n` sessions of one prompt at one training step
    (the sessions of a GiGPO group share the initial state), reproducible across runs."""
    digest = hashlib.sha256(f"{recipe_seed}|{task_id}|{index}|{global_steps}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _plain(value: Any) -> Any:
    """A dataset field as a plain Python value (verl hands them as 0-d tensors, numpy scalars or wrapped)."""
    value = getattr(value, "data", value)
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


def _task_of(value: Any) -> TaskInstance:
    value = _plain(value)
    if isinstance(value, TaskInstance):
        return value
    if isinstance(value, (str, bytes)):
        return TaskInstance.model_validate_json(value)
    if isinstance(value, Mapping):
        return TaskInstance.model_validate(dict(value))
    raise ValueError(f"{AGENT_LOOP_NAME}: the dataset row's `task` must be a TaskInstance JSON string "
                     f"(written by `embodistill verl-data`), got {type(value).__name__}")


def _build_agent_loop_class() -> type:
    agent_loop = _verl("verl.experimental.agent_loop.agent_loop")

    class SandboxAgentLoop(agent_loop.AgentLoopBase):
        """One sandbox episode per call, played through the shared prompt builder; one output row per step.

        Configured by an entry of verl's `actor_rollout_ref.rollout.agent.agent_loop_config_path` file:

            - name: embodistill_sandbox
              _target_: rl.verl_plugin.SandboxAgentLoop
              recipe: recipes/gpu/qwen2.5-1.5b-gigpo.yaml

        The recipe (read by the setup loader `register` was given) gives the judge, the persona mode and
        `rl.reward`, `rl.memory_size`, `rl.max_steps`; verl's config gives sampling, `rollout.prompt_length` (a
        step prompt longer than that is an error, never cut) and `rollout.response_length` (max new tokens per
        step). Dataset rows (`embodistill verl-data`) carry the task as JSON in `task`.

        The episode plays through the one episode loop (`agent.episode.Episode`): each step's prompt from the
        shared builder, ids by the policy's chat template with the project's tools (`rl.engines`' encoding), one
        `server_manager.generate` call, ids kept as generated (cut after the first stop token), the decoded text
        parsed and stepped by `Episode.record`. The state key the step acted from is its anchor. At the end the
        judge scores the trajectory and `rl.trainer.rollout_rewards` gives r_t and R(tau). A trajectory with a
        judge error is not trained on: the loop returns no rows, as the project's trainer drops it.

        Returns a list of `AgentLoopOutput` (verl's v1 agent-loop worker stores each as a row), each with
        reward_score = R(tau) and extra_fields {traj_uid, step_idx, anchor_key, step_reward, reward_extra_info,
        ...}. The judge and the persona run synchronously (fast with the rule backends).
        """

        def __init__(self, *args, recipe: str | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            if not recipe:
                raise ValueError(f"{AGENT_LOOP_NAME}: the agent loop config entry needs `recipe: <recipe YAML>`")
            self.episode = _episode_setup(str(recipe))
            self.prompt_length = int(self.rollout_config.prompt_length)
            self.response_length = int(self.rollout_config.response_length)
            eos = set(_generation_eos_ids(str(self.config.actor_rollout_ref.model.path)))
            if self.tokenizer.eos_token_id is not None:
                eos.add(self.tokenizer.eos_token_id)
            if not eos:
                raise ValueError(f"{AGENT_LOOP_NAME}: the policy has no eos token")
            self.tokens = ChatTokens(self.tokenizer, sorted(eos))
            self.tools = tool_definitions()

        async def run(self, sampling_params: dict[str, Any], **kwargs) -> list:
            if "task" not in kwargs:
                raise ValueError(f"{AGENT_LOOP_NAME}: the dataset row has no `task` column; write the dataset "
                                 "with `embodistill verl-data RECIPE --out DIR`")
            task = _task_of(kwargs["task"])
            setup, cfg = self.episode, self.episode.config
            uid = str(_plain(kwargs.get("uid", "episode")))
            session = int(_plain(kwargs.get("session_id", 0)))
            seed = episode_seed(task.id, int(_plain(kwargs.get("index", 0))),
                                int(_plain(kwargs.get("global_steps", 0)) or 0), setup.seed)
            priority = int(_plain(kwargs.get("priority", 0)) or 0)
            request_id = uuid4().hex   # one per episode: verl routes its steps to one server (prefix cache)

            episode = Episode(SandboxEnv(human_factory=setup.human_factory), "student", seed, {"task": task},
                              memory_size=cfg.memory_size, max_steps=cfg.max_steps)
            gen_info: list[dict[str, Any]] = []
            while not episode.done:
                request = episode.request()
                prompt_ids = self.tokens.encode(request.messages, self.tools)
                if len(prompt_ids) > self.prompt_length:
                    raise ValueError(f"{AGENT_LOOP_NAME}: step {request.step} of task {task.id} has a "
                                     f"{len(prompt_ids)}-token prompt, over actor_rollout_ref.rollout.prompt_length"
                                     f"={self.prompt_length}; raise data.max_prompt_length (a cut prompt would "
                                     "differ from what the policy sees at evaluation)")
                t0 = time.perf_counter()
                out = await self.server_manager.generate(request_id=request_id, prompt_ids=prompt_ids,
                                                         sampling_params=sampling_params, priority=priority)
                t_gen = time.perf_counter() - t0
                response_ids = self.tokens.cut([int(t) for t in out.token_ids])[: self.response_length]
                lp = list(out.log_probs[: len(response_ids)]) if out.log_probs else None
                text, stopped = self.tokens.decode(response_ids)
                t0 = time.perf_counter()
                episode.record(request, Reply(text=text, prompt_ids=prompt_ids, response_ids=response_ids,
                                              logprobs=lp, stopped=stopped))
                gen_info.append({"generate": t_gen, "env": time.perf_counter() - t0,
                                 "num_preempted": out.num_preempted if out.num_preempted is not None else -1,
                                 "min_global_steps": out.extra_fields.get("min_global_steps"),
                                 "max_global_steps": out.extra_fields.get("max_global_steps")})
            traj = episode.trajectory
            samples = [StepSample(traj=0, step=k, anchor=anchor, prompt_ids=r.prompt_ids, response_ids=r.response_ids,
                                  logprobs=r.logprobs or [])
                       for k, (anchor, r) in enumerate(zip(episode.anchors, episode.replies, strict=True))]
            logprobs = [r.logprobs for r in episode.replies]

            t0 = time.perf_counter()
            verdict = setup.rewarder.score(traj)
            rewards = rollout_rewards(RolloutBatch(trajectories=[traj], groups=[0], samples=samples), [verdict],
                                      cfg.reward)
            t_score = time.perf_counter() - t0
            if not rewards["traj_keep"][0]:
                logger.warning("%s: judge errors in task %s (uid %s, session %d): the episode is not trained on",
                               AGENT_LOOP_NAME, task.id, uid, session)
                return []
            episode_return = float(rewards["traj_return"][0])
            reward_info = {"success": float(bool(traj.success)), "episode_score": float(verdict.episode.score),
                           "episode_return": episode_return, "num_steps": float(len(traj.turns))}
            with_logprobs = all(lp is not None for lp in logprobs)
            outputs = []
            for k, (sample, lp, g) in enumerate(zip(samples, logprobs, gen_info, strict=True)):
                metrics = agent_loop.AgentLoopMetrics(generate_sequences=g["generate"], tool_calls=g["env"],
                                                      compute_score=t_score if k == len(samples) - 1 else 0.0,
                                                      num_preempted=g["num_preempted"])
                outputs.append(agent_loop.AgentLoopOutput(
                    prompt_ids=sample.prompt_ids, response_ids=sample.response_ids,
                    response_mask=[1] * len(sample.response_ids),
                    response_logprobs=lp if with_logprobs else None,
                    reward_score=episode_return, num_turns=2, metrics=metrics,
                    extra_fields={"traj_uid": f"{uid}_{session}", "step_idx": sample.step,
                                  "anchor_key": sample.anchor, "step_reward": float(rewards["step_rewards"][k]),
                                  "task_id": task.id, "turn_scores": [], "tool_rewards": [],
                                  "min_global_steps": g["min_global_steps"],
                                  "max_global_steps": g["max_global_steps"], "reward_extra_info": reward_info}))
            return outputs

    SandboxAgentLoop.__module__ = __name__
    SandboxAgentLoop.__qualname__ = "SandboxAgentLoop"   # verl's `register` keys the class by this path
    agent_loop.register(AGENT_LOOP_NAME)(SandboxAgentLoop)
    return SandboxAgentLoop


_LAZY = {"SandboxAgentLoop": _build_agent_loop_class, "VerlGiGPOTrainer": _build_trainer_class}


def _lazy_class(name: str) -> type:
    """The class `name` of `_LAZY`, made once per process."""
    if name not in globals():
        globals()[name] = _LAZY[name]()
    return globals()[name]


def __getattr__(name: str) -> Any:
    """`SandboxAgentLoop` and `VerlGiGPOTrainer` subclass verl classes, so they are made (and verl imported) the
    first time they are looked up: by `register()`, or by hydra / Ray resolving `rl.verl_plugin.SandboxAgentLoop`
    in a worker."""
    if name in _LAZY:
        return _lazy_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------------ registration


def register(setup_loader: Callable[[str], EpisodeSetup] | None = None) -> dict[str, str | None]:
    """Register the estimator, the agent loop and the trainer mode with verl; idempotent (calling it again, in
    any process, changes nothing). `setup_loader(recipe path) -> EpisodeSetup` is what the agent loop plays
    episodes with (`pipeline.verl.register` passes the one that reads a recipe). Returns the registered names;
    the trainer mode is None (with a warning) where verl's v1 trainer cannot be imported (it needs
    TransferQueue: verl's `verl-core` / `vllm` extras).

    In a verl run every Ray worker calls it at start through
    `+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=pipeline.verl.register`: verl picks the
    trainer mode and runs the estimator inside its TaskRunner actor, not in the launching process.
    """
    global _SETUP_LOADER
    if setup_loader is not None and setup_loader is not _SETUP_LOADER:
        _SETUP_LOADER = setup_loader
        _episode_setup.cache_clear()
    core_algos = _verl("verl.trainer.ppo.core_algos")
    if core_algos.ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR_NAME) is not compute_gigpo_advantage:
        core_algos.register_adv_est(ESTIMATOR_NAME)(compute_gigpo_advantage)  # verl refuses a name held by another
    _lazy_class("SandboxAgentLoop")    # registers itself when made
    trainer_mode: str | None = TRAINER_MODE
    try:
        trainer_cls = _lazy_class("VerlGiGPOTrainer")
    except ImportError as e:
        logger.warning("rl.verl_plugin: trainer mode %s not registered: %s", TRAINER_MODE, e)
        trainer_mode = None
    else:
        v1 = _verl("verl.trainer.ppo.v1")
        if v1.trainer_base.TRAINER_REGISTRY.get(TRAINER_MODE) is not trainer_cls:
            v1.register_trainer(TRAINER_MODE)(trainer_cls)
    return {"adv_estimator": ESTIMATOR_NAME, "agent_loop": AGENT_LOOP_NAME, "trainer_mode": trainer_mode}


# ------------------------------------------------------------------------------------------------ the dataset


def dataset_rows(tasks: Sequence[TaskInstance], split: str, data_source: str, memory_size: int = 4
                 ) -> list[dict[str, Any]]:
    """verl RL dataset rows, one per task: `prompt` (the task's first step prompt, as the episode loop builds it;
    verl's dataset uses it for its length filter and logs), `task` (the TaskInstance as JSON, which the agent
    loop plays), `agent_name`, `data_source`, `reward_model` and `extra_info.index`."""
    rows = []
    env = SandboxEnv()
    for i, task in enumerate(tasks):
        prompt = Episode(env, "student", 0, {"task": task}, memory_size=memory_size).request().messages
        rows.append({"data_source": data_source, "agent_name": AGENT_LOOP_NAME, "prompt": prompt,
                     "task": task.model_dump_json(),
                     "reward_model": {"style": "rule", "ground_truth": task.id},
                     "extra_info": {"index": i, "split": split, "task_id": task.id, "difficulty": task.difficulty}})
    return rows
