"""GRPO-style advantages: each sample's reward minus its group's mean (optionally / group std).

A group whose rewards are all equal has zero advantage everywhere and teaches nothing; the
coordinator drops such groups by default (`filter_zero_advantage`) and publishes a replacement
task, so every batch carries signal.
"""

import statistics

STD_EPS = 1e-6


def group_advantages(rewards: list[float], *, normalize: bool = False) -> list[float]:
    """Advantage of each reward of one group."""
    assert rewards, "a group has at least one sample"
    mean = statistics.fmean(rewards)
    advantages = [r - mean for r in rewards]
    if normalize:
        std = statistics.pstdev(rewards)
        advantages = [a / (std + STD_EPS) for a in advantages]
    return advantages


def has_signal(rewards: list[float], *, tol: float = 1e-9) -> bool:
    """Whether a group's rewards differ (a zero-advantage group has none)."""
    return max(rewards) - min(rewards) > tol
