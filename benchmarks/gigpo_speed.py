"""GiGPO advantages (rl/gigpo.py) next to a plain per-row Python loop: same batch, same result, and the call's
share of an RL iteration.

    python benchmarks/gigpo_speed.py                  # 20,000 rows: 64 episode groups x 8 rollouts
    python benchmarks/gigpo_speed.py --rows 5000 --rounds 5 --iteration-seconds 14

This call is not a bottleneck. One RL iteration (rollouts, judge, update) takes about 14 s; the advantages take
a few milliseconds of it, well under 0.1%. rl/gigpo.py is therefore written to be read, not tuned, and there is
no speed target. The benchmark stays as a check that the vectorized code agrees with a loop written from the
definitions, and as a record of what the call costs: the JSON reports the ratio loop / vectorized, the call's
share of an iteration of --iteration-seconds, and a `note` saying the same as this paragraph.

The batch (built once, untimed) imitates one RL update: every episode group is one task whose rollouts all start in
the same state and random-walk a small state graph (3 successors per state), so states repeat across rollouts;
trajectory lengths vary (they sum to --rows); rewards are sparse (a few shaping rewards, a success bonus at the end
of some episodes) and a trajectory's return is the sum of its rewards. Rows arrive step-major (every live rollout's
step 0, then every step 1, ...), as batched environments produce them. Group and trajectory ids are int64
counters; anchor keys are int64 codes per distinct state key from `rl.gigpo.state_key_codes`, as rl/trainer.py
passes them (its cost on the trainer side is reported as `trainer_key_coding_s_median`). The same batch with the
keys as 16-hex-digit strings (what `World.state_key()` returns) is run once, untimed, to check that it gives the
same advantages.

Timed, interleaved so that both see the same machine load: --rounds rounds, each timing the loop once and
`compute_gigpo_advantages` --repeats times; medians over all rounds. The loop's conversion of the arrays to Python
lists is timed too. The loop uses dicts and lists, independently of rl/gigpo.py, and computes each group statistic
once (no quadratic rescans), so the ratio compares against a fair loop. One JSON object on stdout.
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

NOTE = ("Not a bottleneck: compute_gigpo_advantages takes about {ms:.2f} ms, {share:.4%} of a {it:g} s RL "
        "iteration; rl/gigpo.py is written to be read, and this ratio is a record, not a target.")


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
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (one loop call in each)")
    ap.add_argument("--repeats", type=int, default=10, help="vectorized calls in each round")
    ap.add_argument("--iteration-seconds", type=float, default=14.0,
                    help="wall time of one typical RL iteration, to put the call's time in proportion")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    hex_batch = make_batch(args.rows, args.groups, args.rollouts, args.states, args.seed)
    key_list = hex_batch["anchor_keys"].tolist()
    batch = {**hex_batch, "anchor_keys": state_key_codes(key_list)}

    compute_gigpo_advantages(**batch)  # warm-up
    loop_times, vec_times = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        loop_out = loop_advantages(**batch)
        loop_times.append(time.perf_counter() - t0)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            vec_out = compute_gigpo_advantages(**batch)
            vec_times.append(time.perf_counter() - t0)
    coding = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        state_key_codes(key_list)
        coding.append(time.perf_counter() - t0)
    hex_out = compute_gigpo_advantages(**hex_batch)

    loop_s, vec_s = statistics.median(loop_times), statistics.median(vec_times)
    share = vec_s / args.iteration_seconds
    _, stats = anchor_state_groups(batch["group_ids"], batch["anchor_keys"])
    print(json.dumps({
        "benchmark": "gigpo_speed", "python": platform.python_version(), "numpy": np.__version__,
        "note": NOTE.format(ms=vec_s * 1e3, share=share, it=args.iteration_seconds),
        "rows": int(batch["group_ids"].size), "episode_groups": args.groups, "rollouts_per_group": args.rollouts,
        "trajectories": int(np.unique(batch["traj_ids"]).size),
        "anchor_keys": "codes: int64 per distinct state key in the batch, first-seen order (state_key_codes), "
                       "as rl/trainer.py passes them",
        "gamma": 0.95, "step_weight": 1.0, "normalize": "mean_std",
        "rounds": args.rounds, "vectorized_repeats_per_round": args.repeats,
        "vectorized_s_median": round(vec_s, 6), "loop_s_median": round(loop_s, 6),
        "speedup_loop_over_vectorized": round(loop_s / vec_s, 2),
        "iteration_seconds": args.iteration_seconds,
        "share_of_iteration": float(f"{share:.3g}"),
        "max_abs_diff": float(np.max(np.abs(vec_out - loop_out), initial=0.0)),
        "max_abs_diff_hex_str_keys": float(np.max(np.abs(hex_out - vec_out), initial=0.0)),
        "trainer_key_coding_s_median": round(statistics.median(coding), 6),
        "step_groups": size_summary(stats),
    }, indent=2))


if __name__ == "__main__":
    main()
