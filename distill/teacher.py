"""Teacher rollouts over the train tasks, resumable.

Every episode runs through the one episode loop (`agent.episode.play`), so each turn records the exact step
prompt (`agent.prompt.build_step_messages`) and the raw output:

* the expert (embedded default): `sandbox.agents.ExpertAgent` answering as a model would (its thought, then the
  `<tool_call>` markup), `EXPERT_BATCH` episodes in lockstep. It acts on the agent's belief only, so it
  searches, asks, fails and recovers;
* any chat model through a `ClientSpec` (`agent.clients.make_client`): an OpenAI-compatible endpoint plays
  `concurrency` episodes in lockstep, their requests sent concurrently; a local transformers model plays one
  episode at a time.

Resume: each finished episode is appended as one line to `trajectories.partial.jsonl` (flushed and fsynced),
next to a key file naming the inputs it was written for. A rerun reads it back (a torn last line from a
crash is cut off), skips the finished tasks and appends only the others; the caller then writes the final
file in task order, so its bytes depend neither on concurrency nor on interruptions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pydantic import ValidationError
from tqdm import tqdm

from agent.clients import ClientSpec, make_client
from agent.episode import episode_seed, play
from agent.policies import ChatPolicy, ScriptedPolicy
from agent.trajectory import Trajectory, write_json, write_jsonl
from sandbox.agents import ExpertAgent
from sandbox.gym_env import SandboxEnv
from sandbox.schema import TaskInstance

FINAL = "trajectories.jsonl"           # every episode, in task order: written once the run is complete
PARTIAL = "trajectories.partial.jsonl"  # episodes as they finish (fsynced): what a rerun resumes from
KEY = "trajectories.key.json"           # the inputs the episodes were played with (`run_key`)
_OLD_KEY = "trajectories.partial.key.json"   # KEY's name before 2026-12-06


class TeacherError(RuntimeError):
    """The teacher run cannot go on (a model endpoint failed for good, or the resume file does not match)."""


def teacher_name(teacher: str | ClientSpec) -> str:
    """A short, secret-free name: `expert`, `openai:MODEL` or `transformers:FOLDER`."""
    if isinstance(teacher, str):
        return teacher
    return f"{teacher.kind}:{Path(teacher.model).name if teacher.kind == 'transformers' else teacher.model}"


def teacher_description(teacher: str | ClientSpec) -> dict:
    """What identifies the teacher's behaviour (no base URL, no key variable: nothing private)."""
    if isinstance(teacher, str):
        return {"kind": teacher}
    return teacher.model_dump(include={"kind", "model", "temperature", "seed", "max_tokens"})


def tasks_sha256(tasks: list[TaskInstance]) -> str:
    h = hashlib.sha256()
    for t in tasks:
        h.update(t.model_dump_json().encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def run_key(tasks: list[TaskInstance], teacher: str | ClientSpec, recipe_seed: int, persona: dict) -> dict:
    """The inputs a partial file was written for; a rerun resumes only when they are the same."""
    return {"teacher": teacher_description(teacher), "tasks_sha256": tasks_sha256(tasks),
            "tasks": len(tasks), "seed": recipe_seed, "persona": persona}


@dataclass
class TeacherRun:
    trajectories: list[Trajectory]                      # in task order
    resumed: int = 0                                    # episodes read back from the partial file
    ran: int = 0                                        # episodes played by this call
    client_stats: dict = field(default_factory=dict)    # OpenAIClient counters (requests, retries, errors)


# ----------------------------------------------------------------------------- the partial file


def read_partial(path: Path) -> tuple[list[Trajectory], int]:
    """The finished episodes in a partial file and the byte length of its valid part. A last line that does
    not parse (a write cut short by a crash) is left out; a bad line before it is an error naming the line."""
    data = path.read_bytes()
    rows: list[Trajectory] = []
    good_end = pos = 0
    lines = data.split(b"\n")
    for n, line in enumerate(lines, 1):
        end = min(pos + len(line) + 1, len(data))
        if line.strip():
            try:
                rows.append(Trajectory.model_validate_json(line))
            except ValidationError as e:
                if any(rest.strip() for rest in lines[n:]):
                    raise TeacherError(f"{path}:{n}: not a trajectory ({e.errors()[0]['msg'][:120]}); the file is "
                                       "damaged before its last line: delete it (or pass --restart) to start "
                                       "over") from e
                break  # the torn last line
        good_end = pos = end
    return rows, good_end


def _read_key(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _open_partial(folder: Path, key: dict, restart: bool) -> tuple[list[Trajectory], object]:
    """Check the key, read the finished rows, cut a torn tail, and open the file for appending."""
    folder.mkdir(parents=True, exist_ok=True)
    path, key_path, final = folder / PARTIAL, folder / KEY, folder / FINAL
    if (folder / _OLD_KEY).is_file() and not key_path.exists():
        os.replace(folder / _OLD_KEY, key_path)
    if restart:
        for p in (path, key_path, final):
            p.unlink(missing_ok=True)
    if not path.exists() and final.is_file() and _read_key(key_path) == key:
        # a complete run of these inputs (a later step failed, or the stage runs again): resumed, not replayed
        shutil.copyfile(final, path)
    if not path.exists():
        final.unlink(missing_ok=True)   # a complete run of other inputs: replaced, and never left looking current
        write_json(key_path, key)
        return [], open(path, "a")
    if not key_path.is_file():
        raise TeacherError(f"{path} has no {KEY} beside it, so it cannot be matched to this run: "
                           "delete it (or pass --restart) to start over")
    try:
        old = json.loads(key_path.read_text())
    except ValueError as e:
        raise TeacherError(f"{key_path}: not JSON ({e}); delete it and {PARTIAL} (or pass --restart)") from e
    if old != key:
        diff = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
        raise TeacherError(f"{path} was written for other inputs (different {', '.join(diff)}): pass --restart "
                           "to discard it, or restore the recipe and tasks it was made with")
    rows, good_end = read_partial(path)
    with open(path, "r+b") as f:
        if good_end < path.stat().st_size:  # cut the torn tail so the next row starts on a fresh line
            f.truncate(good_end)
        if good_end:
            f.seek(good_end - 1)
            if f.read(1) != b"\n":  # the last row is whole but lost its newline
                f.seek(good_end)
                f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())
    return rows, open(path, "a")


def _append(fh, traj: Trajectory) -> None:
    fh.write(traj.model_dump_json() + "\n")
    fh.flush()
    os.fsync(fh.fileno())


# ----------------------------------------------------------------------------- running episodes


EXPERT_BATCH = 64   # expert episodes in lockstep (the expert is fast; a batch only saves per-round overhead)


def teacher_policy(teacher: str | ClientSpec, client=None, expert: Callable = ExpertAgent,
                   tools: list[dict] | None = None) -> tuple[object, int]:
    """(the episode loop's policy, how many episodes it plays in lockstep). `expert(env, seed)` makes the
    scripted expert of the env (the sandbox's by default); `tools`, the skills a chat model is shown."""
    if teacher == "expert":
        return ScriptedPolicy(expert, name="expert", as_text=True), EXPERT_BATCH
    client = client if client is not None else make_client(teacher)
    return ChatPolicy(client, tools=tools), 1 if teacher.kind == "transformers" else None


def run_teacher(tasks: list[TaskInstance], teacher: str | ClientSpec, folder: str | Path, recipe_seed: int = 0,
                concurrency: int = 8, human_factory=None, persona: dict | None = None, restart: bool = False,
                progress: Callable[[int], None] | None = None, show_progress: bool = True,
                client=None, make_env: Callable[[], object] | None = None, expert: Callable = ExpertAgent,
                tools: list[dict] | None = None) -> TeacherRun:
    """Play every task once with the teacher, resuming from `folder/trajectories.partial.jsonl` (or from a
    complete run's `trajectories.jsonl` made with the same inputs). Writes `folder/trajectories.jsonl` in task
    order once every episode is done, and removes the partial file.

    `progress(n)` is called after each episode is saved (it may raise to stop the run: what was saved stays).
    `client` overrides the client built from a `ClientSpec` (the caller's own ChatModel). An endpoint that
    fails after its retries does not stop the other episodes; the run then raises `TeacherError` naming how
    many failed, and a rerun plays only those. `make_env`, `expert` and `tools`: another env than the sandbox
    (TextWorld: `textworld_env.env.TextWorldEnv`, its teacher, its `operate` actions)."""
    folder = Path(folder)
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise TeacherError("the task list has duplicate ids")
    seeds = {t.id: episode_seed(recipe_seed, t.id) for t in tasks}
    key = run_key(tasks, teacher, recipe_seed, persona or {"mode": "rule"})
    rows, fh = _open_partial(folder, key, restart)
    done: dict[str, Trajectory] = {}
    for n, r in enumerate(rows, 1):
        if r.task_id not in seeds:
            fh.close()
            raise TeacherError(f"{folder / PARTIAL}: row {n} is for task {r.task_id!r}, which is not in this run")
        if r.task_id in done:
            fh.close()
            raise TeacherError(f"{folder / PARTIAL}: task {r.task_id!r} appears twice; pass --restart")
        if r.seed != seeds[r.task_id]:
            fh.close()
            raise TeacherError(f"{folder / PARTIAL}: task {r.task_id!r} was played with seed {r.seed}, not "
                               f"{seeds[r.task_id]}; pass --restart")
        done[r.task_id] = r
    resumed = len(done)
    todo = [(i, t, seeds[t.id]) for i, t in enumerate(tasks) if t.id not in done]
    bar = tqdm(total=len(tasks), initial=resumed, desc=f"teacher {teacher_name(teacher)}", unit="ep",
               disable=not show_progress)
    failures: list[tuple[str, BaseException]] = []
    stats: dict = {}

    def save(traj: Trajectory) -> None:
        _append(fh, traj)
        done[traj.task_id] = traj
        bar.update(1)
        if progress:
            progress(1)

    def finished(i: int, episode) -> None:
        if episode.error is not None:
            failures.append((todo[i][1].id, episode.error))
        else:
            save(episode.trajectory)

    try:
        if todo:
            policy, batch = teacher_policy(teacher, client, expert, tools)
            workers = batch or concurrency
            if make_env is None:
                make_env = lambda: SandboxEnv(human_factory=human_factory)  # noqa: E731
            play(make_env, policy, [({"task": t}, s) for _, t, s in todo],
                 batch_size=workers, raise_errors=False, on_done=finished)
            if isinstance(policy, ChatPolicy):
                stats = dict(getattr(policy.client, "stats", {}) or {})
    finally:
        fh.close()
        bar.close()
    if failures:
        tid, first = failures[0]
        raise TeacherError(f"{len(failures)} of {len(todo)} teacher episodes failed (first: task {tid}: "
                           f"{type(first).__name__}: {str(first)[:200]}); the {len(done)} finished ones are saved "
                           f"in {folder / PARTIAL}: rerun to play only the rest") from first
    trajectories = [done[i] for i in ids]
    write_jsonl(folder / FINAL, trajectories)   # atomic; then the partial file has nothing more to give
    (folder / PARTIAL).unlink()
    return TeacherRun(trajectories=trajectories, resumed=resumed, ran=len(done) - resumed, client_stats=stats)
