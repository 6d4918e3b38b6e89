"""`GiGPOConfig`: the settings of a GiGPO (or GRPO) run, the recipe's `rl:` section. Strict: an unknown or
ill-typed key names itself.

    rl:
      algorithm: gigpo          # or grpo: the same run with episode-level advantages only
      iterations: 24
      tasks_per_iteration: 4    # B
      group_size: 8             # G
      reward: {success: 1.0, episode: 0.5, turn: 0.1}
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RewardMix(_Strict):
    """How the rewards are mixed. Every step t earns `turn * s_t` (s_t: the judge's turn score in [-1, 1]); the
    last step also earns the episode reward `success * 1[success] + episode * S` (S: the judge's episode score in
    [0, 1]). The episode return R that GiGPO and GRPO compare within a group is
    `success * 1[success] + episode * S + turn * mean_t s_t` (a mean: a longer episode does not earn more).

    Parameters:
        success: weight of the sandbox's own success (1 or 0).
        episode: weight of the judge's episode score.
        turn: weight of the judge's turn scores.
    """

    success: float = Field(default=1.0, ge=0.0)
    episode: float = Field(default=0.5, ge=0.0)
    turn: float = Field(default=0.1, ge=0.0)

    @model_validator(mode="after")
    def _some(self):
        if self.success + self.episode + self.turn <= 0:
            raise ValueError("reward: at least one of success, episode, turn must be > 0")
        return self


class GiGPOConfig(_Strict):
    """Configuration of `rl.trainer.GiGPOTrainer`.

    Algorithm and tasks:
        algorithm: "gigpo" (episode-level plus anchor-state step-level advantages) or "grpo" (the same run with
            the episode-level advantage only: step_weight 0).
        init: the starting model: "sft" (the recipe's SFT checkpoint, outputs/<recipe>/sft/final, made first when
            missing), "onpolicy" (the on-policy distilled student, outputs/<recipe>/onpolicy/final, made after
            SFT when missing) or a model folder.
        difficulties: the pool tasks used (default: every difficulty built).
        task_pool: "train" (the train split, the instructions SFT was distilled from) or "fresh" (the "rl"
            split: new instructions and layouts, none of the train or test split).
        pool_instructions_per_scene: instructions per scene of the fresh pool.
        iterations: iterations of rollout -> rewards -> advantages -> update.
        tasks_per_iteration: B, tasks per iteration; each is played `group_size` times from one initial state.
        group_size: G, rollouts per task (an episode group).

    Advantages (`rl.gigpo`):
        gamma: discount of the step return R_t within a trajectory.
        step_weight: omega, the weight of the step-level advantage (grpo forces 0).
        normalize: "mean_std" (F_norm = std + eps) or "mean" (F_norm = 1).
        reward: the reward mix (`RewardMix`).

    Rollouts:
        temperature: sampling temperature of rollouts (evaluation is greedy).
        max_new_tokens: tokens generated per step at most.
        memory_size: recent steps the step prompt shows.
        max_steps: cap on a rollout's steps (default: the task's budget; evaluation keeps the full budget).
        engine: "transformers" (HF generate on the trainer's weights) or "vllm" (the vllm extra).
        vllm_gpu_memory_utilization: vLLM's share of GPU memory.

    The update (PPO clipped surrogate, `rl.loss`):
        loss_agg: "token-mean" (every response token of the iteration weighs the same, so long episodes weigh
            more) or "trajectory-mean" (every trajectory weighs the same, its tokens sharing its weight; the KL
            term stays a token-mean).
        lr, weight_decay, max_grad_norm: AdamW and gradient clipping.
        clip_eps: the surrogate's clip range; clip_eps_high: an asymmetric upper clip (default clip_eps).
        kl_coef: weight of the k3 KL to the initial policy (0: no reference model is loaded).
        old_logprobs: "rollout" (the engine's, kept at sampling), "recompute" (the trainer's, before the
            update) or "auto" (rollout when the engine scores with the trainer's own weights and kernels).
        ppo_epochs: passes over one iteration's rollouts.
        mini_batches: optimizer steps per epoch.
        micro_batch_rows: rows per forward/backward (gradient accumulation within a mini-batch).

    Bookkeeping:
        save_every: iterations between checkpoints.
        eval_every: iterations between evaluations on the test split (0: none, also none at the start and
            end); the starting checkpoint's evaluation is cached beside it.
        eval_start: also evaluate the starting checkpoint (false: its figures are known, as when RL starts from
            the on-policy student, whose last round was evaluated on the test split).
        eval_tasks: test tasks per evaluation (default: all).
        eval_pool_tasks: also play this many RL-pool tasks greedily at each evaluation (a fixed sample: the
            distribution RL practises on; a rise there and none on the test split means RL learned what does not
            transfer); 0: off.
        eval_batch: episodes played in lockstep at evaluation.
        wandb: log to wandb (offline unless WANDB_API_KEY is set).
        threads: torch threads (default: this machine's cores split among the local processes).
        seed_offset: added to the recipe seed.
    """

    algorithm: Literal["gigpo", "grpo"] = "gigpo"
    init: str = "sft"
    difficulties: list[Literal["easy", "medium", "hard"]] | None = None
    task_pool: Literal["train", "fresh"] = "train"
    pool_instructions_per_scene: int = Field(default=200, ge=1)
    iterations: int = Field(default=40, ge=1, le=100_000)
    tasks_per_iteration: int = Field(default=8, ge=1)
    group_size: int = Field(default=8, ge=2)
    gamma: float = Field(default=0.95, gt=0.0, le=1.0)
    step_weight: float = Field(default=1.0, ge=0.0)
    normalize: Literal["mean_std", "mean"] = "mean_std"
    reward: RewardMix = Field(default_factory=RewardMix)
    temperature: float = Field(default=1.0, gt=0.0, le=5.0)
    max_new_tokens: int = Field(default=32, ge=1, le=4096)
    memory_size: int = Field(default=4, ge=0, le=64)
    max_steps: int | None = Field(default=None, ge=1)
    engine: Literal["transformers", "vllm"] = "transformers"
    vllm_gpu_memory_utilization: float = Field(default=0.3, gt=0.0, le=1.0)
    loss_agg: Literal["token-mean", "trajectory-mean"] = "token-mean"
    lr: float = Field(default=1e-4, gt=0.0, le=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    clip_eps: float = Field(default=0.2, gt=0.0, lt=1.0)
    clip_eps_high: float | None = Field(default=None, gt=0.0, lt=10.0)
    kl_coef: float = Field(default=0.0, ge=0.0)
    old_logprobs: Literal["auto", "rollout", "recompute"] = "auto"
    ppo_epochs: int = Field(default=1, ge=1, le=64)
    mini_batches: int = Field(default=1, ge=1, le=1024)
    micro_batch_rows: int = Field(default=32, ge=1)
    save_every: int = Field(default=10, ge=1)
    eval_every: int = Field(default=10, ge=0)
    eval_start: bool = True
    eval_tasks: int | None = Field(default=None, ge=1)
    eval_pool_tasks: int = Field(default=0, ge=0)
    eval_batch: int = Field(default=32, ge=1)
    wandb: bool = False
    threads: int | None = Field(default=None, ge=1)
    seed_offset: int = 0

    @model_validator(mode="after")
    def _clip(self):
        if self.clip_eps_high is not None and self.clip_eps_high < self.clip_eps:
            raise ValueError(f"clip_eps_high ({self.clip_eps_high}) must be >= clip_eps ({self.clip_eps})")
        return self

    def effective_step_weight(self) -> float:
        return 0.0 if self.algorithm == "grpo" else self.step_weight
