"""Tests that close the gaps mutation testing (mutmut, docs/mutation.md) found in rl/gigpo.py: the registry, the
docstring's promises (exact zeros for equal values also with eps = 0, ids of any form including sparse integers,
empty batches through every public function), the step-group statistics, defaults, and which argument an error
names."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from rl.gigpo import (
    ADVANTAGE_ESTIMATORS,
    anchor_state_groups,
    compute_gigpo_advantages,
    discounted_step_returns,
    episode_relative_advantages,
    get_advantage_estimator,
    register_advantage_estimator,
    state_key_codes,
    step_relative_advantages,
)


@pytest.fixture(autouse=True)
def numpy_warnings_are_errors():
    """Valid input must not make numpy divide 0 by 0 anywhere (an empty group slot, an empty batch)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


def test_register_a_new_estimator_then_refuse_the_same_name():
    name = "test-mut-estimator"
    try:
        def estimator(*args, **kwargs):
            return np.zeros(0)
        assert register_advantage_estimator(name)(estimator) is estimator
        assert get_advantage_estimator(name) is estimator
        with pytest.raises(ValueError, match=r"^advantage estimator 'test-mut-estimator' is already registered$"):
            register_advantage_estimator(name)(lambda: None)
        assert ADVANTAGE_ESTIMATORS[name] is estimator
    finally:
        ADVANTAGE_ESTIMATORS.pop(name, None)


def test_state_key_codes_are_int64_even_for_an_empty_batch():
    assert state_key_codes([]).dtype == np.int64 and state_key_codes([]).shape == (0,)
    assert state_key_codes(np.array(["b", "a", "b"])).tolist() == [0, 1, 0]


# ------------------------------------------------------------------------------- exact zeros (module docstring, 2.)


def test_three_equal_returns_give_exactly_zero_with_eps_zero():
    # 0.1 + 0.1 + 0.1 = 0.30000000000000004: a plain mean leaves residue that dividing by a ~0 std blows up
    for normalize in ("mean_std", "mean"):
        assert step_relative_advantages(["s"] * 3, [0.1] * 3, normalize=normalize, eps=0.0).tolist() == [0.0] * 3
        got = episode_relative_advantages(["g"] * 3, ["a", "b", "c"], [0.1] * 3, normalize=normalize, eps=0.0)
        assert got.tolist() == [0.0] * 3
    # next to a group that does vary, the equal group still gives exact zeros
    got = step_relative_advantages(["s", "s", "s", "t", "t"], [0.7, 0.7, 0.7, 1.0, 3.0], eps=0.0)
    assert got[:3].tolist() == [0.0] * 3
    np.testing.assert_allclose(got[3:], [-1 / math.sqrt(2), 1 / math.sqrt(2)], rtol=1e-12)


# ------------------------------------------------------------------------------- ids of any form


def test_sparse_integer_ids_give_the_same_advantages_as_strings():
    # integers in a narrow range take the lookup-table path; with gaps between them the codes must stay dense
    group = np.array([100, 100, 100, 100, 105, 105])
    traj = np.array([10, 10, 20, 30, 40, 50])
    step = np.array([0, 1, 0, 0, 0, 0])
    key = np.array([7, 9, 7, 7, 7, 7])
    reward = np.array([0.0, 1.0, 0.5, 0.0, 2.0, 0.0])
    ret = np.array([1.0, 1.0, 0.5, 0.0, 2.0, 0.0])
    as_str = {"group_ids": group.astype(str), "traj_ids": traj.astype(str), "anchor_keys": key.astype(str)}
    expected = compute_gigpo_advantages(**as_str, step_idx=step, step_rewards=reward, episode_returns=ret)
    got = compute_gigpo_advantages(group, traj, step, key, reward, ret)
    np.testing.assert_array_equal(got, expected)
    # and by hand, episode level of group 100: returns {1, .5, 0} (trajectory 10 counted once)
    a_e = (np.array([1.0, 1.0, 0.5, 0.0]) - 0.5) / (0.5 + 1e-6)
    np.testing.assert_allclose(episode_relative_advantages(group, traj, ret)[:4], a_e, rtol=1e-12)


# ------------------------------------------------------------------------------- empty batches, every function


def test_every_function_accepts_an_empty_batch():
    e, ei = np.zeros(0), np.zeros(0, dtype=np.int64)
    for got in (episode_relative_advantages(e, e, e), step_relative_advantages(ei, e),
                discounted_step_returns(ei, ei, e)):
        assert got.shape == (0,) and got.dtype == np.float64
    ids, stats = anchor_state_groups(ei, ei)
    assert ids.shape == (0,)
    assert stats == {"num_rows": 0, "num_step_groups": 0, "size_distribution": {}, "mean_group_size": 0.0,
                     "frac_size1_groups": 0.0, "frac_rows_in_size1_groups": 0.0}


def test_discounted_returns_of_a_single_row_and_the_default_gamma():
    assert discounted_step_returns(["t"], [0], [2.5]).tolist() == [2.5]
    # gamma defaults to 0.95: R_0 = 1 + .95 * (0 + .95 * 2)
    np.testing.assert_allclose(discounted_step_returns(["t"] * 3, [0, 1, 2], [1.0, 0.0, 2.0]),
                               [1 + 0.95 * 0.95 * 2, 0.95 * 2, 2.0], rtol=1e-15)


def test_step_relative_advantages_default_eps_is_1e_6():
    got = step_relative_advantages(["s", "s"], [0.0, 1.0])
    np.testing.assert_allclose(got, [-0.5 / (math.sqrt(0.5) + 1e-6), 0.5 / (math.sqrt(0.5) + 1e-6)], rtol=1e-12)


# ------------------------------------------------------------------------------- step-group statistics


def test_anchor_state_group_statistics():
    # group g: keys a, a, b, c (a: 2 rows; b, c: 1 row each); group h: key a once (a separate step group)
    ids, stats = anchor_state_groups(["g", "g", "g", "h", "g"], ["a", "a", "b", "a", "c"])
    assert ids.tolist() == [0, 0, 1, 2, 3]                   # numbered in order of each group's first row
    assert stats == {"num_rows": 5, "num_step_groups": 4, "size_distribution": {1: 3, 2: 1},
                     "mean_group_size": 5 / 4, "frac_size1_groups": 3 / 4, "frac_rows_in_size1_groups": 3 / 5}
    # every step group a single row: all of them count as size 1
    ids, stats = anchor_state_groups([0, 0, 1], [5, 6, 5])
    assert ids.tolist() == [0, 1, 2]
    assert stats["size_distribution"] == {1: 3} and stats["frac_size1_groups"] == 1.0
    assert stats["frac_rows_in_size1_groups"] == 1.0 and stats["mean_group_size"] == 1.0


# ------------------------------------------------------------------------------- errors name the right thing


def test_a_scalar_first_argument_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"^group_ids must be a 1-D array with one entry per step row, got shape "
                                         r"\(\)$"):
        compute_gigpo_advantages("g", ["a"], [0], ["s"], [1.0], [1.0])


def test_length_mismatch_message():
    with pytest.raises(ValueError, match=r"^step_returns has length 1, but step_group_ids has length 2; all arrays "
                                         r"must have one entry per step row$"):
        step_relative_advantages([0, 0], [1.0])


def test_non_numbers_are_named():
    with pytest.raises(ValueError, match=r"^step_returns must be numbers, got dtype <U1$"):
        step_relative_advantages([0, 0], ["x", "y"])
    with pytest.raises(ValueError, match=r"^step_returns must be finite; 1 row\(s\) are not, first at row 1: inf$"):
        step_relative_advantages([0, 0], [1.0, np.inf])


MIXED = np.array(["a", 1, "b"], dtype=object)


@pytest.mark.parametrize("call, name", [
    (lambda: episode_relative_advantages(MIXED, [0, 1, 2], [0.0, 1.0, 2.0]), "group_ids"),
    (lambda: anchor_state_groups(MIXED, [0, 1, 2]), "group_ids"),
    (lambda: anchor_state_groups([0, 1, 2], MIXED), "anchor_keys"),
    (lambda: discounted_step_returns(MIXED, [0, 1, 2], [0.0, 1.0, 2.0]), "traj_ids"),
    (lambda: step_relative_advantages(MIXED, [0.0, 1.0, 2.0]), "step_group_ids"),
])
def test_unsortable_ids_name_their_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must hold values of one sortable type \(all ints or all "
                                         r"strings\): "):
        call()


def test_trajectory_errors_name_both_rows_and_values():
    # trajectory A: rows 0 and 1 disagree; the message names the other row's value first, then the failing row's
    with pytest.raises(ValueError, match=r"^trajectory 'A' spans two group_ids: 'g2' \(row 1\) and 'g1' \(row 0\)$"):
        episode_relative_advantages(["g1", "g2", "g1"], ["A", "A", "B"], [1.0, 1.0, 0.0])
    with pytest.raises(ValueError, match=r"^episode_returns disagree within trajectory 'B': 2\.0 \(row 2\) and 1\.0 "
                                         r"\(row 1\)$"):
        episode_relative_advantages(["g"] * 3, ["A", "B", "B"], [0.0, 1.0, 2.0])


def test_duplicate_step_message():
    with pytest.raises(ValueError, match=r"^duplicate \(traj_id, step_idx\) = \('t', 3\): each step of a trajectory "
                                         r"must be one row$"):
        discounted_step_returns(["t", "t"], [3, 3], [0.0, 1.0])
