"""Malformed bus messages on a real nats-server, table-driven: each is quarantined at its first
delivery with a reason that names the culprit field, and the message after it is still handled
(nothing redelivered forever, nothing lost). Train batches raise `PoisonBatch` naming the field."""

import msgspec
import pytest
from bus_factories import make_batch, make_task, wait_for

from rlbus.bus.claimcheck import CLAIM_HEADER
from rlbus.bus.errors import PoisonBatch
from rlbus.wire import rollouts, tasks, weights

VALID_ROLLOUT = rollouts.Rollout(
    task_id="train-0",
    step=0,
    env_id="reverse-text",
    samples=[
        rollouts.RolloutSample(
            prompt_token_ids=[1, 2],
            completion_token_ids=[3],
            completion_logprobs=[-0.5],
            completion_mask=[1],
        )
    ],
)


def mutated(message: msgspec.Struct, change) -> bytes:
    """`message` as a plain map, changed by `change(map)`, msgpack-encoded."""
    data = msgspec.to_builtins(message)
    change(data)
    return msgspec.msgpack.encode(data)


def setter(path: str, value):
    """A change that sets `a.b.0.c` (dots; integers index lists) to `value`."""
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]

    def change(data):
        for key in parents:
            data = data[key]
        data[last] = value

    return change


def dropper(key: str):
    return lambda data: data.pop(key)


TASK = make_task(0)
BAD_TASKS = {
    "not msgpack": (b"\xc1\xc1 garbage", "MessagePack"),
    "empty payload": (b"", "truncated"),
    "a list, not a map": (msgspec.msgpack.encode([1, 2]), "Expected `object`, got `array`"),
    "task_id missing": (mutated(TASK, dropper("task_id")), "missing required field `task_id`"),
    "step a string": (mutated(TASK, setter("step", "1")), "at `$.step`"),
    "step negative": (mutated(TASK, setter("step", -1)), ">= 0 - at `$.step`"),
    "group_size zero": (mutated(TASK, setter("group_size", 0)), ">= 1 - at `$.group_size`"),
    "max_tokens zero": (
        mutated(TASK, setter("sampling.max_tokens", 0)),
        "at `$.sampling.max_tokens`",
    ),
    "temperature negative": (
        mutated(TASK, setter("sampling.temperature", -0.5)),
        "at `$.sampling.temperature`",
    ),
    "top_p above one": (mutated(TASK, setter("sampling.top_p", 2.0)), "at `$.sampling.top_p`"),
    "min_policy_version negative": (
        mutated(TASK, setter("min_policy_version", -3)),
        "at `$.min_policy_version`",
    ),
    "problem missing": (mutated(TASK, dropper("problem")), "missing required field `problem`"),
    "messages a string": (
        mutated(TASK, setter("problem.messages", "hi")),
        "at `$.problem.messages`",
    ),
    "message role missing": (
        mutated(TASK, lambda d: d["problem"]["messages"][0].pop("role")),
        "at `$.problem.messages[0]`",
    ),
    "prompt token id a float": (
        mutated(TASK, setter("problem.prompt_token_ids", [1.5])),
        "at `$.problem.prompt_token_ids[0]`",
    ),
    "sampling stop not a list": (mutated(TASK, setter("sampling.stop", 7)), "at `$.sampling.stop`"),
}
BAD_ROLLOUTS = {
    "step a string": (mutated(VALID_ROLLOUT, setter("step", "x")), "at `$.step`"),
    "samples a map": (mutated(VALID_ROLLOUT, setter("samples", {})), "at `$.samples`"),
    "sample array too short": (
        mutated(VALID_ROLLOUT, setter("samples.0", [[1], [2]])),
        "at `$.samples[0]`",
    ),
    "logprob a string": (
        mutated(VALID_ROLLOUT, setter("samples.0.2", ["x"])),
        "at `$.samples[0][2][0]`",
    ),
    "policy_version negative": (
        mutated(VALID_ROLLOUT, setter("samples.0.10", -1)),
        "at `$.samples[0][10]`",
    ),
}


async def quarantined_reason(
    bus, stream, durable, subject, decoder, bad: bytes, good, headers=None
) -> str:
    """Publish `bad` then `good`; run a consumer until `good` is handled; the dead reason."""
    await bus.publish(subject, bad, msg_id="bad", headers=headers)
    await bus.publish(subject, good, msg_id="good")
    seen = []

    async def handle(delivery):
        seen.append(delivery.msg_id)

    async with bus.consumer(stream, durable, decoder, handle) as consumer:
        await wait_for(lambda: seen and consumer.num_dead == 1, 20)
    assert seen == ["good"]
    dead = await bus.js.get_last_msg(bus.subjects.dead_stream, bus.subjects.dead(stream))
    assert int(dead.headers["Rlbus-Dead-Num-Delivered"]) == 1  # at once, not after retries
    return dead.headers["Rlbus-Dead-Reason"]


@pytest.mark.parametrize("case", BAD_TASKS)
async def test_a_bad_task_is_quarantined_at_once_naming_the_field(make_bus, case):
    bad, culprit = BAD_TASKS[case]
    bus = await make_bus(max_deliver=5)
    s = bus.subjects
    reason = await quarantined_reason(
        bus, s.tasks_stream, s.tasks_durable, s.tasks, tasks.decoder, bad, make_task(1)
    )
    assert culprit in reason


async def test_an_undecodable_claim_check_is_quarantined_at_once(make_bus):
    bus = await make_bus(max_deliver=5)
    s = bus.subjects
    reason = await quarantined_reason(
        bus, s.tasks_stream, s.tasks_durable, s.tasks, tasks.decoder, b"\x93junk", make_task(1),
        headers={CLAIM_HEADER: "1"},
    )  # fmt: skip
    assert "undecodable claim check" in reason


@pytest.mark.parametrize("case", BAD_ROLLOUTS)
async def test_a_bad_rollout_is_quarantined_at_once_naming_the_field(make_bus, case):
    bad, culprit = BAD_ROLLOUTS[case]
    bus = await make_bus(max_deliver=5)
    s = bus.subjects
    reason = await quarantined_reason(
        bus, s.rollouts_stream, s.rollouts_durable, s.rollouts, rollouts.decoder, bad, VALID_ROLLOUT
    )
    assert culprit in reason


BATCH = make_batch(1)
BAD_BATCHES = {
    "step negative": (mutated(BATCH, setter("step", -1)), "at `$.step`"),
    "num_tokens negative": (mutated(BATCH, setter("num_tokens", -5)), "at `$.num_tokens`"),
    "micro_batches not nested": (
        mutated(BATCH, setter("micro_batches", [[1, 2]])),
        "at `$.micro_batches[0][0]`",
    ),
    "garbage": (b"\x00\x01\x02", "Expected `object`, got `int`"),
}


@pytest.mark.parametrize("case", BAD_BATCHES)
async def test_a_bad_batch_is_a_poison_batch_naming_the_field(make_bus, case):
    bad, culprit = BAD_BATCHES[case]
    bus = await make_bus()
    await bus.publish(bus.subjects.batch(1), bad, msg_id="batch-1")
    with pytest.raises(PoisonBatch) as poison:
        await bus.step_log.get(1, timeout_s=5)
    assert poison.value.step == 1 and culprit in poison.value.reason
    assert poison.value.data == bad  # the stored bytes travel on, for the dead letter


PUBLISHED = weights.WeightsPublished(
    version=3,
    transport="filesystem",
    location="broadcasts/step_3",
    files=[weights.WeightFile(name="model.safetensors", size=10, sha256="0" * 64)],
)


@pytest.mark.parametrize(
    ("change", "culprit"),
    [
        (setter("version", -1), "at `$.version`"),
        (setter("files.0.name", "../../configs/rl.toml"), "at `$.files[0].name`"),
        (setter("files.0.name", "/etc/passwd"), "at `$.files[0].name`"),
        (setter("files.0.name", ".hidden"), "at `$.files[0].name`"),
        (setter("files.0.size", -1), "at `$.files[0].size`"),
        (setter("transport", "carrier-pigeon"), "at `$.transport`"),
    ],
)
def test_a_bad_weights_record_does_not_decode_and_names_the_field(change, culprit):
    """The weights record is read by the inference weight agent, which ignores (and dead-letters)
    records that do not decode (tests/integration/bus/test_poison.py)."""
    with pytest.raises(
        msgspec.ValidationError, match=culprit.replace("$", r"\$").replace("[", r"\[")
    ):
        weights.published_decoder.decode(mutated(PUBLISHED, change))
    assert weights.published_decoder.decode(mutated(PUBLISHED, lambda d: None)) == PUBLISHED
