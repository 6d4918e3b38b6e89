"""Evaluation on BabyAI (MiniGrid) from RGB frames only, on any registered level, with the evaluator and the
policy in separate processes.

The evaluator (this module, the parent process) owns the environment: it renders a frame, sends the frame and the
mission to the policy process (`PolicyProcess`), applies the primitive action that comes back, and alone reads
the internal state: BabyAI's verifier (success), the grid encoding (to score perception), the agent's pose and
carried object (to detect deadlocks), and BabyAI's own bot (the reference step count). The policy process runs
`evaluation.pixel_agent.PixelAgent`: perception, belief, skill executor, skill policy.

    embodistill eval recipes/tiny.yaml --env babyai:GoTo --policy expert --episodes 50 --out outputs/babyai/goto

writes `metrics.json` (success with a Wilson interval, steps and the ratio to the bot, invalid-action rate,
deadlocks, perception accuracy), `episodes.jsonl`, `report.md` and a few frame strips (`strip_<n>.png`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from agent.episode import hint_text
from agent.metrics import Deadlock, Decision, deadlock_report, find_deadlocks
from evaluation.isolation import PAYLOAD_KEYS, PolicyProcess, check_payload, probe  # noqa: F401 - re-exported
from evaluation.pixel_report import wilson, write_strip  # noqa: F401 - re-exported

# the catalogue of short names (`--env babyai:GoTo`); any other registered BabyAI id (and MiniGrid's own ids whose
# missions the grammar reads) runs too: `level_id`. name -> gymnasium id
LEVELS = {
    "GoToObj": "BabyAI-GoToObj-v0",            # one room, one object
    "GoToLocal": "BabyAI-GoToLocal-v0",        # one room, 8 distractors
    "GoTo": "BabyAI-GoTo-v0",                  # 3x3 rooms, closed doors, 18 distractors
    "GoToSeq": "BabyAI-GoToSeq-v0",            # sequences of go-to (and, then, after you)
    "GoToImpUnlock": "BabyAI-GoToImpUnlock-v0",  # the target is behind a locked door; its key is elsewhere
    "Open": "BabyAI-Open-v0",                  # open a door somewhere in the 3x3 rooms
    "Unlock": "BabyAI-Unlock-v0",              # open a locked door: find its key first
    "Pickup": "BabyAI-Pickup-v0",              # pick up an object somewhere in the 3x3 rooms
    "PickupLoc": "BabyAI-PickupLoc-v0",        # one room; "on your left"-style locations
    "PutNextLocal": "BabyAI-PutNextLocal-v0",  # one room: put an object next to another
    "PutNext": "BabyAI-PutNextS6N3-v0",        # two rooms
    "Synth": "BabyAI-Synth-v0",                # go to / pick up / open / put next, 3x3 rooms
}
VIEWS = ("topdown", "topdown-fov", "egocentric")
# what the perception reads and the skills act on; a goal square or lava has no skill ("get to the goal")
KNOWN_CELLS = {"empty", "wall", "floor", "door", "key", "ball", "box"}


class LevelError(ValueError):
    """A level id that is not registered, or a level whose mission or grid the skills cannot express."""


def registered_levels(prefix: str = "BabyAI-") -> list[str]:
    """The gymnasium ids registered with `prefix` (BabyAI's levels; `MiniGrid-` for MiniGrid's own)."""
    import gymnasium as gym
    import minigrid  # noqa: F401 — registers the BabyAI and MiniGrid ids

    return sorted(k for k in gym.registry if k.startswith(prefix))


def level_id(level: str) -> str:
    """The gymnasium id of `level`: a short name of the catalogue (`GoTo`), any registered BabyAI id
    (`BabyAI-UnlockLocal-v0`, or `UnlockLocal` for it), or a MiniGrid id (`MiniGrid-KeyCorridorS3R1-v0`).
    Whether the skills can express the level's missions is checked per episode (`check_level`)."""
    if level in LEVELS:
        return LEVELS[level]
    known = set(registered_levels("BabyAI-")) | set(registered_levels("MiniGrid-"))
    for candidate in (level, f"BabyAI-{level}-v0"):
        if candidate in known:
            return candidate
    import difflib
    close = difflib.get_close_matches(level, [*LEVELS, *sorted(known)], n=3, cutoff=0.6)
    raise LevelError(f"unknown BabyAI level {level!r}: neither a short name ({', '.join(LEVELS)}) nor a registered "
                     f"BabyAI or MiniGrid id" + (f"; did you mean {' or '.join(close)}?" if close else ""))


def check_level(env, mission: str, seed: int) -> None:
    """Refuse an episode the skills cannot express, saying which part: a mission the grammar cannot read (go to /
    pick up / open / put X next to Y, joined by "and", ", then", "after you"), or a cell no skill acts on."""
    from evaluation.pixel_agent import MissionError, parse_mission
    env_id = env.spec.id if env.spec is not None else type(env.unwrapped).__name__
    try:
        parse_mission(mission)
    except MissionError as e:
        raise LevelError(f"{env_id} (seed {seed}): the mission grammar {e}; it reads go to / pick up / open / "
                         "put X next to Y, joined by 'and', ', then' and 'after you'") from None
    cells = {c.type for c in env.unwrapped.grid.grid if c is not None}
    other = sorted(cells - KNOWN_CELLS)
    if other:
        raise LevelError(f"{env_id} (seed {seed}): its grid has {' and '.join(other)} cells, which no skill acts on "
                         f"(mission {mission!r})")


def make_env(level: str, tile_size: int = 8):
    import gymnasium as gym
    import minigrid  # noqa: F401 — registers the BabyAI ids

    return gym.make(level_id(level), render_mode="rgb_array", tile_size=tile_size)


def quiet_reset(env, seed: int):
    """BabyAI prints each rejected layout while it samples one; keep the evaluator's output clean."""
    with contextlib.redirect_stdout(io.StringIO()):
        return env.reset(seed=seed)


def render(env, view: str, tile_size: int) -> np.ndarray:
    """The frame the policy gets: the whole grid with the field of view highlighted, or the agent's own 7x7 view."""
    return env.unwrapped.get_frame(highlight=True, tile_size=tile_size, agent_pov=view == "egocentric")


def world_pose(canvas_pose, canvas_start, world_start) -> tuple[int, int, int]:
    """A first-person belief's pose (its own canvas, starting facing north) in the env's coordinates, given where
    the agent really started (evaluator side: for scoring only)."""
    k = (world_start[2] - canvas_start[2]) % 4  # clockwise quarter turns from canvas to world
    dx, dy = canvas_pose[0] - canvas_start[0], canvas_pose[1] - canvas_start[1]
    for _ in range(k):
        dx, dy = -dy, dx
    return world_start[0] + dx, world_start[1] + dy, (canvas_pose[2] + k) % 4


class _BotTimeout(Exception):
    pass


def bot_steps(level: str, seed: int, cap: int, seconds: float = 20.0) -> int | None:
    """Steps BabyAI's own bot takes on the same seed (None if it fails within `cap` steps or `seconds`: on some
    layouts its planner never returns, so in the main thread a timer interrupts it)."""
    import signal
    import threading

    from minigrid.utils.baby_ai_bot import BabyAIBot

    def _alarm(signum, frame):
        raise _BotTimeout

    timed = threading.current_thread() is threading.main_thread()
    if timed:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        env = make_env(level)
        quiet_reset(env, seed)
        bot = BabyAIBot(env)
        for n in range(1, cap + 1):
            action = bot.replan()
            _, reward, terminated, truncated, _ = env.step(action)
            if terminated:
                return n if reward > 0 else None
            if truncated:
                return None
        return None
    except _BotTimeout:
        return None
    except Exception:  # the bot gives up on some layouts (its own DisappearedBoxError and friends)
        return None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------- the policy process


@dataclass(frozen=True)
class PolicySpec:
    """Plain data the policy process builds its agent from: `policy` is expert, random or a model folder."""

    policy: str
    view: str = "topdown"
    tile_size: int = 8
    skill_budget: int = 30
    max_new_tokens: int = 96
    constrained: bool = False             # a model's calls: well-formed, over ids its prompt shows
    instructions: str = "goal"            # a model's task line: goal | step | visual (`agent.instructions`)
    vision_model: str | None = None       # perception by an OpenAI-compatible vision model instead of sprites
    vision_base_url: str | None = None
    vision_api_key_env: str = "OPENAI_API_KEY"

    def build(self):
        return build_agent(self)


def build_agent(spec: PolicySpec):
    from evaluation.perception import VisionPerception
    from evaluation.pixel_agent import PixelAgent, PixelExpert, PixelModel, PixelRandom

    if spec.policy == "expert":
        policy = PixelExpert()
    elif spec.policy == "random":
        policy = PixelRandom()
    else:
        from agent.clients import TransformersClient
        policy = PixelModel(TransformersClient(spec.policy, max_new_tokens=spec.max_new_tokens,
                                               constrained=spec.constrained), name=spec.policy,
                            instructions=spec.instructions)
    perception = None
    if spec.vision_model:
        from agent.clients import OpenAIClient
        perception = VisionPerception(OpenAIClient(spec.vision_model, base_url=spec.vision_base_url,
                                                   api_key_env=spec.vision_api_key_env), spec.tile_size)
    return PixelAgent(policy, view=spec.view, tile_size=spec.tile_size, skill_budget=spec.skill_budget,
                      perception=perception)


# ----------------------------------------------------------------------------- the evaluator


# a deadlock is `deadlock_turns` turns with no change of pose, holdings or grid (`agent.metrics.find_deadlocks`
# classifies it aware / unaware / recovered); the episode ends after STALL_FACTOR times as many
STALL_FACTOR = 4


def _state_key(signature: tuple) -> str:
    return hashlib.blake2b(repr(signature).encode(), digest_size=8).hexdigest()


def _signature(env) -> tuple:
    u = env.unwrapped
    carrying = u.carrying.encode() if u.carrying is not None else None
    return (tuple(int(v) for v in u.agent_pos), int(u.agent_dir), carrying, u.grid.encode().tobytes())


def run_episode(env, proc: PolicyProcess, level: str, seed: int, view: str, tile_size: int,
                deadlock_turns: int = 16, keep_frames: bool = False, deadlock_hint: bool = False) -> dict:
    obs, _ = quiet_reset(env, seed)
    u = env.unwrapped
    mission = obs["mission"]
    check_level(env, mission, seed)
    frame = render(env, view, tile_size)
    frames = [frame] if keep_frames else []
    reply = proc.call(op="reset", mission=mission, frame=frame, seed=seed)
    perc_ok = perc_n = pose_ok = pose_n = 0

    start = (int(u.agent_pos[0]), int(u.agent_pos[1]), int(u.agent_dir))

    def score(reply: dict) -> None:
        nonlocal perc_ok, perc_n, pose_ok, pose_n
        percept = reply["percept"]
        cells = np.asarray(percept["cells"])
        if view == "egocentric":
            grid, vis = u.gen_obs_grid()
            truth = grid.encode(vis)
            if percept["carried"] is not None:  # the view draws the carried object under the agent
                cells[3, 6] = (percept["carried"][0], percept["carried"][1], 0)
            pose = world_pose(reply["pose"], reply["start"], start) if reply.get("pose") else None
        else:
            truth = u.grid.encode()
            pose = tuple(percept["agent"]) if percept["agent"] is not None else None
        shown = cells[:, :, 0] != 0  # cells the percept claims to see
        perc_ok += int((cells == truth).all(axis=2)[shown].sum())
        perc_n += int(shown.sum())
        pose_n += 1
        pose_ok += int(pose == (int(u.agent_pos[0]), int(u.agent_pos[1]), int(u.agent_dir)))

    score(reply)
    steps = turns = still = calls = 0
    success = False
    end = "truncated"
    events: list[dict] = []
    last = _signature(env)
    start_key = _state_key(last)
    decisions: list[Decision] = []   # one per turn: the state after it, the skill running, what was thought
    call = None
    while True:
        # the deadlock intervention: after `deadlock_turns` turns that changed nothing, a neutral note
        reply = proc.call(op="act", frame=frame, note=hint_text(still)) if deadlock_hint and still >= deadlock_turns \
            else proc.call(op="act", frame=frame)
        turns += 1
        score(reply)
        new = [{k: e[k] for k in ("thought", "call", "ok", "error", "observation")} for e in reply["events"]]
        events += new
        call = next((e["call"] for e in reversed(new) if isinstance(e["call"], dict)), call)
        thought = " ".join(e["thought"] for e in new if e.get("thought"))
        calls = reply["calls"]  # started, including one cut short by the episode's end
        if reply["finish"]:
            end = reply.get("why") or "finish"
            decisions.append(Decision(_state_key(last), call, thought))
            break
        if reply["action"] is not None:
            _, reward, terminated, truncated, _ = env.step(int(reply["action"]))
            steps += 1
            frame = render(env, view, tile_size)
            if keep_frames:
                frames.append(frame)
            if terminated or truncated:
                success = terminated and reward > 0
                end = "success" if success else "failed" if terminated else "step budget"
                decisions.append(Decision(_state_key(_signature(env)), call, thought, progress=success))
                break
        sig = _signature(env)
        still = still + 1 if sig == last else 0
        last = sig
        decisions.append(Decision(_state_key(sig), call, thought))
        if still >= STALL_FACTOR * deadlock_turns:   # a deadlock is counted at deadlock_turns; this ends it
            end = "deadlock"
            break
    invalid = sum(1 for e in events if not e["ok"])
    locks = find_deadlocks(start_key, decisions, deadlock_turns)
    return {"level": level, "seed": seed, "mission": mission, "success": bool(success), "steps": steps,
            "turns": turns, "end": end, "deadlock": bool(locks), "deadlocks": [asdict(d) for d in locks],
            "skill_calls": calls, "invalid_calls": invalid,
            "perception_correct": perc_ok, "perception_cells": perc_n, "pose_correct": pose_ok,
            "pose_frames": pose_n, "max_steps": int(u.max_steps), "events": events, "frames": frames}


def evaluate_babyai(level: str, policy: str, episodes: int, out: Path, seed: int = 0, view: str = "topdown",
                    tile_size: int = 8, skill_budget: int = 30, deadlock_turns: int = 16, bot: bool = True,
                    strips: int = 3, progress: Callable[[int], None] | None = None,
                    vision_model: str | None = None, vision_base_url: str | None = None,
                    vision_api_key_env: str = "OPENAI_API_KEY", constrained: bool = False,
                    instructions: str = "goal", deadlock_hint: bool = False) -> dict:
    """Run `episodes` episodes (seeds seed .. seed+episodes-1) of one level; write metrics.json, episodes.jsonl,
    report.md and frame strips under `out`; return the metrics. `constrained`: a model folder's decoding writes
    only well-formed calls over ids its prompt shows (`agent.constrained`). `level`: a short name or any registered
    BabyAI (or MiniGrid) id; an episode the skills cannot express raises `LevelError` saying which part.
    `instructions`: a model's task line, goal | step | visual (`agent.instructions`; the expert and random
    policies read the mission, not a task line). `deadlock_hint`: after `deadlock_turns` turns that changed
    nothing, the policy's next observation ends with `agent.episode.hint_text` (a model reads it)."""
    from agent.instructions import check_granularity
    check_granularity(instructions)
    env_id = level_id(level)
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; choose one of {', '.join(VIEWS)}")
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, not {episodes}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = make_env(level, tile_size)
    check_level(env, quiet_reset(env, seed)[0]["mission"], seed)   # before the policy process starts
    spec = PolicySpec(policy=policy, view=view, tile_size=tile_size, skill_budget=skill_budget,
                      vision_model=vision_model, vision_base_url=vision_base_url,
                      vision_api_key_env=vision_api_key_env, constrained=constrained, instructions=instructions)
    rows = []
    t0 = time.time()
    with PolicyProcess(spec) as proc:
        for i in range(episodes):
            r = run_episode(env, proc, level, seed + i, view, tile_size, deadlock_turns, keep_frames=i < strips,
                            deadlock_hint=deadlock_hint)
            if bot:
                r["bot_steps"] = bot_steps(level, seed + i, r["max_steps"])
            if r["frames"]:
                write_strip(r["frames"], out / f"strip_{i}.png")
            r.pop("frames")
            rows.append(r)
            if progress:
                progress(1)
        audit = sorted(set(proc.sent))
    m = summarize(rows)
    m["deadlock_taxonomy"]["hint"] = deadlock_hint
    m.update({"level": level, "env_id": env_id, "policy": policy, "instructions": instructions, "view": view,
              "tile_size": tile_size,
              "perception": f"vision:{vision_model}" if vision_model else "sprites",
              "seed": seed, "skill_budget": skill_budget, "deadlock_turns": deadlock_turns,
              "payload_keys": [list(k) for k in audit], "wall_s": round(time.time() - t0, 1)})
    from agent.trajectory import write_json, write_text_atomic
    write_text_atomic(out / "episodes.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write_json(out / "metrics.json", m)
    write_text_atomic(out / "report.md", report(m, rows))
    return m


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    k = sum(r["success"] for r in rows)
    lo, hi = wilson(k, n)
    succ = [r for r in rows if r["success"]]
    both = [r for r in succ if r.get("bot_steps")]
    calls = sum(r["skill_calls"] for r in rows)
    cells = sum(r["perception_cells"] for r in rows)
    frames = sum(r["pose_frames"] for r in rows)
    bot_ok = [r for r in rows if r.get("bot_steps")]
    return {
        "episodes": n, "successes": k, "success_rate": k / n, "success_wilson95": [round(lo, 4), round(hi, 4)],
        "step_budget": rows[0]["max_steps"] if rows else None,
        "mean_steps": float(np.mean([r["steps"] for r in rows])) if rows else 0.0,
        "mean_steps_success": float(np.mean([r["steps"] for r in succ])) if succ else None,
        "bot_success_rate": len(bot_ok) / n if "bot_steps" in (rows[0] if rows else {}) else None,
        "step_ratio_to_bot": (float(np.mean([r["steps"] / r["bot_steps"] for r in both])) if both else None),
        "skill_calls": calls, "invalid_action_rate": (sum(r["invalid_calls"] for r in rows) / calls) if calls else 0.0,
        "deadlocks": sum(r["deadlock"] for r in rows),   # episodes with one
        "deadlock_taxonomy": deadlock_report([([Deadlock(**d) for d in r["deadlocks"]], r["success"])
                                              for r in rows]),
        "perception_accuracy": (sum(r["perception_correct"] for r in rows) / cells) if cells else None,
        "pose_accuracy": (sum(r["pose_correct"] for r in rows) / frames) if frames else None,
        "ends": {e: sum(r["end"] == e for r in rows) for e in sorted({r["end"] for r in rows})},
    }


def report(m: dict, rows: list[dict]) -> str:
    def f(v, fmt="{:.3f}"):
        return "n/a" if v is None else fmt.format(v)

    lines = [f"# {m['policy']} on BabyAI {m['level']} ({m['env_id']}), {m['view']} frames",
             "",
             f"{m['episodes']} episodes, seeds {m['seed']}..{m['seed'] + m['episodes'] - 1}, step budget "
             f"{m['step_budget']} primitive actions, {m['skill_budget']} skill calls.",
             "",
             "| metric | value |", "|---|---|",
             f"| success | {m['success_rate']:.3f} (95% Wilson {m['success_wilson95'][0]:.3f}-"
             f"{m['success_wilson95'][1]:.3f}) |",
             f"| mean steps (all / successful) | {m['mean_steps']:.1f} / {f(m['mean_steps_success'], '{:.1f}')} |",
             f"| steps / BabyAI bot's steps (both successful) | {f(m['step_ratio_to_bot'], '{:.2f}')} |",
             f"| BabyAI bot success | {f(m['bot_success_rate'])} |",
             f"| invalid skill calls | {m['invalid_action_rate']:.3f} of {m['skill_calls']} |",
             f"| deadlocks | {m['deadlocks']} episodes; {_taxonomy(m['deadlock_taxonomy'])} |",
             f"| perception accuracy (cells / agent pose) | {f(m['perception_accuracy'], '{:.4f}')} / "
             f"{f(m['pose_accuracy'], '{:.4f}')} |",
             f"| episode ends | {', '.join(f'{k}: {v}' for k, v in m['ends'].items())} |",
             "", "## Episodes", ""]
    for i, r in enumerate(rows[:5]):
        lines.append(f"- seed {r['seed']}: \"{r['mission']}\": {'success' if r['success'] else r['end']} in "
                     f"{r['steps']} steps, {r['skill_calls']} skill calls"
                     + (f" (strip: strip_{i}.png)" if i < 3 else ""))
        for e in r["events"][:8]:
            call = e["call"] if isinstance(e["call"], dict) else {"name": "(unreadable)", "arguments": {}}
            args = ", ".join(f"{v}" for v in call.get("arguments", {}).values())
            lines.append(f"  - {call['name']}({args}) -> {'ok' if e['ok'] else e['error']}")
    return "\n".join(lines) + "\n"


def _taxonomy(d: dict) -> str:
    return (f"aware {d['aware']}, unaware {d['unaware']}, recovered {d['recovered']}; failed episodes with an "
            f"aware one {d['failed_with_aware']}, with an unaware one {d['failed_with_unaware']}")
