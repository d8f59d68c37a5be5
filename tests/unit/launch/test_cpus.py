"""CPU placement of inference and trainer on GPU-less hosts."""

from rlbus_launch.cpus import bind_trainer, plan_cpus


def test_two_cores_give_one_to_each():
    plan = plan_cpus([0, 1], num_replicas=1, num_train_ranks=1)
    assert plan.inference == [[0]] and plan.trainer == [1] and plan.threads_per_rank == 1


def test_replicas_and_ranks_share_their_half():
    plan = plan_cpus(list(range(16)), num_replicas=2, num_train_ranks=2)
    assert plan.inference == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan.trainer == list(range(8, 16)) and plan.threads_per_rank == 4


def test_odd_core_counts_and_sparse_masks_keep_every_core():
    plan = plan_cpus([2, 5, 7], num_replicas=1, num_train_ranks=1)
    assert plan.inference == [[2, 5]] and plan.trainer == [7]


def test_too_few_cores_means_no_binding():
    assert plan_cpus([0], num_replicas=1, num_train_ranks=1) is None
    assert plan_cpus([0, 1, 2, 3], num_replicas=3, num_train_ranks=1) is None


def test_trainer_runs_under_taskset_with_one_thread_per_core_share():
    plan = plan_cpus([0, 1, 2, 3], num_replicas=1, num_train_ranks=1)
    argv, env = bind_trainer(["python", "-m", "x"], plan)
    assert argv[1:] == ["-c", "2,3", "python", "-m", "x"] and env == {"OMP_NUM_THREADS": "2"}


def orchestrator_argvs(monkeypatch, tmp_path, where: str) -> dict[str, list[str]]:
    import shutil

    from rlbus.configs import RLConfig
    from rlbus_launch import plan

    monkeypatch.setattr(plan, "usable_cores", lambda: [0, 1])
    monkeypatch.setattr(plan, "host_has_gpus", lambda: False)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    config = RLConfig(
        deployment={"orchestrator_cpus": where, "num_rollout_workers": 1}
    ).with_run_name("r")
    launch = plan.build_rl_launch(config, tmp_path)
    return {p.name: p.argv for p in launch.processes}


def test_orchestrator_and_its_workers_are_pinned_where_configured(monkeypatch, tmp_path):
    for where, cores in (("inference", "0"), ("trainer", "1")):
        argvs = orchestrator_argvs(monkeypatch, tmp_path / where, where)
        for name in ("orchestrator", "worker-0"):
            assert argvs[name][:3] == ["/usr/bin/taskset", "-c", cores], (where, argvs[name])
        assert argvs["worker-0"][-2:] == ["--role", "worker"]
    argvs = orchestrator_argvs(monkeypatch, tmp_path / "os", "os")
    assert "taskset" not in argvs["orchestrator"][0] and "taskset" not in argvs["worker-0"][0]
