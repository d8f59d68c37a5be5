"""Launching rlbus processes.

- `entry`: what every entry point shares (lazy import of a service's `run`, logging, torchrun rank).
- `plan`: the processes of an RL run (`rl`) as argv lists, with their resolved configs.
- `scripts`: writes those configs (TOML) and one launch script per process into the run directory.
- `rl`: the `rl` command (`--dry-run` writes everything and starts nothing).
- `supervisor`: starts, watches and stops the processes (process groups, no orphans).

Nothing here imports a service package: services are started as separate processes.
"""
