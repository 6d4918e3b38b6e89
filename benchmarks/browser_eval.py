"""Browser track, side by side: the perception-only expert (Tesseract OCR, computer-use clicks) and the random
policy on the catalogue's MiniWoB++ tasks, fixed seeds (prints JSON).

    python benchmarks/browser_eval.py [--episodes 50] [--tasks click-button,click-link] [--seed 1000]

Needs Debian's chromium and tesseract-ocr (`bash .ci/system-deps`) and the browser extra.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evaluation.browser import evaluate_browser, load_catalogue  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--tasks", default=None, help="comma-separated (default: every MiniWoB++ task in the catalogue)")
    ap.add_argument("--policies", default="expert,random")
    ap.add_argument("--interface", default="computer")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cat = load_catalogue()
    tasks = args.tasks.split(",") if args.tasks else [t for t, v in cat.items() if v.game_id.startswith("miniwob/")]
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="browser-eval-"))
    rows = {}
    for task in tasks:
        rows[task] = {}
        for pol in args.policies.split(","):
            m = evaluate_browser(task, pol, args.episodes, out / task / pol, seed=args.seed, interface=args.interface)
            rows[task][pol] = {k: m[k] for k in ("success_rate", "success_wilson95", "progress", "mean_steps",
                                                 "invalid_action_rate", "no_tool_call_rate", "out_of_space_rate",
                                                 "env_failures", "mean_think_s", "wall_s")}
            print(f"{task} {pol}: {rows[task][pol]['success_rate']}", file=sys.stderr)
    print(json.dumps({"episodes": args.episodes, "seeds": [args.seed, args.seed + args.episodes - 1],
                      "interface": args.interface, "results": rows, "out": str(out)}, indent=2))


if __name__ == "__main__":
    main()
