"""What a run shows a person: one progress bar per stage (`agent.progress.StageBar`), the raw logs in a file under
the stage's output folder, and a closing table of what each stage did and where its outputs are."""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOG_FILE = "log.txt"


@contextmanager
def stage_log(folder: str | Path) -> Iterator[Path]:
    """For the block, the stage's raw logs go to FOLDER/log.txt (appended) instead of the terminal: Python
    logging at INFO and above (transformers, datasets, TRL and the project's own loggers, SFT's loss records),
    and warnings. The progress bars of datasets and transformers (loading and writing weights) are off meanwhile:
the stage has its own."""
    import datasets
    import transformers

    path = Path(folder) / LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root, hf = logging.getLogger(), transformers.utils.logging.get_logger()
    old_root_level, old_hf_level = root.level, hf.level
    bars_were_on = datasets.utils.logging.is_progress_bar_enabled()
    hf_bars_were_on = transformers.utils.logging.is_progress_bar_enabled()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    hf.addHandler(handler)   # transformers' logger does not propagate to the root logger
    transformers.utils.logging.disable_default_handler()
    transformers.utils.logging.set_verbosity_info()
    datasets.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()   # loading and writing weights
    logging.captureWarnings(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            yield path
    finally:
        logging.captureWarnings(False)
        if bars_were_on:
            datasets.utils.logging.enable_progress_bar()
        if hf_bars_were_on:
            transformers.utils.logging.enable_progress_bar()
        transformers.utils.logging.set_verbosity(old_hf_level or logging.WARNING)
        transformers.utils.logging.enable_default_handler()
        hf.removeHandler(handler)
        root.removeHandler(handler)
        root.setLevel(old_root_level)
        handler.close()


def _minutes(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def print_tables(stages: list[dict], evaluation: dict | None, before_note: str | None = None) -> None:
    """The closing tables: per stage its time, key figures and output; then the test TSR per difficulty (and
    the RL-pool TSR) before and after RL."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # a log file or a pipe: no wrapping, so every path and figure stays on its line
        console = Console(width=200)
    table = Table(title="embodistill: what each stage did", title_justify="left")
    for col in ("stage", "time", "key figures", "output"):
        table.add_column(col, overflow="fold")
    for s in stages:
        table.add_row(s["stage"], _minutes(s.get("seconds")) + (" (cached)" if s.get("cached") else ""),
                      s["figures"], s["output"])
    console.print(table)
    if evaluation:
        ev = Table(title="TSR before RL -> after RL", caption="task success rate, greedy decoding",
                   title_justify="left", caption_justify="left")
        ev.add_column("split")
        ev.add_column("episodes", justify="right")
        ev.add_column("before", justify="right")
        ev.add_column("after", justify="right")
        for name, (n, before, after) in evaluation.items():
            ev.add_row(name, str(n), "—" if before is None else f"{before:.4f}", f"{after:.4f}")
        console.print(ev)
        if before_note:   # where "before" comes from when RL did not evaluate its start
            console.print(f"before RL: {before_note}")
