"""GiGPO advantages as pure numpy functions, in the style of verl's `core_algos.py` (Feng et al., "Group-in-Group
Policy Optimization for LLM Agent Training", arXiv:2505.10978).

One row per agent step. Rows sharing `group_ids` are rollouts from one initial state (an episode group); rows
sharing `traj_ids` are one trajectory tau_i, ordered by `step_idx`; `anchor_keys` is the env state key the step
acted from. The paper's two levels, by symbol (equation numbers move between the arXiv versions):

    A^E(tau_i)   = (R(tau_i) - mean_j R(tau_j)) / F_norm({R(tau_j)})        episode relative advantage
    G^S(s)       = {(a_t^(i), R_t^(i)) : s_t^(i) = s}, per episode group    anchor-state step group
    R_t^(i)      = sum_k gamma^k r_{t+k}^(i)                                discounted step return
    A^S(a_t^(i)) = (R_t^(i) - mean G^S(s)) / F_norm(G^S(s))                 step relative advantage
    A(a_t^(i))   = A^E(tau_i) + omega * A^S(a_t^(i))                        group-in-group advantage
with F_norm the standard deviation (ddof=1, as torch.std) plus eps, or 1 for `normalize="mean"`.

This call is not a bottleneck: a few milliseconds for 20,000 rows, well under 0.1% of an RL iteration of about
14 s. So the code is written to be read: ids and keys become dense codes (`np.unique`), every group statistic is an
`np.bincount`, and the one Python loop runs over step positions (R_t = r_t + gamma * R_{t+1}), never over rows or
groups. The estimator registry `ADVANTAGE_ESTIMATORS` is the only module-level mutable state.

Two deliberate differences from verl-agent's `gigpo/core_gigpo.py` (https://github.com/langfengQ/verl-agent):
  1. Each trajectory counts once at the episode level, as A^E is defined; verl-agent's default
     (`compute_mean_std_cross_steps=True`) takes the mean and std over step rows: long trajectories count more.
  2. A group of equal returns (and a lone element) gives exactly 0, also with eps = 0: values are shifted by one
     member of their group (a "pivot") before means are taken. verl-agent's float32 mean and std leave rounding
     residue there, which dividing by (std + 1e-6) turns into up to about 0.19 for returns <= 1.5 (more above).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable

import numpy as np

NORMALIZE_MODES = ("mean_std", "mean")

_Estimator = Callable[..., np.ndarray]
ADVANTAGE_ESTIMATORS: dict[str, _Estimator] = {}


def register_advantage_estimator(name: str) -> Callable[[_Estimator], _Estimator]:
    """Decorator: put an estimator into `ADVANTAGE_ESTIMATORS` under `name`."""
    def wrap(fn: _Estimator) -> _Estimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return wrap


def get_advantage_estimator(name: str) -> _Estimator:
    """The estimator registered as `name`; a ValueError lists the registered names otherwise."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


def state_key_codes(keys: Iterable[Hashable]) -> np.ndarray:
    """int64 codes 0..k-1 for a batch's anchor state keys, in order of first appearance (equal keys, equal codes).
    A compact form to pass as `anchor_keys`; the codes mean something only within the batch they were made for."""
    codes: dict[Hashable, int] = {}
    keys = keys.tolist() if isinstance(keys, np.ndarray) else keys
    return np.array([codes.setdefault(key, len(codes)) for key in keys], dtype=np.int64)


def _check_normalize(normalize: str) -> None:
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"normalize must be one of {NORMALIZE_MODES}, got {normalize!r}")


def _rows(**named: Any) -> dict[str, np.ndarray]:
    """1-D arrays of one common length; the first argument sets the length and errors name the offender."""
    arrays = {name: np.asarray(values) for name, values in named.items()}
    first = next(iter(arrays))
    n = arrays[first].shape[0] if arrays[first].ndim else -1
    for name, arr in arrays.items():
        if arr.ndim != 1:
            raise ValueError(f"{name} must be a 1-D array with one entry per step row, got shape {arr.shape}")
        if arr.shape[0] != n:
            raise ValueError(f"{name} has length {arr.shape[0]}, but {first} has length {n}; "
                             "all arrays must have one entry per step row")
    return arrays


def _finite(name: str, values: np.ndarray) -> np.ndarray:
    try:
        x = values.astype(np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be numbers, got dtype {values.dtype}") from e
    bad = np.flatnonzero(~np.isfinite(x))
    if bad.size:
        raise ValueError(f"{name} must be finite; {bad.size} row(s) are not, first at row {bad[0]}: {x[bad[0]]}")
    return x


def _codes(values: np.ndarray, name: str) -> np.ndarray:
    """Dense codes 0..k-1 of the distinct values in sorted order, as np.unique's inverse (any one sortable type).
    Integers in a narrow range (counters, `state_key_codes`) are coded by a lookup table over the range instead."""
    if values.dtype.kind in "iu" and values.size and int(values.max()) - int(values.min()) < 4 * values.size:
        offset = values.astype(np.int64) - values.min().astype(np.int64)  # exact: the span is small
        return (np.cumsum(np.bincount(offset) > 0) - 1)[offset]
    try:
        return np.unique(values, return_inverse=True)[1].reshape(-1)
    except TypeError as e:
        raise ValueError(f"{name} must hold values of one sortable type (all ints or all strings): {e}") from e


def _group_relative(x: np.ndarray, groups: np.ndarray, normalize: str, eps: float) -> np.ndarray:
    """(x - mean_G) / F_norm(G) per element, G its group. x is first shifted by a pivot (one member's value) per
    group, which changes neither x - mean_G nor the std: a lone element and equal values then give exactly 0."""
    n_groups = int(groups.max()) + 1 if groups.size else 0
    count = np.bincount(groups, minlength=n_groups)
    pivot = np.empty(n_groups)
    pivot[groups] = x
    shifted = x - pivot[groups]
    centered = shifted - (np.bincount(groups, weights=shifted, minlength=n_groups) / count)[groups]
    if normalize == "mean":
        return centered
    variance = np.bincount(groups, weights=centered**2, minlength=n_groups) / np.maximum(count - 1, 1)
    f_norm = np.sqrt(variance) + eps
    f_norm[f_norm == 0] = 1.0  # eps = 0 and equal values: centered is exactly 0 there
    return centered / f_norm[groups]


def _per_trajectory(traj: np.ndarray, values: np.ndarray, traj_ids: np.ndarray, shown: np.ndarray,
                    message: str) -> np.ndarray:
    """Each trajectory's value; where a trajectory's rows disagree, a ValueError `message` naming two rows (and
    their values as plain Python values: 'B', not np.str_('B'))."""
    per_traj = np.empty(traj.max(initial=-1) + 1, dtype=values.dtype)
    per_traj[traj] = values
    bad = np.flatnonzero(per_traj[traj] != values)
    if bad.size:
        i = int(bad[0])
        j = int(np.flatnonzero((traj == traj[i]) & (values != values[i]))[0])
        raise ValueError(message.format(t=traj_ids.tolist()[i], a=shown.tolist()[j], b=shown.tolist()[i], i=i, j=j))
    return per_traj


def episode_relative_advantages(group_ids, traj_ids, episode_returns, normalize: str = "mean_std",
                                eps: float = 1e-6) -> np.ndarray:
    """Per-row A^E(tau_i) = (R(tau_i) - mean_j R(tau_j)) / F_norm({R(tau_j)}) (paper, "Episode Relative
    Advantages"), over the trajectories tau_j of the row's episode group, each counted once however many rows
    it has. A group with a single trajectory gives 0."""
    _check_normalize(normalize)
    raw = _rows(group_ids=group_ids, traj_ids=traj_ids, episode_returns=episode_returns)
    returns = _finite("episode_returns", raw["episode_returns"])
    group, traj = _codes(raw["group_ids"], "group_ids"), _codes(raw["traj_ids"], "traj_ids")
    traj_group = _per_trajectory(traj, group, raw["traj_ids"], raw["group_ids"],
                                 "trajectory {t!r} spans two group_ids: {a!r} (row {j}) and {b!r} (row {i})")
    traj_return = _per_trajectory(traj, returns, raw["traj_ids"], returns,
                                  "episode_returns disagree within trajectory {t!r}: {a} (row {j}) and {b} (row {i})")
    return _group_relative(traj_return, traj_group, normalize, eps)[traj]


def anchor_state_groups(group_ids, anchor_keys) -> tuple[np.ndarray, dict[str, Any]]:
    """Step-group id per row, G^S(s) = {(a_t^(i), R_t^(i)) : s_t^(i) = s} within each episode group (paper,
    "Step Relative Advantages"): the same key in two episode groups makes two step groups. Ids are dense, numbered
    in order of each group's first row. Statistics: `size_distribution` maps a group size to its number of groups;
    `frac_size1_groups` is the share of groups with one row (no step-level signal), `frac_rows_in_size1_groups`
    the share of rows in them."""
    raw = _rows(group_ids=group_ids, anchor_keys=anchor_keys)
    n = raw["group_ids"].size
    group, anchor = _codes(raw["group_ids"], "group_ids"), _codes(raw["anchor_keys"], "anchor_keys")
    _, first, pair = np.unique(group * (anchor.max(initial=0) + 1) + anchor, return_index=True, return_inverse=True)
    ids, n_groups = np.argsort(np.argsort(first))[pair.reshape(-1)], first.size  # ranked by first row
    size_counts = np.bincount(np.bincount(ids, minlength=n_groups))
    singles = int(size_counts[1]) if size_counts.size > 1 else 0
    return ids, {"num_rows": int(n), "num_step_groups": int(n_groups),
                 "size_distribution": {int(s): int(c) for s, c in enumerate(size_counts) if c},
                 "mean_group_size": float(n / n_groups) if n_groups else 0.0,
                 "frac_size1_groups": float(singles / n_groups) if n_groups else 0.0,
                 "frac_rows_in_size1_groups": float(singles / n) if n else 0.0}


def discounted_step_returns(traj_ids, step_idx, step_rewards, gamma: float = 0.95) -> np.ndarray:
    """Per-row R_t^(i) = sum_{k>=0} gamma^k r_{t+k}^(i) (paper, "Step Relative Advantages") within the row's
    trajectory, whose rows are taken in `step_idx` order (k counts rows: gaps in step_idx are not extra
    discounting). Rows may come in any order; results line up with the input."""
    raw = _rows(traj_ids=traj_ids, step_idx=step_idx, step_rewards=step_rewards)
    if raw["traj_ids"].size == 0:
        return np.zeros(0)
    rewards = _finite("step_rewards", raw["step_rewards"])
    if not np.issubdtype(raw["step_idx"].dtype, np.integer):
        raise ValueError(f"step_idx must be integers, got dtype {raw['step_idx'].dtype}")
    traj, step = _codes(raw["traj_ids"], "traj_ids"), raw["step_idx"]
    order = np.lexsort((step, traj))  # rows by trajectory, then step: a trajectory's next step is the next row
    dup = np.flatnonzero((traj[order][1:] == traj[order][:-1]) & (step[order][1:] == step[order][:-1]))
    if dup.size:
        i = order[dup[0]]
        raise ValueError(f"duplicate (traj_id, step_idx) = ({raw['traj_ids'].tolist()[i]!r}, {int(step[i])}): "
                         "each step of a trajectory must be one row")
    last_row = np.cumsum(np.bincount(traj)) - 1  # of each trajectory, in sorted order
    to_go = last_row[traj[order]] - np.arange(order.size)  # steps after this one in its trajectory
    by_to_go, bounds = np.argsort(to_go, kind="stable"), np.cumsum(np.bincount(to_go))
    returns = rewards[order]
    for k in range(1, bounds.size):  # R_t = r_t + gamma * R_{t+1}, from each trajectory's end backwards
        rows = by_to_go[bounds[k - 1]:bounds[k]]
        returns[rows] += gamma * returns[rows + 1]
    out = np.empty_like(returns)
    out[order] = returns  # back to the input's row order
    return out


def step_relative_advantages(step_group_ids, step_returns, normalize: str = "mean_std",
                             eps: float = 1e-6) -> np.ndarray:
    """Per-row A^S(a_t^(i)) = (R_t^(i) - mean G^S(s)) / F_norm(G^S(s)) (paper, "Step Relative Advantages"),
    over the rows of the row's step group (from `anchor_state_groups`). A step group of one row gives 0."""
    _check_normalize(normalize)
    raw = _rows(step_group_ids=step_group_ids, step_returns=step_returns)
    returns = _finite("step_returns", raw["step_returns"])
    return _group_relative(returns, _codes(raw["step_group_ids"], "step_group_ids"), normalize, eps)


@register_advantage_estimator("gigpo")
def compute_gigpo_advantages(group_ids, traj_ids, step_idx, anchor_keys, step_rewards, episode_returns,
                             gamma=0.95, step_weight=1.0, normalize="mean_std", eps=1e-6) -> np.ndarray:
    """Per-row GiGPO advantage A(a_t^(i)) = A^E(tau_i) + omega * A^S(a_t^(i)), omega = step_weight (paper,
    "Group-in-Group Policy Optimization"), from the four functions above. One entry per step row (N rows) in every
    array: `step_rewards` is the row's r_t, `episode_returns` the R(tau) of its trajectory. Ids and keys may be ints,
    strings, 64-bit hashes or `state_key_codes`. Returns float64 of shape (N,). Raises ValueError on: arrays of
    different lengths or not 1-D; non-finite rewards or returns; non-integer step_idx; a trajectory over two
    group_ids or two returns; a duplicate (traj_id, step_idx); ids of mixed, unsortable types; `normalize` not in
    NORMALIZE_MODES; gamma outside [0, 1]."""
    _check_normalize(normalize)
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not np.isfinite(step_weight):
        raise ValueError(f"step_weight must be finite, got {step_weight}")
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    raw = _rows(group_ids=group_ids, traj_ids=traj_ids, step_idx=step_idx, anchor_keys=anchor_keys,
                step_rewards=step_rewards, episode_returns=episode_returns)
    if raw["group_ids"].size == 0:
        return np.zeros(0)
    advantages = episode_relative_advantages(raw["group_ids"], raw["traj_ids"], raw["episode_returns"],
                                             normalize, eps)
    step_returns = discounted_step_returns(raw["traj_ids"], raw["step_idx"], raw["step_rewards"], float(gamma))
    if step_weight == 0:  # GRPO: every check above ran; A^S is not needed
        return advantages
    step_groups, _ = anchor_state_groups(raw["group_ids"], raw["anchor_keys"])
    return advantages + step_weight * step_relative_advantages(step_groups, step_returns, normalize, eps)


@register_advantage_estimator("grpo")
def compute_grpo_advantages(group_ids, traj_ids, step_idx, anchor_keys, step_rewards, episode_returns,
                            gamma=0.95, normalize="mean_std", eps=1e-6) -> np.ndarray:
    """GRPO: the episode-level term alone, A = A^E(tau_i) on every row of tau_i (GiGPO with omega = 0). Same
    arguments and checks as `compute_gigpo_advantages`, so the two registry entries are interchangeable;
    `gamma` and `anchor_keys` are accepted and do not affect the result."""
    return compute_gigpo_advantages(group_ids, traj_ids, step_idx, anchor_keys, step_rewards, episode_returns,
                                    gamma=gamma, step_weight=0.0, normalize=normalize, eps=eps)
