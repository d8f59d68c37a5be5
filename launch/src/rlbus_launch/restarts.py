"""When the `rl` launcher restarts a service that died, and when it gives up (pure policy, no
processes: `rlbus_launch.rl` acts on the decisions).

- exit codes 2 (config error) and 3 (service not installed) are deterministic: the same argv
  fails the same way again, so they are never restarted;
- otherwise each service may be restarted `max_restarts` times within a sliding window of
  `window_s` seconds; one more death within the window spends the budget and the run stops;
- the wait before a restart starts at `backoff_s` and doubles with each restart still inside the
  window, up to `max_backoff_s`, so a service that dies at once does not spin.
"""

import re
import signal
from collections import deque
from dataclasses import dataclass, field

from rlbus.configs.base import EXIT_CONFIG_ERROR
from rlbus.configs.common import SupervisionConfig
from rlbus.lifecycle import EXIT_SERVICE_MISSING, EXIT_SIGNAL_BASE

NEVER_RESTARTED = {
    EXIT_CONFIG_ERROR: "a config error",
    EXIT_SERVICE_MISSING: "the service is not installed",
}
"""Exit codes that a restart cannot fix, and what they mean."""


TORCHRUN_RANK_EXIT = re.compile(r"exitcode\s*:\s*(\d+)")
"""torchrun's failure summary names each failed rank's code (`exitcode  : 2`); the agent itself
exits 1 whatever the ranks' codes were."""


def rank_exit_code(code: int, argv: list[str], log_tail: str) -> int:
    """The code that says why a torchrun job failed: a rank's code that a restart cannot fix
    (a config error, a run that cannot resume) instead of the agent's 1; `code` otherwise."""
    if code != 1 or "torch.distributed.run" not in argv:
        return code
    for match in TORCHRUN_RANK_EXIT.finditer(log_tail):
        if int(match.group(1)) in NEVER_RESTARTED:
            return int(match.group(1))
    return code


def describe_exit(code: int) -> str:
    """`exited with code 1`, or `killed by SIGKILL` for a Popen return code of -9."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def shell_exit_code(code: int) -> int:
    """A child's Popen return code as a launcher's own exit code: 128 + N for a child killed by
    signal N (a shell's convention). Never `sys.exit(-N)`: the OS keeps the low byte, so a
    SIGKILLed child would make the launcher exit 247 (256 - 9), which reads like a real code."""
    return EXIT_SIGNAL_BASE - code if code < 0 else code


def launcher_exit_code(code: int) -> int:
    """`rl`'s exit code for a service that ended the run: `shell_exit_code`, 1 for a 0."""
    return shell_exit_code(code) or 1


@dataclass(frozen=True)
class Restart:
    """Restart the service after `delay_s`; this is restart `number` of `budget` in the window."""

    delay_s: float
    number: int
    budget: int


@dataclass(frozen=True)
class GiveUp:
    """Stop the run: `reason` is one line for the console."""

    reason: str


@dataclass
class RestartPolicy:
    """Restart budget and backoff per service; `decide` is called once per death."""

    config: SupervisionConfig = field(default_factory=SupervisionConfig)
    restarts: dict[str, deque[float]] = field(default_factory=dict)
    """service -> monotonic times of its restarts still inside the window."""

    def recent(self, service: str, now: float) -> deque[float]:
        times = self.restarts.setdefault(service, deque())
        while times and now - times[0] >= self.config.window_s:
            times.popleft()
        return times

    def backoff(self, earlier: int) -> float:
        """Wait before a restart that follows `earlier` restarts inside the window."""
        return min(self.config.backoff_s * 2**earlier, self.config.max_backoff_s)

    def decide(self, service: str, code: int, now: float) -> Restart | GiveUp:
        """What to do about `service` that exited with `code` (Popen's: -N for signal N) at
        monotonic time `now`. A Restart is counted at once (the budget is spent on deciding)."""
        if code in NEVER_RESTARTED:
            return GiveUp(
                f"{service} exited with code {code} ({NEVER_RESTARTED[code]}); "
                "a restart cannot fix that, stopping the run"
            )
        if not self.config.enabled:
            return GiveUp(f"{service} {describe_exit(code)}; supervision is off, stopping the run")
        times = self.recent(service, now)
        if len(times) >= self.config.max_restarts:
            return GiveUp(
                f"{service} restarted {len(times)} times in {self.config.window_s:g} s "
                "(supervision.max_restarts); giving up"
            )
        delay = self.backoff(len(times))
        times.append(now)
        return Restart(delay_s=delay, number=len(times), budget=self.config.max_restarts)
