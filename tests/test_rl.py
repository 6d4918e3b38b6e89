"""GiGPO RL: the loss's sign and clipping, token-exact log-probs of packed rows, lockstep group rollouts,
judge rewards, one real iteration end to end, exact resume, two-process DDP, and bad input."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rl.loss import pack, ppo_loss, token_logprobs

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ loss


def test_ppo_loss_sign_follows_the_advantage():
    mask = torch.ones(1, 3)
    for a, sign in ((1.0, -1.0), (-1.0, 1.0)):
        logp = torch.zeros(1, 3, requires_grad=True)
        loss, _ = ppo_loss(logp, torch.zeros(1, 3), torch.tensor([a]), mask, n_tokens=3)
        loss.backward()
        # a positive advantage pushes the log-probs up (the loss falls as they rise), a negative one down
        assert torch.all(torch.sign(logp.grad) == sign)
        assert loss.item() == pytest.approx(-a)


def test_ppo_loss_clips_only_in_the_direction_the_advantage_pushes():
    mask = torch.ones(1, 1)
    old = torch.zeros(1, 1)
    cases = [  # (log ratio, advantage, gradient expected)
        (np.log(1.5), 1.0, False),   # ratio above 1 + eps with A > 0: clipped, no gradient
        (np.log(0.5), -1.0, False),  # ratio below 1 - eps with A < 0: clipped
        (np.log(0.5), 1.0, True),    # below 1 - eps but A > 0: the unclipped term is the minimum
        (np.log(1.5), -1.0, True),   # above 1 + eps but A < 0: unclipped
        (np.log(1.1), 1.0, True),    # inside the trust region
    ]
    for lr, a, grad in cases:
        logp = torch.full((1, 1), float(lr), requires_grad=True)
        loss, st = ppo_loss(logp, old, torch.tensor([a]), mask, n_tokens=1, clip_eps=0.2)
        loss.backward()
        assert (logp.grad.abs().item() > 0) == grad, (lr, a)
        assert st["clipped_tokens"] == (0.0 if grad else 1.0)
    # the asymmetric upper clip widens only the upper side
    logp = torch.full((1, 1), float(np.log(1.25)), requires_grad=True)
    loss, _ = ppo_loss(logp, old, torch.tensor([1.0]), mask, n_tokens=1, clip_eps=0.2, clip_eps_high=0.28)
    loss.backward()
    assert logp.grad.abs().item() > 0


def test_ppo_loss_is_a_token_mean_and_masks_padding_and_adds_k3_kl():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = ppo_loss(logp, logp.detach(), torch.tensor([2.0, -1.0]), mask, n_tokens=3)
    assert loss.item() == pytest.approx(-(2.0 + 2.0 - 1.0) / 3)   # ratio 1: -sum(A) over real tokens / n
    loss.backward()
    assert logp.grad[0, 2].item() == 0 and logp.grad[1, 1].item() == 0
    ref = logp.detach() - 0.1
    loss_kl, st = ppo_loss(logp, logp.detach(), torch.zeros(2), mask, n_tokens=3, ref_logp=ref, kl_coef=0.5)
    k3 = np.exp(-0.1) + 0.1 - 1.0
    assert loss_kl.item() == pytest.approx(0.5 * k3, rel=1e-4) and st["kl_sum"] == pytest.approx(3 * k3, rel=1e-4)
    with pytest.raises(ValueError, match="n_tokens"):
        ppo_loss(logp, logp, torch.zeros(2), mask, n_tokens=0)


def test_trajectory_mean_gives_every_trajectory_the_same_weight():
    from rl.loss import trajectory_mean_scale
    traj = np.array([7, 7, 7, 3, 9, 9])         # a long trajectory, a one-step one, a two-step one
    tokens = np.array([5, 4, 6, 3, 2, 8])
    n_tok = float(tokens.sum())
    scale = trajectory_mean_scale(traj, tokens, n_tok, 3)
    weight = {t: float((scale * tokens)[traj == t].sum()) for t in (7, 3, 9)}
    assert weight == pytest.approx({7: n_tok / 3, 3: n_tok / 3, 9: n_tok / 3})
    assert np.all(scale[traj == 7] == scale[0])  # one factor per trajectory: its rows keep their proportions
    # in the loss: with A = 1 everywhere and ratio 1, each trajectory contributes 1/3 of -1
    adv = torch.tensor(scale, dtype=torch.float32)
    mask = torch.zeros(6, 8)
    for i, k in enumerate(tokens):
        mask[i, :k] = 1.0
    lp = torch.zeros(6, 8)
    loss, _ = ppo_loss(lp, lp, adv, mask, n_tok)
    assert float(loss) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="one length"):
        trajectory_mean_scale(traj, tokens[:3], n_tok, 3)


def test_packed_rows_give_the_log_probs_of_each_row_alone():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    model.eval()
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    responses = [[20, 21], [22, 23, 24, 25], [26]]
    packed = pack(prompts, responses, pad_id=0)
    lp, ent = token_logprobs(model, packed, temperature=0.7, with_entropy=True)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p) - 1: len(p) + len(r) - 1] / 0.7
        alone = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(lp[i, : len(r)].detach(), alone, atol=1e-5)
        assert packed.response_mask[i].sum().item() == len(r)
    assert ent.shape == lp.shape and bool((ent >= 0).all())


# ------------------------------------------------------------------------------------------------ a real student


@pytest.fixture(scope="module")
def ci_setup(tmp_path_factory):
    """The ci recipe's real distillation and a few SFT steps: a real (weak) student to roll out."""
    from pipeline.recipe import load_recipe
    from pipeline.stages import run_distill_stage, run_sft_stage
    out = tmp_path_factory.mktemp("rl")
    recipe = load_recipe(ROOT / "recipes" / "ci.yaml")
    run_distill_stage(recipe, out / "distill", show_progress=False)
    run_sft_stage(recipe, out / "distill" / "dataset", out / "sft", show_progress=False)
    return recipe, out / "sft" / "final"


def _small_rl(recipe, **kw):
    rl = recipe.rl.model_copy(update={"eval_every": 0, **kw})
    return recipe.model_copy(update={"rl": rl})


def test_lockstep_rollouts_share_initial_states_and_keep_token_ids(ci_setup):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent.tools import tool_definitions
    from pipeline.stages import build_tasks
    from rl.engines import TransformersEngine
    from rl.rollout import collect_rollouts
    recipe, final = ci_setup
    tok = AutoTokenizer.from_pretrained(final)
    engine = TransformersEngine(AutoModelForCausalLM.from_pretrained(final), tok)
    tasks = build_tasks(recipe, show_progress=False)[0]["train"][:2]
    a = collect_rollouts(engine, tasks, group_size=3, seed=5, temperature=1.0, max_new_tokens=12, max_steps=3)
    b = collect_rollouts(engine, tasks, group_size=3, seed=5, temperature=1.0, max_new_tokens=12, max_steps=3)
    assert a.groups == [0, 0, 0, 1, 1, 1]
    for g in (0, 1):
        trajs = [t for t, gg in zip(a.trajectories, a.groups, strict=True) if gg == g]
        assert len({t.initial_state_key for t in trajs}) == 1 and len({t.task_id for t in trajs}) == 1
    assert [s.response_ids for s in a.samples] == [s.response_ids for s in b.samples]   # seeded sampling
    tools = tool_definitions()
    for s in a.samples:
        turn = a.trajectories[s.traj].turns[s.step]
        assert s.prompt_ids == engine.encode(turn.prompt, tools)          # exactly what the policy saw
        assert engine.decode(s.response_ids)[0] == turn.raw_output        # and exactly what it wrote
        prev = a.trajectories[s.traj].turns[s.step - 1].state_key if s.step else \
            a.trajectories[s.traj].initial_state_key
        assert s.anchor == prev                                           # the state the step acted from
        assert len(s.response_ids) <= 12
    assert all(len(t.turns) <= 3 for t in a.trajectories)
    # the kept log-probs are the trainer's log-probs of the kept ids (the old policy of the PPO ratio)
    packed = pack([s.prompt_ids for s in a.samples], [s.response_ids for s in a.samples], engine.pad_id)
    with torch.no_grad():
        lp, _ = token_logprobs(engine.model, packed, temperature=1.0)
    for k, s in enumerate(a.samples):
        assert len(s.logprobs) == len(s.response_ids)
        assert torch.allclose(lp[k, : len(s.response_ids)], torch.tensor(s.logprobs), atol=1e-4)
    # distinct samples within a group (temperature 1 on a weak student)
    assert len({tuple(s.response_ids) for s in a.samples}) > 1


def test_rewards_mix_judge_and_success_and_drop_judge_errors(ci_setup):
    from evaluation.sandbox_eval import evaluate
    from pipeline.stages import build_tasks, make_reward_engine
    from rl.config import RewardMix
    from rl.rollout import RolloutBatch, StepSample
    from rl.trainer import rollout_rewards
    recipe, _ = ci_setup
    tasks = build_tasks(recipe, show_progress=False)[0]["train"][:2]
    trajs = evaluate(tasks, "expert")[1]
    samples = [StepSample(traj=i, step=k, anchor="x", prompt_ids=[1], response_ids=[2], logprobs=[-0.5])
               for i, t in enumerate(trajs) for k in range(len(t.turns))]
    batch = RolloutBatch(trajectories=trajs, groups=[0, 1], samples=samples)
    engine = make_reward_engine(recipe)
    verdicts = [engine.score(t) for t in trajs]
    mix = RewardMix(success=1.0, episode=0.5, turn=0.1)
    rw = rollout_rewards(batch, verdicts, mix)
    for i, (t, v) in enumerate(zip(trajs, verdicts, strict=True)):
        rows = [k for k, s in enumerate(samples) if s.traj == i]
        terminal = float(t.success) + 0.5 * v.episode.score
        assert rw["step_rewards"][rows[-1]] == pytest.approx(0.1 * v.turns[-1].score + terminal)
        assert rw["step_rewards"][rows[0]] == pytest.approx(0.1 * v.turns[0].score + (terminal if len(rows) == 1
                                                                                      else 0.0))
        assert rw["traj_return"][i] == pytest.approx(terminal + 0.1 * np.mean([u.score for u in v.turns]))
    assert rw["keep"].all()
    broken = verdicts[0].model_copy(update={"judge_errors": 1})
    rw2 = rollout_rewards(batch, [broken, verdicts[1]], mix)
    assert not rw2["traj_keep"][0] and rw2["traj_keep"][1]
    assert not rw2["keep"][[s.traj == 0 for s in samples]].any()


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def test_one_iteration_end_to_end_then_exact_resume(ci_setup, tmp_path):
    from pipeline.stages import make_rl_trainer
    from rl.trainer import RLError
    recipe, final = ci_setup
    r = _small_rl(recipe, iterations=2, save_every=1)
    straight = make_rl_trainer(r, tmp_path / "straight", final, show_progress=False).train()
    assert straight["iterations"] == 2 and straight["rollout_episodes"] == 8
    assert (tmp_path / "straight" / "final" / "config.json").is_file()
    assert (tmp_path / "straight" / "curves.png").stat().st_size > 1000
    rows = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in rows] == [1, 2]
    first = rows[0]
    assert first["rows"] > 0 and first["response_tokens"] > 0 and "anchor_size_distribution" in first
    # the update moved the weights
    w0, w2 = _weights(final), _weights(tmp_path / "straight" / "final")
    assert any(not torch.equal(w0[k], w2[k]) for k in w0)
    # the same run cut after one iteration and resumed ends bit for bit where the straight one did
    make_rl_trainer(_small_rl(recipe, iterations=1, save_every=1), tmp_path / "cut", final,
                    show_progress=False).train()
    with pytest.raises(RLError, match="--resume"):
        make_rl_trainer(r, tmp_path / "cut", final, show_progress=False).train()
    resumed = make_rl_trainer(r, tmp_path / "cut", final, resume=True, show_progress=False).train()
    assert resumed["iterations"] == 2
    wa, wb = _weights(tmp_path / "straight" / "final"), _weights(tmp_path / "cut" / "final")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    cut_rows = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    timing = ("generate_s", "env_s", "judge_s", "update_s", "iteration_s", "rss_mb")
    strip = [{k: v for k, v in x.items() if k not in timing} for x in rows]
    assert [{k: v for k, v in x.items() if k not in timing} for x in cut_rows] == strip
    state = json.loads(sorted((tmp_path / "cut" / "checkpoints").glob("iter_*"))[-1].joinpath("state.json")
                       .read_text())
    assert state["iteration"] == 2 and state["reward_prompt"]["version"] >= 1


class _Killed(BaseException):
    """What a kill -9 leaves: the run stops where it is, its files as they were."""


def test_resume_before_the_first_checkpoint_starts_over_without_duplicate_rows(ci_setup, tmp_path, monkeypatch):
    from pipeline.stages import make_rl_trainer
    from rl.trainer import GiGPOTrainer
    recipe, final = ci_setup
    r = _small_rl(recipe, iterations=2, save_every=2, eval_every=2, eval_tasks=2)
    straight = tmp_path / "straight"
    make_rl_trainer(r, straight, final, show_progress=False).train()
    real = GiGPOTrainer.iteration

    def killed_in_iteration_2(self, it):
        if it == 1:
            raise _Killed
        return real(self, it)

    monkeypatch.setattr(GiGPOTrainer, "iteration", killed_in_iteration_2)
    with pytest.raises(_Killed):   # after the iteration-0 evaluation and iteration 1, before any checkpoint
        make_rl_trainer(r, tmp_path / "cut", final, show_progress=False).train()
    monkeypatch.setattr(GiGPOTrainer, "iteration", real)
    assert not (tmp_path / "cut" / "checkpoints").exists()
    assert [(x["kind"], x["iteration"]) for x in map(json.loads, (tmp_path / "cut" / "metrics.jsonl").read_text()
                                                     .splitlines())] == [("eval", 0), ("train", 1)]
    make_rl_trainer(r, tmp_path / "cut", final, resume=True, show_progress=False).train()
    rows = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [(x["kind"], x["iteration"]) for x in rows] == [("eval", 0), ("train", 1), ("train", 2), ("eval", 2)]
    timing = ("generate_s", "env_s", "judge_s", "update_s", "iteration_s", "rss_mb", "seconds", "cached")
    assert [{k: v for k, v in x.items() if k not in timing} for x in rows] == \
        [{k: v for k, v in x.items() if k not in timing} for x in want]


class _Bomb:
    """A pickle that, when loaded, creates a file: what a planted checkpoint file could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_resume_unpickles_nothing_from_the_output_folder(ci_setup, tmp_path):
    from pipeline.stages import make_rl_trainer
    recipe, final = ci_setup
    out = tmp_path / "run"
    make_rl_trainer(_small_rl(recipe, iterations=1, save_every=1), out, final, show_progress=False).train()
    ckpt = out / "checkpoints" / "iter_000001"
    assert sorted(p.name for p in ckpt.iterdir()) == ["model", "optimizer.pt", "rng.json", "state.json"]
    marker = tmp_path / "pwned"
    torch.save(_Bomb(marker), ckpt / "rng.pt")      # an old-style RNG file: never read
    make_rl_trainer(_small_rl(recipe, iterations=2, save_every=1), out, final, resume=True,
                    show_progress=False).train()
    assert not marker.exists()
    ckpt = out / "checkpoints" / "iter_000002"
    torch.save(_Bomb(marker), ckpt / "optimizer.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        make_rl_trainer(_small_rl(recipe, iterations=3, save_every=1), out, final, resume=True,
                        show_progress=False).train()
    assert not marker.exists()


def test_the_update_does_not_depend_on_the_micro_batch_size(ci_setup, tmp_path):
    """Micro-batches (sorted by length within a mini-batch, so they pad less) only split the mini-batch's
    gradient into a sum: one micro-batch per mini-batch and micro-batches of 2 rows give the same weights.
    With trajectories of equal length the trajectory-mean loss is the token-mean (unequal ones: the test above)."""
    from pipeline.stages import make_rl_trainer
    recipe, final = ci_setup
    whole = _small_rl(recipe, iterations=1, save_every=1, micro_batch_rows=10_000, mini_batches=2)
    split = _small_rl(recipe, iterations=1, save_every=1, micro_batch_rows=2, mini_batches=2)
    a = make_rl_trainer(whole, tmp_path / "whole", final, show_progress=False).train()
    b = make_rl_trainer(split, tmp_path / "split", final, show_progress=False).train()
    assert a["rollout_episodes"] == b["rollout_episodes"] > 0
    row = json.loads((tmp_path / "split" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["active_rows"] > 4 and row["optimizer_steps"] == 2  # several micro-batches per mini-batch
    w0, wa, wb = _weights(final), _weights(tmp_path / "whole" / "final"), _weights(tmp_path / "split" / "final")
    moved = max(float((wa[k] - w0[k]).abs().max()) for k in w0)
    apart = max(float((wa[k] - wb[k]).abs().max()) for k in w0)
    # float sums in another order only: Adam can turn a near-zero gradient's rounding into a small step, so
    # the two runs differ by a tiny fraction of what the update moved
    assert moved > 1e-5 and apart < 0.05 * moved, (moved, apart)
    # rl.loss_agg: trajectory-mean runs in the trainer; here every trajectory has the same number of tokens
    # (each response runs to max_new_tokens, each episode to max_steps), where it is the token-mean
    per_traj = _small_rl(recipe, iterations=1, save_every=1, mini_batches=2, loss_agg="trajectory-mean")
    c = make_rl_trainer(per_traj, tmp_path / "traj", final, show_progress=False).train()
    assert c["rollout_episodes"] == a["rollout_episodes"]
    cfg = per_traj.rl
    assert row["response_tokens"] == row["rows"] * cfg.max_new_tokens and row["mean_steps"] == cfg.max_steps
    wc = _weights(tmp_path / "traj" / "final")
    assert max(float((wc[k] - wa[k]).abs().max()) for k in w0) < 0.05 * moved


def test_grpo_plays_the_same_rollouts_with_episode_level_advantages_only(ci_setup, tmp_path, monkeypatch):
    from pipeline.stages import make_rl_trainer
    recipe, final = ci_setup
    r = _small_rl(recipe, iterations=1, save_every=1)
    make_rl_trainer(r, tmp_path / "gigpo", final, show_progress=False).train()
    monkeypatch.setenv("WANDB_MODE", "offline")    # and the wandb logging path, offline
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    r_wandb = r.model_copy(update={"rl": r.rl.model_copy(update={"wandb": True})})
    make_rl_trainer(r_wandb, tmp_path / "grpo", final, algorithm="grpo", show_progress=False).train()
    assert list((tmp_path / "grpo" / "wandb").glob("offline-run-*"))
    g = json.loads((tmp_path / "gigpo" / "metrics.jsonl").read_text().splitlines()[0])
    p = json.loads((tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()[0])
    # equal rollout budget and the same samples (same seed, same starting weights)
    assert (g["episodes"], g["rows"], g["response_tokens"]) == (p["episodes"], p["rows"], p["response_tokens"])
    assert json.loads((tmp_path / "grpo" / "metrics.json").read_text())["rl"]["algorithm"] == "grpo"


def test_the_starting_checkpoint_is_evaluated_once_per_test_split(ci_setup, tmp_path):
    import shutil

    from pipeline.stages import make_rl_trainer
    recipe, final = ci_setup
    init = tmp_path / "init"   # the checkpoint without the caches that earlier tests' evaluations left beside it
    shutil.copytree(final, init, ignore=shutil.ignore_patterns("rl_initial_eval_*.json"))
    r = _small_rl(recipe, iterations=1, eval_every=1, eval_tasks=1, save_every=1)
    a = make_rl_trainer(r, tmp_path / "a", init, show_progress=False).train()
    b = make_rl_trainer(r, tmp_path / "b", init, algorithm="grpo", show_progress=False).train()
    assert a["initial_eval"]["all"]["episodes"] == 1 and "cached" not in a["initial_eval"]
    assert b["initial_eval"]["cached"] and b["initial_eval"]["all"] == a["initial_eval"]["all"]
    assert a["final_eval"]["iteration"] == 1 and len(list(init.glob("rl_initial_eval_*.json"))) == 1
    # the recipe's eval.constrained decodes RL's evaluations too (as `embodistill eval` and the on-policy stage
    # do), and a free decoding's figures are never read back for it
    rc = r.model_copy(update={"eval": r.eval.model_copy(update={"constrained": True})})
    c = make_rl_trainer(rc, tmp_path / "c", init, show_progress=False).train()
    assert not a["initial_eval"]["constrained_decoding"] and "cached" not in c["initial_eval"]
    assert c["initial_eval"]["constrained_decoding"] and c["final_eval"]["constrained_decoding"]
    assert len(list(init.glob("rl_initial_eval_*.json"))) == 2


def test_eval_start_false_skips_only_the_evaluation_of_the_start(ci_setup, tmp_path):
    from pipeline.stages import make_rl_trainer
    recipe, final = ci_setup
    r = _small_rl(recipe, iterations=1, eval_every=1, eval_tasks=1, save_every=1, eval_start=False)
    s = make_rl_trainer(r, tmp_path / "a", final, show_progress=False).train()
    evals = [json.loads(ln) for ln in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in ln]
    assert s["initial_eval"] is None and [e["iteration"] for e in evals] == [1]
    assert s["final_eval"]["all"]["episodes"] == 1


def test_evaluation_splits_seen_and_compositional_tasks_and_plays_a_fixed_pool_sample(ci_setup, tmp_path):
    from pipeline.recipe import SandboxSection
    from pipeline.stages import build_tasks, make_rl_trainer
    from sandbox.builder import compositional_split
    recipe, final = ci_setup
    # the rooms scene alone, 10 train and 4 test instructions: 2 of the 8 test tasks target a (type, colour)
    # never targeted in training (the SFT benchmark's compositional split)
    rooms = recipe.model_copy(update={"sandbox": SandboxSection.model_validate(
        {**recipe.sandbox.model_dump(), "scenes": ["rooms"], "train_instructions_per_scene": 10,
         "test_instructions_per_scene": 4})})
    splits = build_tasks(rooms, show_progress=False)[0]
    comp = {t.id for t in compositional_split(splits["train"], splits["test"])}
    assert len(splits["test"]) == 8 and 1 <= len(comp) < 8
    r = _small_rl(rooms, iterations=1, eval_every=1, eval_tasks=None, eval_pool_tasks=3, save_every=1)
    a = make_rl_trainer(r, tmp_path / "a", final, show_progress=False)
    s = a.train()
    assert len(a.pool_eval) == 3 and a.compositional == comp
    for ev in (s["initial_eval"], s["final_eval"]):
        assert ev["pool"]["episodes"] == 3 and ev["all"]["episodes"] == 8
        assert ev["compositional"]["episodes"] == len(comp) and ev["seen"]["episodes"] == 8 - len(comp)
        assert ev["seen"]["tsr"] * (8 - len(comp)) + ev["compositional"]["tsr"] * len(comp) == \
            pytest.approx(ev["all"]["tsr"] * 8, abs=1e-3)
    b = make_rl_trainer(_small_rl(rooms, iterations=1, eval_pool_tasks=3), tmp_path / "b", final, seed=1,
                     show_progress=False)
    b.setup()
    assert [t.id for t in b.pool_eval] == [t.id for t in a.pool_eval]  # one sample for every seed
    plain = make_rl_trainer(_small_rl(recipe, iterations=1), tmp_path / "c", final, show_progress=False)
    plain.setup()
    assert plain.pool_eval == [] and plain.compositional == set()


def test_two_processes_train_with_ddp(ci_setup, tmp_path):
    """torchrun with two CPU processes (gloo): each plays its groups, gradients are averaged."""
    recipe, final = ci_setup
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           str(ROOT / "rl" / "train_gigpo.py"), str(ROOT / "recipes" / "ci.yaml"), "--init", str(final),
           "--out", str(tmp_path / "ddp"), "--iterations", "1", "--quiet"]
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    assert summary["processes"] == 2 and summary["iterations"] == 1
    row = json.loads((tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()[-1 if summary["final_eval"] is None
                                                                                   else -2])
    assert row["kind"] == "train" and row["episodes"] == recipe.rl.tasks_per_iteration * recipe.rl.group_size


# ------------------------------------------------------------------------------------------------ bad input


def test_bad_recipe_errors_name_the_key(tmp_path, capsys):
    from rl.train_gigpo import main
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nrl:\n  iteratons: 3\n")
    main([str(bad)])
    assert "rl.iteratons" in capsys.readouterr().err
    bad.write_text("name: bad\nrl:\n  algorithm: ppo\n")
    main([str(bad)])
    assert "rl.algorithm" in capsys.readouterr().err
    bad.write_text("name: bad\nrl:\n  group_size: many\n")
    assert main([str(bad)]) == 2
    assert "rl.group_size" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists() and not (ROOT / "outputs" / "bad").exists()


def test_a_missing_checkpoint_names_the_stage_that_makes_it(tmp_path, capsys):
    from rl.train_gigpo import main
    assert main([str(ROOT / "recipes" / "ci.yaml"), "--init", str(tmp_path / "nowhere"),
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "embodistill sft" in err


def test_a_fresh_task_pool_shares_no_layout_or_text_with_train_or_test(ci_setup, tmp_path):
    from pipeline.stages import build_rl_pool, build_tasks, make_rl_trainer
    recipe, final = ci_setup
    splits = build_tasks(recipe, show_progress=False)[0]
    pool = build_rl_pool(recipe, splits, 2)
    assert pool and {t.split for t in pool} == {"rl"}
    seen_layouts = {t.layout_id for s in splits.values() for t in s}
    seen_texts = {t.instruction for s in splits.values() for t in s}
    assert not {t.layout_id for t in pool} & seen_layouts
    assert not {t.instruction for t in pool} & seen_texts
    assert [t.id for t in build_rl_pool(recipe, splits, 2)] == [t.id for t in pool]  # deterministic
    # the trainer draws its tasks from it
    r = _small_rl(recipe, iterations=1, save_every=1, task_pool="fresh", pool_instructions_per_scene=2)
    trainer = make_rl_trainer(r, tmp_path / "fresh", final, show_progress=False)
    trainer.setup()
    assert {t.id for t in trainer.pool} <= {t.id for t in pool}
    assert all(t.split == "rl" for t in trainer.tasks_for(0))
