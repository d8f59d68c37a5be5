from rlbus.wire.events import StepMetrics
from rlbus.wire.weights import WeightsApplied, WeightsFailed
from rlbus_launch.monitor.join import StepJoiner


def make_metrics(service, step, **metrics):
    return StepMetrics(service=service, step=step, metrics=metrics, time=float(step))


def test_row_is_released_only_when_trainer_and_orchestrator_reported():
    joiner = StepJoiner()
    assert joiner.add_metrics(make_metrics("orchestrator", 1, **{"reward/mean": 0.5}), "a") == []
    rows = joiner.add_metrics(make_metrics("trainer", 1, loss=0.1), "b")
    assert rows == [({"step": 1, "reward/mean": 0.5, "loss": 0.1, "time": 1.0}, ["a", "b"])]


def test_rows_come_out_in_step_order():
    joiner = StepJoiner()
    joiner.add_metrics(make_metrics("orchestrator", 1, r=1.0))
    joiner.add_metrics(make_metrics("orchestrator", 2, r=2.0))
    assert joiner.add_metrics(make_metrics("trainer", 2, loss=2.0)) == []  # step 1 still waits
    rows = joiner.add_metrics(make_metrics("trainer", 1, loss=1.0))
    assert [row["step"] for row, _ in rows] == [1, 2]


def test_a_service_that_reports_late_after_a_restart_still_joins_its_row():
    """A coordinator killed after publishing step 1's batch republishes its metrics after the
    restart, when later steps are complete: the row waits for them instead of being written
    without them (they would then be dropped as a step already written)."""
    now = [0.0]
    joiner = StepJoiner(lookahead=2, wait_s=300, clock=lambda: now[0])
    joiner.add_metrics(make_metrics("trainer", 1, loss=1.0))
    for step in (2, 3, 4):
        joiner.add_metrics(make_metrics("trainer", step, loss=1.0))
        assert joiner.add_metrics(make_metrics("orchestrator", step, r=1.0)) == []
    now[0] = 60.0
    rows = joiner.add_metrics(make_metrics("orchestrator", 1, r=1.0))
    assert [row["step"] for row, _ in rows] == [1, 2, 3, 4] and rows[0][0]["r"] == 1.0


def test_a_step_a_service_never_reports_is_released_after_lookahead_and_wait():
    now = [0.0]
    joiner = StepJoiner(lookahead=2, wait_s=300, clock=lambda: now[0])
    joiner.add_metrics(make_metrics("orchestrator", 1, r=1.0))  # trainer never reports step 1
    joiner.add_metrics(make_metrics("orchestrator", 2, r=1.0))
    joiner.add_metrics(make_metrics("trainer", 2, loss=1.0))
    joiner.add_metrics(make_metrics("orchestrator", 3, r=1.0))
    assert joiner.add_metrics(make_metrics("trainer", 3, loss=1.0)) == []  # not waited long enough
    now[0] = 301.0
    released = joiner.add_metrics(make_metrics("orchestrator", 4, r=1.0))
    released += joiner.add_metrics(make_metrics("trainer", 4, loss=1.0))
    assert [row["step"] for row, _ in released] == [1, 2, 3, 4]
    assert "loss" not in released[0][0]


def test_with_no_wait_the_lookahead_alone_releases_a_row():
    joiner = StepJoiner(lookahead=2, wait_s=0)
    joiner.add_metrics(make_metrics("orchestrator", 1, r=1.0))  # trainer never reports step 1
    released = []
    for step in (2, 3):
        joiner.add_metrics(make_metrics("orchestrator", step, r=1.0))
        released += joiner.add_metrics(make_metrics("trainer", step, loss=1.0))
    assert [row["step"] for row, _ in released] == [1, 2, 3]
    assert "loss" not in released[0][0]


def test_same_metric_from_two_services_keeps_both():
    joiner = StepJoiner()
    joiner.add_metrics(make_metrics("orchestrator", 1, tokens_per_s=10.0))
    ((row, _),) = joiner.add_metrics(make_metrics("trainer", 1, tokens_per_s=99.0))
    assert row["tokens_per_s"] == 10.0 and row["trainer/tokens_per_s"] == 99.0


def test_weights_acks_land_in_the_row_of_their_version():
    joiner = StepJoiner()
    joiner.add_weights(WeightsApplied(version=1, replica_id="r0", duration_s=0.3))
    joiner.add_weights(WeightsFailed(version=1, replica_id="r1", reason="checksum"))
    joiner.add_metrics(make_metrics("orchestrator", 1, r=1.0))
    ((row, _),) = joiner.add_metrics(make_metrics("trainer", 1, loss=1.0))
    assert row["weights/num_applied"] == 1 and row["weights/num_failed"] == 1
    assert row["weights/apply_s"] == 0.3


def test_flush_releases_incomplete_rows():
    joiner = StepJoiner()
    joiner.add_metrics(make_metrics("orchestrator", 5, r=1.0))
    assert [row["step"] for row, _ in joiner.flush()] == [5]
    assert joiner.pending == {}


def test_acks_arriving_after_their_row_go_into_the_next_row_not_a_second_row():
    joiner = StepJoiner()
    written = []
    written += joiner.add_metrics(make_metrics("orchestrator", 1, r=1.0))
    written += joiner.add_metrics(make_metrics("trainer", 1, loss=1.0))  # row 1 written
    written += joiner.add_weights(
        WeightsApplied(version=1, replica_id="r0", duration_s=0.1)
    )  # late ack
    written += joiner.add_metrics(make_metrics("orchestrator", 2, r=1.0))
    written += joiner.add_metrics(make_metrics("trainer", 2, loss=1.0))
    steps = [row["step"] for row, _ in written]
    assert steps == [1, 2]
    assert written[1][0]["weights/applied/r0"] == 1 and written[1][0]["weights/num_applied"] == 1


def test_resume_marks_written_steps_and_ignores_rows_of_monitor_keys_only():
    joiner = StepJoiner()
    joiner.resume([
        {"step": 1, "loss": 1.0, "reward/mean": 0.1},
        {"step": 2, "weights/num_applied": 1, "dead_letters/total": 0},  # an old weights-only row
    ])  # fmt: skip
    assert joiner.is_written(1) and not joiner.is_written(2)
    assert joiner.last_written == 2
    joiner.add_metrics(make_metrics("orchestrator", 2, r=1.0))
    ((row, _),) = joiner.add_metrics(make_metrics("trainer", 2, loss=2.0))
    assert row["step"] == 2 and joiner.is_written(2)


def test_rows_not_ready_are_held_with_their_tokens_not_written():
    joiner = StepJoiner()
    joiner.add_metrics(make_metrics("orchestrator", 1, r=1.0), "o1")
    joiner.add_weights(WeightsApplied(version=1, replica_id="r0", duration_s=0.1), "w1")
    assert sorted(joiner.held_tokens()) == ["o1", "w1"]
    assert not joiner.is_written(1)


def test_complete_rows_behind_an_incomplete_one_come_out_at_a_clean_stop():
    joiner = StepJoiner(lookahead=2, wait_s=300)
    joiner.add_metrics(make_metrics("trainer", 1, loss=1.0))  # step 1's orchestrator half lost
    for step in (2, 3):
        joiner.add_metrics(make_metrics("trainer", step, loss=1.0))
        joiner.add_metrics(make_metrics("orchestrator", step, r=1.0))
    assert [row["step"] for row, _ in joiner.complete_rows()] == [2, 3]
    assert list(joiner.pending) == [1]


def test_a_row_waits_for_earlier_steps_a_killed_monitor_held():
    """Steps 3-4 went to a monitor that was killed before writing them: they come back only
    after the consumer's ack wait, so step 5 waits for them (rows stay in step order), and
    goes out alone once `gap_wait_s` passed without them."""
    now = [0.0]
    joiner = StepJoiner(gap_wait_s=60, clock=lambda: now[0])
    joiner.resume([{"step": 1, "loss": 1.0}, {"step": 2, "loss": 1.0}])
    joiner.add_metrics(make_metrics("orchestrator", 5, r=1.0))
    assert joiner.add_metrics(make_metrics("trainer", 5, loss=1.0)) == []
    now[0] = 30.0  # redelivered
    for step in (3, 4):
        joiner.add_metrics(make_metrics("orchestrator", step, r=1.0))
    rows = joiner.add_metrics(make_metrics("trainer", 3, loss=1.0))
    rows += joiner.add_metrics(make_metrics("trainer", 4, loss=1.0))
    assert [row["step"] for row, _ in rows] == [3, 4, 5]

    joiner.add_metrics(make_metrics("orchestrator", 7, r=1.0))  # step 6 never comes
    assert joiner.add_metrics(make_metrics("trainer", 7, loss=1.0)) == []
    now[0] = 91.0
    assert [row["step"] for row, _ in joiner.ready()] == [7]


def test_a_fresh_file_waits_for_step_one_too():
    now = [0.0]
    joiner = StepJoiner(gap_wait_s=60, clock=lambda: now[0])
    joiner.add_metrics(make_metrics("orchestrator", 2, r=1.0))
    assert joiner.add_metrics(make_metrics("trainer", 2, loss=1.0)) == []
    joiner.add_metrics(make_metrics("orchestrator", 1, r=1.0))
    rows = joiner.add_metrics(make_metrics("trainer", 1, loss=1.0))
    assert [row["step"] for row, _ in rows] == [1, 2]


def test_metrics_a_service_sends_again_after_a_restart_do_not_change_its_row():
    joiner = StepJoiner()
    joiner.add_metrics(make_metrics("orchestrator", 1, r=1.0), "a")
    assert joiner.add_metrics(make_metrics("orchestrator", 1, r=9.0, replayed=1.0), "b") == []
    ((row, tokens),) = joiner.add_metrics(make_metrics("trainer", 1, loss=1.0), "c")
    assert row["r"] == 1.0 and "replayed" not in row and "orchestrator/r" not in row
    assert tokens == ["a", "b", "c"]  # the replay is acked with the row


def test_replayed_metrics_fill_a_row_that_lacks_the_service():
    joiner = StepJoiner()
    joiner.add_metrics(make_metrics("trainer", 1, loss=1.0))
    ((row, _),) = joiner.add_metrics(make_metrics("orchestrator", 1, r=1.0, replayed=1.0))
    assert row["r"] == 1.0 and row["loss"] == 1.0


def test_when_the_run_is_over_rows_missing_a_service_are_written_as_they_are():
    """A step whose orchestrator half never came (its coordinator was killed between the batch
    and its metrics) must not take its trainer half, and every row behind it, out of the file."""
    joiner = StepJoiner()
    joiner.add_metrics(make_metrics("orchestrator", 1, r=1.0))
    joiner.add_metrics(make_metrics("trainer", 1, loss=1.0))
    joiner.add_metrics(make_metrics("trainer", 2, loss=2.0))  # no orchestrator half
    for step in (3, 4):
        joiner.add_metrics(make_metrics("orchestrator", step, r=1.0))
        joiner.add_metrics(make_metrics("trainer", step, loss=1.0))
    joiner.add_weights(WeightsApplied(version=5, replica_id="r0", duration_s=0.1))
    rows = joiner.rows_with_metrics()
    assert [row["step"] for row, _ in rows] == [2, 3, 4]
    assert rows[0][0]["loss"] == 2.0
    assert list(joiner.pending) == [5]  # a row of weights acks only is not a step's row
