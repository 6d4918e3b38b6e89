"""Recipe `rl:`: the GiGPO trainer's settings (strict: an unknown or ill-typed key names itself).

    rl:
      algorithm: gigpo          # or grpo: the same run with step_weight 0
      init: sft                 # this recipe's SFT checkpoint (made first when missing), or a model folder
      iterations: 40
      tasks_per_iteration: 8    # B: train tasks per iteration, each played group_size times from one state
      group_size: 8             # G
      reward: {success: 1.0, episode: 0.5, turn: 0.1}

Rewards: every step t earns `turn * s_t` (the judge's turn score in [-1, 1]); the last step also earns the
episode reward `success * 1[success] + episode * S` (S: the judge's episode score in [0, 1]). The episode
return R that GiGPO and GRPO compare within a group is `success * 1[success] + episode * S + turn * mean_t s_t`
(a mean, so a longer episode does not earn more by being longer).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RewardMix(_Strict):
    success: float = Field(default=1.0, ge=0.0)   # the sandbox's own success (1 or 0)
    episode: float = Field(default=0.5, ge=0.0)   # the judge's episode score
    turn: float = Field(default=0.1, ge=0.0)      # the judge's turn scores

    @model_validator(mode="after")
    def _some(self):
        if self.success + self.episode + self.turn <= 0:
            raise ValueError("reward: at least one of success, episode, turn must be > 0")
        return self


class RLSection(_Strict):
    algorithm: Literal["gigpo", "grpo"] = "gigpo"
    init: str = "sft"                    # "sft" (outputs/<recipe>/sft/final) or a model folder
    difficulties: list[Literal["easy", "medium", "hard"]] | None = None   # pool tasks used (default: all built)
    # "train": the train split (the instructions SFT was distilled from); "fresh": the "rl" split, new instructions
    # and layouts (none of train or test), `pool_instructions_per_scene` of them
    task_pool: Literal["train", "fresh"] = "train"
    pool_instructions_per_scene: int = Field(default=200, ge=1)
    iterations: int = Field(default=40, ge=1, le=100_000)
    tasks_per_iteration: int = Field(default=8, ge=1)
    group_size: int = Field(default=8, ge=2)
    # advantages (rl.gigpo)
    gamma: float = Field(default=0.95, gt=0.0, le=1.0)
    step_weight: float = Field(default=1.0, ge=0.0)      # omega; grpo forces 0
    normalize: Literal["mean_std", "mean"] = "mean_std"
    reward: RewardMix = Field(default_factory=RewardMix)
    # rollouts
    temperature: float = Field(default=1.0, gt=0.0, le=5.0)
    max_new_tokens: int = Field(default=32, ge=1, le=4096)
    memory_size: int = Field(default=4, ge=0, le=64)
    max_steps: int | None = Field(default=None, ge=1)   # cap on an episode's steps (default: the task's budget)
    engine: Literal["transformers", "vllm"] = "transformers"
    vllm_gpu_memory_utilization: float = Field(default=0.3, gt=0.0, le=1.0)
    # the update (PPO clipped surrogate). loss_agg "token-mean": every response token of the iteration weighs the
    # same (long episodes weigh more); "trajectory-mean": every trajectory weighs the same, its tokens sharing its
    # weight (the surrogate only: the KL term stays a token-mean)
    loss_agg: Literal["token-mean", "trajectory-mean"] = "token-mean"
    lr: float = Field(default=1e-4, gt=0.0, le=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    clip_eps: float = Field(default=0.2, gt=0.0, lt=1.0)
    clip_eps_high: float | None = Field(default=None, gt=0.0, lt=10.0)   # asymmetric upper clip (default clip_eps)
    kl_coef: float = Field(default=0.0, ge=0.0)          # KL to the initial (SFT) policy, k3 estimator
    # old log-probs: "rollout" (the engine's, kept at sampling), "recompute" (the trainer's, before the update),
    # "auto" (rollout when the engine scores with the trainer's own weights and kernels, i.e. transformers)
    old_logprobs: Literal["auto", "rollout", "recompute"] = "auto"
    ppo_epochs: int = Field(default=1, ge=1, le=64)
    mini_batches: int = Field(default=1, ge=1, le=1024)  # optimizer steps per epoch over one iteration's rollouts
    micro_batch_rows: int = Field(default=32, ge=1)      # rows per forward/backward (gradient accumulation)
    # bookkeeping
    save_every: int = Field(default=10, ge=1)
    eval_every: int = Field(default=10, ge=0)           # 0: no evaluation (also none at the start and end)
    eval_tasks: int | None = Field(default=None, ge=1)   # test tasks per periodic evaluation (default: all)
    # also play this many RL-pool tasks greedily at each evaluation (a fixed sample: the distribution RL practises
    # on, so a rise there and none on the test split means RL learned what does not transfer); 0: off
    eval_pool_tasks: int = Field(default=0, ge=0)
    eval_batch: int = Field(default=32, ge=1)
    wandb: bool = False
    threads: int | None = Field(default=None, ge=1)
    seed_offset: int = 0

    @model_validator(mode="after")
    def _engine(self):
        if self.clip_eps_high is not None and self.clip_eps_high < self.clip_eps:
            raise ValueError(f"clip_eps_high ({self.clip_eps_high}) must be >= clip_eps ({self.clip_eps})")
        return self

    def effective_step_weight(self) -> float:
        return 0.0 if self.algorithm == "grpo" else self.step_weight
