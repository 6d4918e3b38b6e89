"""Seconds per TextWorld game: a `tw-make` process per game against one long-lived maker (`textworld_env.games.Maker`).

    python benchmarks/textworld_games.py                     # 3 games of each kind of recipes/textworld.yaml
    python benchmarks/textworld_games.py --games 5 --out outputs/bench-games

Builds the same specs both ways, interleaved one game at a time on one core each in turn (so load on the machine
falls on both alike), into two fresh folders, checks that each pair of games is the same bytes, and prints one
JSON object: seconds per game for each way, by kind and in all, and their ratio. The maker's first game pays
TextWorld's start (as every `tw-make` game does); it is counted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.recipe import load_recipe  # noqa: E402
from textworld_env.games import Maker, make_game  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "textworld.yaml"))
    ap.add_argument("--games", type=int, default=3, help="games of each family")
    ap.add_argument("--seed", type=int, default=777_000_000, help="first tw-make seed (away from the recipes' splits)")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench-textworld-games"))
    args = ap.parse_args()

    families = load_recipe(args.recipe).textworld.games
    specs = [f.spec(args.seed + 100 * k + i, random.Random(args.seed + 100 * k + i))
             for k, f in enumerate(families) for i in range(args.games)]
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    (out / "tw-make").mkdir(parents=True)
    (out / "maker").mkdir()
    tw_make = str(Path(sys.executable).with_name("tw-make"))
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    rows = []
    with Maker() as maker:
        for spec in specs:
            target = out / "tw-make" / f"{spec.key}.z8"
            t0 = time.perf_counter()
            run = subprocess.run([tw_make, *spec.command(target)[1:]], capture_output=True, env=env)
            t_cli = time.perf_counter() - t0
            if run.returncode != 0:          # no quest for this seed: neither way makes a game
                continue
            t0 = time.perf_counter()
            made = make_game(spec, out / "maker", maker)
            t_maker = time.perf_counter() - t0
            same = all(target.with_suffix(x).read_bytes() == made.with_suffix(x).read_bytes()
                       for x in (".z8", ".json"))
            rows.append({"kind": spec.kind, "key": spec.key, "tw_make_s": t_cli, "maker_s": t_maker, "same": same})
            print(f"{spec.key}: tw-make {t_cli:.1f} s, maker {t_maker:.1f} s, same bytes {same}", file=sys.stderr)

    def summary(part: list[dict]) -> dict:
        cli, mk = sum(r["tw_make_s"] for r in part), sum(r["maker_s"] for r in part)
        return {"games": len(part), "tw_make_s_per_game": round(cli / len(part), 2),
                "maker_s_per_game": round(mk / len(part), 2), "ratio": round(cli / mk, 2),
                "maker_median_s": round(statistics.median(r["maker_s"] for r in part), 2)}

    print(json.dumps({
        "cpu": next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name")), "unknown"),
        "all_same_bytes": all(r["same"] for r in rows),
        "all": summary(rows),
        "by_kind": {k: summary([r for r in rows if r["kind"] == k]) for k in sorted({r["kind"] for r in rows})},
    }, indent=1))


if __name__ == "__main__":
    main()
