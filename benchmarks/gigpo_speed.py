"""Speed of the vectorized GiGPO advantages (rl/gigpo.py) next to a plain per-row Python loop, same batch, same result.

    python benchmarks/gigpo_speed.py                  # 20,000 rows: 64 episode groups x 8 rollouts
    python benchmarks/gigpo_speed.py --rows 5000 --rounds 5

The batch (built once, untimed) imitates one RL update: every episode group is one task whose rollouts all start in
the same state and random-walk a small state graph (3 successors per state), so states repeat across rollouts;
trajectory lengths vary (they sum to --rows); rewards are sparse (a few shaping rewards, a success bonus at the end
of some episodes) and a trajectory's return is the sum of its rewards. Rows arrive step-major (every live rollout's
step 0, then every step 1, ...), as batched environments produce them, so neither implementation gets them sorted by
trajectory. Group and trajectory ids are int64 counters. Each row's anchor state key is a 16-hex-digit string, as
`World.state_key()` returns, a hash of (task, state).

Anchor keys, three input forms of the same keys (every other array is the same):
- "codes" (the HEADLINE): int64 codes 0..k-1 per distinct key in the batch, in order of first appearance, from
  `rl.gigpo.state_key_codes` -- what the RL trainer passes (rl/trainer.py codes its rows' state keys the same way,
  with a dict, while assembling the batch). Its cost on the trainer side is reported as `trainer_key_coding_s`
  (a dict lookup per key; it can equally be paid while the rollouts are collected).
- "int64 hash": the keys' 64-bit values as int64 (wide integers: hashed again inside).
- "hex str": the strings themselves (parsed inside on every call).

Timed, interleaved so that both see the same machine load: --rounds rounds, each timing the loop once and
`compute_gigpo_advantages` --repeats times per input form; medians over all rounds. The loop's conversion of the
arrays to Python lists is timed too. The loop is written from the definitions with dicts and lists, independently of
rl/gigpo.py, and computes each group statistic once (no quadratic rescans), so the ratio compares against a fair
loop. One JSON object on stdout; `speedup_loop_over_vectorized` and `acceptance` are for the headline form.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl.gigpo import anchor_state_groups, compute_gigpo_advantages, state_key_codes  # noqa: E402

HEADLINE = "codes"


def make_batch(rows: int, groups: int, rollouts: int, states: int, seed: int) -> dict:
    """Synthetic rollouts as the six row arrays of `compute_gigpo_advantages`, rows in step-major order; anchor
    keys as 16-hex-digit strings."""
    rng = np.random.default_rng(seed)
    n_traj = groups * rollouts
    if rows < n_traj:
        raise SystemExit(f"--rows {rows} is fewer than one row per trajectory ({n_traj})")
    weights = rng.uniform(0.2, 1.8, n_traj)
    lengths = 1 + rng.multinomial(rows - n_traj, weights / weights.sum())
    walks = []  # per trajectory: (group, traj, [(key, reward), ...])
    for g in range(groups):
        successors = rng.integers(0, states, size=(states, 3))
        keys = [hashlib.blake2b(f"task{g}/state{s}".encode(), digest_size=8).hexdigest() for s in range(states)]
        for i in range(rollouts):
            traj = g * rollouts + i
            state, steps = 0, []
            for t in range(lengths[traj]):
                reward = 0.1 if rng.random() < 0.05 else 0.0
                if t == lengths[traj] - 1 and rng.random() < 0.4:
                    reward += 1.0
                steps.append((keys[state], reward))
                state = int(successors[state, rng.integers(0, 3)])
            walks.append((g, traj, steps))
    out = defaultdict(list)
    for t in range(int(lengths.max())):
        for g, traj, steps in walks:
            if t < len(steps):
                key, reward = steps[t]
                out["group_ids"].append(g)
                out["traj_ids"].append(traj)
                out["step_idx"].append(t)
                out["anchor_keys"].append(key)
                out["step_rewards"].append(reward)
                out["episode_returns"].append(math.fsum(r for _, r in steps))
    return {k: np.array(v) for k, v in out.items()}


def anchor_forms(batch: dict) -> dict[str, dict]:
    """The batch three times, anchor keys as per-batch codes (headline), as 64-bit ints, as hex strings."""
    hex_keys = batch["anchor_keys"]
    as_int64 = np.array([int(k, 16) for k in hex_keys.tolist()], dtype=np.uint64).view(np.int64)
    return {
        HEADLINE: {**batch, "anchor_keys": state_key_codes(hex_keys.tolist())},
        "int64 hash": {**batch, "anchor_keys": as_int64},
        "hex str": batch,
    }


def loop_advantages(group_ids, traj_ids, step_idx, anchor_keys, step_rewards, episode_returns,
                    gamma=0.95, step_weight=1.0, normalize="mean_std", eps=1e-6) -> np.ndarray:
    """GiGPO row by row with dicts: A = A^E(trajectory) + w * A^S(row's (group, state) step group)."""
    group_ids, traj_ids, step_idx = group_ids.tolist(), traj_ids.tolist(), step_idx.tolist()
    anchor_keys, step_rewards, episode_returns = anchor_keys.tolist(), step_rewards.tolist(), episode_returns.tolist()
    n = len(group_ids)

    def stats(xs):  # (count, mean, std with ddof=1)
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
        return len(xs), mean, std

    def relative(x, st):
        count, mean, std = st
        if count < 2:
            return 0.0
        return (x - mean) / (std + eps) if normalize == "mean_std" else x - mean

    # episode level: one return per trajectory, then per episode group
    traj_return, traj_group = {}, {}
    for i in range(n):
        traj_return[traj_ids[i]] = episode_returns[i]
        traj_group[traj_ids[i]] = group_ids[i]
    returns_of_group = defaultdict(list)
    for traj, group in traj_group.items():
        returns_of_group[group].append(traj_return[traj])
    group_stats = {group: stats(xs) for group, xs in returns_of_group.items()}
    episode_adv = {traj: relative(traj_return[traj], group_stats[traj_group[traj]]) for traj in traj_return}

    # discounted return per row, walking each trajectory backwards in step order
    rows_of_traj = defaultdict(list)
    for i in range(n):
        rows_of_traj[traj_ids[i]].append(i)
    step_return = [0.0] * n
    for rows in rows_of_traj.values():
        rows.sort(key=lambda i: step_idx[i])
        running = 0.0
        for i in reversed(rows):
            running = step_rewards[i] + gamma * running
            step_return[i] = running

    # step level: rows with the same (episode group, anchor key)
    rows_of_state = defaultdict(list)
    for i in range(n):
        rows_of_state[(group_ids[i], anchor_keys[i])].append(i)
    out = [0.0] * n
    for rows in rows_of_state.values():
        st = stats([step_return[i] for i in rows])
        for i in rows:
            out[i] = episode_adv[traj_ids[i]] + step_weight * relative(step_return[i], st)
    return np.array(out)


def numpy_pass_costs(rows: int, rounds: int, seed: int) -> dict[str, float]:
    """Median seconds of one numpy pass over `rows` rows of each kind the vectorized code uses, codes spread over
    rows / 8 groups (about a step group's spread)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, max(rows // 8, 1), rows)
    x, out = rng.random(rows), np.empty(rows)
    table = np.zeros(max(rows // 8, 1))
    passes = {
        "bincount_weighted": lambda: np.bincount(codes, weights=x, minlength=table.size),
        "scatter": lambda: table.__setitem__(codes, x),
        "gather": lambda: table.take(codes, out=out, mode="wrap"),  # as rl/gigpo.py gathers (no buffered copy)
        "elementwise_multiply": lambda: np.multiply(x, x, out=out),
    }
    costs = {}
    for name, fn in passes.items():
        fn()
        times = []
        for _ in range(rounds * 20):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        costs[name] = statistics.median(times)
    return costs


def size_summary(stats: dict) -> dict:
    """Step-group sizes in power-of-two buckets, plus count, mean, median and max."""
    dist = stats["size_distribution"]
    sizes = np.repeat(np.array(list(dist), dtype=np.int64), np.array(list(dist.values()), dtype=np.int64))
    buckets = {"1": 0, "2": 0, "3-4": 0, "5-8": 0, "9-16": 0, "17-32": 0, "33+": 0}
    for size, count in dist.items():
        label = "1" if size == 1 else "2" if size == 2 else "3-4" if size <= 4 else "5-8" if size <= 8 else \
            "9-16" if size <= 16 else "17-32" if size <= 32 else "33+"
        buckets[label] += count
    return {
        "num_step_groups": stats["num_step_groups"],
        "mean_size": round(stats["mean_group_size"], 2),
        "median_size": float(np.median(sizes)) if sizes.size else 0.0,
        "max_size": int(sizes.max()) if sizes.size else 0,
        "groups_by_size": buckets,
        "frac_size1_groups": round(stats["frac_size1_groups"], 4),
        "frac_rows_in_size1_groups": round(stats["frac_rows_in_size1_groups"], 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--groups", type=int, default=64, help="episode groups (tasks)")
    ap.add_argument("--rollouts", type=int, default=8, help="rollouts per episode group")
    ap.add_argument("--states", type=int, default=120, help="states in each task's random state graph")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (one loop call per form in each)")
    ap.add_argument("--repeats", type=int, default=10, help="vectorized calls per form in each round")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    forms = anchor_forms(make_batch(args.rows, args.groups, args.rollouts, args.states, args.seed))

    for batch in forms.values():  # warm-up: first-call allocations and imports are not the steady state
        compute_gigpo_advantages(**batch)
    loop_times: dict[str, list[float]] = {form: [] for form in forms}
    vec_times: dict[str, list[float]] = {form: [] for form in forms}
    loop_out, vec_out = {}, {}
    for _ in range(args.rounds):
        for form, batch in forms.items():
            t0 = time.perf_counter()
            loop_out[form] = loop_advantages(**batch)
            loop_times[form].append(time.perf_counter() - t0)
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                vec_out[form] = compute_gigpo_advantages(**batch)
                vec_times[form].append(time.perf_counter() - t0)
    pass_costs = numpy_pass_costs(int(forms[HEADLINE]["group_ids"].size), args.rounds, args.seed)
    key_list = forms["hex str"]["anchor_keys"].tolist()
    coding = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        state_key_codes(key_list)
        coding.append(time.perf_counter() - t0)

    by_form = {}
    for form in forms:
        loop_s, vec_s = statistics.median(loop_times[form]), statistics.median(vec_times[form])
        by_form[form] = {
            "vectorized_s_median": round(vec_s, 6), "loop_s_median": round(loop_s, 6),
            "speedup_loop_over_vectorized": round(loop_s / vec_s, 2),
            "max_abs_diff": float(np.max(np.abs(vec_out[form] - loop_out[form]), initial=0.0)),
        }
    head = by_form[HEADLINE]
    same_across_forms = max(float(np.max(np.abs(vec_out[f] - vec_out[HEADLINE]), initial=0.0)) for f in forms)
    batch = forms[HEADLINE]
    _, stats = anchor_state_groups(batch["group_ids"], batch["anchor_keys"])
    print(json.dumps({
        "benchmark": "gigpo_speed", "python": platform.python_version(), "numpy": np.__version__,
        "rows": int(batch["group_ids"].size), "episode_groups": args.groups, "rollouts_per_group": args.rollouts,
        "trajectories": int(np.unique(batch["traj_ids"]).size),
        "anchor_keys": "codes: int64 per distinct state key in the batch, first-seen order (state_key_codes), "
                       "as rl/trainer.py passes them",
        "gamma": 0.95, "step_weight": 1.0, "normalize": "mean_std",
        "rounds": args.rounds, "vectorized_repeats_per_round": args.repeats,
        "vectorized_s_median": head["vectorized_s_median"], "loop_s_median": head["loop_s_median"],
        "speedup_loop_over_vectorized": head["speedup_loop_over_vectorized"],
        "max_abs_diff": head["max_abs_diff"],
        "by_anchor_form": by_form,
        "max_abs_diff_between_forms": same_across_forms,
        "trainer_key_coding_s_median": round(statistics.median(coding), 6),
        "step_groups": size_summary(stats),
        "numpy_pass_costs_s": {k: round(v, 7) for k, v in pass_costs.items()},
        "passes_within_100x": {k: round(head["loop_s_median"] / 100 / v, 1) for k, v in pass_costs.items()},
        "acceptance": {"speedup_ge_100": bool(head["speedup_loop_over_vectorized"] >= 100),
                       "max_abs_diff_le_1e-6": bool(head["max_abs_diff"] <= 1e-6)},
    }, indent=2))


if __name__ == "__main__":
    main()
