"""GiGPO (and GRPO) online RL in the sandbox. One iteration reads top to bottom:

    batch    = trainer.rollout(it)                 1. B tasks x G samples in lockstep from the current policy
    rewards  = trainer.rewards(batch)              2. the judge's turn and episode verdicts, mixed with success
    adv      = trainer.advantages(batch, rewards)  3. episode-level + anchor-state step-level advantages
    update   = trainer.update(adv, it)             4. PPO clipped surrogate on the response tokens
    row      = trainer.metrics(...)                5. one row of metrics.jsonl

    trainer = GiGPOTrainer(GiGPOConfig(...), init="outputs/medium/sft/final", out="outputs/medium/rl/gigpo",
                           train_tasks=pool, eval_tasks=test, reward_engine=engine, seed=0)
    summary = trainer.train()

The caller hands in everything the run needs (`pipeline.stages.run_rl_stage` builds it from a recipe): the
task pool, the test split, the reward engine and the starting checkpoint. Runs under `accelerate` (DDP: each
process plays its share of the groups, advantages are computed per group, gradients are averaged),
checkpoints every `save_every` iterations (model, optimizer, RNG, iteration, reward-prompt version) and resumes
from the last one bit for bit: every random draw of an iteration is seeded from (seed, iteration). Metrics go
to OUT/metrics.jsonl (one line per iteration and per evaluation), wandb (offline unless configured) and, at
the end, OUT/curves.png and OUT/metrics.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np

from agent.clients import TransformersClient
from agent.episode import episode_seed, play
from agent.metrics import aggregate, split_metrics
from agent.policies import ChatPolicy
from agent.progress import StageBar
from agent.trajectory import write_json
from rl.config import GiGPOConfig, RewardMix
from rl.gigpo import anchor_state_groups, get_advantage_estimator
from rl.rollout import RolloutBatch, collect_rollouts
from sandbox.gym_env import SandboxEnv

# the blocks of an evaluation row: test tasks by difficulty and all of them, then (when present) the test tasks
# on target combinations seen in training and the others (`compositional`), and the RL-pool sample
EVAL_GROUPS = ("easy", "medium", "hard", "all", "seen", "compositional", "pool")
EVAL_KEYS = ("episodes", "tsr", "gcr", "mean_steps", "invalid_action_rate")


class RLError(RuntimeError):
    """A run that cannot start or continue; the message says what to do."""


# ------------------------------------------------------------------------------------------------ rewards


def rollout_rewards(batch: RolloutBatch, verdicts, mix: RewardMix) -> dict[str, np.ndarray]:
    """Per-step rewards r_t and per-trajectory returns R from the judge's verdicts (see `rl.config.RewardMix`).

    Returns arrays over the batch's samples (`step_rewards`, `returns`, `keep`) and over trajectories
    (`traj_return`, `traj_keep`). A trajectory with any judge error is not trained on (`keep` False): no
    silent zero reward."""
    n_traj = len(batch.trajectories)
    traj_return = np.zeros(n_traj)
    traj_keep = np.ones(n_traj, dtype=bool)
    turn_scores: list[list[float]] = []
    for i, (traj, v) in enumerate(zip(batch.trajectories, verdicts, strict=True)):
        scores = v.turn_rewards
        if v.judge_errors or any(s is None for s in scores) or len(scores) != len(traj.turns):
            traj_keep[i] = False
            turn_scores.append([0.0] * len(traj.turns))
            continue
        turn_scores.append([float(s) for s in scores])
        terminal = mix.success * float(traj.success) + mix.episode * v.episode.score
        traj_return[i] = terminal + mix.turn * (float(np.mean(scores)) if scores else 0.0)
    step_rewards = np.zeros(len(batch.samples))
    for k, s in enumerate(batch.samples):
        traj = batch.trajectories[s.traj]
        r = mix.turn * turn_scores[s.traj][s.step]
        if s.step == len(traj.turns) - 1 and traj_keep[s.traj]:
            v = verdicts[s.traj]
            r += mix.success * float(traj.success) + mix.episode * v.episode.score
        step_rewards[k] = r
    keep = np.array([traj_keep[s.traj] for s in batch.samples], dtype=bool)
    returns = np.array([traj_return[s.traj] for s in batch.samples])
    return {"step_rewards": step_rewards, "returns": returns, "keep": keep, "traj_return": traj_return,
            "traj_keep": traj_keep}


def rng_state() -> dict:
    """Python's, NumPy's and torch's random states as JSON (a checkpoint holds no pickle)."""
    import torch
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(state), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached],
            "torch": torch.random.get_rng_state().tolist()}


def set_rng_state(rng: dict) -> None:
    """Restore what `rng_state` saved."""
    import torch
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.random.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))


def anchor_codes(keys: list[str]) -> np.ndarray:
    """A dense int64 code per distinct state key (first-seen order): what the estimator groups by."""
    table: dict[str, int] = {}
    return np.fromiter((table.setdefault(k, len(table)) for k in keys), dtype=np.int64, count=len(keys))


@dataclass
class Advantages:
    """The step rows an update trains on (those of trajectories the judge scored) and their advantages."""

    rows: list                      # rl.rollout.StepSample
    values: np.ndarray              # A per row
    traj_ids: np.ndarray            # per row: its trajectory in the batch
    anchor_stats: dict              # step-group sizes (rl.gigpo.anchor_state_groups)
    filler: object = None           # a row to score with weight 0 where this process has none (DDP lockstep)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------------------------ trainer


class GiGPOTrainer:
    """One RL run from the checkpoint `init`; `out` gets checkpoints/, final/, metrics.jsonl, metrics.json and
    curves.png.

    `train_tasks` is the task pool (the config's `difficulties` pick from it), `eval_tasks` the test split (the
    first `eval_tasks` of it when the config says), `reward_engine` anything with `score(trajectory)` returning a
    `reward_engine.judge.TrajectoryVerdict` and a `prompt` (its version goes into checkpoints).
    `compositional`: ids of test tasks whose targets were never targets in training (their evaluation block).
    `seed` (plus the config's `seed_offset`) seeds every draw; `eval_seed` the evaluation episodes and the
    pool sample, the same for every seed and algorithm; `eval_constrained` decodes the evaluation as the recipe's
    `eval.constrained` says (`agent.constrained`), so its figures read like `embodistill eval`'s.
    `human_factory(compiled)` makes who answers the agent (default: the rule persona). `make_env` and `tools`:
    another env than the sandbox (TextWorld: its env and its skills). Progress shows on `bar` (the RL stage's
    bar), or a bar of its own."""

    def __init__(self, config: GiGPOConfig, init: str | Path, out: str | Path, train_tasks: list, eval_tasks: list,
                 reward_engine, *, seed: int = 0, eval_seed: int = 0, eval_constrained: bool = False,
                 compositional=(), human_factory=None,
                 name: str = "rl", resume: bool = False, restart: bool = False, show_progress: bool = True,
                 cpu: bool | None = None, bar: StageBar | None = None, make_env=None, tools: list[dict] | None = None):
        self.cfg = config
        # the env episodes are played in (the sandbox with `human_factory`, or another: TextWorld) and its skills
        self.make_env = make_env or (lambda: SandboxEnv(human_factory=human_factory))
        self.tools = tools
        self.init, self.out = Path(init), Path(out)
        self.seed = seed + config.seed_offset
        self.eval_seed, self.eval_constrained = eval_seed, eval_constrained
        self.rewarder = reward_engine
        self.name = name
        self.resume, self.restart = resume, restart
        self.show_progress, self.cpu, self.bar = show_progress, cpu, bar
        if not (self.init / "config.json").is_file():
            raise RLError(f"{self.init}: no model checkpoint there (no config.json). `embodistill sft RECIPE` "
                          "writes outputs/<recipe>/sft/final; an RL run writes OUT/final")
        levels = {"easy", "medium", "hard"}
        diffs = set(config.difficulties or levels)
        # another env's groups (TextWorld's game families) are not difficulties: all of them stay
        self.pool = [t for t in train_tasks if t.difficulty in diffs or t.difficulty not in levels]
        if not self.pool:
            raise RLError(f"no {config.task_pool} pool tasks at difficulties {sorted(diffs)} in {name}")
        self.test = eval_tasks[: config.eval_tasks] if config.eval_tasks else list(eval_tasks)
        # a fixed sample of the pool (the same for every seed and algorithm), played greedily at each evaluation
        pick = np.random.default_rng(eval_seed).permutation(len(self.pool))[: config.eval_pool_tasks]
        self.pool_eval = [self.pool[i] for i in sorted(pick.tolist())]
        test_ids = {t.id for t in self.test}
        self.compositional = {i for i in compositional if i in test_ids}
        self.metrics_path = self.out / "metrics.jsonl"

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """The accelerator, torch threads, the model (from the last checkpoint when resuming), the optimizer,
        the rollout engine and the metrics log."""
        import torch
        from accelerate import Accelerator, InitProcessGroupKwargs

        cpu = self.cpu if self.cpu is not None else not torch.cuda.is_available()
        self.acc = acc = Accelerator(cpu=cpu, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(hours=4))])
        # torch threads: rl.threads, else this machine's cores split among the local processes (`accelerate
        # launch` may have set OMP_NUM_THREADS=1, which would leave cores idle on CPU)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes))
        if cpu:
            torch.set_num_threads(self.cfg.threads or max(1, len(os.sched_getaffinity(0)) // max(local, 1)))
        elif self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        if self.cfg.tasks_per_iteration < acc.num_processes:
            raise RLError(f"rl.tasks_per_iteration ({self.cfg.tasks_per_iteration}) must be >= the number of "
                          f"processes ({acc.num_processes}): each process plays whole groups")
        if acc.is_main_process and self.restart and self.out.exists():
            shutil.rmtree(self.out)
        acc.wait_for_everyone()
        ckpt = self._checkpoint_to_resume()
        self._load(ckpt.joinpath("model") if ckpt else self.init)
        if ckpt is not None:
            # tensors and plain containers only: nothing in the output folder is unpickled
            self.opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
            self.engine.sync(acc.unwrap_model(self.model))   # a vLLM engine starts from `init`
        if acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            # rows up to the checkpoint stay; without one the run starts over, its iteration-0 evaluation too
            self._trim_metrics(self.start_iteration if ckpt is not None else -1)
        self._wandb = self._init_wandb() if self.cfg.wandb and acc.is_main_process else None

    def _checkpoint_to_resume(self) -> Path | None:
        """The last checkpoint when resuming (checked against this run's algorithm and seed), else None."""
        ckpt = self.latest_checkpoint()
        self.start_iteration = 0
        if ckpt is None:
            return None
        if not self.resume:
            raise RLError(f"{self.out / 'checkpoints'} holds checkpoints of an earlier run: pass --resume to "
                          "continue it or --restart to discard it")
        state = json.loads((ckpt / "state.json").read_text())
        for key, mine in (("algorithm", self.cfg.algorithm), ("seed", self.seed)):
            if state[key] != mine:
                raise RLError(f"{ckpt}: the checkpoint was made with {key}={state[key]!r}; this run has "
                              f"{key}={mine!r}")
        self.start_iteration = state["iteration"]
        return ckpt

    def _load(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rl.engines import TransformersEngine, VLLMEngine, eos_ids_of  # torch: imported when a run starts
        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
        self.ref = None
        if self.cfg.kl_coef > 0:
            self.ref = AutoModelForCausalLM.from_pretrained(self.init, local_files_only=True, dtype=torch.float32)
            self.ref.requires_grad_(False).eval().to(self.acc.device)
        opt = torch.optim.AdamW(model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        model.train()
        self.model, self.opt = self.acc.prepare(model, opt)
        unwrapped = self.acc.unwrap_model(self.model)
        if self.cfg.engine == "vllm":
            self.engine = VLLMEngine(self.init, self.tok, eos_ids_of(unwrapped, self.tok),
                                     gpu_memory_utilization=self.cfg.vllm_gpu_memory_utilization, seed=self.seed)
        else:
            self.engine = TransformersEngine(unwrapped, self.tok)
        self.pad_id = self.engine.pad_id

    def _init_wandb(self):
        import wandb
        mode = "online" if os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") != "offline" \
            else "offline"
        return wandb.init(project=os.environ.get("WANDB_PROJECT", "embodistill"), dir=str(self.out), mode=mode,
                          name=f"{self.name}-{self.cfg.algorithm}-s{self.seed}", resume="allow",
                          config={"recipe": self.name, "rl": self.cfg.model_dump(mode="json"), "seed": self.seed})

    # ------------------------------------------------------------------ schedule

    def tasks_for(self, iteration: int) -> list:
        """The B tasks of an iteration: walks seeded permutations of the pool, one per pass (no repeats
        within a pass); a function of (seed, iteration) only, so a resumed run draws the same tasks."""
        n, b = len(self.pool), self.cfg.tasks_per_iteration
        out = []
        for j in range(b):
            idx = iteration * b + j
            perm = list(range(n))
            random.Random(self.seed * 1_000_003 + idx // n).shuffle(perm)
            out.append(self.pool[perm[idx % n]])
        return out

    # ------------------------------------------------------------------ one iteration

    def iteration(self, it: int) -> dict:
        t0 = time.perf_counter()
        batch = self.rollout(it)
        rewards, verdicts_s = self.rewards(batch)
        adv = self.advantages(batch, rewards)
        update = self.update(adv, it)
        return self.metrics(it, batch, rewards, adv, update, {"judge_s": verdicts_s, "t0": t0})

    def rollout(self, it: int) -> RolloutBatch:
        """1. This process's share of the iteration's B tasks, each played G times in lockstep (token ids kept)."""
        cfg, acc = self.cfg, self.acc
        tasks = self.tasks_for(it)[acc.process_index:: acc.num_processes]
        return collect_rollouts(self.engine, tasks, cfg.group_size,
                                seed=self.seed * 100_003 + it * 101 + acc.process_index, temperature=cfg.temperature,
                                max_new_tokens=cfg.max_new_tokens, memory_size=cfg.memory_size,
                                max_steps=cfg.max_steps, make_env=self.make_env, tools=self.tools)

    def rewards(self, batch: RolloutBatch) -> tuple[dict[str, np.ndarray], float]:
        """2. The judge's verdict on every trajectory, mixed into step rewards r_t and returns R(tau); and the
        seconds the judge took."""
        t0 = time.perf_counter()
        verdicts = [self.rewarder.score(t) for t in batch.trajectories]
        return rollout_rewards(batch, verdicts, self.cfg.reward), time.perf_counter() - t0

    def advantages(self, batch: RolloutBatch, rewards: dict[str, np.ndarray]) -> Advantages:
        """3. The registered estimator (`rl.gigpo`: "gigpo" or "grpo") over the rows of judged trajectories, with
        anchor states coded per batch."""
        cfg, samples = self.cfg, batch.samples
        keep = np.flatnonzero(rewards["keep"])
        rows = [samples[k] for k in keep]
        group_ids = np.array([batch.groups[samples[k].traj] for k in keep], dtype=np.int64)
        traj_ids = np.array([samples[k].traj for k in keep], dtype=np.int64)
        step_idx = np.array([samples[k].step for k in keep], dtype=np.int64)
        anchors = anchor_codes([samples[k].anchor for k in keep])
        filler = rows[0] if rows else (samples[0] if samples else None)
        if not rows:
            return Advantages(rows, np.zeros(0), traj_ids, {}, filler)
        kwargs = {"gamma": cfg.gamma, "normalize": cfg.normalize}
        if cfg.algorithm == "gigpo":
            kwargs["step_weight"] = cfg.effective_step_weight()
        values = get_advantage_estimator(cfg.algorithm)(group_ids, traj_ids, step_idx, anchors,
                                                        rewards["step_rewards"][keep], rewards["returns"][keep],
                                                        **kwargs)
        return Advantages(rows, values, traj_ids, anchor_state_groups(group_ids, anchors)[1], filler)

    def update(self, adv: Advantages, it: int) -> dict:
        """4. PPO: `ppo_epochs` passes over the rows in `mini_batches` optimizer steps, each accumulated over
        micro-batches of similar lengths; the clipped surrogate against the old log-probs (the engine's, kept at
        sampling, or recomputed before the update). Returns summed statistics and the seconds it took."""
        import torch

        from rl.loss import ppo_loss, trajectory_mean_scale
        cfg, acc, model, rows = self.cfg, self.acc, self.model, adv.rows
        t0 = time.perf_counter()
        n_tok = self._reduce({"n": float(sum(len(r.response_ids) for r in rows))})["n"]
        active = [i for i in range(len(rows)) if abs(adv.values[i]) > 1e-12 or self.ref is not None]
        adv_loss = adv.values
        if cfg.loss_agg == "trajectory-mean" and rows:
            # scale each row's advantage by n_tok / (K * tokens of its trajectory): under the token-mean every
            # trajectory then weighs 1/K (the clipped surrogate is linear in a positive scale of A)
            k_total = self._reduce({"k": float(np.unique(adv.traj_ids).size)})["k"]
            adv_loss = adv.values * trajectory_mean_scale(adv.traj_ids, [len(r.response_ids) for r in rows], n_tok,
                                                          k_total)
        mode = self._old_logprob_mode()
        old, ref = self._reference_logprobs(rows, active, mode)
        stats = {"loss": 0.0, "clipped_tokens": 0.0, "ratio_sum": 0.0, "kl_sum": 0.0, "approx_kl_sum": 0.0,
                 "entropy_sum": 0.0, "trained_tokens": 0.0, "grad_norm": 0.0, "optimizer_steps": 0.0}
        world, mb = acc.num_processes, cfg.micro_batch_rows
        per_step_tokens = max(n_tok / cfg.mini_batches, 1.0) / world
        rng = np.random.default_rng([self.seed, it, acc.process_index])
        lengths = np.array([len(rows[i].prompt_ids) + len(rows[i].response_ids) for i in active], dtype=np.int64)
        # nothing to learn anywhere (every advantage 0, e.g. a GRPO batch of equal returns): no optimizer step,
        # which would still move the weights through Adam's momentum
        epochs = cfg.ppo_epochs if self._reduce({"a": float(len(active))})["a"] > 0 else 0
        for _epoch in range(epochs):
            order = rng.permutation(len(active)) if active else np.zeros(0, dtype=np.int64)
            for part in np.array_split(order, cfg.mini_batches):
                # micro-batches of similar lengths pad less; the mini-batch's gradient is their sum either way
                part = part[np.argsort(lengths[part], kind="stable")] if len(part) else part
                chunks = [part[lo: lo + mb] for lo in range(0, len(part), mb)]
                n_chunks = int(self._reduce({"k": float(max(len(chunks), 1))}, op="max")["k"]) if world > 1 \
                    else max(len(chunks), 1)
                chunks += [None] * (n_chunks - len(chunks))
                for ci, chunk in enumerate(chunks):
                    ctx = acc.no_sync(model) if (world > 1 and ci < n_chunks - 1) else nullcontext()
                    with ctx:
                        if chunk is None or len(chunk) == 0:
                            # keeps every process's collective calls in step; contributes a zero gradient
                            _, (lp, _) = self._logprobs(model, [adv.filler], cfg.temperature)
                            loss = lp.sum() * 0.0
                        else:
                            idx = [active[int(c)] for c in chunk]
                            packed, (lp, ent) = self._logprobs(model, [rows[i] for i in idx], cfg.temperature,
                                                               entropy=True)
                            old_t, ref_t = torch.zeros_like(lp), torch.zeros_like(lp) if self.ref is not None else None
                            for j, i in enumerate(idx):
                                old_t[j, : len(rows[i].response_ids)] = old[i].to(lp.device)
                                if ref_t is not None:
                                    ref_t[j, : len(rows[i].response_ids)] = ref[i]
                            mask = packed.response_mask.to(lp.device)
                            a = torch.tensor(adv_loss[idx], dtype=lp.dtype, device=lp.device)
                            loss, st = ppo_loss(lp, old_t, a, mask, per_step_tokens, cfg.clip_eps, cfg.clip_eps_high,
                                                ref_t, cfg.kl_coef)
                            for key in ("clipped_tokens", "ratio_sum", "approx_kl_sum"):
                                stats[key] += st[key]
                            stats["kl_sum"] += st.get("kl_sum", 0.0)
                            stats["entropy_sum"] += float((ent.detach() * mask).sum())
                            stats["trained_tokens"] += float(mask.sum())
                        acc.backward(loss)
                        stats["loss"] += float(loss.detach())
                gn = acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                stats["grad_norm"] += float(gn) if gn is not None else 0.0
                stats["optimizer_steps"] += 1
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
        self.engine.sync(acc.unwrap_model(model))
        return {**stats, "active_rows": float(len(active)), "old_logprobs": mode,
                "update_s": time.perf_counter() - t0}

    def metrics(self, it: int, batch: RolloutBatch, rewards: dict, adv: Advantages, update: dict,
                timing: dict) -> dict:
        """5. One metrics row: rollout success, returns, advantages, the update's loss, clip fraction, KL and
        entropy, and where the time went; sums over processes, then divided."""
        m = aggregate(batch.trajectories)
        kept, values = rewards["traj_keep"], adv.values
        n_groups = adv.anchor_stats.get("num_step_groups", 0)
        sums = {"episodes": m["episodes"], "success": m["tsr"] * m["episodes"], "gcr": m["gcr"] * m["episodes"],
                "steps": float(len(batch.samples)), "invalid": m["invalid_action_rate"] * len(batch.samples),
                "return_sum": float(rewards["traj_return"][kept].sum()), "return_n": float(kept.sum()),
                "judge_dropped": float((~kept).sum()), "rows": float(len(adv.rows)),
                "adv_abs": float(np.abs(values).sum()), "adv_zero": float((np.abs(values) <= 1e-12).sum()),
                "anchor_groups": float(n_groups),
                "anchor_size1": float(adv.anchor_stats.get("frac_size1_groups", 0.0) * n_groups),
                "gen_tokens": float(batch.generated_tokens), "truncated": float(batch.truncated_responses),
                "generate_s": batch.generate_seconds, "env_s": batch.env_seconds, "judge_s": timing["judge_s"],
                **{k: v for k, v in update.items() if k != "old_logprobs"}}
        tot, world = self._reduce(sums), self.acc.num_processes
        n_steps, trained = max(tot["steps"], 1.0), max(tot["trained_tokens"], 1.0)
        episodes = max(tot["episodes"], 1)
        return {"kind": "train", "iteration": it + 1, "episodes": int(tot["episodes"]),
                "success_rate": round(tot["success"] / episodes, 4), "gcr": round(tot["gcr"] / episodes, 4),
                "mean_return": round(tot["return_sum"] / max(tot["return_n"], 1), 4),
                "mean_steps": round(tot["steps"] / episodes, 3),
                "invalid_action_rate": round(tot["invalid"] / n_steps, 4),
                "judge_dropped_episodes": int(tot["judge_dropped"]),
                "rows": int(tot["rows"]), "active_rows": int(tot["active_rows"]),
                "adv_mean_abs": round(tot["adv_abs"] / max(tot["rows"], 1), 4),
                "adv_zero_frac": round(tot["adv_zero"] / max(tot["rows"], 1), 4),
                "anchor_groups": int(tot["anchor_groups"]),
                "anchor_size1_frac": round(tot["anchor_size1"] / max(tot["anchor_groups"], 1), 4),
                "anchor_size_distribution": adv.anchor_stats.get("size_distribution") if world == 1 else None,
                "loss": round(tot["loss"] / world, 6),
                "clip_frac": round(tot["clipped_tokens"] / trained, 4),
                "ratio_mean": round(tot["ratio_sum"] / trained, 4),
                "old_logprobs": update["old_logprobs"],
                "kl": round(tot["kl_sum"] / trained, 6), "approx_kl": round(tot["approx_kl_sum"] / trained, 6),
                "entropy": round(tot["entropy_sum"] / trained, 4),
                "grad_norm": round(tot["grad_norm"] / max(tot["optimizer_steps"], 1), 4),
                "optimizer_steps": int(tot["optimizer_steps"] / world),
                "response_tokens": int(tot["gen_tokens"]), "truncated_responses": int(tot["truncated"]),
                "generate_s": round(tot["generate_s"] / world, 2), "env_s": round(tot["env_s"] / world, 2),
                "judge_s": round(tot["judge_s"] / world, 2), "update_s": round(tot["update_s"] / world, 2),
                "iteration_s": round(time.perf_counter() - timing["t0"], 2)}

    # ------------------------------------------------------------------ helpers of the update

    def _reduce(self, sums: dict[str, float], op: str = "sum") -> dict[str, float]:
        """Sum (or max) scalars over processes."""
        if self.acc.num_processes == 1:
            return dict(sums)
        import torch
        import torch.distributed as dist
        keys = sorted(sums)
        t = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=self.acc.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return {k: float(v) for k, v in zip(keys, t.tolist(), strict=True)}

    def _logprobs(self, model, rows: list, temperature: float, entropy: bool = False):
        """Pack rows and score their response ids (the caller decides about gradients)."""
        from rl.loss import pack, token_logprobs
        packed = pack([r.prompt_ids for r in rows], [r.response_ids for r in rows], self.pad_id)
        return packed, token_logprobs(model, packed, temperature, with_entropy=entropy)

    def _old_logprob_mode(self) -> str:
        """"rollout": the engine's log-probs kept with the ids at sampling (token in, token out); "recompute": the
        trainer's, once before the update, where the engine's numerics differ from the trainer's (vLLM)."""
        mode = self.cfg.old_logprobs
        if mode == "auto":
            mode = "rollout" if getattr(self.engine, "logprobs_exact", False) else "recompute"
        return mode

    def _reference_logprobs(self, rows: list, active: list[int], mode: str) -> tuple[dict, dict]:
        """The old log-probs of the active rows, and the reference model's when there is a KL term."""
        import torch
        old: dict = {}
        ref: dict = {}
        mb = self.cfg.micro_batch_rows
        with torch.no_grad():
            for lo in range(0, len(active), mb):
                part = active[lo: lo + mb]
                if mode == "rollout":
                    for i in part:
                        old[i] = torch.tensor(rows[i].logprobs, dtype=torch.float32)
                else:
                    _, (lp, _) = self._logprobs(self.acc.unwrap_model(self.model), [rows[i] for i in part],
                                                self.cfg.temperature)
                    for j, i in enumerate(part):
                        old[i] = lp[j, : len(rows[i].response_ids)].clone()
                if self.ref is not None:
                    _, (rl_, _) = self._logprobs(self.ref, [rows[i] for i in part], self.cfg.temperature)
                    for j, i in enumerate(part):
                        ref[i] = rl_[j, : len(rows[i].response_ids)].clone()
        return old, ref

    # ------------------------------------------------------------------ evaluation

    def _initial_eval_cache(self) -> Path:
        """Where the starting checkpoint's test evaluation is kept: runs from one checkpoint (seeds, GiGPO and
        GRPO) share it. Keyed by the weights file, the test tasks and the evaluation settings."""
        h = hashlib.sha256()
        for f in sorted(self.init.glob("*.safetensors")):
            h.update(f.name.encode())
            h.update(str(f.stat().st_size).encode())
            h.update(str(f.stat().st_mtime_ns).encode())
        for tasks in (self.test, self.pool_eval):   # a sandbox task, or a TextWorld game (its file and spec)
            h.update(json.dumps([t.fingerprint for t in tasks]).encode())
        h.update(json.dumps(sorted(self.compositional)).encode())
        # the episode seeds: `episode_seed(eval_seed, task id)` ("task-id"; before 2026-12-06 they came from the
        # task's position, and a cache made so must not look current)
        h.update(json.dumps([self.eval_seed, "task-id", self.cfg.max_new_tokens, self.cfg.memory_size]).encode())
        if self.eval_constrained:   # (added 2026-12-07; free decoding keeps the keys made before)
            from agent.constrained import RULES
            h.update(b"constrained" + RULES.encode())   # a cache made under other decoding rules is not current
        return self.init / f"rl_initial_eval_{h.hexdigest()[:16]}.json"

    def evaluate(self, it: int) -> dict | None:
        """Greedy play of the current policy on the test split (main process; the others wait): metrics per
        difficulty and "all"; "compositional" and "seen" when some test tasks target only combinations never
        targeted in training; with `eval_pool_tasks`, "pool" (the fixed sample of the RL pool, played alike)."""
        out = None
        cache = self._initial_eval_cache() if it == 0 else None
        if self.acc.is_main_process and cache is not None and cache.is_file():
            out = {**json.loads(cache.read_text()), "cached": True}
        elif self.acc.is_main_process:
            t0 = time.perf_counter()
            model = self.acc.unwrap_model(self.model)
            policy = ChatPolicy(TransformersClient(model, self.tok, max_new_tokens=self.cfg.max_new_tokens,
                                                   batch_size=self.cfg.eval_batch, device=str(self.acc.device),
                                                   constrained=self.eval_constrained),
                                name="student", tools=self.tools)

            def play_greedy(tasks: list) -> list:
                return play(self.make_env, policy,
                            [({"task": t}, episode_seed(self.eval_seed, t.id)) for t in tasks],
                            batch_size=self.cfg.eval_batch, memory_size=self.cfg.memory_size).trajectories

            trajs = play_greedy(self.test)
            m = split_metrics(trajs)
            if self.compositional:
                m["seen"] = aggregate([t for t in trajs if t.task_id not in self.compositional])
                m["compositional"] = aggregate([t for t in trajs if t.task_id in self.compositional])
            if self.pool_eval:
                m["pool"] = aggregate(play_greedy(self.pool_eval))
            model.train()
            out = {"kind": "eval", "iteration": it, "split": "test", "seconds": round(time.perf_counter() - t0, 1),
                   "constrained_decoding": self.eval_constrained,
                   **{d: {k: m[d][k] for k in EVAL_KEYS} for d in [*EVAL_GROUPS, *m] if d in m}}
            if cache is not None:
                try:
                    write_json(cache, out)
                except OSError:  # a read-only checkpoint folder: evaluate again next time
                    pass
        self.acc.wait_for_everyone()
        return out

    # ------------------------------------------------------------------ persistence

    def latest_checkpoint(self) -> Path | None:
        root = self.out / "checkpoints"
        if not root.is_dir():
            return None
        done = sorted((p for p in root.glob("iter_*") if (p / "state.json").is_file()),
                      key=lambda p: int(p.name.split("_")[1]))
        return done[-1] if done else None

    def save_checkpoint(self, iteration: int) -> None:
        import torch
        acc = self.acc
        if acc.is_main_process:
            root = self.out / "checkpoints"
            final = root / f"iter_{iteration:06d}"
            tmp = root / f".tmp-iter_{iteration:06d}"
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            acc.unwrap_model(self.model).save_pretrained(tmp / "model")
            self.tok.save_pretrained(tmp / "model")
            torch.save(self.opt.state_dict(), tmp / "optimizer.pt")
            write_json(tmp / "rng.json", rng_state())
            p = self.rewarder.prompt
            write_json(tmp / "state.json", {"iteration": iteration, "algorithm": self.cfg.algorithm,
                                            "seed": self.seed, "recipe": self.name,
                                            "reward_prompt": {"name": p.name, "version": p.version,
                                                              "hash": p.content_hash()}})
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # a checkpoint exists whole or not at all
            for old in sorted(root.glob("iter_*"))[:-2]:   # keep the last two
                shutil.rmtree(old)
        acc.wait_for_everyone()

    def _restore_rng(self, ckpt: Path) -> None:
        if not (ckpt / "rng.json").is_file():
            raise RLError(f"{ckpt}: no rng.json (a checkpoint from before 2026-12-06 kept it in a pickle, which "
                          "is not loaded): pass --restart")
        set_rng_state(json.loads((ckpt / "rng.json").read_text()))

    def _trim_metrics(self, iteration: int) -> None:
        """On resume, drop the lines an interrupted run wrote after its last checkpoint (no duplicates)."""
        if not self.metrics_path.is_file():
            return
        keep = [ln for ln in self.metrics_path.read_text().splitlines()
                if ln.strip() and _complete_json(ln) and json.loads(ln)["iteration"] <= iteration]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        os.replace(tmp, self.metrics_path)

    def log(self, row: dict) -> None:
        if not self.acc.is_main_process:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._wandb is not None:
            flat = {f"{row['kind']}/{k}": v for k, v in row.items() if isinstance(v, (int, float))}
            for d, block in row.items():      # the evaluation's groups: difficulties (or families), all, ...
                if row["kind"] == "eval" and isinstance(block, dict):
                    flat.update({f"eval/{d}/{k}": v for k, v in block.items()})
            self._wandb.log(flat, step=row["iteration"])

    # ------------------------------------------------------------------ the run

    def train(self) -> dict:
        """Evaluate the start, run the iterations (evaluating and checkpointing on schedule), save OUT/final,
        OUT/metrics.json and OUT/curves.png. Returns the summary (on the main process; {} on the others)."""
        self.setup()
        cfg, acc = self.cfg, self.acc
        ckpt = self.latest_checkpoint()
        if ckpt is not None and self.resume:
            self._restore_rng(ckpt)
        t_run = time.perf_counter()
        bar = self.bar or StageBar("rl", enabled=self.show_progress and acc.is_main_process)
        bar.phase(cfg.algorithm, cfg.iterations, unit="it")
        bar.update(self.start_iteration)
        if self.start_iteration == 0 and cfg.eval_every and cfg.eval_start:
            bar.postfix("evaluating the start")
            self.log_eval(self.evaluate(0))
        for it in range(self.start_iteration, cfg.iterations):
            row = self.iteration(it)
            row["rss_mb"] = round(_rss_mb(), 1)
            self.log(row)
            bar.update(1)
            bar.postfix(f"success {row['success_rate']:.2f}, return {row['mean_return']:.2f}, "
                        f"{row['iteration_s']:.0f} s/it")
            done = it + 1
            if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.iterations):
                bar.postfix(f"evaluating iteration {done}")
                self.log_eval(self.evaluate(done))
            if done % cfg.save_every == 0 or done == cfg.iterations:
                self.save_checkpoint(done)
        if self.bar is None:
            bar.close()
        summary = None
        if acc.is_main_process:
            final, tmp = self.out / "final", self.out / ".tmp-final"
            if tmp.exists():
                shutil.rmtree(tmp)
            acc.unwrap_model(self.model).save_pretrained(tmp)
            self.tok.save_pretrained(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            summary = self.summarize(time.perf_counter() - t_run)
            write_json(self.out / "metrics.json", summary)
            if self.metrics_path.is_file():
                plot_curves(self.metrics_path, self.out / "curves.png", title=f"{self.name} {cfg.algorithm}")
        if self._wandb is not None:
            import wandb
            self._wandb.finish()
            wandb.teardown()  # the process-wide wandb settings (dir, mode) go with the run
        acc.wait_for_everyone()
        return summary or {}

    def log_eval(self, row: dict | None) -> None:
        if row:
            self.log(row)

    def summarize(self, seconds: float) -> dict:
        rows = [json.loads(ln) for ln in self.metrics_path.read_text().splitlines() if ln.strip()]
        train = [r for r in rows if r["kind"] == "train"]
        evals = [r for r in rows if r["kind"] == "eval"]
        return {"recipe": self.name, "algorithm": self.cfg.algorithm, "seed": self.seed,
                "init": str(self.init), "iterations": len(train), "processes": self.acc.num_processes,
                "rollout_episodes": sum(r["episodes"] for r in train),
                "initial_eval": evals[0] if evals and evals[0]["iteration"] == 0 else None,
                "final_eval": evals[-1] if evals else None,
                "train_success_first": train[0]["success_rate"] if train else None,
                "train_success_last": train[-1]["success_rate"] if train else None,
                "seconds_this_session": round(seconds, 1), "peak_rss_mb": round(_rss_mb(), 1),
                "final": str(self.out / "final"), "rl": self.cfg.model_dump(mode="json")}


def _complete_json(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------------ curves


def plot_curves(metrics_path: Path, png: Path, title: str = "") -> Path:
    """The learning curves of a run (PNG): rollout success and mean return, the PPO loss, entropy, KL (to the
    sampling policy, and to the reference when there is a KL term) and clip fraction per iteration, and the test
    TSR per difficulty, test GCR and RL-pool TSR at every evaluation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(ln) for ln in Path(metrics_path).read_text().splitlines() if ln.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    it = [r["iteration"] for r in train]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    (ret, loss, ent), (kl, clip, test) = axes

    def line(ax, key, label, **kw):
        ax.plot(it, [r.get(key, float("nan")) for r in train], marker=".", label=label, **kw)

    line(ret, "success_rate", "rollout success")
    line(ret, "mean_return", "mean return R(tau)")
    ret.set_title("rollouts")
    line(loss, "loss", "PPO loss")
    loss.set_title("loss")
    line(ent, "entropy", "entropy (nats/token)")
    ent.set_title("policy entropy")
    line(kl, "approx_kl", "KL(sampling || current)")
    if any(r.get("kl") for r in train):
        line(kl, "kl", "KL to the reference (k3)")
    kl.set_title("KL per token")
    line(clip, "clip_frac", "clipped tokens")
    clip.set_title("clip fraction")
    ev_it = [r["iteration"] for r in evals]
    groups = [d for d, v in (evals[0] if evals else {}).items()   # difficulties (or TextWorld's families), all
              if isinstance(v, dict) and "tsr" in v and d not in ("seen", "compositional", "pool")]
    for d in groups:
        test.plot(ev_it, [r[d]["tsr"] for r in evals], marker="o", label=f"test TSR {d}",
                  lw=2.5 if d == "all" else 1)
    test.plot(ev_it, [r["all"]["gcr"] for r in evals], "k--", marker="x", label="test GCR all")
    pool = [r for r in evals if "pool" in r]
    if pool:
        test.plot([r["iteration"] for r in pool], [r["pool"]["tsr"] for r in pool], ":", marker="s",
                  label="RL-pool TSR")
    test.set_ylim(-0.02, 1.02)
    test.set_title("evaluation (greedy)")
    for ax in axes.flat:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = png.with_name(png.stem + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, png)
    return png
