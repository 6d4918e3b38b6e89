"""GiGPO advantages as pure, vectorized numpy functions (Feng et al., "Group-in-Group Policy Optimization for
LLM Agent Training", arXiv:2505.10978).

One row per agent step. Rows sharing `group_ids` are rollouts from the same initial state (an episode group);
rows sharing `traj_ids` are one trajectory, ordered by `step_idx`; `anchor_keys` is the env state key the step
acted from. The paper's two levels:

    A^E(tau_i)   = (R(tau_i) - mean_j R(tau_j)) / F_norm({R(tau_j)})        episode relative advantage
    G^S(s)       = {(a_t^(i), R_t^(i)) : s_t^(i) = s}                       anchor-state step group
    R_t^(i)      = sum_k gamma^k r_{t+k}^(i)                                discounted step return
    A^S(a_t^(i)) = (R_t^(i) - mean G^S) / F_norm(G^S)                       step relative advantage
    A(a_t^(i))   = A^E(tau_i) + omega * A^S(a_t^(i))                        group-in-group advantage

F_norm is the standard deviation (ddof=1, as torch.std) plus eps, or 1 (`normalize="mean"`). Equation numbers
move between the paper's arXiv versions, so each function names its equation by symbol and section title.

Every group reduction is a bincount over dense codes from `np.unique` (or, for integer ids in a narrow range, a
presence table); no Python loop runs per row (the one loop, in the discounted return, runs over step positions).
`ADVANTAGE_ESTIMATORS` registers the estimators by name, as verl's `core_algos` does.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

NORMALIZE_MODES = ("mean_std", "mean")

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., np.ndarray]] = {}


def register_advantage_estimator(name: str) -> Callable[[Callable[..., np.ndarray]], Callable[..., np.ndarray]]:
    """Decorator: put an estimator into `ADVANTAGE_ESTIMATORS` under `name`."""
    def wrap(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return wrap


def get_advantage_estimator(name: str) -> Callable[..., np.ndarray]:
    """The estimator registered as `name`; a ValueError lists the registered names otherwise."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


# ---------------------------------------------------------------------------------------------- input checks


def _check_normalize(normalize: str) -> None:
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"normalize must be one of {NORMALIZE_MODES}, got {normalize!r}")


def _rows(named: dict[str, Any]) -> dict[str, np.ndarray]:
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


def _finite_floats(name: str, values: np.ndarray) -> np.ndarray:
    try:
        x = values.astype(np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be numbers, got dtype {values.dtype}") from e
    bad = ~np.isfinite(x)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name} must be finite; {int(bad.sum())} row(s) are not, first at row {i}: {x[i]}")
    return x


def _value(values: np.ndarray, i: int) -> Any:
    """values[i] as a plain Python value, so messages read 'B', not np.str_('B')."""
    v = values[i]
    return v.item() if isinstance(v, np.generic) else v


def _integer_steps(step_idx: np.ndarray) -> np.ndarray:
    if not np.issubdtype(step_idx.dtype, np.integer):
        raise ValueError(f"step_idx must be integers, got dtype {step_idx.dtype}")
    return step_idx.astype(np.int64)


def _factorize(values: np.ndarray, name: str) -> tuple[np.ndarray, int]:
    """Dense codes 0..n-1 for the distinct values (any one sortable type: ints, strings, ...) and n.

    Integers in a span not much wider than the array are coded through a presence table (a bincount-sized
    array and a cumsum) instead of a sort; anything else goes through np.unique(return_inverse=True).
    """
    if values.dtype.kind in "iub" and values.size:
        # widen first so that `ints - lo` cannot wrap; uint64 stays unsigned (values >= lo, so no wrap either)
        ints = values if values.dtype == np.uint64 else values.astype(np.int64)
        lo, hi = ints.min(), ints.max()
        span = int(hi) - int(lo) + 1
        if span <= 4 * ints.size + 1024:
            offset = (ints - lo).astype(np.intp)
            present = np.zeros(span, dtype=bool)
            present[offset] = True
            code_of = np.cumsum(present, dtype=np.intp) - 1
            return code_of[offset], int(code_of[-1]) + 1
    try:
        uniques, codes = np.unique(values, return_inverse=True)
    except TypeError as e:
        raise ValueError(f"{name} must hold values of one sortable type (all ints or all strings): {e}") from e
    return codes.reshape(-1).astype(np.intp, copy=False), int(uniques.size)


# ---------------------------------------------------------------------------------------------- reductions


def _group_relative(values: np.ndarray, groups: np.ndarray, n_groups: int, normalize: str, eps: float) -> np.ndarray:
    """(x - mean_group) / (std_group + eps), or x - mean_group; 0 for an element alone in its group.

    The shared form of A^E and A^S. Values are first shifted by one member of their group (which changes
    neither mean-differences nor std), so a group of equal values gives exactly 0, and sums stay small.
    """
    counts = np.bincount(groups, minlength=n_groups)
    pivot = np.empty(n_groups)
    pivot[groups] = values
    shifted = values - pivot[groups]
    mean = np.bincount(groups, weights=shifted, minlength=n_groups) / np.maximum(counts, 1)
    centered = shifted - mean[groups]
    if normalize == "mean_std":
        sum_sq = np.bincount(groups, weights=centered * centered, minlength=n_groups)
        denom = (np.sqrt(sum_sq / np.maximum(counts - 1, 1)) + eps)[groups]  # std with ddof=1, as torch.std
        # denom is 0 only for eps = 0 and a group of equal values, where centered is exactly 0: keep that 0
        centered = np.divide(centered, denom, out=np.zeros_like(centered), where=denom > 0)
    return np.where(counts[groups] > 1, centered, 0.0)


def _trajectory_table(group: np.ndarray, traj: np.ndarray, n_traj: int, returns: np.ndarray,
                      raw: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Each trajectory's episode group code and return R(tau), checking that its rows agree on both."""
    traj_group = np.empty(n_traj, dtype=np.intp)
    traj_group[traj] = group
    bad = np.flatnonzero(traj_group[traj] != group)
    if bad.size:
        i = int(bad[0])
        j = int(np.flatnonzero((traj == traj[i]) & (group != group[i]))[0])
        raise ValueError(f"trajectory {_value(raw['traj_ids'], i)!r} spans two group_ids: "
                         f"{_value(raw['group_ids'], j)!r} (row {j}) and {_value(raw['group_ids'], i)!r} (row {i})")
    traj_return = np.empty(n_traj)
    traj_return[traj] = returns
    bad = np.flatnonzero(traj_return[traj] != returns)
    if bad.size:
        i = int(bad[0])
        j = int(np.flatnonzero((traj == traj[i]) & (returns != returns[i]))[0])
        raise ValueError(f"episode_returns disagree within trajectory {_value(raw['traj_ids'], i)!r}: "
                         f"{returns[j]} (row {j}) and {returns[i]} (row {i})")
    return traj_group, traj_return


def _sorted_positions(traj: np.ndarray, n_traj: int, step: np.ndarray,
                      raw: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Where each row lands when rows are sorted by (trajectory, step_idx), and each trajectory's length.

    Usual case, no sort: steps of a trajectory are consecutive integers, so a row's place is its
    trajectory's start plus (step - first step); the check that this is a permutation also proves there
    are no duplicates. Otherwise (gaps in step_idx, or duplicates): a lexsort, which names a duplicate.
    """
    n = traj.size
    lengths = np.bincount(traj, minlength=n_traj)
    starts = np.cumsum(lengths) - lengths
    first = np.full(n_traj, np.iinfo(np.int64).max)
    np.minimum.at(first, traj, step)
    rank = step - first[traj]
    if (rank < lengths[traj]).all():
        pos = starts[traj] + rank
        if (np.bincount(pos, minlength=n) == 1).all():
            return pos, lengths
    order = np.lexsort((step, traj))
    dup = (traj[order[1:]] == traj[order[:-1]]) & (step[order[1:]] == step[order[:-1]])
    if dup.any():
        i = int(order[np.flatnonzero(dup)[0]])
        raise ValueError(f"duplicate (traj_id, step_idx) = ({_value(raw['traj_ids'], i)!r}, {int(step[i])}): "
                         "each step of a trajectory must be one row")
    pos = np.empty(n, dtype=np.intp)
    pos[order] = np.arange(n)
    return pos, lengths


def _discount_sorted(rewards_sorted: np.ndarray, lengths: np.ndarray, gamma: float) -> np.ndarray:
    """R_t = r_t + gamma * R_{t+1} over rows sorted by (trajectory, step), trajectory lengths given.

    The loop runs over "steps before the end" d = 1..max_len-1, updating at once the row d steps before the
    end of every trajectory longer than d: max_len iterations, each a vector op over trajectories.
    """
    returns = rewards_sorted.copy()
    if lengths.size == 0:
        return returns
    ends = np.cumsum(lengths)
    longest_first = np.argsort(-lengths, kind="stable")
    ends_desc = ends[longest_first]
    neg_len_desc = -lengths[longest_first]  # ascending, for searchsorted
    max_len = int(-neg_len_desc[0])
    n_longer = np.searchsorted(neg_len_desc, -np.arange(max_len), side="left")  # trajectories longer than d
    last_rows = ends_desc - 1
    for d in range(1, max_len):
        rows = last_rows[: n_longer[d]] - d
        returns[rows] += gamma * returns[rows + 1]
    return returns


def _step_group_codes(group: np.ndarray, anchor: np.ndarray, n_anchor: int) -> tuple[np.ndarray, int]:
    """Codes of (episode group, anchor state) pairs: one state key in two episode groups is two step groups.

    Episode groups start from different states, so a state key seldom occurs in two of them; when none does,
    the anchor codes already are the pair codes and the second factorization is skipped.
    """
    anchor_group = np.empty(n_anchor, dtype=group.dtype)
    anchor_group[anchor] = group
    if (anchor_group[anchor] == group).all():
        return anchor, n_anchor
    return _factorize(group.astype(np.int64) * n_anchor + anchor, "step groups")


def _group_size_stats(step_groups: np.ndarray, n_step_groups: int) -> dict[str, Any]:
    sizes = np.bincount(step_groups, minlength=n_step_groups)
    size_counts = np.bincount(sizes)
    distribution = {int(s): int(c) for s, c in enumerate(size_counts) if c}
    singles = int(size_counts[1]) if size_counts.size > 1 else 0
    return {
        "num_rows": int(step_groups.size),
        "num_step_groups": int(n_step_groups),
        "size_distribution": distribution,
        "mean_group_size": float(step_groups.size / n_step_groups) if n_step_groups else 0.0,
        "frac_size1_groups": float(singles / n_step_groups) if n_step_groups else 0.0,
        "frac_rows_in_size1_groups": float(singles / step_groups.size) if step_groups.size else 0.0,
    }


# ---------------------------------------------------------------------------------------------- public API


def episode_relative_advantages(group_ids, traj_ids, episode_returns, normalize: str = "mean_std",
                                eps: float = 1e-6) -> np.ndarray:
    """Per-row A^E (paper, "Episode Relative Advantages"):

        A^E(tau_i) = (R(tau_i) - mean({R(tau_j)}_j)) / F_norm({R(tau_j)}_j)

    over the trajectories tau_j of the row's episode group, each trajectory counted once however many rows
    it has. A group with a single trajectory gives 0.
    """
    _check_normalize(normalize)
    raw = _rows({"group_ids": group_ids, "traj_ids": traj_ids, "episode_returns": episode_returns})
    if raw["group_ids"].size == 0:
        return np.zeros(0)
    returns = _finite_floats("episode_returns", raw["episode_returns"])
    group, n_groups = _factorize(raw["group_ids"], "group_ids")
    traj, n_traj = _factorize(raw["traj_ids"], "traj_ids")
    traj_group, traj_return = _trajectory_table(group, traj, n_traj, returns, raw)
    return _group_relative(traj_return, traj_group, n_groups, normalize, eps)[traj]


def anchor_state_groups(group_ids, anchor_keys) -> tuple[np.ndarray, dict[str, Any]]:
    """Step-group id per row and group statistics (paper, "Step Relative Advantages", anchor state grouping):

        G^S(s) = {(a_t^(i), R_t^(i)) : s_t^(i) = s, tau_i in the episode group}

    Rows with equal `anchor_keys` inside one episode group share a step group; the same key in two episode
    groups makes two. Ids are dense, 0..num_step_groups-1. Statistics: `size_distribution` maps a group size
    to the number of step groups of that size; `frac_size1_groups` is the share of step groups with one row
    (those carry no step-level signal), `frac_rows_in_size1_groups` the share of rows in them.
    """
    raw = _rows({"group_ids": group_ids, "anchor_keys": anchor_keys})
    if raw["group_ids"].size == 0:
        return np.zeros(0, dtype=np.intp), _group_size_stats(np.zeros(0, dtype=np.intp), 0)
    group, _ = _factorize(raw["group_ids"], "group_ids")
    anchor, n_anchor = _factorize(raw["anchor_keys"], "anchor_keys")
    step_groups, n_step_groups = _step_group_codes(group, anchor, n_anchor)
    return step_groups, _group_size_stats(step_groups, n_step_groups)


def discounted_step_returns(traj_ids, step_idx, step_rewards, gamma: float = 0.95) -> np.ndarray:
    """Per-row R_t (paper, "Step Relative Advantages", discounted return):

        R_t^(i) = sum_{k>=0} gamma^k r_{t+k}^(i)

    within the row's trajectory, the rows of which are taken in `step_idx` order (k counts rows, so gaps
    in step_idx are not extra discounting). Rows may come in any order; results line up with the input.
    """
    raw = _rows({"traj_ids": traj_ids, "step_idx": step_idx, "step_rewards": step_rewards})
    if raw["traj_ids"].size == 0:
        return np.zeros(0)
    rewards = _finite_floats("step_rewards", raw["step_rewards"])
    step = _integer_steps(raw["step_idx"])
    traj, n_traj = _factorize(raw["traj_ids"], "traj_ids")
    pos, lengths = _sorted_positions(traj, n_traj, step, raw)
    rewards_sorted = np.empty_like(rewards)
    rewards_sorted[pos] = rewards
    return _discount_sorted(rewards_sorted, lengths, float(gamma))[pos]


def step_relative_advantages(step_group_ids, step_returns, normalize: str = "mean_std",
                             eps: float = 1e-6) -> np.ndarray:
    """Per-row A^S (paper, "Step Relative Advantages"):

        A^S(a_t^(i)) = (R_t^(i) - mean({R_t'^(j) in G^S(s)})) / F_norm({R_t'^(j) in G^S(s)})

    over the rows of the row's step group (from `anchor_state_groups`). A step group of one row gives 0.
    """
    _check_normalize(normalize)
    raw = _rows({"step_group_ids": step_group_ids, "step_returns": step_returns})
    if raw["step_group_ids"].size == 0:
        return np.zeros(0)
    returns = _finite_floats("step_returns", raw["step_returns"])
    groups, n_groups = _factorize(raw["step_group_ids"], "step_group_ids")
    return _group_relative(returns, groups, n_groups, normalize, eps)


@register_advantage_estimator("gigpo")
def compute_gigpo_advantages(group_ids, traj_ids, step_idx, anchor_keys, step_rewards, episode_returns,
                             gamma=0.95, step_weight=1.0, normalize="mean_std", eps=1e-6) -> np.ndarray:
    """Per-row GiGPO advantage (paper, "Group-in-Group Policy Optimization"):

        A(a_t^(i)) = A^E(tau_i) + omega * A^S(a_t^(i)),   omega = step_weight

    with A^E from `episode_relative_advantages`, R_t from `discounted_step_returns` and A^S from
    `step_relative_advantages` over `anchor_state_groups`. All arrays have one entry per step row (N rows);
    `step_rewards` is r_t of the row, `episode_returns` the R(tau) of the row's trajectory (equal on all its
    rows). Returns float64 of shape (N,); N = 0 gives an empty array.

    Raises ValueError on: `normalize` not in NORMALIZE_MODES; arrays of different lengths or not 1-D;
    non-finite rewards or returns; non-integer step_idx; a trajectory over two group_ids or with two
    episode returns; a duplicate (traj_id, step_idx); ids or keys of mixed, unsortable types.
    """
    _check_normalize(normalize)
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not np.isfinite(step_weight):
        raise ValueError(f"step_weight must be finite, got {step_weight}")
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    raw = _rows({"group_ids": group_ids, "traj_ids": traj_ids, "step_idx": step_idx, "anchor_keys": anchor_keys,
                 "step_rewards": step_rewards, "episode_returns": episode_returns})
    if raw["group_ids"].size == 0:
        return np.zeros(0)
    rewards = _finite_floats("step_rewards", raw["step_rewards"])
    returns = _finite_floats("episode_returns", raw["episode_returns"])
    step = _integer_steps(raw["step_idx"])
    group, n_groups = _factorize(raw["group_ids"], "group_ids")
    traj, n_traj = _factorize(raw["traj_ids"], "traj_ids")

    traj_group, traj_return = _trajectory_table(group, traj, n_traj, returns, raw)
    advantages = _group_relative(traj_return, traj_group, n_groups, normalize, eps)[traj]

    pos, lengths = _sorted_positions(traj, n_traj, step, raw)  # validates steps even when omega = 0
    if step_weight == 0:
        return advantages
    rewards_sorted = np.empty_like(rewards)
    rewards_sorted[pos] = rewards
    step_returns = _discount_sorted(rewards_sorted, lengths, float(gamma))[pos]
    anchor, n_anchor = _factorize(raw["anchor_keys"], "anchor_keys")
    step_groups, n_step_groups = _step_group_codes(group, anchor, n_anchor)
    return advantages + step_weight * _group_relative(step_returns, step_groups, n_step_groups, normalize, eps)


@register_advantage_estimator("grpo")
def compute_grpo_advantages(group_ids, traj_ids, step_idx, anchor_keys, step_rewards, episode_returns,
                            gamma=0.95, normalize="mean_std", eps=1e-6) -> np.ndarray:
    """GRPO: the episode-level term alone, A = A^E(tau_i) on every row of tau_i (GiGPO with omega = 0).

    Same arguments and checks as `compute_gigpo_advantages`, so the two registry entries are interchangeable;
    `gamma` and `anchor_keys` are accepted and do not affect the result.
    """
    return compute_gigpo_advantages(group_ids, traj_ids, step_idx, anchor_keys, step_rewards, episode_returns,
                                    gamma=gamma, step_weight=0.0, normalize=normalize, eps=eps)
