"""gk.distributed in one process: environment reading, batch sizes, sharding, padding removal."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from gpukit import distributed as dist
from gpukit._tree import leaves_with_paths
from gpukit.distributed.batch_sizes import per_device_size
from gpukit.distributed.data import RankBatches
from gpukit.distributed.launcher import _failures
from gpukit.distributed.metrics import _disagreement, _signature
from gpukit.distributed.weights import SampleWeights
from gpukit.errors import DistributedError, InvalidArgumentError

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}
LAUNCH_VARS = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def _ids_loader(n: int, *, shuffle: bool = False, batch_size: int = 4) -> DataLoader[object]:
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size, shuffle=shuffle)


def test_environment_takes_ranks_from_torchrun_variables() -> None:
    env = dist.environment(TORCHRUN)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert env.source == "torchrun"


def test_environment_under_slurm_without_a_node_list_or_master_addr_says_what_is_missing() -> None:
    with pytest.raises(DistributedError, match="MASTER_ADDR") as info:
        dist.environment(
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}
        )
    assert "SLURM_JOB_NODELIST" in str(info.value)


def test_environment_rejects_a_rank_outside_the_world() -> None:
    with pytest.raises(DistributedError, match="rank 4 does not fit"):
        dist.environment({**TORCHRUN, "RANK": "4"})


def test_init_without_a_launcher_is_a_single_process_on_the_auto_device() -> None:
    ctx = dist.init()
    assert (ctx.rank, ctx.world_size, ctx.distributed, ctx.is_main) == (0, 1, False, True)
    assert ctx.device == torch.device("cpu")  # this test machine has no GPU


def test_rank_reads_the_launcher_before_init_so_is_main_is_right_everywhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    assert (dist.rank(), dist.world_size(), dist.local_rank(), dist.is_main()) == (3, 4, 1, False)


def test_prepare_in_one_process_returns_the_model_itself_unwrapped() -> None:
    model = nn.Linear(2, 2)
    assert dist.prepare(model) is model


def test_prepare_returns_objects_in_the_order_given() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = dist.prepare(model, opt, _ids_loader(8), per_device_batch_size=4)
    assert (got[0], got[1]) == (model, opt)
    assert isinstance(got[2], dist.DistributedLoader)


def test_prepare_refuses_a_loader_without_an_explicit_batch_size() -> None:
    with pytest.raises(InvalidArgumentError, match="neither per_device_batch_size"):
        dist.prepare(nn.Linear(1, 1), loader=_ids_loader(8))


def test_prepare_refuses_two_batch_sizes_that_are_no_whole_number_of_micro_batches() -> None:
    # Both sizes together mean micro-batches (gradient accumulation): 4 is no multiple of 3.
    with pytest.raises(InvalidArgumentError, match="whole number of micro-batches"):
        dist.prepare(
            nn.Linear(1, 1), loader=_ids_loader(8), per_device_batch_size=3, global_batch_size=4
        )


def test_global_batch_size_is_split_evenly_over_processes() -> None:
    assert per_device_size(4, None, 64) == 16
    with pytest.raises(InvalidArgumentError, match="multiple of 4"):
        per_device_size(4, None, 30)


def test_prepare_refuses_a_sampler_it_cannot_shard() -> None:
    data = TensorDataset(torch.arange(8))
    loader = DataLoader(data, batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8))
    with pytest.raises(InvalidArgumentError, match="WeightedRandomSampler"):
        dist.prepare(nn.Linear(1, 1), loader=loader, per_device_batch_size=2)


def test_prepared_loader_uses_the_explicit_batch_size_not_the_loaders() -> None:
    _, loader = dist.prepare(
        nn.Linear(1, 1), loader=_ids_loader(10, batch_size=4), per_device_batch_size=3
    )
    assert [len(b[0]) for b in loader] == [3, 3, 3, 1]


def test_prepared_loader_shuffles_differently_each_epoch_and_reproducibly_per_seed() -> None:
    def passes(seed: int) -> list[list[int]]:
        _, loader = dist.prepare(
            nn.Linear(1, 1),
            loader=_ids_loader(16, shuffle=True),
            per_device_batch_size=16,
            seed=seed,
        )
        return [next(iter(loader))[0].tolist() for _ in range(2)]

    first = passes(seed=3)
    assert first[0] != first[1]
    assert passes(seed=3) == first


def test_set_epoch_picks_the_shuffle_of_that_epoch() -> None:
    _, loader = dist.prepare(
        nn.Linear(1, 1), loader=_ids_loader(16, shuffle=True), per_device_batch_size=16
    )
    epoch0 = next(iter(loader))[0].tolist()
    loader.set_epoch(0)
    assert next(iter(loader))[0].tolist() == epoch0


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 60),
    world=st.integers(1, 6),
    per_device=st.integers(1, 5),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
def test_ranks_split_the_global_batches_of_one_process_without_repeating_a_sample(
    n: int, world: int, per_device: int, shuffle: bool, drop_last: bool
) -> None:
    def batches(rank: int, size: int) -> list[list[int]]:
        sampler = RankBatches(
            n,
            global_batch_size=per_device * world,
            rank=rank,
            world_size=size,
            shuffle=shuffle,
            seed=5,
            drop_last=drop_last,
        )
        return list(sampler)

    single = batches(0, 1)
    per_rank = [batches(r, world) for r in range(world)]
    assert {len(b) for b in per_rank} == {len(single)}  # every rank takes every step
    # In rank order, the shares of each step are exactly one process's global batch.
    joined = [[i for b in per_rank for i in b[step]] for step in range(len(single))]
    assert joined == single
    seen = sorted(i for batch in single for i in batch)
    full = n - n % (per_device * world) if drop_last else n
    assert len(seen) == full
    assert len(set(seen)) == full


def test_a_rank_with_no_sample_in_the_last_step_gets_an_empty_batch_of_the_same_structure() -> None:
    data = TensorDataset(torch.arange(13), torch.ones(13, 2))
    loader = dist.DistributedLoader(
        DataLoader(data, batch_size=4),
        batch_size=2,
        rank=2,
        world_size=3,
        device=torch.device("cpu"),
        seed=0,
    )
    got = list(loader)
    assert [b[0].tolist() for b in got] == [[4, 5], [10, 11], []]
    assert got[-1][1].shape == (0, 2)


def test_sample_weights_weigh_each_rank_by_its_share_of_the_global_batch() -> None:
    data = TensorDataset(torch.arange(13))
    seen = []
    for rank in range(3):
        loader = dist.DistributedLoader(
            DataLoader(data, batch_size=4),
            batch_size=2,
            rank=rank,
            world_size=3,
            device=torch.device("cpu"),
            seed=0,
        )
        weights = SampleWeights(world_size=3, context=loader.context)  # as prepare() hands it
        seen.append([weights.weight() for _ in loader])
        assert weights.weight() == 1 / 3  # outside its loader's pass: DDP's plain average
    # Steps of 6 samples give each rank 2/6; the last step's one sample is all rank 0's.
    assert seen == [[1 / 3, 1 / 3, 1.0], [1 / 3, 1 / 3, 0.0], [1 / 3, 1 / 3, 0.0]]


def test_the_hook_reads_its_own_loaders_shares_inside_another_loaders_loop() -> None:
    # An evaluation loop inside the training loop: the gradients are the training batch's.
    def loader(n: int, rank: int) -> dist.DistributedLoader:
        data = DataLoader(TensorDataset(torch.arange(n)), batch_size=4)
        return dist.DistributedLoader(
            data, batch_size=2, rank=rank, world_size=3, device=torch.device("cpu"), seed=0
        )

    training, evaluation = loader(13, 0), loader(6, 2)
    weights = SampleWeights(world_size=3, context=training.context)
    seen = []
    for _ in training:
        for _ in evaluation:
            seen.append(weights.weight())
    assert seen == [1 / 3, 1 / 3, 1.0]  # the training batches' shares of rank 0


def test_gather_for_metrics_in_one_process_returns_the_values_themselves() -> None:
    values = {"pred": torch.arange(3)}
    assert dist.gather_for_metrics(values) is values


def _signatures(x: object) -> dict[tuple[object, ...], object]:
    return {path: _signature(leaf) for path, leaf in leaves_with_paths(x, None)}


def test_structures_that_agree_up_to_rows_and_key_order_are_not_a_disagreement() -> None:
    rank0 = _signatures({"a": torch.zeros(3, 2), "b": [torch.zeros(())]})
    rank1 = _signatures({"b": [torch.ones(())], "a": torch.ones(5, 2)})
    assert _disagreement([rank0, rank1]) is None


def test_a_disagreement_names_the_ranks_and_the_path() -> None:
    rank0 = _signatures({"a": torch.zeros(3)})
    rank1 = _signatures({"a": torch.zeros(3), "extra": [torch.zeros(1)]})
    assert _disagreement([rank0, rank1]) == "rank 1 has x['extra'][0], which rank 0 does not"
    wide = _signatures({"a": torch.zeros(3, 4)})
    assert _disagreement([rank0, rank0, wide]) == (
        "x['a'] is a torch.float32 tensor of shape (N) on rank 0 but a torch.float32 "
        "tensor of shape (N, 4) on rank 2"
    )


def test_all_reduce_mean_of_a_number_in_one_process_is_that_number_as_float() -> None:
    assert dist.all_reduce_mean(3) == 3.0


def test_main_only_logger_drops_records_on_other_ranks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    log = dist.get_logger("gpukit.test.main_only")
    with caplog.at_level(logging.INFO, logger="gpukit.test.main_only"):
        log.info("from rank 0")
        for key, value in TORCHRUN.items():
            monkeypatch.setenv(key, value)
        log.info("from rank 3")
    assert [r.getMessage() for r in caplog.records] == ["from rank 0"]


def test_print_main_prints_only_on_rank_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    dist.print_main("shown")
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    dist.print_main("hidden")
    assert capsys.readouterr().out == "shown\n"


def test_launch_refuses_a_process_count_below_one() -> None:
    with pytest.raises(InvalidArgumentError, match="nprocs=0"):
        dist.launch(print, 0)


def test_launch_failure_names_the_rank_that_vanished_before_the_peer_that_lost_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "0.start").touch()
    (tmp_path / "1.start").touch()
    (tmp_path / "0.error").write_text(
        json.dumps(
            {"time": 1.0, "error": "RuntimeError: Connection closed by peer", "traceback": "t"}
        )
    )
    order = [rank for rank, _, _ in _failures({}, tmp_path)]
    assert order == [1, 0]


def test_prepare_with_the_loader_in_the_optimizers_place_says_to_pass_it_by_keyword() -> None:
    with pytest.raises(InvalidArgumentError, match="DataLoader as its optimizer") as info:
        dist.prepare(nn.Linear(1, 1), _ids_loader(8), per_device_batch_size=2)  # type: ignore[call-overload]
    assert "loader=loader" in str(info.value)


@pytest.mark.parametrize("args", [("model",), (None,), (nn.Linear(1, 1), None, [1, 2])])
def test_prepare_refuses_objects_that_are_not_a_model_optimizer_or_loader(
    args: tuple[object, ...],
) -> None:
    with pytest.raises(InvalidArgumentError, match="where it needs a torch"):
        dist.prepare(*args, per_device_batch_size=2)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({**TORCHRUN, "LOCAL_RANK": "abc"}, "LOCAL_RANK"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE"),
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": "x",
                "SLURM_STEP_ID": "0",
                "MASTER_ADDR": "node1",
                "MASTER_PORT": "29500",
            },
            "SLURM_LOCALID",
        ),
    ],
)
def test_environment_names_a_local_rank_variable_that_is_not_an_integer(
    env: dict[str, str], name: str
) -> None:
    with pytest.raises(DistributedError, match=f"{name}=.* is not an integer"):
        dist.environment(env)


def test_prepare_given_both_batch_sizes_says_both_even_when_one_is_zero() -> None:
    with pytest.raises(InvalidArgumentError, match="both per_device_batch_size"):
        per_device_size(2, 0, 8)


@pytest.mark.parametrize(("per_device", "global_"), [(3.5, None), (None, 8.0), (True, None)])
def test_batch_sizes_that_are_not_whole_numbers_are_refused(
    per_device: float | None, global_: float | None
) -> None:
    with pytest.raises(InvalidArgumentError, match="is not a batch size"):
        per_device_size(2, per_device, global_)  # type: ignore[arg-type]


def test_launch_refuses_a_function_spawned_processes_cannot_receive() -> None:
    with pytest.raises(InvalidArgumentError, match="cannot send") as info:
        dist.launch(lambda: 1, 1)
    assert "top level of an importable module" in str(info.value)


@pytest.mark.parametrize("value", ["3", None, [1.0]])
def test_all_reduce_mean_refuses_what_is_not_a_tensor_or_number(value: object) -> None:
    with pytest.raises(InvalidArgumentError, match="a tensor or a number"):
        dist.all_reduce_mean(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["bogus", "", 3, "NCCL2"])
def test_init_refuses_a_backend_torch_does_not_know(backend: object) -> None:
    with pytest.raises(InvalidArgumentError, match=f"backend={backend!r} is not a torch"):
        dist.init(backend=backend)  # type: ignore[arg-type]


def test_a_function_defined_in_python_c_is_refused_before_any_worker_starts() -> None:
    import subprocess
    import sys

    from tests.helpers import subprocess_env

    code = (
        "import gpukit as gk\n"
        "from gpukit import distributed as dist\n"
        "def f(): return 1\n"
        "try:\n"
        "    dist.launch(f, 2)\n"
        "except gk.InvalidArgumentError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        check=True,
        timeout=120,
    ).stdout
    assert "defined in `python -c`, a notebook cell or the REPL" in out
    assert 'start_method="fork"' in out


def test_a_result_that_cannot_be_pickled_is_named_with_its_type() -> None:
    import threading

    from gpukit.distributed.launcher import _check_result_travels

    _check_result_travels(len, {"loss": [0.5], "weights": torch.zeros(2)})
    with pytest.raises(InvalidArgumentError, match="returned a generator, which cannot be sent"):
        _check_result_travels(len, (i for i in range(2)))
    with pytest.raises(InvalidArgumentError, match="returned a lock"):
        _check_result_travels(len, threading.Lock())


def test_a_rank_that_exited_before_starting_is_reported_as_unable_to_load_the_function(
    tmp_path: Path,
) -> None:
    from types import SimpleNamespace

    failure = SimpleNamespace(exitcode=1, pid=42, signal_name=lambda: "")
    (tmp_path / "1.start").touch()  # rank 1 reached fn; rank 0 never did
    texts = dict((rank, text) for rank, text, _ in _failures({0: failure, 1: failure}, tmp_path))
    assert "could not load it or its arguments" in texts[0]
    assert "without a Python error" in texts[1]


@pytest.mark.parametrize("weight", [-1, float("nan"), True, "3"])
def test_all_reduce_mean_refuses_a_weight_that_is_not_a_sample_count(weight: object) -> None:
    with pytest.raises(InvalidArgumentError, match="weight"):
        dist.all_reduce_mean(1.0, weight=weight)  # type: ignore[arg-type]


def test_all_reduce_mean_with_a_weight_in_one_process_is_the_value_itself() -> None:
    assert dist.all_reduce_mean(torch.tensor([2.0, 4.0]), weight=3).tolist() == [2.0, 4.0]


def test_a_group_that_init_joined_is_left_when_the_script_exits() -> None:
    from tests.helpers import run_python

    # The check is registered before init(), so it runs after gpukit's own exit handler.
    code = (
        "import atexit, os\n"
        "import torch.distributed as tdist\n"
        "from gpukit import distributed as dist\n"
        "os.environ.update(RANK='0', LOCAL_RANK='0', WORLD_SIZE='1', LOCAL_WORLD_SIZE='1',\n"
        "                  MASTER_ADDR='127.0.0.1', MASTER_PORT='0',  # one rank: any free port\n"
        "                  TORCHELASTIC_RUN_ID='t')\n"
        "atexit.register(lambda: print('still in a group at exit:', tdist.is_initialized()))\n"
        "print('joined:', dist.init().world_size, tdist.is_initialized())\n"
    )
    out = run_python(code)
    assert out.splitlines() == ["joined: 1 True", "still in a group at exit: False"]
