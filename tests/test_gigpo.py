"""GiGPO advantages (rl/gigpo.py): hand-computed cases, invariances, input errors, and a randomized comparison
with a plain per-row reference written here."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from rl.gigpo import (
    ADVANTAGE_ESTIMATORS,
    anchor_state_groups,
    compute_gigpo_advantages,
    compute_grpo_advantages,
    discounted_step_returns,
    episode_relative_advantages,
    get_advantage_estimator,
    state_key_codes,
    step_relative_advantages,
)

EPS = 1e-6


def batch(rows):
    """Rows (group, traj, step, key, reward) -> the six arrays; a trajectory's return is the sum of its rewards."""
    group, traj, step, key, reward = (list(col) for col in zip(*rows, strict=True))
    totals: dict = {}
    for t, r in zip(traj, reward, strict=True):
        totals[t] = totals.get(t, 0.0) + r
    return dict(group_ids=np.array(group), traj_ids=np.array(traj), step_idx=np.array(step),
                anchor_keys=np.array(key), step_rewards=np.array(reward, dtype=float),
                episode_returns=np.array([totals[t] for t in traj]))


# One episode group "g", three rollouts, gamma = 0.5:
#   A: s0 -> s1            rewards 0, 1      R = 1
#   B: s0 -> s2 -> s1      rewards 0, 0, 1   R = 1
#   C: s0                  reward  0         R = 0
HAND = batch([
    ("g", "A", 0, "s0", 0.0), ("g", "A", 1, "s1", 1.0),
    ("g", "B", 0, "s0", 0.0), ("g", "B", 1, "s2", 0.0), ("g", "B", 2, "s1", 1.0),
    ("g", "C", 0, "s0", 0.0),
])


def test_hand_computed_repeated_anchor_states():
    # discounted returns: A: G1 = 1, G0 = 0 + .5*1 = .5;  B: G2 = 1, G1 = .5, G0 = .25;  C: G0 = 0
    returns = discounted_step_returns(HAND["traj_ids"], HAND["step_idx"], HAND["step_rewards"], gamma=0.5)
    np.testing.assert_allclose(returns, [0.5, 1.0, 0.25, 0.5, 1.0, 0.0], atol=1e-15)

    # episode level, over trajectories {1, 1, 0}: mean 2/3, std (ddof=1) sqrt(((1/3)^2*2 + (2/3)^2) / 2) = sqrt(1/3)
    std_e = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    a_e_ab = (1 / 3) / (std_e + EPS)
    a_e_c = (-2 / 3) / (std_e + EPS)
    # step level: s0 holds G = .5 (A), .25 (B), 0 (C): mean .25, std sqrt((.25^2 + 0 + .25^2) / 2) = .25;
    # s1 holds G = 1 (A), 1 (B): equal, so 0;  s2 holds one row (B): 0
    std_s0 = math.sqrt((0.25**2 + 0.0 + 0.25**2) / 2)
    a_s = [0.25 / (std_s0 + EPS), 0.0, 0.0, 0.0, 0.0, -0.25 / (std_s0 + EPS)]
    a_e = [a_e_ab, a_e_ab, a_e_ab, a_e_ab, a_e_ab, a_e_c]

    got = compute_gigpo_advantages(**HAND, gamma=0.5)
    np.testing.assert_allclose(got, np.add(a_e, a_s), rtol=0, atol=1e-12)
    assert got.dtype == np.float64 and got.shape == (6,)
    half = compute_gigpo_advantages(**HAND, gamma=0.5, step_weight=0.5)
    np.testing.assert_allclose(half, np.add(a_e, 0.5 * np.array(a_s)), rtol=0, atol=1e-12)

    ids, stats = anchor_state_groups(HAND["group_ids"], HAND["anchor_keys"])
    assert ids[0] == ids[2] == ids[5] and ids[1] == ids[4] and len({ids[0], ids[1], ids[3]}) == 3
    assert stats["num_step_groups"] == 3
    assert stats["size_distribution"] == {1: 1, 2: 1, 3: 1}
    assert stats["frac_size1_groups"] == pytest.approx(1 / 3)
    assert stats["frac_rows_in_size1_groups"] == pytest.approx(1 / 6)


def test_mean_normalisation_hand_computed():
    # A^E: 1 - 2/3 = 1/3 (A, B), 0 - 2/3 = -2/3 (C);  A^S: s0 -> .5-.25 = .25, .25-.25 = 0, 0-.25 = -.25
    got = compute_gigpo_advantages(**HAND, gamma=0.5, normalize="mean")
    expected = [1 / 3 + 0.25, 1 / 3, 1 / 3 + 0.0, 1 / 3, 1 / 3, -2 / 3 - 0.25]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


def test_same_state_key_in_two_episode_groups_is_not_pooled():
    b = batch([
        (1, 10, 0, "k", 1.0),
        (1, 11, 0, "k", 0.0),
        (2, 20, 0, "k", 5.0),
        (2, 21, 0, "m", 5.0),
    ])
    ids, stats = anchor_state_groups(b["group_ids"], b["anchor_keys"])
    assert ids[0] == ids[1] and ids[2] != ids[0] and ids[3] not in (ids[0], ids[2])
    assert stats["size_distribution"] == {1: 2, 2: 1}
    # group 1: A^E = 1 - .5, 0 - .5; A^S over {1, 0}: +-.5.  group 2: equal returns and single-row step groups: 0.
    # (pooling "k" across groups would give A^S = 1 - 2, 0 - 2, 5 - 2 instead)
    got = compute_gigpo_advantages(**b, normalize="mean")
    np.testing.assert_allclose(got, [0.5 + 0.5, -0.5 - 0.5, 0.0, 0.0], rtol=0, atol=1e-12)


def test_size_one_groups_give_zero():
    lone = batch([("g", "only", 0, "a", 1.0), ("g", "only", 1, "b", 2.0), ("g", "only", 2, "c", 3.0)])
    for normalize in ("mean_std", "mean"):
        assert np.all(compute_gigpo_advantages(**lone, normalize=normalize) == 0.0)
    # two trajectories, no shared state: A^S is 0, only A^E remains (returns 3 and 1: mean 2, std sqrt(2))
    apart = batch([("g", "x", 0, "a", 1.0), ("g", "x", 1, "b", 2.0), ("g", "y", 0, "c", 1.0)])
    a_e = 1 / (math.sqrt(((3 - 2) ** 2 + (1 - 2) ** 2) / 1) + EPS)
    np.testing.assert_allclose(compute_gigpo_advantages(**apart), [a_e, a_e, -a_e], rtol=0, atol=1e-12)


def test_all_equal_rewards_give_exactly_zero():
    rows = [(g, f"{g}-{i}", t, f"{g}-s{t}", 0.1) for g in ("g1", "g2") for i in range(4) for t in range(3)]
    b = batch(rows)
    for normalize in ("mean_std", "mean"):
        got = compute_gigpo_advantages(**b, normalize=normalize)
        assert np.all(got == 0.0), got
    assert np.all(compute_gigpo_advantages(**b, eps=0.0) == 0.0)


def test_step_weight_zero_is_grpo():
    b = random_batch(np.random.default_rng(3), n_groups=4, rollouts=5, max_len=6, n_states=4)
    episode_only = episode_relative_advantages(b["group_ids"], b["traj_ids"], b["episode_returns"])
    np.testing.assert_array_equal(compute_gigpo_advantages(**b, step_weight=0.0), episode_only)
    np.testing.assert_array_equal(compute_grpo_advantages(**b), episode_only)
    assert ADVANTAGE_ESTIMATORS["grpo"] is compute_grpo_advantages
    assert get_advantage_estimator("gigpo") is compute_gigpo_advantages
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        get_advantage_estimator("ppo")
    # on the hand case GRPO gives every row of a trajectory its A^E
    std_e = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    a_ab, a_c = (1 / 3) / (std_e + EPS), (-2 / 3) / (std_e + EPS)
    np.testing.assert_allclose(compute_grpo_advantages(**HAND), [a_ab] * 5 + [a_c], rtol=0, atol=1e-12)


def test_trajectory_counted_once_in_episode_normalisation():
    # long trajectory (4 rows, R = 1) and short one (1 row, R = 0): mean over trajectories is .5, not 4/5
    b = batch([("g", "long", t, f"L{t}", 0.25) for t in range(4)] + [("g", "short", 0, "S0", 0.0)])
    got = episode_relative_advantages(b["group_ids"], b["traj_ids"], b["episode_returns"], normalize="mean")
    np.testing.assert_allclose(got, [0.5, 0.5, 0.5, 0.5, -0.5], rtol=0, atol=1e-12)
    std = math.sqrt((0.5**2 + 0.5**2) / 1)
    got = compute_gigpo_advantages(**b)  # no shared states, so A = A^E
    np.testing.assert_allclose(got, [0.5 / (std + EPS)] * 4 + [-0.5 / (std + EPS)], rtol=0, atol=1e-12)


def test_discounting_within_a_trajectory_gamma_half():
    # trajectory "t" rewards 1, 2, 3, 4:  G3 = 4, G2 = 3 + 4/2 = 5, G1 = 2 + 5/2 = 4.5, G0 = 1 + 4.5/2 = 3.25
    # trajectory "u" (interleaved) rewards 8, 2:  G1 = 2, G0 = 8 + 2/2 = 9
    traj = np.array(["t", "u", "t", "t", "u", "t"])
    step = np.array([2, 1, 0, 3, 0, 1])
    reward = np.array([3.0, 2.0, 1.0, 4.0, 8.0, 2.0])
    got = discounted_step_returns(traj, step, reward, gamma=0.5)
    np.testing.assert_allclose(got, [5.0, 2.0, 3.25, 4.0, 9.0, 4.5], rtol=0, atol=1e-15)
    # step_idx only orders the rows: gaps and offsets are not extra discounting (rewards 1, 2, 3 -> 2.75, 3.5, 3)
    got = discounted_step_returns([7, 7, 7], [15, 10, 12], [3.0, 1.0, 2.0], gamma=0.5)
    np.testing.assert_allclose(got, [3.0, 1 + 0.5 * (2 + 0.5 * 3), 2 + 0.5 * 3], rtol=0, atol=1e-15)
    assert discounted_step_returns([1, 1], [0, 1], [1.0, 1.0], gamma=0.0).tolist() == [1.0, 1.0]
    assert discounted_step_returns([1, 1], [0, 1], [1.0, 1.0], gamma=1.0).tolist() == [2.0, 1.0]


def test_row_order_does_not_matter():
    rng = np.random.default_rng(7)
    b = random_batch(rng, n_groups=5, rollouts=4, max_len=9, n_states=5)
    base = compute_gigpo_advantages(**b, gamma=0.9)
    perm = rng.permutation(len(base))
    shuffled = compute_gigpo_advantages(**{k: v[perm] for k, v in b.items()}, gamma=0.9)
    np.testing.assert_allclose(shuffled, base[perm], rtol=0, atol=1e-12)


def test_step_relative_advantages_matches_its_definition():
    got = step_relative_advantages(["a", "a", "b", "a"], [1.0, 2.0, 5.0, 6.0], normalize="mean")
    np.testing.assert_allclose(got, [1 - 3, 2 - 3, 0.0, 6 - 3], rtol=0, atol=1e-12)


def test_empty_batch():
    empty = {k: np.zeros(0) for k in ("group_ids", "traj_ids", "anchor_keys", "step_rewards", "episode_returns")}
    got = compute_gigpo_advantages(**empty, step_idx=np.zeros(0, dtype=int))
    assert got.shape == (0,) and got.dtype == np.float64


@pytest.mark.parametrize("change, message", [
    (dict(normalize="zscore"), r"normalize must be one of \('mean_std', 'mean'\), got 'zscore'"),
    (dict(step_rewards=np.zeros(5)), "step_rewards has length 5, but group_ids has length 6"),
    (dict(anchor_keys=["s0"] * 7), "anchor_keys has length 7, but group_ids has length 6"),
    (dict(step_rewards=[0, 1, 0, 0, np.nan, 0]), "step_rewards must be finite; 1 row.* row 4"),
    (dict(episode_returns=[1, 1, 1, 1, 1, np.inf]), "episode_returns must be finite"),
    (dict(group_ids=["g", "g", "g", "h", "g", "g"]), "trajectory 'B' spans two group_ids"),
    (dict(episode_returns=[1, 1, 1, 1, 2, 0]), "episode_returns disagree within trajectory 'B'"),
    (dict(step_idx=[0, 1, 0, 1, 1, 0]), r"duplicate \(traj_id, step_idx\) = \('B', 1\)"),
    (dict(step_idx=[0.0, 1.0, 0.0, 1.0, 2.0, 0.0]), "step_idx must be integers"),
    (dict(traj_ids=np.array(["A", "A", 1, 1, 1, 2], dtype=object)), "traj_ids must hold values of one sortable"),
    (dict(gamma=1.5), r"gamma must be in \[0, 1\]"),
    (dict(group_ids=np.array([["g"] * 6])), "group_ids must be a 1-D array"),
])
def test_bad_input_is_rejected_with_a_clear_message(change, message):
    with pytest.raises(ValueError, match=message):
        compute_gigpo_advantages(**{**HAND, **change})


def test_grpo_validates_like_gigpo():
    with pytest.raises(ValueError, match="duplicate"):
        compute_grpo_advantages(**{**HAND, "step_idx": [0, 0, 0, 1, 2, 0]})


# ------------------------------------------------------------------------------- randomized vs reference


def random_batch(rng, n_groups, rollouts, max_len, n_states, shared_states=False, string_ids=False,
                 hash_keys=False, gaps=False):
    rows = []
    for g in range(n_groups):
        for i in range(rollouts):
            length = int(rng.integers(1, max_len + 1))
            steps = np.cumsum(rng.integers(1, 4, length)) if gaps else np.arange(length)
            for t in range(length):
                state = int(rng.integers(0, n_states))
                key = state if shared_states else g * 1000 + state
                if hash_keys:
                    key = (key * 0x9E3779B97F4A7C15) % (1 << 63)
                reward = float(rng.choice([0.0, 0.0, 1.0, 0.5, rng.normal()]))
                traj = f"traj-{g}-{i}" if string_ids else g * 100 + i
                rows.append((f"group-{g}" if string_ids else g, traj, int(steps[t]), key, reward))
    b = batch(rows)
    perm = rng.permutation(len(rows))
    return {k: v[perm] for k, v in b.items()}


def reference_advantages(group_ids, traj_ids, step_idx, anchor_keys, step_rewards, episode_returns,
                         gamma, step_weight, normalize, eps):
    """Per row, straight from the definitions: plain lists, loops and the statistics module."""
    rows = list(zip(group_ids.tolist(), traj_ids.tolist(), step_idx.tolist(), anchor_keys.tolist(),
                    step_rewards.tolist(), episode_returns.tolist(), strict=True))

    def relative(x, xs):
        if len(xs) < 2:
            return 0.0
        mean = statistics.fmean(xs)
        return (x - mean) / (statistics.stdev(xs) + eps) if normalize == "mean_std" else x - mean

    step_return = []
    for _, t, s, _, _, _ in rows:
        later = sorted((s2, r2) for g2, t2, s2, _, r2, _ in rows if t2 == t and s2 >= s)
        step_return.append(sum(gamma**k * r2 for k, (_, r2) in enumerate(later)))
    out = []
    for i, (g, _, _, key, _, ret) in enumerate(rows):
        group_returns = {t2: ret2 for g2, t2, _, _, _, ret2 in rows if g2 == g}
        a_e = relative(ret, list(group_returns.values()))
        peers = [step_return[j] for j, (g2, _, _, key2, _, _) in enumerate(rows) if g2 == g and key2 == key]
        out.append(a_e + step_weight * relative(step_return[i], peers))
    return np.array(out)


@pytest.mark.parametrize("seed", range(12))
def test_randomized_against_per_row_reference(seed):
    rng = np.random.default_rng(seed)
    b = random_batch(rng, n_groups=int(rng.integers(1, 5)), rollouts=int(rng.integers(1, 6)), max_len=8,
                     n_states=int(rng.integers(1, 5)), shared_states=bool(seed % 2), string_ids=seed % 3 == 0,
                     hash_keys=seed in (1, 4), gaps=seed >= 4)
    gamma = float(rng.choice([0.0, 0.5, 0.95, 1.0]))
    step_weight = float(rng.choice([0.0, 0.3, 1.0]))
    for normalize in ("mean_std", "mean"):
        expected = reference_advantages(**b, gamma=gamma, step_weight=step_weight, normalize=normalize, eps=EPS)
        got = compute_gigpo_advantages(**b, gamma=gamma, step_weight=step_weight, normalize=normalize)
        assert np.max(np.abs(got - expected), initial=0.0) <= 1e-9


# ------------------------------------------------------------------------------- integer-coded (trainer) inputs


def trainer_form(b):
    """The same batch as a trainer passes it: int64 counters for groups and trajectories, anchor keys as
    `state_key_codes` (int64 per distinct key, first-seen order)."""
    return {**b, "group_ids": state_key_codes(b["group_ids"]), "traj_ids": state_key_codes(b["traj_ids"]),
            "step_idx": b["step_idx"].astype(np.int64), "anchor_keys": state_key_codes(b["anchor_keys"])}


def step_major(b):
    """Rows reordered step-major (all step-0 rows, then all step-1 rows, ...), as batched environments emit."""
    order = np.lexsort((b["traj_ids"], b["step_idx"]))
    return {k: v[order] for k, v in b.items()}


def hex_key(key) -> str:
    return f"{hash(('state', key)) & (2**64 - 1):016x}"


def test_state_key_codes():
    codes = state_key_codes(["b", "a", "b", "c", "a"])
    assert codes.dtype == np.int64 and codes.tolist() == [0, 1, 0, 2, 1]
    assert state_key_codes(np.array(["x", "y", "x"])).tolist() == [0, 1, 0]
    assert state_key_codes([]).shape == (0,)


@pytest.mark.parametrize("seed", range(10))
def test_integer_codes_give_the_same_result_as_string_keys(seed):
    """Anchor keys as strings, 16-digit hex strings, 64-bit ints and per-batch int64 codes (ids too): the same
    advantages, also with the rows reordered step-major."""
    rng = np.random.default_rng(100 + seed)
    b = random_batch(rng, n_groups=int(rng.integers(2, 7)), rollouts=int(rng.integers(2, 7)), max_len=12,
                     n_states=int(rng.integers(1, 6)), shared_states=bool(seed % 2), string_ids=True,
                     gaps=seed % 3 == 2)
    hexed = {**b, "anchor_keys": np.array([hex_key(k) for k in b["anchor_keys"].tolist()])}
    as_int = {**b, "anchor_keys": np.array([int(k, 16) for k in hexed["anchor_keys"].tolist()], dtype=np.uint64)}
    order = np.lexsort((b["traj_ids"], b["step_idx"]))
    gamma = float(rng.choice([0.0, 0.5, 0.95, 1.0]))
    for normalize in ("mean_std", "mean"):
        kw = dict(gamma=gamma, normalize=normalize)
        expected = reference_advantages(**b, step_weight=1.0, eps=EPS, **kw)
        for form in (b, hexed, as_int, trainer_form(b), trainer_form(hexed)):
            np.testing.assert_allclose(compute_gigpo_advantages(**form, **kw), expected, rtol=0, atol=1e-9)
            reordered = {k: v[order] for k, v in form.items()}
            np.testing.assert_allclose(compute_gigpo_advantages(**reordered, **kw), expected[order],
                                       rtol=0, atol=1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_trainer_form_against_per_row_reference(seed):
    """Integer-coded, step-major batches (the fast path) and the same rows shuffled, against the reference."""
    rng = np.random.default_rng(200 + seed)
    b = trainer_form(random_batch(rng, n_groups=int(rng.integers(1, 6)), rollouts=int(rng.integers(1, 7)),
                                  max_len=10, n_states=int(rng.integers(1, 6)), shared_states=seed % 4 == 3))
    gamma = float(rng.choice([0.0, 0.5, 0.95, 1.0]))
    step_weight = float(rng.choice([0.0, 0.3, 1.0]))
    perm = rng.permutation(len(b["group_ids"]))
    for rows in (step_major(b), {k: v[perm] for k, v in b.items()}):
        for normalize in ("mean_std", "mean"):
            kw = dict(gamma=gamma, step_weight=step_weight, normalize=normalize)
            expected = reference_advantages(**rows, eps=EPS, **kw)
            np.testing.assert_allclose(compute_gigpo_advantages(**rows, **kw), expected, rtol=0, atol=1e-9)


def test_fast_and_general_paths_agree():
    """int64 inputs take the fast path; the same values as int32 (or strings) take the general one."""
    rng = np.random.default_rng(5)
    b = step_major(trainer_form(random_batch(rng, n_groups=6, rollouts=5, max_len=15, n_states=4)))
    as32 = {k: (v.astype(np.int32) if v.dtype == np.int64 else v) for k, v in b.items()}
    as_str = {**b, "anchor_keys": b["anchor_keys"].astype(str)}
    for normalize in ("mean_std", "mean"):
        fast = compute_gigpo_advantages(**b, normalize=normalize)
        for other in (as32, as_str):
            np.testing.assert_allclose(compute_gigpo_advantages(**other, normalize=normalize), fast,
                                       rtol=0, atol=1e-12)
    np.testing.assert_array_equal(compute_gigpo_advantages(**b, step_weight=0.0),
                                  episode_relative_advantages(b["group_ids"], b["traj_ids"], b["episode_returns"]))


def test_trainer_form_fallbacks_match_the_reference():
    """Integer-coded inputs the fast path hands to the general path: an anchor code in two episode groups,
    gaps in step_idx, trajectory codes far apart, a reward of -0.0, steps starting above 0."""
    rng = np.random.default_rng(11)
    base = step_major(trainer_form(random_batch(rng, n_groups=4, rollouts=4, max_len=9, n_states=3)))
    shared = {**base, "anchor_keys": base["anchor_keys"] % 3}  # the same codes in every episode group
    gaps = {**base, "step_idx": base["step_idx"] * 3}
    spread = {**base, "traj_ids": base["traj_ids"] * 10_000}
    neg_zero = {**base, "step_rewards": np.where(base["step_rewards"] == 0.0, -0.0, base["step_rewards"])}
    offset = {**base, "step_idx": base["step_idx"] + 7}
    for rows in (shared, gaps, spread, neg_zero, offset):
        for normalize in ("mean_std", "mean"):
            expected = reference_advantages(**rows, gamma=0.9, step_weight=1.0, normalize=normalize, eps=EPS)
            got = compute_gigpo_advantages(**rows, gamma=0.9, normalize=normalize)
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-9)


def test_trainer_form_errors():
    rows = trainer_form(HAND)  # trajectories A, B, C -> 0, 1, 2; group g -> 0
    with pytest.raises(ValueError, match=r"duplicate \(traj_id, step_idx\) = \(1, 1\)"):
        compute_gigpo_advantages(**{**rows, "step_idx": np.array([0, 1, 0, 1, 1, 0])})
    with pytest.raises(ValueError, match="trajectory 1 spans two group_ids"):
        compute_gigpo_advantages(**{**rows, "group_ids": np.array([0, 0, 0, 1, 0, 0])})
    with pytest.raises(ValueError, match="episode_returns disagree within trajectory 1"):
        compute_gigpo_advantages(**{**rows, "episode_returns": np.array([1, 1, 1, 1, 2, 0.0])})
    with pytest.raises(ValueError, match="step_rewards must be finite"):
        compute_gigpo_advantages(**{**rows, "step_rewards": np.array([0, 1, 0, 0, np.inf, 0])})


def test_trainer_form_equal_returns_give_exactly_zero():
    b = trainer_form(batch([(g, f"{g}-{i}", t, f"{g}-s{t}", 0.1) for g in ("g1", "g2") for i in range(4)
                            for t in range(3)]))
    for rows in (b, step_major(b)):
        for normalize in ("mean_std", "mean"):
            assert np.all(compute_gigpo_advantages(**rows, normalize=normalize) == 0.0)
        assert np.all(compute_gigpo_advantages(**rows, eps=0.0) == 0.0)


def test_results_are_fresh_arrays():
    """Work arrays are reused between calls; what a call returns must not change with the next call."""
    rng = np.random.default_rng(3)
    b = step_major(trainer_form(random_batch(rng, n_groups=3, rollouts=4, max_len=8, n_states=3)))
    first = compute_gigpo_advantages(**b)
    kept = first.copy()
    returns = discounted_step_returns(b["traj_ids"], b["step_idx"], b["step_rewards"])
    kept_returns = returns.copy()
    step_adv = step_relative_advantages(b["anchor_keys"], returns)
    kept_step_adv = step_adv.copy()
    other = {**b, "step_rewards": b["step_rewards"][::-1].copy(), "episode_returns": b["episode_returns"] * 2}
    compute_gigpo_advantages(**other)
    discounted_step_returns(other["traj_ids"], other["step_idx"], other["step_rewards"])
    step_relative_advantages(other["anchor_keys"], other["step_rewards"])
    np.testing.assert_array_equal(first, kept)
    np.testing.assert_array_equal(returns, kept_returns)
    np.testing.assert_array_equal(step_adv, kept_step_adv)
    np.testing.assert_array_equal(compute_gigpo_advantages(**b), kept)


def test_anchor_state_groups_same_for_every_key_form():
    rng = np.random.default_rng(8)
    b = random_batch(rng, n_groups=3, rollouts=3, max_len=6, n_states=3, shared_states=True, string_ids=True)
    ids, stats = anchor_state_groups(b["group_ids"], b["anchor_keys"])
    t = trainer_form(b)
    ids_t, stats_t = anchor_state_groups(t["group_ids"], t["anchor_keys"])
    hexed = np.array([hex_key(k) for k in b["anchor_keys"].tolist()])
    ids_h, stats_h = anchor_state_groups(b["group_ids"], hexed)
    assert stats == stats_t == stats_h
    for other in (ids_t, ids_h):  # the same partition of the rows
        pairs = set(zip(ids.tolist(), other.tolist(), strict=True))
        assert len(pairs) == len(set(ids.tolist())) == len(set(other.tolist()))
