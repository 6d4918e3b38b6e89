"""TextWorld games (Microsoft's TextWorld, built here as `tw-make` builds them) behind the sandbox's env contract.

`textworld_env.games` builds and caches games by spec; `textworld_env.env.TextWorldEnv` plays one through the
skills. Named so as not to shadow the `textworld` library. Needs the `textworld` extra.
"""
