"""SFT samples from kept trajectories, in two configs that keep the interaction structure, and the local
artifact (parquet shards + README.md card) that `datasets.load_dataset(DIR, CONFIG)` reads offline.

* `conversation`: one row per trajectory in the Hugging Face conversational format TRL's SFTTrainer takes as
  is: `messages` = system (`agent.prompt.SYSTEM_PROMPT`), the step-0 prompt's user message, then for every
  turn an assistant message (its reasoning as `content`, its call in `tool_calls`) and a `tool` message (the
  observation, human replies included); failed attempts and recoveries are kept. An unparseable turn ends the
  sample before it. `tools` = `agent.tools.tool_definitions()`.
* `step`: one row per turn: `messages` = the turn's recorded prompt (system + user: task, known map, memory
  of recent steps, current observation; exactly what RL rollouts show the student) + the assistant message.

Both are built from the prompts the shared builder wrote during the teacher run. Tool-call `arguments` and
the `tools` column are `datasets.Json()`, so every row has one schema whatever the skill. Splits: whole
instructions go to train or validation, by a hash of (recipe seed, instruction id).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from agent.prompt import SYSTEM_PROMPT
from agent.tools import tool_definitions
from agent.trajectory import Trajectory, Turn, temp_beside
from sandbox.schema import TaskInstance

CONFIGS = ("conversation", "step")       # what distillation writes
ONPOLICY = "onpolicy"                    # what on-policy distillation adds (`distill.onpolicy`)
ALL_CONFIGS = (*CONFIGS, ONPOLICY)
SPLITS = ("train", "validation")
META_COLUMNS = ("task_id", "instruction_id", "difficulty", "scene", "kind", "teacher", "episode_score")


class DatasetBuildError(ValueError):
    """The kept trajectories cannot make a dataset (none kept, no prompts recorded, ...)."""


def features(config: str):
    """The explicit `datasets.Features` of a config (the same schema for every row)."""
    from datasets import Features, Json, List, Value
    if config not in ALL_CONFIGS:
        raise ValueError(f"unknown dataset config {config!r}: choose {', '.join(ALL_CONFIGS)}")
    call = {"id": Value("string"), "type": Value("string"),
            "function": {"name": Value("string"), "arguments": Json()}}
    message = {"role": Value("string"), "content": Value("string"), "tool_calls": List(call),
               "tool_call_id": Value("string"), "name": Value("string")}
    cols = {"messages": List(message), "tools": Json(),
            **{c: Value("string") for c in META_COLUMNS if c != "episode_score"},
            "episode_score": Value("float64")}
    if config in ("step", ONPOLICY):
        cols["step"] = Value("int32")
    if config == ONPOLICY:   # the round that labelled the state, what the student did there, and whether it agreed
        cols.update(round=Value("int32"), student_action=Value("string"), agreed=Value("bool"))
    return Features(cols)


# ----------------------------------------------------------------------------- messages


def _message(role: str, content: str, tool_calls: list[dict] | None = None, tool_call_id: str | None = None,
             name: str | None = None) -> dict:
    return {"role": role, "content": content or "", "tool_calls": tool_calls, "tool_call_id": tool_call_id,
            "name": name}


def call_id(turn: Turn) -> str:
    return f"call_{turn.index}"


def call_message(reasoning: str, call: dict, index: int) -> dict:
    """The assistant message of one decision: its reasoning as `content`, its call as the one tool call."""
    return _message("assistant", reasoning, tool_calls=[
        {"id": f"call_{index}", "type": "function",
         "function": {"name": call["name"], "arguments": dict(call.get("arguments") or {})}}])


def assistant_message(turn: Turn) -> dict:
    return call_message(turn.reasoning, turn.tool_call, turn.index)


def tool_message(turn: Turn) -> dict:
    return _message("tool", turn.observation, tool_call_id=call_id(turn), name=turn.tool_call["name"])


def step_prompt(p: list[dict], where: str) -> list[dict]:
    """A recorded step prompt (system + user) as dataset messages; `where` names it in the error."""
    if len(p) != 2 or p[0].get("role") != "system" or p[1].get("role") != "user":
        raise DatasetBuildError(f"{where} has no recorded step prompt (system + user); teacher runs must go "
                                "through the episode loop (agent.episode.play) with a policy that reads prompts")
    if p[0].get("content") != SYSTEM_PROMPT:
        raise DatasetBuildError(f"{where} was prompted with another system prompt than agent.prompt.SYSTEM_PROMPT; "
                                "rerun the teacher")
    return [_message(m["role"], m["content"]) for m in p]


def _prompt(traj: Trajectory, turn: Turn) -> list[dict]:
    return step_prompt(turn.prompt, f"trajectory {traj.task_id} turn {turn.index}")


def conversation_messages(traj: Trajectory) -> list[dict] | None:
    """The whole episode as one conversation (None when its first turn is already unreadable)."""
    if not traj.turns:
        return None
    msgs = _prompt(traj, traj.turns[0])
    for turn in traj.turns:
        if turn.tool_call is None:
            break  # an unreadable turn: what follows it is not a clean continuation
        msgs += [assistant_message(turn), tool_message(turn)]
    return msgs if len(msgs) > 2 else None


def step_samples(traj: Trajectory) -> list[tuple[int, list[dict]]]:
    """(turn index, prompt + assistant message) for every readable turn."""
    return [(t.index, _prompt(traj, t) + [assistant_message(t)]) for t in traj.turns if t.tool_call is not None]


# ----------------------------------------------------------------------------- rows and splits


def validation_instructions(instruction_ids: list[str], fraction: float, seed: int) -> set[str]:
    """A deterministic ~`fraction` of the instructions (at least one when there are two or more), ranked by a
    hash of (seed, instruction id), so the choice does not depend on the order or the other ids' fate."""
    ids = sorted(set(instruction_ids))
    if len(ids) < 2:
        return set()
    n = min(len(ids) - 1, max(1, round(fraction * len(ids))))
    ranked = sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
    return set(ranked[:n])


def build_rows(kept: list[Trajectory], tasks: dict[str, TaskInstance], scores: dict[str, float], teacher: str,
               validation_fraction: float, seed: int, tools: list[dict] | None = None
               ) -> tuple[dict[str, dict[str, list[dict]]], dict]:
    """{config: {split: rows}} in trajectory order, and {split: [instruction ids]}. `tools`: the skills as the
    env offers them (default: the sandbox's)."""
    if not kept:
        raise DatasetBuildError("no trajectory passed the filter, so there is nothing to train on (see the "
                                "distill thresholds)")
    missing = [t.task_id for t in kept if t.task_id not in tasks]
    if missing:
        raise DatasetBuildError(f"no task for trajectories {missing[:3]} (the tasks changed since the teacher ran)")
    instr = [tasks[t.task_id].instruction_id for t in kept]
    val = validation_instructions(instr, validation_fraction, seed)
    if not val:
        raise DatasetBuildError(f"the kept trajectories come from {len(set(instr))} instruction(s); a validation "
                                "split needs at least 2 (whole instructions go to one side): add tasks or relax the "
                                "filter")
    tools = tool_definitions() if tools is None else tools
    rows = {c: {s: [] for s in SPLITS} for c in CONFIGS}
    for traj in kept:
        task = tasks[traj.task_id]
        split = "validation" if task.instruction_id in val else "train"
        meta = {"task_id": traj.task_id, "instruction_id": task.instruction_id, "difficulty": task.difficulty,
                "scene": task.scene, "kind": task.kind, "teacher": teacher,
                "episode_score": float(scores[traj.task_id])}
        conv = conversation_messages(traj)
        if conv is not None:
            rows["conversation"][split].append({"messages": conv, "tools": tools, **meta})
        for index, msgs in step_samples(traj):
            rows["step"][split].append({"messages": msgs, "tools": tools, **meta, "step": index})
    instructions = {"train": sorted(set(instr) - val), "validation": sorted(val)}
    return rows, instructions


# ----------------------------------------------------------------------------- the artifact on disk


def data_path(config: str, split: str) -> str:
    """Where a split's shard lives, relative to the artifact: the layout `DatasetDict.push_to_hub` writes."""
    return f"{config}/{split}-00000-of-00001.parquet"


@contextmanager
def _quiet_datasets():
    from datasets.utils import logging as ds_logging
    was = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            ds_logging.enable_progress_bar()


def write_parquet(rows: list[dict], config: str, path: Path) -> dict:
    """Write one split (atomically) and return {"num_examples", "num_bytes"} as the card records them."""
    from datasets import Dataset
    with _quiet_datasets():
        feats = features(config)
        ds = Dataset.from_list(rows, features=feats) if rows else \
            Dataset.from_dict({k: [] for k in feats}, features=feats)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_beside(path)
        os.close(fd)
        try:
            ds.to_parquet(tmp)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return {"num_examples": len(ds), "num_bytes": ds.data.nbytes}


def write_artifact(out: str | Path, rows: dict[str, dict[str, list[dict]]], card_text_for) -> dict:
    """Write every config's splits (the configs `rows` has) and the card into a fresh folder, then put it in
    place of `out`.

    `card_text_for(sizes, file_sizes)` gets {config: {split: {"num_examples", "num_bytes"}}} and {shard path:
    bytes on disk}, and returns README.md's text. Returns the sizes."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # what a killed write left: its temp folder, or the old folder it was swapping out
    for left in [*out.parent.glob(f".{out.name}.*.tmp"), out.parent / f".{out.name}.old"]:
        if left.is_dir():
            shutil.rmtree(left)
    tmp = Path(temp_beside(out, directory=True)[1])
    try:
        configs = [c for c in ALL_CONFIGS if c in rows]
        sizes = {c: {s: write_parquet(rows[c][s], c, tmp / data_path(c, s)) for s in SPLITS} for c in configs}
        file_sizes = {data_path(c, s): (tmp / data_path(c, s)).stat().st_size for c in configs for s in SPLITS}
        (tmp / "README.md").write_text(card_text_for(sizes, file_sizes))
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old"
            if old.exists():
                shutil.rmtree(old)
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        if tmp.exists():
            shutil.rmtree(tmp)
        raise
    return sizes
