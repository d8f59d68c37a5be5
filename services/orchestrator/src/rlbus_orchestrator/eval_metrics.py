"""What an evaluation of one environment reports: `eval/<env>/<metric>` (docs/evaluating.md).

Per problem the evaluation has `n` samples (`rollouts_per_example`), `c` of which pass (reward
>= `pass_threshold`). For each k asked (k <= n):

- `pass@k`: the chance that at least one of k samples drawn without replacement from the n
  passes, `1 - C(n-c, k) / C(n, k)`, averaged over problems: the unbiased estimator of the
  pass@k of k fresh samples (Chen et al., 2021), not the biased `1 - (1 - c/n)^k`;
- `mean@k`: the expected mean reward of k such samples, which for any k <= n is the mean of all
  n rewards (by linearity), averaged over problems.

Besides: `reward/mean` over every sample, `reward/std`, `completion_len/mean` (completion tokens,
environment tokens of a multi-turn episode included), `turns/mean`, `tool_calls/mean`,
`truncated` (share cut at max_tokens), `num_examples` (problems with at least one sample),
`num_samples`, and `failed`: problems with no sample (an error, a timeout, a lost task).

A problem some of whose samples failed counts with its `n' < n` surviving samples; a k above n'
is estimated with k = n' for it (it is as if fewer samples were drawn).
"""

import math
import statistics
from collections.abc import Sequence

from rlbus.wire.rollouts import Rollout, RolloutSample


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` passing samples out of `n` (module docstring)."""
    assert 0 <= c <= n and 1 <= k <= n, (n, c, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(
    env: str,
    rollouts: Sequence[Rollout],
    *,
    num_expected: int,
    ks: Sequence[int],
    n: int,
    threshold: float,
) -> dict[str, float]:
    """`eval/<env>/*` of the rollouts of one evaluation (one rollout per problem; `num_expected`
    problems were asked for: the ones missing or without samples count as `failed`)."""
    groups = [r.samples for r in rollouts if r.samples]
    samples = [s for group in groups for s in group]
    prefix = f"eval/{env}/"
    m = {
        prefix + "num_examples": float(len(groups)),
        prefix + "num_samples": float(len(samples)),
        prefix + "failed": float(num_expected - len(groups)),
    }
    if not samples:
        return m
    rewards = [s.reward for s in samples]
    m[prefix + "reward/mean"] = statistics.fmean(rewards)
    m[prefix + "reward/std"] = statistics.pstdev(rewards)
    m |= {prefix + key: value for key, value in shape_means(samples).items()}
    for k in sorted({k for k in ks if k <= n}):
        m[f"{prefix}pass@{k}"] = statistics.fmean(
            pass_at_k(len(g), sum(s.reward >= threshold for s in g), min(k, len(g))) for g in groups
        )
        m[f"{prefix}mean@{k}"] = statistics.fmean(
            statistics.fmean(s.reward for s in g) for g in groups
        )
    return m


def shape_means(samples: Sequence[RolloutSample]) -> dict[str, float]:
    """The means of what the samples look like (lengths, turns, tool calls, truncation)."""
    return {
        "completion_len/mean": statistics.fmean(len(s.completion_token_ids) for s in samples),
        "turns/mean": statistics.fmean(s.num_turns for s in samples),
        "tool_calls/mean": statistics.fmean(s.num_tool_calls for s in samples),
        "truncated": statistics.fmean(float(s.is_truncated) for s in samples),
    }
