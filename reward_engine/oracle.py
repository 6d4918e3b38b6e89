"""Oracle label sets: episodes played by scripted agents, each turn labelled from the sandbox's ground truth.

These are NOT human labels: `sandbox.oracle.OracleLabeller` labels each turn as it is played, from the
environment's privileged state (see there for what each label means). `build_oracle_set` plays expert, noisy
(the expert with seeded, typed mistakes) and random episodes through the episode loop (`agent.episode`) and
returns the trajectories with one `LabelRecord` (source "oracle") per turn; the project ships one such set,
made from recipes/ci.yaml, for tests, benchmarks and the evolution loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from agent.episode import Episode, Reply
from agent.trajectory import Trajectory, read_jsonl, write_jsonl
from reward_engine.labels import LabelRecord, case_id, read_labels, trajectory_key, write_labels_jsonl
from sandbox.agents import ExpertAgent, RandomAgent
from sandbox.gym_env import SandboxEnv
from sandbox.oracle import NoisyExpertAgent, OracleLabeller
from sandbox.schema import TaskInstance
from sandbox.skills import SKILLS

AGENTS: dict[str, Callable] = {"expert": ExpertAgent, "noisy": NoisyExpertAgent, "random": RandomAgent}


def oracle_episode(task: TaskInstance, agent_factory: Callable, seed: int, env: SandboxEnv | None = None,
                   name: str | None = None) -> tuple[Trajectory, list[LabelRecord]]:
    """Play one episode with the scripted agent `agent_factory(env, seed)` (see `sandbox.agents`) and label each
    turn from the sandbox's ground truth as it happens. `name` (default: the factory's `name`) is recorded as
    the trajectory's policy."""
    env = env or SandboxEnv()
    episode = Episode(env, name or agent_factory.name, seed, {"task": task})
    agent = agent_factory(env, seed)
    labeller = OracleLabeller(env)
    key = trajectory_key(episode.trajectory)
    labels: list[LabelRecord] = []
    while not episode.done:
        thought, action = agent.act(episode.info)
        pre = labeller.before()
        reply = Reply(action=action, reasoning=thought) if isinstance(action, dict) else \
            Reply(text=action, reasoning=thought)
        turn = episode.record(episode.request(with_prompt=False), reply)
        label, why = labeller.label(pre, turn.tool_call, episode.info, turn.observation)
        skill = turn.tool_call.get("name") if isinstance(turn.tool_call, dict) and \
            turn.tool_call.get("name") in SKILLS else None
        labels.append(LabelRecord(case_id=case_id(key, turn.index), trajectory=key, turn=turn.index, skill=skill,
                                  label=label, source="oracle", annotator="sandbox-oracle", note=why))
        agent.observe(turn.tool_call, episode.info, turn.observation)
    return episode.trajectory, labels


def build_oracle_set(tasks: Iterable[TaskInstance], policies: Iterable[str] = ("expert", "noisy", "random"),
                     seed: int = 0, progress: Callable[[int], None] | None = None
                     ) -> tuple[list[Trajectory], list[LabelRecord]]:
    """Every task with every policy (episode seed = seed + task index): trajectories and oracle labels."""
    policies = list(policies)
    for p in policies:
        if p not in AGENTS:
            raise ValueError(f"unknown policy {p!r}; available: {', '.join(AGENTS)}")
    env = SandboxEnv()
    trajs, labels = [], []
    for i, task in enumerate(tasks):
        for p in policies:
            tr, lb = oracle_episode(task, AGENTS[p], seed + i, env)
            trajs.append(tr)
            labels.extend(lb)
        if progress:
            progress(1)
    return trajs, labels


SHIPPED = Path(__file__).parent / "data" / "oracle-ci"   # `embodistill oracle-labels recipes/ci.yaml --gzip`


def write_oracle_set(out: str | Path, trajs: list[Trajectory], labels: list[LabelRecord],
                     compress: bool = False) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ext = ".jsonl.gz" if compress else ".jsonl"
    write_jsonl(out / f"trajectories{ext}", trajs)
    write_labels_jsonl(labels, out / f"labels{ext}")
    return {"trajectories": str(out / f"trajectories{ext}"), "labels": str(out / f"labels{ext}")}


def read_oracle_set(folder: str | Path = SHIPPED) -> tuple[list[Trajectory], list[LabelRecord]]:
    """A label set folder (default: the one the project ships, made from recipes/ci.yaml)."""
    folder = Path(folder)
    ext = ".jsonl.gz" if (folder / "labels.jsonl.gz").exists() else ".jsonl"
    return list(read_jsonl(folder / f"trajectories{ext}", Trajectory)), read_labels(folder / f"labels{ext}")
