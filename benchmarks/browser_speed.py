"""Steps per second of the paused browser protocol (prints JSON).

    python benchmarks/browser_speed.py [--task click-button] [--seconds 10]

A step is what the evaluator does per action: execute it (a random computer-use click), run the page clock for
the task's `step_ms`, pause it, read `gameAPI.getState()`; "with screenshot" adds the PNG capture the policy
needs. A terminal state starts the next episode (`reset`: fresh page, seeded `gameAPI.reset`, readiness gate),
timed separately. One Chromium, one page at a time, no policy in the loop.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evaluation.browser import BrowserEnv, get_task  # noqa: E402


def run(env: BrowserEnv, seconds: float, screenshot: bool, seed: int) -> dict:
    rng = random.Random(seed)
    w, h = env.viewport[0] * env.scale, env.viewport[1] * env.scale
    steps = resets = 0
    reset_s = step_s = 0.0
    ep = seed
    t = time.perf_counter()
    env.reset(ep)
    reset_s += time.perf_counter() - t
    resets += 1
    while step_s + reset_s < seconds:
        t = time.perf_counter()
        r = env.step({"name": "click", "arguments": {"x": rng.randrange(w), "y": rng.randrange(h)}})
        if screenshot:
            env.screenshot()
        step_s += time.perf_counter() - t
        steps += 1
        if r["state"].get("status") == "terminal":
            ep += 1
            t = time.perf_counter()
            env.reset(ep)
            reset_s += time.perf_counter() - t
            resets += 1
    return {"steps": steps, "steps_per_s": round(steps / step_s, 1), "ms_per_step": round(1000 * step_s / steps, 2),
            "resets": resets, "ms_per_reset": round(1000 * reset_s / resets, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="click-button")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    task = get_task(args.task)
    t = time.perf_counter()
    with BrowserEnv(task) as env:
        launch = time.perf_counter() - t
        out = {"task": args.task, "step_ms_page_time": task.step_ms, "browser_launch_s": round(launch, 2),
               "paused": run(env, args.seconds, False, 0), "paused_with_screenshot": run(env, args.seconds, True, 0)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
