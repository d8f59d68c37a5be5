"""Difficulty filtering: the prompts too easy or too hard to issue right now.

A prompt is (environment id, example index): what a data cursor draws (task_issue.py). Each time
a task of a tracked prompt ends with a group whose rewards are known (trained in a batch, or
dropped as `zero_advantage` or `stale`) its outcome is recorded: all solved (every reward >=
`solved_threshold`), all failed (every reward <= `failed_threshold`), or neither. `consecutive`
all-solved (all-failed) outcomes in a row make the prompt easy (hard): it is skipped while the
step being built is below `skip_until = step + skip_steps`; after that it is eligible again and
its streak starts from nothing. An outcome that arrives while its prompt is skipped (a task
issued before) is not counted: the verdict is in.

Recording when a task ends, not when its rollout arrives, keeps the history exact across a
restart: the outcome and the task leaving the ledger are one state change, saved together, and a
redelivered rollout of a task no longer outstanding is never looked at again.

The history is part of the coordinator state (`CoordinatorState.prompts`, saved with it):
env id -> example index -> `[streak, skip_until]`, with `streak` > 0 for that many all-solved
outcomes in a row and < 0 for all-failed ones. A prompt whose last outcome was neither has no
entry, so the state holds only prompts that are on a streak or skipped. Only environments with a
finite train set are tracked: a generated one (reverse-text without `num_train`) never draws an
example twice.

Each environment has its own settings: `[[orchestrator.env]] difficulty_filter` fields over
`orchestrator.difficulty_filter`'s (one may turn the filter off, or set its own thresholds).

The task issuer asks `selection(step)` once per issue: the cursors of skipped prompts are passed
over (the data cursor moves on; `CoordinatorState.skipped` counts them), except in an environment
whose every tracked prompt is skipped, whose tasks are issued anyway and counted as forced (so a
run never stops issuing).
"""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from rlbus.configs.orchestrator import DifficultyFilterConfig
from rlbus_orchestrator import validation
from rlbus_orchestrator.state_store import StateStore

log = structlog.get_logger()

Prompt = tuple[str, int]
"""(environment id, example index of its train split)."""
PromptOf = Callable[[int], Prompt | None]
"""The prompt a data cursor draws; None when its environment is not tracked (generated data)."""

SOLVED, FAILED, NEITHER = 1, -1, 0
KINDS = {SOLVED: "easy", FAILED: "hard"}


def group_outcome(rewards: list[float], config: DifficultyFilterConfig) -> int:
    """SOLVED when every reward is >= solved_threshold, FAILED when every one is <=
    failed_threshold, else NEITHER."""
    if all(r >= config.solved_threshold for r in rewards):
        return SOLVED
    if all(r <= config.failed_threshold for r in rewards):
        return FAILED
    return NEITHER


def next_streak(streak: int, outcome: int) -> int:
    """The streak after `outcome`: one longer in its direction, restarted at +-1 when the
    direction changes, 0 (no entry) after NEITHER."""
    if outcome == NEITHER:
        return 0
    return streak + outcome if streak * outcome > 0 else outcome


@dataclass
class Selection:
    """What one issue decided: the cursors passed over and issued for skipped prompts."""

    kinds: dict[Prompt, str]
    """Skipped prompt -> `easy` or `hard`."""
    exhausted: frozenset[str]
    """Environments whose every tracked prompt is skipped (their tasks are issued anyway)."""
    prompt_of: PromptOf
    num_skips: Counter[str] = field(default_factory=Counter)
    """Cursors passed over, by kind."""
    num_forced: int = 0
    """Cursors issued although their prompt is skipped (its environment is exhausted)."""

    def passes_over(self, cursor: int) -> bool:
        """Whether `cursor` is not to be issued (counted either way)."""
        prompt = self.prompt_of(cursor) if self.kinds else None
        if prompt is None or prompt not in self.kinds:
            return False
        if prompt[0] in self.exhausted:
            self.num_forced += 1
            return False
        self.num_skips[self.kinds[prompt]] += 1
        return True


class DifficultyFilter:
    """The prompt history in the coordinator state, and which prompts it skips (module
    docstring). Callers hold the coordinator's lock and save the state after a change."""

    def __init__(
        self,
        configs: dict[str, DifficultyFilterConfig],
        store: StateStore,
        *,
        prompt_of: PromptOf,
        num_prompts: dict[str, int],
    ) -> None:
        self.configs = configs
        """Each tracked environment's filter (`orchestrator.difficulty_filter` under its
        `env[].difficulty_filter`), by environment id."""
        self.store = store
        self.prompt_of = prompt_of
        self.num_prompts = num_prompts
        """Train examples of each tracked environment (the livelock check)."""

    @property
    def enabled(self) -> bool:
        """Whether any environment's prompts are filtered (the step metrics exist then)."""
        return any(config.enabled for config in self.configs.values())

    def is_filtered(self, env_id: str) -> bool:
        config = self.configs.get(env_id)
        return config is not None and config.enabled

    def record(self, task_id: str, rewards: list[float]) -> None:
        """The outcome of a training task's group, as its task ends (module docstring)."""
        cursor = validation.train_cursor(task_id)
        prompt = None if cursor is None or not rewards else self.prompt_of(cursor)
        if prompt is None or not self.is_filtered(prompt[0]):
            return
        env_id, index = prompt
        config = self.configs[env_id]
        step = self.store.state.next_step
        table = self.store.state.prompts.setdefault(env_id, {})
        streak, skip_until = table.get(str(index), (0, 0))
        if skip_until > step:
            return  # skipped: a task issued before its verdict
        if skip_until:  # eligible again: the streak starts from nothing
            streak = 0
        streak = next_streak(streak, group_outcome(rewards, config))
        if streak == 0:
            table.pop(str(index), None)
        elif abs(streak) >= config.consecutive:
            until = step + config.skip_steps
            table[str(index)] = [streak, until]
            kind = KINDS[SOLVED if streak > 0 else FAILED]
            log.debug("prompt_skipped", env_id=env_id, example=index, kind=kind, until_step=until)
        else:
            table[str(index)] = [streak, 0]

    def skipped(self, step: int) -> dict[Prompt, str]:
        """Prompts skipped while step `step` is built -> `easy` or `hard` (of the environments
        filtered now: a history kept from a run that filtered more is left alone)."""
        return {
            (env_id, int(index)): KINDS[SOLVED if streak > 0 else FAILED]
            for env_id, table in self.store.state.prompts.items()
            if self.is_filtered(env_id)
            for index, (streak, until) in table.items()
            if until > step
        }

    def num_skipped(self, step: int) -> Counter[str]:
        """Prompts skipped while step `step` is built, by kind (`easy`, `hard`)."""
        return Counter(self.skipped(step).values())

    def selection(self, step: int) -> Selection:
        """The skips of one issue at step `step` (nothing skipped when disabled)."""
        kinds = self.skipped(step)
        per_env = Counter(env_id for env_id, _ in kinds)
        exhausted = {
            env_id for env_id, n in per_env.items() if n >= self.num_prompts.get(env_id, n)
        }
        return Selection(kinds, frozenset(exhausted), self.prompt_of)
