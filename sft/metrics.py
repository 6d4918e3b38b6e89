"""Student metrics beyond the sandbox rollouts: teacher-forced next-action exact match on held-out steps."""

from __future__ import annotations

import json

from agent.parser import ToolCall, parse_action
from sandbox.skills import same_call


def _target_call(row: dict) -> dict:
    fn = row["messages"][-1]["tool_calls"][0]["function"]
    args = fn["arguments"]
    if isinstance(args, str):
        args = json.loads(args)
    return {"name": fn["name"], "arguments": {k: v for k, v in (args or {}).items() if v is not None}}


def next_action_exact_match(client, rows, batch_size: int = 32) -> dict:
    """Teacher forcing: the student sees each held-out step's prompt (the teacher's history) and predicts the
    next call; the share whose skill and arguments equal the teacher's, and the share that parse at all."""
    rows = list(rows)
    hits = parsed_ok = skill_hits = 0
    for lo in range(0, len(rows), batch_size):
        chunk = rows[lo: lo + batch_size]
        prompts = [[m for m in r["messages"][:-1]] for r in chunk]
        replies = client.chat_many(prompts, seed=0)
        for r, reply in zip(chunk, replies, strict=True):
            if isinstance(reply, Exception):
                raise reply
            p = parse_action(reply.text) if not reply.tool_calls else reply.action()
            if not isinstance(p, ToolCall):
                continue
            parsed_ok += 1
            gold = _target_call(r)
            skill_hits += p.name == gold["name"]
            hits += same_call(p.as_dict(), gold)
    n = max(len(rows), 1)
    return {"steps": len(rows), "exact_match": round(hits / n, 4), "skill_match": round(skill_hits / n, 4),
            "parse_rate": round(parsed_ok / n, 4)}
