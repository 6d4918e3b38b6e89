"""GiGPO (and GRPO) online RL in the sandbox, one iteration at a time:

    1. rollouts   B train tasks x G samples in lockstep from the current policy     (rl.rollout)
    2. rewards    the reward engine's turn and episode verdicts, mixed with success (rl.config.RewardMix)
    3. advantages episode-level + anchor-state step-level relative advantages       (rl.gigpo)
    4. update     PPO clipped surrogate on the response tokens, token- or trajectory-mean (rl.loss)

    from rl.trainer import GiGPOTrainer
    GiGPOTrainer(recipe, out="outputs/medium/rl/gigpo").train()

Runs under `accelerate` (DDP; each process plays its share of the groups, advantages are computed per group,
gradients are averaged), checkpoints every `save_every` iterations (model, optimizer, RNG, iteration,
reward-prompt version) and resumes from the last one bit for bit: every random draw of an iteration is seeded
from (seed, iteration). Metrics go to OUT/metrics.jsonl (one line per iteration and per evaluation), wandb
(offline unless configured) and, at the end, OUT/curves.png and OUT/metrics.json.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

from agent.trajectory import write_json
from rl.config import RLSection
from rl.gigpo import anchor_state_groups, get_advantage_estimator
from sft.metrics import compositional_split

# the blocks of an evaluation row: test tasks by difficulty and all of them, then (when present) the test tasks
# on target combinations seen in training and on the others (`sft.metrics.compositional_split`), and the RL-pool
# sample
EVAL_GROUPS = ("easy", "medium", "hard", "all", "seen", "compositional", "pool")


class RLError(RuntimeError):
    """A run that cannot start or continue; the message says what to do."""


# ------------------------------------------------------------------------------------------------ rewards


def rollout_rewards(batch, verdicts, mix) -> dict[str, np.ndarray]:
    """Per-step rewards r_t and per-trajectory returns R from the judge's verdicts (see `rl.config`).

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


def anchor_codes(keys: list[str]) -> np.ndarray:
    """A dense int64 code per distinct state key (first-seen order): what the estimator groups by."""
    table: dict[str, int] = {}
    return np.fromiter((table.setdefault(k, len(table)) for k in keys), dtype=np.int64, count=len(keys))


# ------------------------------------------------------------------------------------------------ trainer


def _rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class GiGPOTrainer:
    """One RL run. `init` is the starting model folder (the SFT student); `out` gets checkpoints/, final/,
    metrics.jsonl, metrics.json and curves.png."""

    def __init__(self, recipe, out: str | Path, init: str | Path, algorithm: str | None = None,
                 seed: int | None = None, iterations: int | None = None, resume: bool = False,
                 restart: bool = False, show_progress: bool = True, cpu: bool | None = None):
        cfg: RLSection = recipe.rl
        upd = {k: v for k, v in (("algorithm", algorithm), ("iterations", iterations)) if v is not None}
        if upd:
            cfg = RLSection.model_validate({**cfg.model_dump(), **upd})
        self.recipe, self.cfg = recipe, cfg
        self.out = Path(out)
        self.init = Path(init)
        self.seed = (recipe.seed if seed is None else seed) + cfg.seed_offset
        self.resume, self.restart = resume, restart
        self.show_progress = show_progress
        self.cpu = cpu
        if not (self.init / "config.json").is_file():
            raise RLError(f"{self.init}: no model checkpoint there (no config.json). `embodistill sft RECIPE` "
                          "writes outputs/<recipe>/sft/final; an RL run writes OUT/final")

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        import torch
        from accelerate import Accelerator, InitProcessGroupKwargs
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from pipeline.stages import build_rl_pool, build_tasks, human_factory, make_reward_engine

        cfg = self.cfg
        cpu = self.cpu if self.cpu is not None else not torch.cuda.is_available()
        self.acc = Accelerator(cpu=cpu, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(hours=4))])
        # torch threads: rl.threads, else this machine's cores split among the local processes (`accelerate
        # launch` may have set OMP_NUM_THREADS=1, which would leave cores idle on CPU)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.acc.num_processes))
        if cpu:
            torch.set_num_threads(cfg.threads or max(1, len(os.sched_getaffinity(0)) // max(local, 1)))
        elif cfg.threads:
            torch.set_num_threads(cfg.threads)
        acc = self.acc
        if cfg.tasks_per_iteration < acc.num_processes:
            raise RLError(f"rl.tasks_per_iteration ({cfg.tasks_per_iteration}) must be >= the number of processes "
                          f"({acc.num_processes}): each process plays whole groups")
        ckpt_root = self.out / "checkpoints"
        if acc.is_main_process and self.restart and self.out.exists():
            shutil.rmtree(self.out)
        acc.wait_for_everyone()
        ckpt = self.latest_checkpoint()
        if ckpt is not None and not self.resume:
            raise RLError(f"{ckpt_root} holds checkpoints of an earlier run: pass --resume to continue it or "
                          "--restart to discard it")
        self.start_iteration = 0
        model_dir = self.init
        if ckpt is not None:
            state = json.loads((ckpt / "state.json").read_text())
            for key in ("algorithm", "seed"):
                if state[key] != (cfg.algorithm if key == "algorithm" else self.seed):
                    raise RLError(f"{ckpt}: the checkpoint was made with {key}={state[key]!r}; this run has "
                                  f"{key}={cfg.algorithm if key == 'algorithm' else self.seed!r}")
            self.start_iteration = state["iteration"]
            model_dir = ckpt / "model"
        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = AutoModelForCausalLM.from_pretrained(self.init, local_files_only=True, dtype=torch.float32)
            self.ref.requires_grad_(False).eval().to(acc.device)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        model.train()
        self.model, self.opt = acc.prepare(model, opt)
        if ckpt is not None:
            self.opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=False))
        self.engine = self._make_engine()
        if ckpt is not None:  # a vLLM engine starts from `init`: give it the resumed weights
            self.engine.sync(acc.unwrap_model(self.model))
        self.pad_id = self.engine.pad_id
        self.rewarder = make_reward_engine(self.recipe)
        self.human_factory = human_factory(self.recipe)
        splits = build_tasks(self.recipe, show_progress=False)[0]
        diffs = set(cfg.difficulties or ("easy", "medium", "hard"))
        pool = splits["train"] if cfg.task_pool == "train" else \
            build_rl_pool(self.recipe, splits, cfg.pool_instructions_per_scene)
        self.pool = [t for t in pool if t.difficulty in diffs]
        if not self.pool:
            raise RLError(f"no {cfg.task_pool} pool tasks at difficulties {sorted(diffs)} in recipe {self.recipe.name}")
        self.test = splits["test"][: cfg.eval_tasks] if cfg.eval_tasks else splits["test"]
        # a fixed sample of the pool (the same for every seed and algorithm), played greedily at each evaluation
        pick = np.random.default_rng(self.recipe.eval.seed).permutation(len(self.pool))[: cfg.eval_pool_tasks]
        self.pool_eval = [self.pool[i] for i in sorted(pick.tolist())]
        # the compositional split of the SFT benchmark: test tasks whose targets were never targets in training
        self.compositional = {t.id for t in compositional_split(splits["train"], self.test)}
        self.metrics_path = self.out / "metrics.jsonl"
        if acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            self._trim_metrics(self.start_iteration)
        self._wandb = None
        if cfg.wandb and acc.is_main_process:
            import wandb
            mode = "online" if os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") != "offline" \
                else "offline"
            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "embodistill"), dir=str(self.out),
                                     mode=mode, name=f"{self.recipe.name}-{cfg.algorithm}-s{self.seed}",
                                     config={"recipe": self.recipe.name, "rl": cfg.model_dump(mode="json"),
                                             "seed": self.seed}, resume="allow")

    def _make_engine(self):
        from rl.engines import TransformersEngine, VLLMEngine, eos_ids_of
        unwrapped = self.acc.unwrap_model(self.model)
        if self.cfg.engine == "vllm":
            return VLLMEngine(self.init, self.tok, eos_ids_of(unwrapped, self.tok),
                              gpu_memory_utilization=self.cfg.vllm_gpu_memory_utilization, seed=self.seed)
        return TransformersEngine(unwrapped, self.tok)

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

    def _reduce(self, sums: dict[str, float], op: str = "sum") -> dict[str, float]:
        """Sum (or max) scalars over processes."""
        import torch
        if self.acc.num_processes == 1:
            return dict(sums)
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

    def iteration(self, it: int) -> dict:
        import torch

        from rl.loss import ppo_loss, trajectory_mean_scale
        from rl.rollout import collect_rollouts
        from sandbox.metrics import aggregate

        cfg, acc = self.cfg, self.acc
        t_iter = time.perf_counter()
        tasks = self.tasks_for(it)[acc.process_index:: acc.num_processes]
        batch = collect_rollouts(self.engine, tasks, cfg.group_size, seed=self.seed * 100_003 + it * 101 +
                                 acc.process_index, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                 memory_size=cfg.memory_size, max_steps=cfg.max_steps,
                                 human_factory=self.human_factory)
        t0 = time.perf_counter()
        verdicts = [self.rewarder.score(t) for t in batch.trajectories]
        rw = rollout_rewards(batch, verdicts, cfg.reward)
        judge_s = time.perf_counter() - t0
        samples = batch.samples
        keep = np.flatnonzero(rw["keep"])
        rows = [samples[k] for k in keep]
        group_ids = np.array([batch.groups[samples[k].traj] for k in keep], dtype=np.int64)
        traj_ids = np.array([samples[k].traj for k in keep], dtype=np.int64)
        step_idx = np.array([samples[k].step for k in keep], dtype=np.int64)
        anchors = anchor_codes([samples[k].anchor for k in keep])
        estimator = get_advantage_estimator(cfg.algorithm)
        kwargs = {"gamma": cfg.gamma, "normalize": cfg.normalize}
        if cfg.algorithm == "gigpo":
            kwargs["step_weight"] = cfg.effective_step_weight()
        adv = estimator(group_ids, traj_ids, step_idx, anchors, rw["step_rewards"][keep], rw["returns"][keep],
                        **kwargs) if len(rows) else np.zeros(0)
        _, anchor_stats = anchor_state_groups(group_ids, anchors) if len(rows) else (None, {})

        # ---- update
        t0 = time.perf_counter()
        model = self.model
        unwrapped = acc.unwrap_model(model)
        n_tok_local = float(sum(len(r.response_ids) for r in rows))
        n_tok = self._reduce({"n": n_tok_local})["n"]
        active = [i for i in range(len(rows)) if abs(adv[i]) > 1e-12 or self.ref is not None]
        adv_loss = adv
        if cfg.loss_agg == "trajectory-mean" and len(rows):
            # scale each row's advantage by n_tok / (K * tokens of its trajectory): under the token-mean below
            # every trajectory then weighs 1/K (the clipped surrogate is linear in a positive scale of A)
            k_total = self._reduce({"k": float(np.unique(traj_ids).size)})["k"]
            adv_loss = adv * trajectory_mean_scale(traj_ids, [len(r.response_ids) for r in rows], n_tok, k_total)
        mb = cfg.micro_batch_rows
        # old log-probs: the engine's own, kept with the ids at sampling time (token in, token out), or computed
        # once before the update on the kept ids when the engine's numerics differ from the trainer's (vLLM)
        mode = cfg.old_logprobs
        if mode == "auto":
            mode = "rollout" if getattr(self.engine, "logprobs_exact", False) else "recompute"
        old: dict = {}
        ref: dict = {}
        with torch.no_grad():
            for lo in range(0, len(active), mb):
                part = active[lo: lo + mb]
                if mode == "rollout":
                    for i in part:
                        old[i] = torch.tensor(rows[i].logprobs, dtype=torch.float32)
                else:
                    _, (lp, _) = self._logprobs(unwrapped, [rows[i] for i in part], cfg.temperature)
                    for j, i in enumerate(part):
                        old[i] = lp[j, : len(rows[i].response_ids)].clone()
                if self.ref is not None:
                    _, (rl_, _) = self._logprobs(self.ref, [rows[i] for i in part], cfg.temperature)
                    for j, i in enumerate(part):
                        ref[i] = rl_[j, : len(rows[i].response_ids)].clone()
        stats = {"loss": 0.0, "clipped_tokens": 0.0, "ratio_sum": 0.0, "kl_sum": 0.0, "entropy_sum": 0.0,
                 "trained_tokens": 0.0, "grad_norm": 0.0, "optimizer_steps": 0.0}
        world = acc.num_processes
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
                    sync = ci == n_chunks - 1
                    ctx = acc.no_sync(model) if (world > 1 and not sync) else _nullcontext()
                    with ctx:
                        if chunk is None or len(chunk) == 0:
                            # keeps every process's collective calls in step; contributes a zero gradient
                            packed, (lp, _) = self._logprobs(model, [rows[0] if rows else samples[0]],
                                                             cfg.temperature)
                            loss = lp.sum() * 0.0
                        else:
                            idx = [active[int(c)] for c in chunk]
                            sel = [rows[i] for i in idx]
                            packed, (lp, ent) = self._logprobs(model, sel, cfg.temperature,
                                                               entropy=True)
                            old_t = torch.zeros_like(lp)
                            ref_t = torch.zeros_like(lp) if self.ref is not None else None
                            for j, i in enumerate(idx):
                                old_t[j, : len(rows[i].response_ids)] = old[i].to(lp.device)
                                if ref_t is not None:
                                    ref_t[j, : len(rows[i].response_ids)] = ref[i]
                            mask = packed.response_mask.to(lp.device)
                            a = torch.tensor(adv_loss[idx], dtype=lp.dtype, device=lp.device)
                            loss, st = ppo_loss(lp, old_t, a, mask, per_step_tokens, cfg.clip_eps, cfg.clip_eps_high,
                                                ref_t, cfg.kl_coef)
                            stats["clipped_tokens"] += st["clipped_tokens"]
                            stats["ratio_sum"] += st["ratio_sum"]
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
        update_s = time.perf_counter() - t0

        # ---- metrics (summed over processes, then divided)
        m = aggregate(batch.trajectories)
        kept = rw["traj_keep"]
        sums = {"episodes": m["episodes"], "success": m["tsr"] * m["episodes"], "gcr": m["gcr"] * m["episodes"],
                "steps": float(len(samples)), "invalid": m["invalid_action_rate"] * len(samples),
                "return_sum": float(rw["traj_return"][kept].sum()), "return_n": float(kept.sum()),
                "judge_dropped": float((~kept).sum()), "rows": float(len(rows)), "active_rows": float(len(active)),
                "adv_abs": float(np.abs(adv).sum()), "adv_zero": float((np.abs(adv) <= 1e-12).sum()),
                "anchor_groups": float(anchor_stats.get("num_step_groups", 0)),
                "anchor_size1": float(anchor_stats.get("frac_size1_groups", 0.0) *
                                      anchor_stats.get("num_step_groups", 0)),
                "gen_tokens": float(batch.generated_tokens), "truncated": float(batch.truncated_responses),
                "generate_s": batch.generate_seconds, "env_s": batch.env_seconds, "judge_s": judge_s,
                "update_s": update_s, **stats}
        tot = self._reduce(sums)
        n_steps = max(tot["steps"], 1.0)
        trained = max(tot["trained_tokens"], 1.0)
        out = {"kind": "train", "iteration": it + 1, "episodes": int(tot["episodes"]),
               "success_rate": round(tot["success"] / max(tot["episodes"], 1), 4),
               "gcr": round(tot["gcr"] / max(tot["episodes"], 1), 4),
               "mean_return": round(tot["return_sum"] / max(tot["return_n"], 1), 4),
               "mean_steps": round(tot["steps"] / max(tot["episodes"], 1), 3),
               "invalid_action_rate": round(tot["invalid"] / n_steps, 4),
               "judge_dropped_episodes": int(tot["judge_dropped"]),
               "rows": int(tot["rows"]), "active_rows": int(tot["active_rows"]),
               "adv_mean_abs": round(tot["adv_abs"] / max(tot["rows"], 1), 4),
               "adv_zero_frac": round(tot["adv_zero"] / max(tot["rows"], 1), 4),
               "anchor_groups": int(tot["anchor_groups"]),
               "anchor_size1_frac": round(tot["anchor_size1"] / max(tot["anchor_groups"], 1), 4),
               "anchor_size_distribution": anchor_stats.get("size_distribution") if world == 1 else None,
               "loss": round(tot["loss"] / world, 6),
               "clip_frac": round(tot["clipped_tokens"] / trained, 4),
               "ratio_mean": round(tot["ratio_sum"] / trained, 4),
               "old_logprobs": mode,
               "kl": round(tot["kl_sum"] / trained, 6), "entropy": round(tot["entropy_sum"] / trained, 4),
               "grad_norm": round(tot["grad_norm"] / max(tot["optimizer_steps"], 1), 4),
               "optimizer_steps": int(tot["optimizer_steps"] / world),
               "response_tokens": int(tot["gen_tokens"]), "truncated_responses": int(tot["truncated"]),
               "generate_s": round(tot["generate_s"] / world, 2), "env_s": round(tot["env_s"] / world, 2),
               "judge_s": round(tot["judge_s"] / world, 2), "update_s": round(tot["update_s"] / world, 2),
               "iteration_s": round(time.perf_counter() - t_iter, 2)}
        return out

    # ------------------------------------------------------------------ evaluation

    def _initial_eval_cache(self) -> Path:
        """Where the starting checkpoint's test evaluation is kept: runs from one checkpoint (seeds, GiGPO and
        GRPO) share it. Keyed by the weights file, the test tasks and the evaluation settings."""
        import hashlib
        h = hashlib.sha256()
        for f in sorted(self.init.glob("*.safetensors")):
            h.update(f.name.encode())
            h.update(str(f.stat().st_size).encode())
            h.update(str(f.stat().st_mtime_ns).encode())
        h.update(json.dumps([[t.id, t.instruction, t.step_budget] for t in self.test]).encode())
        h.update(json.dumps([[t.id, t.instruction, t.step_budget] for t in self.pool_eval]).encode())
        h.update(json.dumps(sorted(self.compositional)).encode())
        h.update(json.dumps([self.recipe.eval.seed, self.cfg.max_new_tokens, self.cfg.memory_size]).encode())
        return self.init / f"rl_initial_eval_{h.hexdigest()[:16]}.json"

    def evaluate(self, it: int) -> dict | None:
        """Greedy play of the current policy on the test split (main process; the others wait): metrics per
        difficulty and "all"; when some test tasks target only combinations never targeted in training, also
        "compositional" (those, as `sft.metrics.compositional_split` picks them) and "seen" (the others); with
        `rl.eval_pool_tasks` also "pool" (the fixed sample of the RL pool, played the same way)."""
        from agent.clients import TransformersClient
        from evaluation.sandbox_eval import run_model_batched
        from sandbox.metrics import aggregate, split_metrics
        out = None
        cache = self._initial_eval_cache() if it == 0 else None
        if self.acc.is_main_process and cache is not None and cache.is_file():
            out = {**json.loads(cache.read_text()), "cached": True}
        elif self.acc.is_main_process:
            t0 = time.perf_counter()
            model = self.acc.unwrap_model(self.model)
            client = TransformersClient(model, self.tok, max_new_tokens=self.cfg.max_new_tokens,
                                        batch_size=self.cfg.eval_batch, device=str(self.acc.device))

            def play(tasks: list, first_seed: int) -> list:
                seeds = [self.recipe.eval.seed * 100_003 + first_seed + i for i in range(len(tasks))]
                return run_model_batched(tasks, client, seeds, batch_size=self.cfg.eval_batch,
                                         memory_size=self.cfg.memory_size, name="student",
                                         human_factory=self.human_factory)

            trajs = play(self.test, 0)
            m = split_metrics(trajs)
            if self.compositional:
                m["seen"] = aggregate([t for t in trajs if t.task_id not in self.compositional])
                m["compositional"] = aggregate([t for t in trajs if t.task_id in self.compositional])
            if self.pool_eval:
                m["pool"] = aggregate(play(self.pool_eval, 50_000))
            model.train()
            out = {"kind": "eval", "iteration": it, "split": "test", "seconds": round(time.perf_counter() - t0, 1),
                   **{d: {k: m[d][k] for k in ("episodes", "tsr", "gcr", "mean_steps", "invalid_action_rate")}
                      for d in EVAL_GROUPS if d in m}}
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
            torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                        "torch": torch.random.get_rng_state()}, tmp / "rng.pt")
            p = self.rewarder.prompt
            write_json(tmp / "state.json", {"iteration": iteration, "algorithm": self.cfg.algorithm,
                                            "seed": self.seed, "recipe": self.recipe.name,
                                            "reward_prompt": {"name": p.name, "version": p.version,
                                                              "hash": p.content_hash()}})
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # a checkpoint exists whole or not at all
            for old in sorted(root.glob("iter_*"))[:-2]:   # keep the last two
                shutil.rmtree(old)
        acc.wait_for_everyone()

    def _restore_rng(self, ckpt: Path) -> None:
        import torch
        rng = torch.load(ckpt / "rng.pt", weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.random.set_rng_state(rng["torch"])

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
            for d in EVAL_GROUPS:
                if isinstance(row.get(d), dict):
                    flat.update({f"eval/{d}/{k}": v for k, v in row[d].items()})
            self._wandb.log(flat, step=row["iteration"])

    # ------------------------------------------------------------------ the run

    def train(self) -> dict:
        from tqdm import tqdm
        self.setup()
        cfg, acc = self.cfg, self.acc
        ckpt = self.latest_checkpoint()
        if ckpt is not None and self.resume:
            self._restore_rng(ckpt)
        t_run = time.perf_counter()
        if self.start_iteration == 0 and cfg.eval_every:
            ev = self.evaluate(0)
            if ev:
                self.log(ev)
        bar = tqdm(range(self.start_iteration, cfg.iterations), initial=self.start_iteration, total=cfg.iterations,
                   desc=f"{cfg.algorithm} iterations", disable=not (self.show_progress and acc.is_main_process))
        for it in bar:
            row = self.iteration(it)
            row["rss_mb"] = round(_rss_mb(), 1)
            self.log(row)
            bar.set_postfix(success=row["success_rate"], ret=row["mean_return"], s=row["iteration_s"])
            done = it + 1
            if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.iterations):
                ev = self.evaluate(done)
                if ev:
                    self.log(ev)
            if done % cfg.save_every == 0 or done == cfg.iterations:
                self.save_checkpoint(done)
        summary = None
        if acc.is_main_process:
            final = self.out / "final"
            tmp = self.out / ".tmp-final"
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
                plot_curves(self.metrics_path, self.out / "curves.png", title=f"{self.recipe.name} {cfg.algorithm}")
        if self._wandb is not None:
            import wandb
            self._wandb.finish()
            wandb.teardown()  # the process-wide wandb settings (dir, mode) go with the run
        acc.wait_for_everyone()
        return summary or {}

    def summarize(self, seconds: float) -> dict:
        rows = [json.loads(ln) for ln in self.metrics_path.read_text().splitlines() if ln.strip()]
        train = [r for r in rows if r["kind"] == "train"]
        evals = [r for r in rows if r["kind"] == "eval"]
        return {"recipe": self.recipe.name, "algorithm": self.cfg.algorithm, "seed": self.seed,
                "init": str(self.init), "iterations": len(train), "processes": self.acc.num_processes,
                "rollout_episodes": sum(r["episodes"] for r in train),
                "initial_eval": evals[0] if evals and evals[0]["iteration"] == 0 else None,
                "final_eval": evals[-1] if evals else None,
                "train_success_first": train[0]["success_rate"] if train else None,
                "train_success_last": train[-1]["success_rate"] if train else None,
                "seconds_this_session": round(seconds, 1), "peak_rss_mb": round(_rss_mb(), 1),
                "final": str(self.out / "final"), "rl": self.cfg.model_dump(mode="json")}


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _complete_json(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


def plot_curves(metrics_path: Path, png: Path, title: str = "") -> Path | None:
    """Training success rate and mean return per iteration, and test TSR (and GCR) at each evaluation (PNG)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dependency; stay usable without it
        return None
    rows = [json.loads(ln) for ln in Path(metrics_path).read_text().splitlines() if ln.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    it = [r["iteration"] for r in train]
    axes[0].plot(it, [r["success_rate"] for r in train], label="rollout success")
    axes[0].plot(it, [r["mean_return"] for r in train], label="mean return")
    axes[0].set_xlabel("iteration")
    axes[0].legend()
    for d in ("easy", "medium", "hard", "all"):
        axes[1].plot([r["iteration"] for r in evals], [r[d]["tsr"] for r in evals], marker="o", label=f"test TSR {d}")
    axes[1].plot([r["iteration"] for r in evals], [r["all"]["gcr"] for r in evals], "k--", marker="x",
                 label="test GCR all")
    pool = [r for r in evals if "pool" in r]
    if pool:
        axes[1].plot([r["iteration"] for r in pool], [r["pool"]["tsr"] for r in pool], ":", marker="s",
                     label="RL-pool TSR")
    axes[1].set_xlabel("iteration")
    axes[1].set_ylim(-0.02, 1.02)
    axes[1].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = png.with_name(png.stem + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, png)
    return png
