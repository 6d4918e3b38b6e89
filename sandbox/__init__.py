"""The text sandbox: schema, EnvController, HumanAgent, builder, scene packs, expert planner, Gymnasium env.

Importing `sandbox` registers the Gymnasium id `embodistill/Sandbox-v0`.
"""

import gymnasium as gym

ENV_ID = "embodistill/Sandbox-v0"

if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="sandbox.gym_env:SandboxEnv", disable_env_checker=True)
