"""Tests that close the gaps mutation testing (mutmut, docs/mutation.md) found in rl/loss.py: the packed layout
cell by cell, log-probs of packed rows with a model that has absolute positions, ppo_loss's defaults and logged
sums against the module docstring's equations, and trajectory_mean_scale's bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl.loss import pack, ppo_loss, token_logprobs, trajectory_mean_scale

# ------------------------------------------------------------------------------------------------ pack


def test_pack_lays_out_pads_prompt_response_pads_cell_by_cell():
    b = pack([[3, 4, 5], [6]], [[7, 8], [9, 10, 11]], pad_id=0)
    # T = 3 (the longest response); L = max(len(p) + T) = 6; row 1's prompt is left-padded by 2
    assert b.input_ids.tolist() == [[3, 4, 5, 7, 8, 0],
                                    [0, 0, 6, 9, 10, 11]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0],
                                         [0, 0, 1, 1, 1, 1]]
    # positions count real tokens from 0; pads before the prompt sit at 0
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 4],
                                       [0, 0, 0, 1, 2, 3]]
    assert b.response_ids.tolist() == [[7, 8, 0], [9, 10, 11]]
    assert b.response_mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    assert b.input_ids.dtype == b.attention_mask.dtype == b.position_ids.dtype == torch.long
    assert b.response_ids.dtype == torch.long and b.response_mask.dtype == torch.float32


def test_pack_keeps_a_one_column_window_when_every_response_is_empty():
    b = pack([[1, 2], [3]], [[], []], pad_id=9)
    assert b.response_ids.tolist() == [[9], [9]] and b.response_mask.tolist() == [[0.0], [0.0]]
    assert b.input_ids.tolist() == [[1, 2, 9], [9, 3, 9]]
    assert b.attention_mask.tolist() == [[1, 1, 0], [0, 1, 0]]


@pytest.mark.parametrize("prompts, responses", [([], []), ([[1]], [[2], [3]]), ([[1], [2]], [[3]])])
def test_pack_rejects_empty_or_unequal_lists(prompts, responses):
    with pytest.raises(ValueError, match=r"^pack: prompts and responses must be non-empty lists of the same length$"):
        pack(prompts, responses, pad_id=0)


# ------------------------------------------------------------------------------------------------ token_logprobs


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    return model.eval()


def test_packed_log_probs_equal_each_row_alone_with_absolute_positions():
    """GPT-2 adds a learned embedding per absolute position, so a left-padded row is only right if its
    position ids start at 0 where its prompt starts (Llama's rotary positions would hide an offset)."""
    model = _gpt2()
    prompts, responses = [[3, 4, 5, 6], [8], [10, 11]], [[20, 21], [22, 23, 24], [26]]
    packed = pack(prompts, responses, pad_id=0)
    with torch.no_grad():
        lp, ent = token_logprobs(model, packed)                 # temperature 1 by default, no entropy asked
        assert ent is None
        lp_t, ent_t = token_logprobs(model, packed, temperature=0.5, with_entropy=True)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1: len(p) + len(r) - 1]
        for temp, got in ((1.0, lp), (0.5, lp_t)):
            alone = torch.log_softmax(logits / temp, -1).gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1)
            assert torch.allclose(got[i, : len(r)], alone, atol=1e-5), (i, temp)
        probs = torch.softmax(logits / 0.5, -1)
        entropy = -(probs * probs.log()).sum(-1)                # H = -sum_v p_v log p_v
        assert torch.allclose(ent_t[i, : len(r)], entropy, atol=1e-5)


# ------------------------------------------------------------------------------------------------ ppo_loss


def test_ppo_loss_default_clip_is_0_2():
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(1.5))                    # ratio 1.5, A > 0: clipped at 1 + 0.2
    loss, st = ppo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), n_tokens=1)
    assert loss.item() == pytest.approx(-1.2) and st["clipped_tokens"] == 1.0


def test_ppo_loss_per_token_advantages_weight_each_token():
    logp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 5.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss, _ = ppo_loss(logp, logp, adv, mask, n_tokens=4)       # ratio 1: loss = -sum(mask * A) / n_tokens
    assert loss.item() == pytest.approx(-(1 + 2 + 3 - 1) / 4)


def test_ppo_loss_logged_sums_follow_the_docstring_and_skip_padding():
    r = torch.tensor([[1.5, 0.6, 1.1], [0.7, 2.0, 9.0]])
    old = torch.zeros(2, 3)
    logp = torch.log(r)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])     # one pad token (ratio 9 there)
    loss, st = ppo_loss(logp, old, torch.tensor([1.0, -1.0]), mask, n_tokens=5, clip_eps=0.2)
    assert set(st) == {"clipped_tokens", "ratio_sum", "approx_kl_sum"}   # no KL term without a reference
    real = r[mask.bool()]
    assert st["ratio_sum"] == pytest.approx(float(real.sum()))
    assert st["approx_kl_sum"] == pytest.approx(float(((real - 1) - torch.log(real)).sum()), rel=1e-5)
    # clipped: row 0 (A > 0) ratio 1.5 > 1.2; row 1 (A < 0) ratio 0.7 < 0.8: two tokens
    assert st["clipped_tokens"] == 2.0
    surr = [min(1.5, 1.2), 0.6, 1.1, -0.8, -2.0]                # min(r A, clip(r) A) per real token
    assert loss.item() == pytest.approx(-sum(surr) / 5, abs=1e-6)


def test_ppo_loss_kl_term_needs_both_a_reference_and_a_positive_coefficient():
    logp = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    ref = torch.full((1, 2), -0.3)
    base, st = ppo_loss(logp, logp, torch.zeros(1), mask, n_tokens=2, ref_logp=ref)   # kl_coef defaults to 0
    assert base.item() == 0.0 and "kl_sum" not in st
    zero, st = ppo_loss(logp, logp, torch.zeros(1), mask, n_tokens=2, ref_logp=ref, kl_coef=0.0)
    assert zero.item() == 0.0 and "kl_sum" not in st
    no_ref, st = ppo_loss(logp, logp, torch.zeros(1), mask, n_tokens=2, kl_coef=0.5)  # no reference: no KL
    assert no_ref.item() == 0.0 and "kl_sum" not in st
    k3 = math.exp(-0.3) + 0.3 - 1.0
    kl, st = ppo_loss(logp, logp, torch.zeros(1), mask, n_tokens=2, ref_logp=ref, kl_coef=0.5)
    assert kl.item() == pytest.approx(0.5 * k3, rel=1e-5) and st["kl_sum"] == pytest.approx(2 * k3, rel=1e-5)


def test_ppo_loss_rejects_no_tokens():
    with pytest.raises(ValueError, match=r"^ppo_loss: n_tokens must be > 0$"):
        ppo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), n_tokens=0)


# ------------------------------------------------------------------------------------------------ trajectory_mean


def test_trajectory_mean_scale_with_one_trajectory_and_one_token_trajectories():
    # one trajectory of one token: its single row gets the whole weight n_tokens / 1
    assert trajectory_mean_scale([4], [1], 1.0, 1).tolist() == [1.0]
    # two one-token trajectories and one of 3 tokens over two rows: each trajectory weighs n_tokens / 3
    scale = trajectory_mean_scale(["a", "b", "c", "c"], [1, 1, 2, 1], 5.0, 3)
    assert scale.tolist() == pytest.approx([5 / 3, 5 / 3, 5 / 9, 5 / 9])
    # a trajectory whose rows have no tokens gets n_tokens / n_trajectories (its token count counts as 1)
    assert trajectory_mean_scale([1, 2], [0, 4], 4.0, 2).tolist() == pytest.approx([2.0, 0.5])


def test_trajectory_mean_scale_errors():
    with pytest.raises(ValueError, match=r"^trajectory_mean_scale: n_trajectories must be > 0$"):
        trajectory_mean_scale([1], [1], 1.0, 0)
    with pytest.raises(ValueError, match=r"^trajectory_mean_scale: traj_ids \(2,\) and row_tokens \(1,\) must be "
                                         r"1-D of one length$"):
        trajectory_mean_scale(np.array([1, 2]), [1], 1.0, 1)
