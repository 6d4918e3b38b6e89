"""One progress bar per stage: every stage (distill, sft, rl, eval) shows one bar, whose phases reset it."""

from __future__ import annotations

from tqdm import tqdm


class StageBar:
    """One progress bar for a stage; each phase of the stage (build tasks, teacher, judge ...) resets it with
    its own total and says its name. Disabled, it counts nothing and shows nothing."""

    def __init__(self, stage: str, enabled: bool = True):
        self.stage = stage
        self.bar = tqdm(total=0, desc=stage, disable=not enabled, unit="", dynamic_ncols=True)

    def phase(self, name: str, total: int | None, unit: str = "") -> None:
        self.bar.reset(total=total)
        self.bar.unit = unit
        self.bar.set_description(f"{self.stage}: {name}")

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def postfix(self, text: str) -> None:
        self.bar.set_postfix_str(text)

    def close(self) -> None:
        self.bar.close()
