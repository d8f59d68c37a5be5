"""Launching rlbus processes (the launchers only: what a service itself runs on is in
`rlbus.lifecycle` and `rlbus.rundirs`, and no service imports this package).

- `plan`: the processes of an RL run (`rl`) as argv lists, with their resolved configs.
- `scripts`: writes those configs (TOML) and one launch script per process into the run directory.
- `rl`: the `rl` command (`--dry-run` writes everything and starts nothing).
- `sft`: the `sft` command (writes the config and the torchrun script, then runs torchrun).
- `supervisor`: starts, watches and stops the processes (process groups and launch marks, no
  orphans).
- `restarts`: when a service that died is restarted (budget, backoff) and the exit codes of
  children as a launcher reports them.
- `watchdog`: ends a launch's processes when its launcher died without stopping them.
- `lock`: `<run_dir>/launcher.json`, so that a second launcher refuses a run directory in use.

Nothing here imports a service package: services are started as separate processes.
"""
