"""What both pixel tracks (BabyAI, browser) report with: Wilson intervals and screenshot strips."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from agent.trajectory import atomic_target


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n (95% by default)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def write_strip(frames: list[np.ndarray], path: Path, n: int = 8) -> None:
    """Up to `n` frames of an episode, evenly spaced, side by side."""
    from PIL import Image

    idx = sorted({round(i * (len(frames) - 1) / max(1, n - 1)) for i in range(min(n, len(frames)))})
    strip = np.concatenate([np.pad(frames[i], ((2, 2), (2, 2), (0, 0)), constant_values=255) for i in idx], axis=1)
    with atomic_target(path) as tmp:
        Image.fromarray(strip).save(tmp, format="PNG")
