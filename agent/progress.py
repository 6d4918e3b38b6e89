"""One progress bar per stage: every stage (distill, sft, rl, eval) shows one bar, whose phases reset it."""

from __future__ import annotations

import sys

from tqdm import tqdm


class StageBar:
    """One progress bar for a stage; each phase of the stage (build tasks, teacher, judge ...) resets it with
    its own total and says its name. Disabled, it counts nothing and shows nothing. Written to a file or a pipe
    rather than a terminal, it redraws at most every 30 s, so a captured log holds a few lines per stage."""

    def __init__(self, stage: str, enabled: bool = True):
        self.stage = stage
        interval = 0.1 if sys.stderr.isatty() else 30.0
        self.bar = tqdm(total=0, desc=stage, disable=not enabled, unit="", dynamic_ncols=True, mininterval=interval)

    def phase(self, name: str, total: int | None, unit: str = "") -> None:
        self.bar.set_description(f"{self.stage}: {name}", refresh=False)
        self.bar.unit = unit
        self.bar.set_postfix_str("", refresh=False)   # the last phase's figures (a loss) are not this one's
        self.bar.reset(total=total)   # redraws, with the new name

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def postfix(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=False)  # shown at the next redraw

    def close(self) -> None:
        self.bar.close()
