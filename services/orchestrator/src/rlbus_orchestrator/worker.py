"""Rollout workers: tasks in, finished groups out.

A worker is one pull consumer on the shared durable `rollout-workers` of the tasks stream (N
workers, in one process or many, share it: JetStream hands each task to one of them). For each
task it plays the `group_size` episodes of the task's environment: with one `run_group` call
(one inference request with `n` choices) when the environment has it (`GroupEnvironment`), else
with `group_size` concurrent `run_episode` calls. At most `max_concurrency` samples are in flight
per worker (a group request of n counts n; a group larger than that is split into requests of at
most `max_concurrency`). Each request goes to the inference replica with the fewest outstanding
requests. The group is then published as one `Rollout` (message id = task id, so a worker that
dies after publishing but before acking is deduplicated) and the task acked.

With `[eval]` a worker is also a consumer of the durable `eval-workers` (the eval tasks subject),
whose groups it plays the same way (`GroupPlayer`, which needs no bus) with `eval.max_concurrency`
samples of their own: evaluations and training never wait for each other's slots.

Failure handling:
- a replica that fails mid-request is backed off and the request retried on another
  (`InferenceClient`; deadlines and back-off in `OrchestratorConfig.http`);
- no replica alive: the group's other requests are cancelled, the task waits (held, heartbeated)
  up to `http.no_replica_wait_s` for a replica to come back and is rolled out again; past that it
  is nak'ed with a delay and comes back later (a wait does not spend a delivery);
- the worker process dies: the task is never acked and JetStream redelivers it after AckWait;
- an episode played on its own (`run_episode`) raises, or is still running DEADLINE_GRACE_S past
  its deadline (`Task.limits.deadline_s`, the environment's `episode_timeout_s`; it is then
  cancelled): it is left out, the others play on, and the group is published with the survivors
  and `Rollout.dropped` (`error` / `timeout` -> count) and the first failure's text in
  `metadata["episode_error"]`; the coordinator trains on the survivors when at least
  `min_group_size` are left, else drops the group (docs/orchestrator.md, "Partial groups");
- a group request (`run_group`) fails, or no episode survives: the group is published with
  `error` set and no samples (the coordinator drops it, counts it, and issues a replacement task).
  Either way the task is acked.

A background loop refreshes the replica registry (bus KV `replicas`, or `inference_urls`) every
second, and at once when a replica is backed off.

On `stop` the workers stop fetching; the episodes in flight finish and are published (drain),
unless the service was asked to `Stop`, or the drain budget (rlbus.lifecycle.DRAIN_BUDGET_S, from
the drain request) runs out: then they are abandoned and redelivered.
"""

import asyncio
import contextlib
import functools
import itertools
import json
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeGuard, TypeVar

import msgspec
import structlog

from rlbus.bus.client import Bus
from rlbus.bus.consumer import Consumer, Delivery
from rlbus.configs.orchestrator import InferenceHttpConfig
from rlbus.lifecycle import DRAIN_BUDGET_S, ServiceState, TaskSupervisor
from rlbus.obs import tracing
from rlbus.wire import tasks as tasks_wire
from rlbus.wire.rollouts import Rollout, RolloutSample
from rlbus.wire.tasks import EpisodeLimits, SamplingArgs, Task
from rlbus_orchestrator.client import (
    InferenceClient,
    NoReplicaError,
    ReplicaPool,
    make_http_client,
    static_replicas,
)
from rlbus_orchestrator.envs import Environment, GroupEnvironment, load_environment
from rlbus_orchestrator.envs.base import play_episode
from rlbus_orchestrator.metrics import count_rollout

log = structlog.get_logger()

T = TypeVar("T")

NO_REPLICA_NAK_DELAY_S = 2.0
DEADLINE_GRACE_S = 5.0
"""An episode is cancelled this long after its deadline: the environment ends an episode at its
deadline itself (stop_reason `deadline`, between turns); this is the backstop for one stuck
inside a turn or a tool."""
REGISTRY_REFRESH_S = 1.0
NO_REPLICA_POLL_S = 0.1
"""While a task waits for a replica, the registry is read again this often: a replica that
registers is used within ~0.1 s (its first request is on a run's critical path at start-up).
A read is the bucket's subject index plus one direct get per key (rlbus.bus.kv)."""


class EnvCache:
    """Environments built once per (id, args)."""

    def __init__(self) -> None:
        self._envs: dict[str, Environment] = {}

    def get(self, env_id: str, args: dict) -> Environment:
        key = env_id + json.dumps(args, sort_keys=True)
        if key not in self._envs:
            self._envs[key] = load_environment(env_id, args)
        return self._envs[key]

    async def aclose(self) -> None:
        """Release what the environments hold (a `vf:` environment's server process)."""
        envs, self._envs = list(self._envs.values()), {}
        for env in envs:
            close = getattr(env, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception as error:
                    log.warning("environment_close_failed", env_id=env.env_id, error=repr(error))


async def refresh_replicas(
    bus: Bus, pool: ReplicaPool, static_urls: list[str], model: str, stop: asyncio.Event
) -> None:
    """Keep `pool` in sync with the registry (or the static URLs) until `stop`."""
    while not stop.is_set():
        if static_urls:
            pool.update(static_replicas(static_urls, model))
        else:
            try:
                pool.update(await bus.read_replicas())
            except Exception as error:
                log.warning("replica_registry_read_failed", error=repr(error))
        pool.refresh_now.clear()
        waiters = [
            asyncio.ensure_future(stop.wait()),
            asyncio.ensure_future(pool.refresh_now.wait()),
        ]
        try:
            await asyncio.wait(
                waiters, timeout=REGISTRY_REFRESH_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waiters:
                waiter.cancel()


class SampleSlots:
    """At most `capacity` samples in flight; a request for n samples holds n slots.

    One request gathers its slots at a time (FIFO), so two half-served groups can never wait on
    each other forever."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self._free = asyncio.Semaphore(capacity)
        self._gathering = asyncio.Lock()

    @asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        assert 1 <= n <= self.capacity, f"{n} samples cannot fit in {self.capacity} slots"
        taken = 0
        try:
            async with self._gathering:
                for _ in range(n):
                    await self._free.acquire()
                    taken += 1
            self.in_flight += n
            try:
                yield
            finally:
                self.in_flight -= n
        finally:
            for _ in range(taken):
                self._free.release()


class EpisodeTimeoutError(Exception):
    """An episode ran past its deadline plus DEADLINE_GRACE_S and was cancelled."""


@asynccontextmanager
async def episode_deadline(limits: EpisodeLimits, grace_s: float) -> AsyncIterator[None]:
    """Cancel the body `grace_s` after `limits.deadline_s` (EpisodeTimeoutError); no limit when
    the task has no deadline. A TimeoutError of the body itself passes through unchanged."""
    if limits.deadline_s is None:
        yield
        return
    timeout = asyncio.timeout(limits.deadline_s + grace_s)
    try:
        async with timeout:
            yield
    except TimeoutError as error:
        if not timeout.expired():
            raise
        raise EpisodeTimeoutError(
            f"episode still running {grace_s:g} s past its deadline ({limits.deadline_s:g} s)"
        ) from error


def failure_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def failure_reason(error: BaseException) -> str:
    """How a failed episode is counted in `Rollout.dropped`."""
    return "timeout" if isinstance(error, EpisodeTimeoutError) else "error"


async def settled(episode: Awaitable[T]) -> T | Exception:
    """The episode's result, or the exception it failed with; NoReplicaError (the task waits for
    a replica, the group is played again) and cancellation propagate."""
    try:
        return await episode
    except NoReplicaError:
        raise
    except Exception as error:
        return error


async def gather_or_cancel(*coros: Awaitable[T]) -> list[T]:
    """`asyncio.gather`, but the first error cancels the others (no episode outlives its task)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class GroupPlayer:
    """Plays the group of a task against inference, at most `slots.capacity` samples at a time:
    the part of a worker that needs no bus (a worker has one for training tasks and one for
    evaluation tasks; the `eval` command plays its tasks with one of its own)."""

    def __init__(
        self,
        client: InferenceClient,
        slots: SampleSlots,
        *,
        envs: EnvCache | None = None,
        worker_id: str = "",
        no_replica_wait_s: float = 60.0,
        group_requests: bool = True,
        deadline_grace_s: float = DEADLINE_GRACE_S,
    ) -> None:
        self.client = client
        self.slots = slots
        self.envs = envs or EnvCache()
        self.worker_id = worker_id
        self.no_replica_wait_s = no_replica_wait_s
        self.group_requests = group_requests
        self.deadline_grace_s = deadline_grace_s

    async def roll_out_when_a_replica_answers(self, task: Task) -> Rollout | None:
        """`roll_out`, again while no replica answers, for up to `no_replica_wait_s` (the
        delivery stays held and heartbeated meanwhile); None when that time ran out."""
        deadline = time.monotonic() + self.no_replica_wait_s
        waiting = False
        while True:
            try:
                return await self.roll_out(task)
            except NoReplicaError as error:
                if time.monotonic() >= deadline:
                    log.warning(
                        "task_deferred_no_replica",
                        task_id=task.task_id,
                        error=str(error),
                        waited_s=self.no_replica_wait_s,
                    )
                    return None
                if not waiting:
                    log.warning("task_waiting_for_replica", task_id=task.task_id, error=str(error))
                    waiting = True
            await self.wait_for_replica(deadline)

    async def wait_for_replica(self, deadline: float) -> None:
        """Until some replica may be tried again (registry refreshed meanwhile) or `deadline`."""
        pool = self.client.pool
        while time.monotonic() < deadline:
            up_in = pool.next_up_in_s()
            if up_in is not None and up_in <= 0:
                return
            pool.refresh_now.set()
            await asyncio.sleep(min(NO_REPLICA_POLL_S, max(0.0, deadline - time.monotonic())))

    async def roll_out(self, task: Task) -> Rollout:
        """Run the task's group (module docstring, failure handling): episodes played one by one
        are left out when they fail; a group request fails whole (`Rollout.error`)."""
        started = time.time()
        try:
            env = self.envs.get(task.env_id, task.env_args)
            sizes = self.request_sizes(env, task.group_size)
            firsts = itertools.accumulate(sizes, initial=0)  # each request's first sample (+ total)
            plays = [
                self.play(env, task, n, first) for n, first in zip(sizes, firsts, strict=False)
            ]
            if not self.plays_groups(env):
                outcomes = await gather_or_cancel(*map(settled, plays))
                return self.partial_rollout(task, outcomes, started=started)
            parts = await gather_or_cancel(*plays)
        except NoReplicaError:
            raise
        except Exception as error:
            log.exception("episode_failed", task_id=task.task_id, env_id=task.env_id)
            dropped = {failure_reason(error): task.group_size}
            return self.make_rollout(
                task, [], error=failure_text(error), dropped=dropped, started=started
            )
        return self.make_rollout(task, [s for part in parts for s in part], started=started)

    def partial_rollout(
        self, task: Task, outcomes: list[list[RolloutSample] | Exception], *, started: float
    ) -> Rollout:
        """The group of the episodes that succeeded; the failed ones counted in `dropped` (the
        first one's text in `metadata["episode_error"]`, and in `error` when none succeeded)."""
        samples = [s for outcome in outcomes if not isinstance(outcome, Exception) for s in outcome]
        failures = [outcome for outcome in outcomes if isinstance(outcome, Exception)]
        if not failures:
            return self.make_rollout(task, samples, started=started)
        dropped = dict(Counter(map(failure_reason, failures)))
        first = failure_text(failures[0])
        log.warning(
            "episodes_dropped",
            task_id=task.task_id,
            env_id=task.env_id,
            num_samples=len(samples),
            **dropped,
            first_error=first,
            exc_info=failures[0],
        )
        rollout = self.make_rollout(
            task, samples, error=None if samples else first, dropped=dropped, started=started
        )
        rollout.metadata["episode_error"] = first
        return rollout

    def plays_groups(self, env: Environment) -> TypeGuard[GroupEnvironment]:
        """Whether a group of `env` goes out as `run_group` requests (else one per episode)."""
        return self.group_requests and isinstance(env, GroupEnvironment)

    def request_sizes(self, env: Environment, group_size: int) -> list[int]:
        """Samples per inference request for one group (module docstring)."""
        if not self.plays_groups(env):
            return [1] * group_size
        full, rest = divmod(group_size, self.slots.capacity)
        return [self.slots.capacity] * full + ([rest] if rest else [])

    async def play(self, env: Environment, task: Task, n: int, first: int) -> list[RolloutSample]:
        """`n` samples of the task, from its sample number `first`: one `run_group` call, or one
        episode. A seeded task's sample i is seeded `seed + i` however the group is split (vLLM
        seeds choice j of a request with the request's seed + j), so no two samples repeat."""
        sampling = sample_seeded(task.sampling, first)
        async with self.slots.hold(n), episode_deadline(task.limits, self.deadline_grace_s):
            if not self.plays_groups(env):
                return [await play_episode(env, self.client, task.problem, sampling, task.limits)]
            samples = await env.run_group(self.client, task.problem, sampling, n)
        if len(samples) != n:
            raise ValueError(f"{env.env_id}: run_group returned {len(samples)} samples for n={n}")
        return samples

    def make_rollout(
        self,
        task: Task,
        samples: list[RolloutSample],
        *,
        started: float,
        error: str | None = None,
        dropped: dict[str, int] | None = None,
    ) -> Rollout:
        return Rollout(
            task_id=task.task_id,
            step=task.step,
            env_id=task.env_id,
            example_id=task.example_id,
            samples=samples,
            worker_id=self.worker_id,
            error=error,
            dropped=dropped or {},
            metadata={"started_at": started},
            prompt=task.problem.messages or [],
        )


class RolloutWorker:
    """One consumer of the tasks stream, and one of the eval tasks (see module docstring)."""

    def __init__(
        self,
        bus: Bus,
        client: InferenceClient,
        *,
        max_concurrency: int,
        group_size: int,
        worker_id: str | None = None,
        no_replica_wait_s: float = 60.0,
        group_requests: bool = True,
        deadline_grace_s: float = DEADLINE_GRACE_S,
        eval_concurrency: int | None = None,
    ) -> None:
        """`group_requests=False`: one request per sample even for a `GroupEnvironment` (the
        baseline of benchmarks/orchestrator.py --group-compare). `group_size`: the smallest
        group size of the run's environments (it sets how many tasks are fetched at once).
        `eval_concurrency`: eval samples in flight besides (None: no eval consumer)."""
        self.bus = bus
        self.envs = EnvCache()
        self.worker_id = worker_id or f"worker-{uuid.uuid4().hex[:8]}"
        self.slots = SampleSlots(max_concurrency)
        self.num_tasks = max(1, math.ceil(max_concurrency / group_size))
        self.num_rollouts = 0

        def player(slots: SampleSlots) -> GroupPlayer:
            return GroupPlayer(
                client,
                slots,
                envs=self.envs,
                worker_id=self.worker_id,
                no_replica_wait_s=no_replica_wait_s,
                group_requests=group_requests,
                deadline_grace_s=deadline_grace_s,
            )

        self.player = player(self.slots)
        self.eval_player = player(SampleSlots(eval_concurrency)) if eval_concurrency else None

    async def roll_out(self, task: Task) -> Rollout:
        """The group of a training task (GroupPlayer.roll_out)."""
        return await self.player.roll_out(task)

    def consumers(self) -> list[Consumer[Task]]:
        """The training tasks' consumer, and the eval tasks' when this worker serves them."""
        s = self.bus.subjects
        out = [
            self.bus.consumer(
                s.tasks_stream,
                s.tasks_durable,
                tasks_wire.decoder,
                self.handle,
                concurrency=self.num_tasks,
                nak_delay_s=NO_REPLICA_NAK_DELAY_S,
                filter_subject=s.tasks,
            )
        ]
        if self.eval_player is not None:
            out.append(
                self.bus.consumer(
                    s.tasks_stream,
                    s.eval_tasks_durable,
                    tasks_wire.decoder,
                    functools.partial(self.handle, player=self.eval_player),
                    concurrency=self.eval_player.slots.capacity,
                    nak_delay_s=NO_REPLICA_NAK_DELAY_S,
                    filter_subject=s.eval_tasks,
                )
            )
        return out

    async def run(self, stop: asyncio.Event, service: ServiceState | None = None) -> None:
        consumers = self.consumers()
        try:
            async with contextlib.AsyncExitStack() as stack:
                for consumer in consumers:
                    await stack.enter_async_context(consumer)
                log.info(
                    "rollout_worker_started",
                    worker_id=self.worker_id,
                    tasks_in_flight=self.num_tasks,
                    evals=self.eval_player is not None,
                )
                await stop.wait()
                if service is not None:  # a group past the drain budget is redelivered elsewhere
                    for consumer in consumers:
                        await consumer.stop(
                            timeout_s=0 if service.stop_now else service.left_of(DRAIN_BUDGET_S)
                        )
        finally:
            await self.envs.aclose()
        log.info("rollout_worker_stopped", worker_id=self.worker_id, num_rollouts=self.num_rollouts)

    async def handle(self, delivery: Delivery[Task], player: GroupPlayer | None = None) -> None:
        """Play a task (with the training player unless `player` says otherwise), publish its
        rollout, ack it."""
        player = player or self.player
        task = delivery.data
        with tracing.span(
            tracing.ROLLOUT,
            attributes={
                tracing.TASK_ID: task.task_id,
                "rlbus.env_id": task.env_id,
                "rlbus.group_size": task.group_size,
            },
        ):
            rollout = await player.roll_out_when_a_replica_answers(task)
            if rollout is None:
                await delivery.nak(NO_REPLICA_NAK_DELAY_S)
                return
            # The batch span links to this rollout span itself (the message headers name the
            # publish span, a child of it).
            rollout.metadata["traceparent"] = tracing.inject_headers({}).get("traceparent", "")
            await self.bus.publish(self.bus.subjects.rollouts, rollout, msg_id=task.task_id)
        await delivery.ack()
        self.num_rollouts += 1
        count_rollout(rollout)  # Prometheus (rlbus.obs.metrics)


def sample_seeded(sampling: SamplingArgs, first: int) -> SamplingArgs:
    """The sampling args of a request whose first sample is the group's sample `first`."""
    if sampling.seed is None or first == 0:
        return sampling
    return msgspec.structs.replace(sampling, seed=sampling.seed + first)


async def run_workers(
    bus: Bus,
    *,
    num_workers: int,
    max_concurrency: int,
    group_size: int,
    model: str,
    static_urls: list[str],
    stop: asyncio.Event,
    state: ServiceState | None = None,
    http_config: InferenceHttpConfig | None = None,
    eval_concurrency: int | None = None,
) -> None:
    """Run `num_workers` workers sharing one replica pool until `stop` (see module docstring);
    with `eval_concurrency`, each also serves eval tasks with that many samples in flight."""
    http_config = http_config or InferenceHttpConfig()
    pool = ReplicaPool.from_config(http_config)
    connections = num_workers * (max_concurrency + (eval_concurrency or 0))
    async with make_http_client(http_config, connections) as http:
        client = InferenceClient(pool, http, model, max_attempts=http_config.max_attempts)
        workers = [
            RolloutWorker(
                bus,
                client,
                max_concurrency=max_concurrency,
                group_size=group_size,
                no_replica_wait_s=http_config.no_replica_wait_s,
                eval_concurrency=eval_concurrency,
            )
            for _ in range(num_workers)
        ]
        async with TaskSupervisor() as tasks:
            tasks.spawn("refresh_replicas", refresh_replicas(bus, pool, static_urls, model, stop))
            for worker in workers:
                tasks.spawn(f"rollout_worker {worker.worker_id}", worker.run(stop, state))
            await tasks.join()
