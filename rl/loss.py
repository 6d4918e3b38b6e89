"""The policy loss: PPO's clipped surrogate on response tokens, token-mean aggregation, optional k3 KL to the
reference policy, entropy and the approximate KL to the sampling policy for logging. Pure torch functions over
padded (rows, tokens) tensors.

    ratio_t   = exp(logp_t - old_logp_t)
    surr_t    = min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps_high) * A)      (Schulman et al. 2017, eq. 7)
    kl_t      = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                      (k3, Schulman 2020)
    approx_kl = mean_t (ratio_t - 1) - log ratio_t        (k3 of KL(old || new), logged only)
    loss      = -sum_t mask_t * surr_t / n_tokens + kl_coef * sum_t mask_t * kl_t / n_tokens

`n_tokens` is the number of response tokens in the whole update batch (token-mean over the batch, as in
DAPO/verl's "token-mean"), so micro-batches accumulate to the same gradient as one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PackedBatch:
    """Rows laid out as [pads][prompt][response][pads]: position j of the last T columns is response token j."""

    input_ids: torch.Tensor        # (R, L)
    attention_mask: torch.Tensor   # (R, L)
    position_ids: torch.Tensor     # (R, L)
    response_mask: torch.Tensor    # (R, T): 1 on response tokens; T = the longest response
    response_ids: torch.Tensor     # (R, T)


def pack(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> PackedBatch:
    """Left-pad each prompt so the last T columns hold its response (left-aligned there, pads after it)."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError("pack: prompts and responses must be non-empty lists of the same length")
    T = max(max(len(r) for r in responses), 1)
    # a row whose response is shorter than T: pad the response's right side inside the window, so position j
    # of the window is response token j for every row
    L = max(len(p) + T for p in prompts)
    R = len(prompts)
    ids = torch.full((R, L), pad_id, dtype=torch.long)
    att = torch.zeros((R, L), dtype=torch.long)
    rmask = torch.zeros((R, T), dtype=torch.float32)
    rids = torch.full((R, T), pad_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        start = L - T - len(p)
        ids[i, start: L - T] = torch.tensor(p, dtype=torch.long)
        att[i, start: L - T] = 1
        if r:
            ids[i, L - T: L - T + len(r)] = torch.tensor(r, dtype=torch.long)
            att[i, L - T: L - T + len(r)] = 1
            rids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            rmask[i, : len(r)] = 1.0
    pos = (att.cumsum(dim=1) - 1).clamp(min=0)
    return PackedBatch(ids, att, pos, rmask, rids)


def token_logprobs(model, batch: PackedBatch, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(response token | prefix) at temperature `temperature`, shape (R, T); and the per-token entropy.

    Only the last T+1 positions go through the LM head (`logits_to_keep`): a step prompt is hundreds of tokens
    and a response a handful."""
    T = batch.response_ids.shape[1]
    dev = next(model.parameters()).device
    out = model(input_ids=batch.input_ids.to(dev), attention_mask=batch.attention_mask.to(dev),
                position_ids=batch.position_ids.to(dev), logits_to_keep=T + 1, use_cache=False)
    logits = out.logits[:, -(T + 1):-1, :].float() / temperature   # position k predicts token k+1
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch.response_ids.to(dev).unsqueeze(-1)).squeeze(-1)
    ent = None
    if with_entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             n_tokens: int | float, clip_eps: float = 0.2, clip_eps_high: float | None = None,
             ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate (to minimise) over masked tokens divided by `n_tokens`; `advantages` is per row (R,)
    or per token (R, T). Returns the loss and sums for logging (clipped tokens, KL, ratio)."""
    if n_tokens <= 0:
        raise ValueError("ppo_loss: n_tokens must be > 0")
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + hi) * adv
    surr = torch.minimum(unclipped, clipped)
    loss = -(surr * mask).sum() / n_tokens
    with torch.no_grad():  # how far the update has moved the policy from the one that sampled (k3, as CleanRL logs)
        approx_kl = (ratio - 1.0) - log_ratio
    stats = {"clipped_tokens": float(((clipped < unclipped).float() * mask).sum()),
             "ratio_sum": float((ratio.detach() * mask).sum()), "approx_kl_sum": float((approx_kl * mask).sum())}
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1.0
        loss = loss + kl_coef * (kl * mask).sum() / n_tokens
        stats["kl_sum"] = float((kl.detach() * mask).sum())
    return loss, stats


def trajectory_mean_scale(traj_ids, row_tokens, n_tokens: float, n_trajectories: float) -> np.ndarray:
    """Per-row factors that turn the token-mean into a mean over trajectories (`rl.loss_agg: trajectory-mean`).

    Multiplying row i's advantage by n_tokens / (n_trajectories * tokens of i's trajectory) gives every
    trajectory the total weight n_tokens / n_trajectories under the token-mean of `ppo_loss` (the clipped
    surrogate scales with a positive factor on A), so a long episode weighs as much as a short one. `n_tokens`
    and `n_trajectories` are the whole update batch's (all processes); the rows' trajectories are local.
    """
    traj_ids = np.asarray(traj_ids)
    tokens = np.asarray(row_tokens, dtype=np.float64)
    if traj_ids.shape != tokens.shape or traj_ids.ndim != 1:
        raise ValueError(f"trajectory_mean_scale: traj_ids {traj_ids.shape} and row_tokens {tokens.shape} must be "
                         "1-D of one length")
    if n_trajectories <= 0:
        raise ValueError("trajectory_mean_scale: n_trajectories must be > 0")
    _, of_row = np.unique(traj_ids, return_inverse=True)
    per_traj = np.bincount(of_row.reshape(-1), weights=tokens)
    return (n_tokens / (n_trajectories * np.maximum(per_traj, 1.0)))[of_row.reshape(-1)]
