"""A `tw-make` that stays up: one Python process that builds game after game.

`tw-make` starts a new interpreter for every game, imports TextWorld (about 2.5 s) and loads its knowledge base and
grammars on the first generation (about 7 s more); the game itself then takes 2-5 s to generate and compile. This
process pays the start once and then reads requests from stdin, one JSON object per line, and answers each on
stdout:

    {"args": ["tw-coin_collector", "--level", "5"], "seed": 3, "output": "/abs/path/game.z8"}
    -> {"ok": true}  |  {"ok": false, "no_quest": true, "error": "..."}  |  {"ok": false, "error": "..."}

`args` are `tw-make`'s own arguments for the game (`GameSpec.args`: a challenge or `custom` and its settings);
they are parsed by the challenge's own argument parser and turned into `GameOptions` exactly as `tw-make` does, so
a game is byte for byte the game `tw-make` makes from the same spec (`tests/test_textworld_env.py` builds both and
compares them). The parent starts it with `PYTHONHASHSEED=0`, as it ran `tw-make`: TextWorld writes sets into the
game's `.json`. `textworld_env.games.Maker` is the parent side (timeouts, restarts).

It imports nothing of this project: it runs as a script (`python textworld_env/maker.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback


def options_for(args: list[str], seed: int, output: str):
    """`(challenge or None, settings, GameOptions)` for tw-make's arguments, as `tw-make` sets them."""
    import textworld
    import textworld.challenges

    options = textworld.GameOptions()
    options.seeds = seed
    options.path = os.path.abspath(output)
    options.file_ext = ".z8"
    options.force_recompile = True
    name, rest = args[0], args[1:]
    if name == "custom":
        p = argparse.ArgumentParser(prog="custom", add_help=False)
        p.add_argument("--world-size", type=int, default=5)
        p.add_argument("--nb-objects", type=int, default=10)
        p.add_argument("--quest-length", type=int, required=True)
        a = p.parse_args(rest)
        options.nb_rooms = a.world_size
        options.nb_objects = a.nb_objects
        options.nb_parallel_quests = 1
        # tw-make's defaults for what a spec does not set; --quest-length N fixes length and depth to N
        options.chaining.min_breadth, options.chaining.max_breadth = 1, 5
        options.chaining.min_depth, options.chaining.max_depth = 1, a.quest_length
        options.chaining.min_length = options.chaining.max_length = a.quest_length
        options.grammar.theme = "house"
        options.grammar.include_adj = False
        options.grammar.only_last_action = False
        options.grammar.blend_instructions = False
        options.grammar.blend_descriptions = False
        options.grammar.ambiguous_instructions = False
        options.grammar.allowed_variables_numbering = False
        return None, None, options
    if name not in textworld.challenges.CHALLENGES:
        raise ValueError(f"unknown challenge {name!r}")
    _, _, add_arguments = textworld.challenges.CHALLENGES[name]
    p = argparse.ArgumentParser(prog=name, add_help=False)
    add_arguments(p)
    # the whole of tw-make's namespace, in its order: tw-cooking writes these settings into the game's .json
    settings = {"third_party": None, "subcommand": name, **vars(p.parse_args(rest)), "output": output,
                "seed": seed, "format": "z8", "overview": False, "save_overview": False, "force": True,
                "silent": True, "verbose": False}
    return name, settings, options


def build(args: list[str], seed: int, output: str) -> None:
    import textworld
    import textworld.challenges
    from textworld.generator import compile_game

    challenge, settings, options = options_for(args, seed, output)
    if challenge is None:
        textworld.make(options)
    else:
        _, make_game, _ = textworld.challenges.CHALLENGES[challenge]
        compile_game(make_game(settings=settings, options=options), options)


def serve() -> None:
    """Answer build requests on stdin until it closes. TextWorld's own prints go to stderr, so stdout carries
    only answers."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    import textworld  # noqa: F401  (paid once, before the first request)
    from textworld.generator import QuestGenerationError

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            build(req["args"], int(req["seed"]), req["output"])
            answer = {"ok": True}
        except QuestGenerationError as e:
            answer = {"ok": False, "no_quest": True, "error": f"QuestGenerationError: {e}"[:2000]}
        except Exception as e:  # noqa: BLE001 (any failure is the request's answer; the process goes on)
            tail = traceback.format_exc().strip().splitlines()[-3:]
            answer = {"ok": False, "error": f"{type(e).__name__}: {e} | {' | '.join(tail)}"[:2000]}
        out.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    serve()
