"""Rollout worker decisions with stand-ins for the bus and inference (real ones in integration tests)."""

import asyncio

import msgspec
import pytest

from rlbus.wire.replicas import ReplicaInfo
from rlbus.wire.subjects import RunSubjects
from rlbus.wire.tasks import EpisodeLimits, SamplingArgs, Task
from rlbus_orchestrator.client import NoReplicaError, ReplicaPool
from rlbus_orchestrator.envs import ChatTurn, ReverseTextEnv, SingleTurnEnv, registry
from rlbus_orchestrator.worker import RolloutWorker, SampleSlots


class FakeBus:
    def __init__(self):
        self.subjects = RunSubjects("unit")
        self.published = []

    async def publish(self, subject, message, msg_id=None):
        self.published.append((subject, message, msg_id))


class FakeDelivery:
    def __init__(self, task):
        self.data = task
        self.settled = None

    async def ack(self):
        self.settled = "ack"

    async def nak(self, delay_s=None):
        self.settled = ("nak", delay_s)


class EchoClient:
    """Answers every prompt with its reverse; records each request's number of samples."""

    def __init__(self):
        self.requests = []

    async def chat(self, messages, sampling):
        self.requests.append(("chat", 1))
        return self.turn(messages)

    async def chat_n(self, messages, sampling, n):
        self.requests.append(("chat_n", n))
        return [self.turn(messages) for _ in range(n)]

    def turn(self, messages):
        return ChatTurn(
            [1, 2], [3, 4], [-0.1, -0.2], messages[-1]["content"][::-1], "stop", policy_version=2
        )


class DownClient:
    def __init__(self):
        self.pool = ReplicaPool()
        self.calls = 0

    async def chat(self, messages, sampling):
        self.calls += 1
        raise NoReplicaError("none")

    async def chat_n(self, messages, sampling, n):
        return [await self.chat(messages, sampling)]


class ComesBackClient(DownClient):
    """No replica for the first `down_calls` calls, then answers."""

    def __init__(self, down_calls):
        super().__init__()
        self.down_calls = down_calls

    async def chat_n(self, messages, sampling, n):
        self.calls += 1
        if self.calls <= self.down_calls:
            self.pool.update([ReplicaInfo(replica_id="r", base_url="http://r/v1", model="m")])
            raise NoReplicaError("none")
        return await EchoClient().chat_n(messages, sampling, n)


class PerEpisodeEnv(ReverseTextEnv):
    """reverse-text without `run_group`, as a multi-turn or verifiers environment is."""

    env_id = "per-episode"
    run_group = None


@pytest.fixture
def per_episode_env(monkeypatch):
    monkeypatch.setitem(registry.BUILTINS, "per-episode", PerEpisodeEnv)
    return "per-episode"


def make_task(env_id="reverse-text", group_size=3):
    problem = ReverseTextEnv().example("train", 0)
    return Task(
        task_id="train-0",
        step=1,
        env_id=env_id,
        problem=problem,
        sampling=SamplingArgs(),
        group_size=group_size,
    )


def make_worker(client, no_replica_wait_s=0.0, max_concurrency=4):
    return RolloutWorker(
        FakeBus(),
        client,
        max_concurrency=max_concurrency,
        group_size=3,
        worker_id="w",
        no_replica_wait_s=no_replica_wait_s,
    )


def test_worker_publishes_the_group_under_the_task_id_then_acks():
    worker = make_worker(EchoClient())
    delivery = FakeDelivery(make_task())
    asyncio.run(worker.handle(delivery))
    ((subject, rollout, msg_id),) = worker.bus.published
    assert subject == worker.bus.subjects.rollouts and msg_id == "train-0"
    assert len(rollout.samples) == 3 and all(
        s.reward == 1.0 and s.policy_version == 2 for s in rollout.samples
    )
    assert delivery.settled == "ack"


def test_worker_naks_with_delay_when_no_replica_is_alive():
    worker = make_worker(DownClient())
    delivery = FakeDelivery(make_task())
    asyncio.run(worker.handle(delivery))
    assert worker.bus.published == []
    assert delivery.settled[0] == "nak" and delivery.settled[1] > 0


def test_environment_failure_is_published_as_an_error_rollout():
    worker = make_worker(EchoClient())
    delivery = FakeDelivery(make_task(env_id="no-such-env"))
    asyncio.run(worker.handle(delivery))
    ((_, rollout, _),) = worker.bus.published
    assert rollout.samples == [] and "no-such-env" in rollout.error
    assert delivery.settled == "ack"


def test_worker_waits_for_a_replica_that_comes_back_instead_of_nak():
    client = ComesBackClient(down_calls=1)
    worker = make_worker(client, no_replica_wait_s=10.0)
    delivery = FakeDelivery(make_task())
    asyncio.run(worker.handle(delivery))
    assert delivery.settled == "ack" and len(worker.bus.published) == 1
    assert client.calls > 1  # rolled out again once a replica was back


@pytest.mark.parametrize("grouped", [False, True])
def test_no_replica_cancels_the_other_requests_of_the_group(grouped, per_episode_env):
    """Per episode: 3 requests of 1; grouped with 2 slots: requests of 2 and 2."""
    finished = []

    class OneDownClient(EchoClient):
        pool = ReplicaPool()

        async def chat_n(self, messages, sampling, n):
            self.requests.append(("chat_n", n))
            if len(self.requests) == 1:
                raise NoReplicaError("none")
            await asyncio.sleep(0.5)
            finished.append(1)
            return [self.turn(messages) for _ in range(n)]

        async def chat(self, messages, sampling):
            return (await self.chat_n(messages, sampling, 1))[0]

    client = OneDownClient()

    async def scenario():
        worker = make_worker(client, max_concurrency=2 if grouped else 4)
        env_id = "reverse-text" if grouped else per_episode_env
        delivery = FakeDelivery(make_task(env_id=env_id, group_size=4 if grouped else 3))
        await worker.handle(delivery)
        await asyncio.sleep(0.8)
        return delivery

    delivery = asyncio.run(scenario())
    assert delivery.settled[0] == "nak" and finished == []
    assert len(client.requests) >= 2  # another request had started and was cancelled


def test_worker_sends_one_request_per_group_when_the_env_has_run_group():
    client = EchoClient()
    worker = make_worker(client)
    asyncio.run(worker.handle(FakeDelivery(make_task(group_size=3))))
    assert client.requests == [("chat_n", 3)]
    ((_, rollout, _),) = worker.bus.published
    assert len(rollout.samples) == 3 and all(s.reward == 1.0 for s in rollout.samples)


def test_worker_plays_one_episode_per_sample_when_the_env_has_no_run_group(per_episode_env):
    client = EchoClient()
    worker = make_worker(client)
    asyncio.run(worker.handle(FakeDelivery(make_task(env_id=per_episode_env, group_size=3))))
    assert client.requests == [("chat", 1)] * 3
    ((_, rollout, _),) = worker.bus.published
    assert len(rollout.samples) == 3 and rollout.error is None


def test_group_requests_off_plays_one_episode_per_sample():
    client = EchoClient()
    worker = RolloutWorker(FakeBus(), client, max_concurrency=4, group_size=3, group_requests=False)
    asyncio.run(worker.handle(FakeDelivery(make_task(group_size=3))))
    assert client.requests == [("chat", 1)] * 3


class SeedClient(EchoClient):
    """Records the seed and sample count of every request."""

    def __init__(self):
        super().__init__()
        self.seeds = []

    async def chat(self, messages, sampling):
        self.seeds.append((sampling.seed, 1))
        return await super().chat(messages, sampling)

    async def chat_n(self, messages, sampling, n):
        self.seeds.append((sampling.seed, n))
        return await super().chat_n(messages, sampling, n)


def seeded_task(env_id="reverse-text", group_size=3, seed=7):
    task = make_task(env_id=env_id, group_size=group_size)
    return msgspec.structs.replace(task, sampling=SamplingArgs(seed=seed))


@pytest.mark.parametrize(
    ("grouped", "group_size", "seed", "expected"),
    [
        (False, 3, 7, [(7, 1), (8, 1), (9, 1)]),  # episode i: seed + i, as choice i of a group
        (True, 10, 7, [(7, 4), (11, 4), (15, 2)]),  # a split group: each part from its first
        (True, 3, 7, [(7, 3)]),
        (False, 2, None, [(None, 1), (None, 1)]),  # unseeded stays unseeded
    ],
)
def test_a_seeded_group_seeds_every_sample_differently_however_it_is_sent(
    grouped, group_size, seed, expected
):
    client = SeedClient()
    worker = RolloutWorker(
        FakeBus(), client, max_concurrency=4, group_size=group_size, group_requests=grouped
    )
    asyncio.run(worker.handle(FakeDelivery(seeded_task(group_size=group_size, seed=seed))))
    assert sorted(client.seeds, key=str) == sorted(expected, key=str)


class PeakClient(EchoClient):
    """Records the most samples in flight at once over concurrent requests."""

    def __init__(self):
        super().__init__()
        self.in_flight = self.peak = 0

    async def chat_n(self, messages, sampling, n):
        self.in_flight += n
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.05)
        self.in_flight -= n
        return await super().chat_n(messages, sampling, n)


def test_a_group_request_holds_one_slot_per_sample():
    """max_concurrency 4: two groups of 3 cannot be in flight together (6 > 4), and a group of 10
    goes out as requests of 4, 4 and 2, never more than 4 samples at once."""
    client = PeakClient()
    worker = make_worker(client)

    async def scenario():
        await asyncio.gather(
            worker.handle(FakeDelivery(make_task(group_size=3))),
            worker.handle(FakeDelivery(make_task(group_size=3))),
            worker.handle(FakeDelivery(make_task(group_size=10))),
        )

    asyncio.run(scenario())
    assert client.peak <= 4
    assert sorted(n for _, n in client.requests) == [2, 3, 3, 4, 4]
    assert sorted(len(r.samples) for _, r, _ in worker.bus.published) == [3, 3, 10]
    assert worker.slots.in_flight == 0


def test_sample_slots_never_leave_two_groups_half_served():
    """Three groups of 2 in 2 slots, releasing at staggered times: taking slots one by one
    without the gathering lock ends with two groups holding one slot each, both waiting forever
    (checked: it times out)."""
    slots = SampleSlots(2)
    done = []

    async def group(i):
        async with slots.hold(2):
            await asyncio.sleep(0.001 * i)
            done.append(i)

    async def scenario():
        await asyncio.wait_for(asyncio.gather(*(group(i) for i in range(3))), 5)

    asyncio.run(scenario())
    assert sorted(done) == [0, 1, 2] and slots.in_flight == 0


def test_a_cancelled_wait_for_slots_gives_back_what_it_took():
    slots = SampleSlots(4)

    async def scenario():
        async with slots.hold(3):
            waiter = asyncio.ensure_future(slots.hold(3).__aenter__())
            await asyncio.sleep(0.01)  # the waiter took the 4th slot and waits for two more
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
        async with slots.hold(4):  # all 4 are free again
            return slots.in_flight

    assert asyncio.run(asyncio.wait_for(scenario(), 5)) == 4


def test_run_group_returning_the_wrong_number_of_samples_is_an_error_rollout(monkeypatch):
    async def short_group(self, client, problem, sampling, n):
        return (await SingleTurnEnv.run_group(self, client, problem, sampling, n))[:-1]

    monkeypatch.setattr(ReverseTextEnv, "run_group", short_group)
    worker = make_worker(EchoClient())
    delivery = FakeDelivery(make_task(group_size=3))
    asyncio.run(worker.handle(delivery))
    ((_, rollout, _),) = worker.bus.published
    assert rollout.samples == [] and "returned 2 samples for n=3" in rollout.error
    assert delivery.settled == "ack"


class FlakyClient(EchoClient):
    """Per episode (one `chat` each): the calls whose number is in `fail` raise, those in `hang`
    never answer (until cancelled); the others answer like EchoClient."""

    def __init__(self, fail=(), hang=()):
        super().__init__()
        self.fail, self.hang, self.calls, self.cancelled = set(fail), set(hang), 0, 0

    async def chat(self, messages, sampling):
        self.calls += 1
        call = self.calls
        if call in self.fail:
            raise RuntimeError(f"tool broke in episode {call}")
        if call in self.hang:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return await super().chat(messages, sampling)


def limited_task(env_id, group_size=4, deadline_s=None):
    task = make_task(env_id=env_id, group_size=group_size)
    return msgspec.structs.replace(task, limits=EpisodeLimits(deadline_s=deadline_s))


def roll_out(client, task, *, grouped=True, grace_s=0.05):
    worker = RolloutWorker(
        FakeBus(),
        client,
        max_concurrency=8,
        group_size=2,
        worker_id="w",
        group_requests=grouped,
        deadline_grace_s=grace_s,
    )
    delivery = FakeDelivery(task)
    asyncio.run(asyncio.wait_for(worker.handle(delivery), 10))
    ((_, rollout, _),) = worker.bus.published
    assert delivery.settled == "ack"
    return rollout


def test_a_failed_episode_is_left_out_and_the_group_is_published_with_the_survivors(
    per_episode_env,
):
    rollout = roll_out(FlakyClient(fail={2}), limited_task(per_episode_env, group_size=4))
    assert len(rollout.samples) == 3 and rollout.dropped == {"error": 1}
    assert rollout.error is None  # the coordinator decides against min_group_size
    assert rollout.metadata["episode_error"] == "RuntimeError: tool broke in episode 2"


def test_an_episode_past_its_deadline_is_cancelled_and_counted_as_a_timeout(per_episode_env):
    client = FlakyClient(fail={1}, hang={3})
    rollout = roll_out(client, limited_task(per_episode_env, group_size=4, deadline_s=0.1))
    assert len(rollout.samples) == 2 and rollout.dropped == {"error": 1, "timeout": 1}
    assert client.cancelled == 1


def test_an_episode_raising_timeout_error_itself_is_an_error_not_a_timeout(per_episode_env):
    class TimesOutClient(EchoClient):
        async def chat(self, messages, sampling):
            raise TimeoutError("the tool's own timeout")

    rollout = roll_out(TimesOutClient(), limited_task(per_episode_env, 2, deadline_s=30.0))
    assert rollout.samples == [] and rollout.dropped == {"error": 2}


def test_a_group_with_no_surviving_episode_is_an_error_rollout_with_its_drops(per_episode_env):
    rollout = roll_out(FlakyClient(fail={1, 2}), limited_task(per_episode_env, group_size=2))
    assert rollout.samples == [] and rollout.dropped == {"error": 2}
    assert rollout.error.startswith("RuntimeError: tool broke in episode")


def test_a_group_request_still_fails_whole():
    class FailingGroupClient(EchoClient):
        async def chat_n(self, messages, sampling, n):
            raise RuntimeError("bad group")

    rollout = roll_out(FailingGroupClient(), limited_task("reverse-text", group_size=3))
    assert rollout.samples == [] and rollout.dropped == {"error": 3}
    assert rollout.error == "RuntimeError: bad group"


def test_a_group_request_past_its_deadline_fails_whole_as_a_timeout():
    class HangingGroupClient(EchoClient):
        async def chat_n(self, messages, sampling, n):
            await asyncio.sleep(60)

    rollout = roll_out(HangingGroupClient(), limited_task("reverse-text", 3, deadline_s=0.1))
    assert rollout.samples == [] and rollout.dropped == {"timeout": 3}
    assert "past its deadline" in rollout.error
