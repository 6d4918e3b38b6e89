"""GiGPO online RL of the SFT student in the sandbox: the main job's entry point for `accelerate launch`.

    accelerate launch rl/train_gigpo.py recipes/medium.yaml             # GiGPO, outputs/medium/rl/gigpo
    accelerate launch rl/train_gigpo.py recipes/medium.yaml --algorithm grpo
    python rl/train_gigpo.py recipes/medium.yaml --resume                # one process works too
    torchrun --nproc_per_node 2 rl/train_gigpo.py recipes/ci.yaml        # two CPU processes (gloo DDP)

It is `embodistill rl RECIPE [OPTIONS]` (`pipeline.main_job`): when the recipe's starting checkpoint
(`rl.init: sft`) is missing, the distillation and SFT stages run first, then RL, then a table of what each stage
did. The pipeline is the only orchestrator; this file is where `accelerate launch` enters it.
"""

from __future__ import annotations

import sys

try:
    from pipeline.cli import main as cli_main
except ModuleNotFoundError as e:  # a checkout that was never installed
    sys.exit(f"error: {e}. Install the project first, from its folder: pip install -e .")


def main(argv: list[str] | None = None) -> int:
    """`embodistill rl ARGV`; returns the exit code (2 for a bad recipe or option, with the reason on stderr)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("error: no recipe given: rl/train_gigpo.py RECIPE [OPTIONS] (--help lists the options)", file=sys.stderr)
        return 2
    return cli_main(["rl", *argv])


if __name__ == "__main__":
    sys.exit(main())
