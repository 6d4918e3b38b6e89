"""The policy side of a pixel evaluation runs in its own process and receives only what a player would see.

`PolicyProcess(spec)` spawns a process (sharing no memory with the evaluator) that builds its agent with
`spec.build()` and answers `reset` (the instruction and the first frame), `act` (a frame) and `probe` (what the
process can reach: environment objects, browser pages; there must be none) until `close`. Every message passes
`check_payload`: only the op, the mission or instruction text, an RGB frame, a seed and the deadlock hint's
note. The evaluator alone
holds the environment, its internal state and the verifier. BabyAI and the browser track both use it.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import re
import sys
import time

import numpy as np

# all the policy process ever receives; `note` is the deadlock hint's neutral text (`agent.episode.hint_text`)
PAYLOAD_KEYS = {"op", "mission", "frame", "seed", "note"}


def _serve(conn, spec) -> None:
    """The policy process: build the agent, then answer reset / act / probe messages until close."""
    agent = None
    try:
        agent = spec.build()
        conn.send({"ready": True, "pid": os.getpid()})
    except Exception as e:  # report, do not hang the evaluator
        conn.send({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return
    while True:
        msg = conn.recv()
        op = msg.get("op")
        try:
            if op == "close":
                return
            if op == "reset":
                conn.send(agent.reset(msg["mission"], msg["frame"], msg.get("seed", 0)))
            elif op == "act":
                conn.send(agent.act(msg["frame"], note=msg["note"]) if "note" in msg else agent.act(msg["frame"]))
            elif op == "probe":
                conn.send(probe())
            else:
                conn.send({"error": f"unknown op {op!r}"})
        except Exception as e:
            conn.send({"error": f"{type(e).__name__}: {e}"})


def probe() -> dict:
    """What this process can reach: gymnasium environments and Playwright pages or browsers (there must be none)."""
    envs = pages = 0
    if "gymnasium" in sys.modules:
        import gymnasium
        envs = sum(1 for o in gc.get_objects() if isinstance(o, gymnasium.Env))
    if "playwright.sync_api" in sys.modules:
        from playwright.sync_api import Browser, Page
        pages = sum(1 for o in gc.get_objects() if isinstance(o, (Page, Browser)))
    return {"pid": os.getpid(), "env_objects": envs, "browser_objects": pages}


_NOTE = re.compile(r"Note: nothing has changed for \d+ steps\.")


def check_payload(msg: dict) -> dict:
    """Every message to the policy process passes here: only the op, the mission text, the RGB frame, a seed and
    the deadlock hint's note (which must be the hint's own words: nothing else can travel in it)."""
    extra = set(msg) - PAYLOAD_KEYS
    if extra:
        raise ValueError(f"the policy process may not receive {sorted(extra)}")
    if "frame" in msg and not (isinstance(msg["frame"], np.ndarray) and msg["frame"].dtype == np.uint8 and
                               msg["frame"].ndim == 3):
        raise ValueError("the frame must be an HxWx3 uint8 array")
    if "mission" in msg and not isinstance(msg["mission"], str):
        raise ValueError("the mission must be text")
    if "note" in msg and not (isinstance(msg["note"], str) and _NOTE.fullmatch(msg["note"])):
        raise ValueError(f"the note must be the deadlock hint's text, not {msg['note']!r}")
    return msg


class PolicyProcess:
    """The policy in its own process (spawned: it shares no memory with the evaluator). `sent` keeps every
    payload's keys for audits."""

    def __init__(self, spec, timeout: float = 300.0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, spec), daemon=True)
        self.proc.start()
        self.timeout = timeout
        self.sent: list[tuple[str, ...]] = []
        hello = self._recv()
        if not hello.get("ready"):
            self.close()
            raise RuntimeError(f"the policy process could not start: {hello.get('error')}")
        self.pid = hello["pid"]

    def _recv(self) -> dict:
        deadline = time.time() + self.timeout
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the policy process died (exit code {self.proc.exitcode}); with the spawn "
                                   "start method a script must guard its entry point with "
                                   "`if __name__ == '__main__':`")
            if time.time() > deadline:
                self.close()
                raise TimeoutError(f"the policy process did not answer within {self.timeout:.0f} s")
        reply = self.conn.recv()
        if "error" in reply and "ready" not in reply:
            raise RuntimeError(f"policy process: {reply['error']}")
        return reply

    def call(self, **msg) -> dict:
        self.conn.send(check_payload(msg))
        self.sent.append(tuple(sorted(msg)))
        return self._recv()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send({"op": "close"})
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
