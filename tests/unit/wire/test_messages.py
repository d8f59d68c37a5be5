"""Every wire message round-trips, and decoders survive schema evolution."""

import msgspec
import pytest

from rlbus.wire import batches, claims, control, events, replicas, rollouts, tasks, weights
from rlbus.wire.subjects import RunSubjects, sanitize_run_id


def make_task(**kw) -> tasks.Task:
    fields = dict(
        task_id="3-17",
        step=3,
        env_id="reverse-text",
        example_id=17,
        problem=tasks.Problem(
            messages=[tasks.ChatMessage(role="user", content="abc")], answer="cba"
        ),
        sampling=tasks.SamplingArgs(temperature=0.7, max_tokens=16, stop=["\n"]),
        group_size=8,
        min_policy_version=2,
    )
    return tasks.Task(**(fields | kw))


def make_sample(**kw) -> rollouts.RolloutSample:
    fields = dict(
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        completion_logprobs=[-0.5, -1.25],
        completion_mask=[1, 1],
        reward=0.75,
        reward_components={"lcs": 0.75},
        finish_reason="stop",
        policy_version=2,
        replica_id="r0",
        timings={"generate": 0.1},
    )
    return rollouts.RolloutSample(**(fields | kw))


def make_micro_batch() -> batches.MicroBatch:
    return batches.MicroBatch(
        input_ids=[1, 2, 3, 4, 5],
        position_ids=[0, 1, 2, 0, 1],
        loss_mask=[0, 1, 1, 0, 1],
        advantages=[0.0, 0.5, 0.5, 0.0, -0.5],
        inference_logprobs=[0.0, -0.1, -0.2, 0.0, -0.3],
        temperatures=[1.0] * 5,
        seq_lens=[3, 2],
    )


ALL_MESSAGES = [
    (tasks, make_task()),
    (
        rollouts,
        rollouts.Rollout(
            task_id="3-17", step=3, env_id="e", samples=[make_sample(), make_sample()]
        ),
    ),
    (
        batches,
        batches.TrainBatch(
            step=3, micro_batches=[[make_micro_batch()], [make_micro_batch()]], num_samples=4
        ),
    ),
    (
        weights,
        weights.WeightsPublished(
            version=3,
            transport="filesystem",
            location="/x/step_3",
            files=[weights.WeightFile(name="model.safetensors", size=10, sha256="ab")],
        ),
    ),
    (weights, weights.WeightsApplied(version=3, replica_id="r0", duration_s=1.5)),
    (weights, weights.WeightsFailed(version=3, replica_id="r0", reason="checksum mismatch")),
    (
        replicas,
        replicas.ReplicaInfo(
            replica_id="r0", base_url="http://h:8000/v1", model="m", weights_version=3
        ),
    ),
    (events, events.StepMetrics(service="trainer", step=3, metrics={"loss": 0.5})),
    (events, events.Lifecycle(service="trainer", state="failed", reason="oom")),
    (events, weights.WeightsApplied(version=3, replica_id="r0")),
    (control, control.Drain(reason="done")),
    (control, control.Stop()),
    (control, control.Pause()),
    (control, control.Resume()),
    (claims, claims.ClaimCheck(path="claims/x", size=3, sha256="00")),
]


@pytest.mark.parametrize("module,message", ALL_MESSAGES, ids=lambda v: type(v).__name__)
def test_every_message_round_trips_through_its_module_codec(module, message):
    assert module.decoder.decode(module.encoder.encode(message)) == message


def test_control_reply_round_trips():
    reply = control.ControlReply(ok=True, service="orchestrator", state="draining")
    assert control.reply_decoder.decode(control.encoder.encode(reply)) == reply


def test_union_decoders_pick_the_type_by_tag():
    raw = events.encoder.encode(events.Lifecycle(service="inference", state="ready"))
    assert isinstance(events.decoder.decode(raw), events.Lifecycle)
    raw = control.encoder.encode(control.Pause(reason="x"))
    assert isinstance(control.decoder.decode(raw), control.Pause)


def test_map_message_with_unknown_extra_field_decodes():
    data = msgspec.to_builtins(make_task()) | {"added_in_a_later_version": {"x": 1}}
    assert tasks.decoder.decode(msgspec.msgpack.encode(data)) == make_task(
        created_at=data["created_at"]
    )


def test_map_message_missing_defaulted_field_decodes_with_default():
    data = msgspec.to_builtins(make_task())
    del data["min_policy_version"]
    del data["sampling"]
    decoded = tasks.decoder.decode(msgspec.msgpack.encode(data))
    assert decoded.min_policy_version == 0
    assert decoded.sampling == tasks.SamplingArgs()


def test_tagged_union_member_with_extra_field_decodes():
    data = msgspec.to_builtins(events.StepMetrics(service="t", step=1)) | {"new_field": 1}
    assert events.decoder.decode(msgspec.msgpack.encode(data)).step == 1


def test_array_like_message_with_trailing_extra_field_decodes():
    sample = make_sample()
    data = msgspec.to_builtins(sample) + ["a field from the future"]
    assert rollouts.decoder.decode(
        msgspec.msgpack.encode({"task_id": "t", "step": 1, "env_id": "e", "samples": [data]})
    ).samples == [sample]


def test_array_like_message_missing_trailing_defaulted_fields_decodes():
    data = msgspec.to_builtins(make_micro_batch())
    assert len(data) == 8
    # a micro-batch from before the shared-prefix layout (7 fields) is a plain one
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(data[:7]), type=batches.MicroBatch)
    assert old.parent_ids == [] and old.input_ids == data[0]
    sample = msgspec.to_builtins(make_sample())[:4]  # only the required fields
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(sample), type=rollouts.RolloutSample)
    assert decoded.reward == 0.0 and decoded.policy_version == 0


def test_missing_required_field_fails_loudly():
    data = msgspec.to_builtins(make_task())
    del data["task_id"]
    with pytest.raises(msgspec.ValidationError, match="task_id"):
        tasks.decoder.decode(msgspec.msgpack.encode(data))


def test_run_subjects_are_prefixed_and_valid_names():
    s = RunSubjects("exp.1 x")
    assert s.run_id == "exp_1_x" == sanitize_run_id("exp.1 x")
    assert s.tasks == "rlbus.exp_1_x.tasks"
    assert s.batch(12) == "rlbus.exp_1_x.batches.12"
    for spec in s.streams():
        assert "." not in spec.name and all(
            sub.startswith("rlbus.exp_1_x.") for sub in spec.subjects
        )
    assert {c.stream for c in s.consumers()} <= {spec.name for spec in s.streams()}
    assert all("." not in b.name for b in s.buckets())
