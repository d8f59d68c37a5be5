"""The samples a step keeps for reading: which steps, which samples, and the records."""

from coordinator_fakes import make_pooled

from rlbus.configs.orchestrator import SamplesConfig
from rlbus.rundirs import rollouts_file
from rlbus.samples import read_records
from rlbus_orchestrator.rollout_samples import is_kept, kept_records, write_step_samples


def test_step_1_and_every_interval_keep_samples_and_none_without_a_config():
    config = SamplesConfig(interval=5)
    assert [s for s in range(1, 12) if is_kept(config, s)] == [1, 5, 10]
    assert not is_kept(None, 5)


def test_first_samples_of_every_group_come_first_up_to_per_env():
    groups = [make_pooled(f"train-{i}", [0.1 * i, 0.5, 0.9]) for i in range(3)]
    for group in groups:
        group.advantages = [-1.0, 0.0, 1.0]
    records = kept_records(7, groups, per_env=4)
    assert [(r["task_id"], r["sample"]) for r in records] == [
        ("train-0", 0),
        ("train-1", 0),
        ("train-2", 0),
        ("train-0", 1),
    ]
    assert [r["advantage"] for r in records] == [-1.0, -1.0, -1.0, 0.0]
    assert all(r["step"] == 7 and r["env"] == "reverse-text" for r in records)


def test_written_records_read_back(tmp_path):
    groups = [make_pooled("train-3", [1.0, 0.0])]
    write_step_samples(tmp_path, SamplesConfig(per_env=8), 10, groups)
    records = read_records(rollouts_file(tmp_path, 10))
    assert [r["reward"] for r in records] == [1.0, 0.0]
    assert records[0]["completion_tokens"] == 3 and records[0]["trained_tokens"] == 3
