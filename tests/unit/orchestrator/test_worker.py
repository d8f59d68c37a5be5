"""Rollout worker decisions with stand-ins for the bus and inference (real ones in integration tests)."""

import asyncio

from rlbus.wire.replicas import ReplicaInfo
from rlbus.wire.subjects import RunSubjects
from rlbus.wire.tasks import SamplingArgs, Task
from rlbus_orchestrator.client import NoReplicaError, ReplicaPool
from rlbus_orchestrator.envs import ChatTurn, ReverseTextEnv
from rlbus_orchestrator.worker import RolloutWorker


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
    async def chat(self, messages, sampling):
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


class ComesBackClient(DownClient):
    """No replica for the first `down_calls` calls, then answers."""

    def __init__(self, down_calls):
        super().__init__()
        self.down_calls = down_calls

    async def chat(self, messages, sampling):
        self.calls += 1
        if self.calls <= self.down_calls:
            self.pool.update([ReplicaInfo(replica_id="r", base_url="http://r/v1", model="m")])
            raise NoReplicaError("none")
        return await EchoClient().chat(messages, sampling)


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


def make_worker(client, no_replica_wait_s=0.0):
    return RolloutWorker(
        FakeBus(),
        client,
        max_concurrency=4,
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


def test_no_replica_cancels_the_other_episodes_of_the_group():
    finished = []

    class OneDownClient:
        pool = ReplicaPool()

        def __init__(self):
            self.calls = 0

        async def chat(self, messages, sampling):
            self.calls += 1
            if self.calls == 1:
                raise NoReplicaError("none")
            await asyncio.sleep(0.5)
            finished.append(1)
            return await EchoClient().chat(messages, sampling)

    async def scenario():
        worker = make_worker(OneDownClient())
        delivery = FakeDelivery(make_task())
        await worker.handle(delivery)
        await asyncio.sleep(0.8)
        return delivery

    delivery = asyncio.run(scenario())
    assert delivery.settled[0] == "nak" and finished == []
