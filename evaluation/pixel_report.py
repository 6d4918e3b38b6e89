"""What both pixel tracks (BabyAI, browser) report with: Wilson intervals and screenshot strips."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agent.trajectory import atomic_target


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n (95% by default), by statsmodels' `proportion_confint`;
    (0, 1) when there are no trials. `z` is the normal quantile, passed to statsmodels as alpha = 2·P(Z > z)."""
    if n == 0:
        return (0.0, 1.0)
    if not 0 <= k <= n:
        raise ValueError(f"wilson needs 0 <= k <= n, got k={k}, n={n}")
    # imported here: statsmodels and scipy take about a second to import, which runs that never report should not pay
    from scipy.stats import norm
    from statsmodels.stats.proportion import proportion_confint
    lo, hi = proportion_confint(k, n, alpha=2 * norm.sf(z), method="wilson")
    # at k = 0 (k = n) the bound is exactly 0 (1); z from alpha is z only to an ulp, which can leave 3e-17 there
    return (0.0 if k == 0 else float(lo), 1.0 if k == n else float(hi))


def write_strip(frames: list[np.ndarray], path: Path, n: int = 8) -> None:
    """Up to `n` frames of an episode, evenly spaced, side by side."""
    from PIL import Image

    idx = sorted({round(i * (len(frames) - 1) / max(1, n - 1)) for i in range(min(n, len(frames)))})
    strip = np.concatenate([np.pad(frames[i], ((2, 2), (2, 2), (0, 0)), constant_values=255) for i in idx], axis=1)
    with atomic_target(path) as tmp:
        Image.fromarray(strip).save(tmp, format="PNG")
