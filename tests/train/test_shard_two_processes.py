"""Sharding with FSDP2 over a gloo group of two where rank 0 is this process (fast).

The slow tests (``test_shard_exact.py``, ``test_shard_checkpoint.py``) run whole trainings and
saves in processes of their own; here rank 0 runs in the test process, so that coverage and
mutation runs see what it runs: ``shard_model`` and the optimizer following it, the weighted
reduce-scatter, mixed precision, and the sharded part of a training state (``_sharded_part``:
its shards written, read back bitwise, refused when damaged or another model's).

Every model is the float64 ``Stack`` of ``shard_workloads``: 7 rows split 4 + 3 over the ranks.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from gpukit.checkpoint import sharded_model
from gpukit.checkpoint.dcp import open_dcp
from gpukit.errors import CheckpointError
from gpukit.train import _sharded_part
from gpukit.train.shard import (
    PlainBuffers,
    WeightedReduceScatter,
    mixed_precision,
    shard,
    shard_model,
)
from tests.helpers.two_processes import OtherRank, two_processes
from tests.train import shard_workloads as work

pytestmark = pytest.mark.cpu_workers

CPU = torch.device("cpu")
UNITS = ["", "blocks.0", "blocks.1", "blocks.2", "embed", "head"]
"""The units of the default policy: the root, the blocks, and the two Linear layers around them."""


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as rank1:
        yield rank1


def _both(other: OtherRank, fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """``fn(rank, *args)`` on both ranks at once: (rank 0's result, rank 1's)."""
    other.run(fn, *args)
    mine = fn(0, *args)
    return mine, other.result()


def _inputs(rank: int, nan: bool = False) -> torch.Tensor:
    """Rank ``rank``'s own batch of 3 samples (all nan: a loss over no real sample)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + rank), dtype=torch.float64)
    return torch.full_like(x, float("nan")) if nan else x


def _full(tensor: Any) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _error(call: Callable[[], Any]) -> tuple[str, str, str | None]:
    """(type name, message, hint) of what ``call`` raised (it crosses a process boundary)."""
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc), getattr(exc, "hint", None)
    return "no error", "", None


# --- shard_model: the model and its optimizer, over two ranks ------------------------------------


def _optimizer(net: nn.Module) -> torch.optim.Optimizer:
    """SGD in two groups of their own options: the input layer, and the rest."""
    embed = list(net.embed.parameters())  # type: ignore[union-attr]
    rest = [p for p in net.parameters() if all(p is not q for q in embed)]
    return torch.optim.SGD([{"params": embed, "lr": 0.25}, {"params": rest}], lr=0.5)


def sharded_step(rank: int, weights: list[float], nan_on: int | None) -> dict[str, Any]:
    """Shard the model with its optimizer, weighing this rank's gradients by
    ``weights[rank]`` (set after sharding: read when reducing), take one SGD step on this
    rank's batch (nan on rank ``nan_on``); what this rank then sees."""
    net = work.model()
    opt = _optimizer(net)
    weight = [float("inf")]
    got = shard_model(net, True, device=CPU, weight=lambda: weight[0], optimizer=opt)
    weight[0] = weights[rank]
    names = {id(p): n for n, p in net.named_parameters()}
    net(_inputs(rank, nan=rank == nan_on)).sum().backward()
    grads = {n: _full(p.grad) for n, p in net.named_parameters()}
    opt.step()
    return {
        "same": got is net,
        "units": sorted(n for n, m in net.named_modules() if isinstance(m, FSDPModule)),
        "local": {n: tuple(p.to_local().shape) for n, p in net.named_parameters()},
        "groups": [
            ([names.get(id(p), "not the model's") for p in g["params"]], g["lr"])
            for g in opt.param_groups
        ],
        "grads": grads,
        "weights": {n: _full(p) for n, p in net.named_parameters()},
        "joined": sharded_model._JOIN_GROUPS.get(net) is not None,
    }


def _expected_step(weights: list[float], nan_on: int | None) -> dict[str, Any]:
    """What one process computes: each rank's gradient weighed by its weight, summed (a rank
    of weight 0 adds nothing, even nan), and the SGD step of it."""
    grads: dict[str, torch.Tensor] = {}
    for rank, w in enumerate(weights):
        net = work.model()
        net(_inputs(rank, nan=rank == nan_on)).sum().backward()
        for name, param in net.named_parameters():
            assert param.grad is not None
            part = torch.zeros_like(param.grad) if w == 0.0 else w * param.grad
            grads[name] = grads[name] + part if name in grads else part
    stepped = {}
    for name, param in work.model().named_parameters():
        lr = 0.25 if name.startswith("embed.") else 0.5
        stepped[name] = param.detach() - lr * grads[name]
    return {"grads": grads, "weights": stepped}


def _assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype, name
        assert torch.equal(got[name], expected[name]), name


@pytest.mark.parametrize(
    ("weights", "nan_on"),
    [([0.25, 2.0], None), ([1.0, 0.5], None), ([1.0, 0.0], 1), ([0.0, 0.75], 0)],
    ids=["weighed", "one of weight 1", "rank 1 has no sample", "rank 0 has no sample"],
)
def test_two_ranks_take_the_step_of_their_gradients_each_weighed_by_its_rank_weight(
    other: OtherRank, weights: list[float], nan_on: int | None
) -> None:
    mine, theirs = _both(other, sharded_step, weights, nan_on)
    expected = _expected_step(weights, nan_on)
    for seen in (mine, theirs):
        _assert_equal(seen["grads"], expected["grads"])  # float64 sums, bitwise
        _assert_equal(seen["weights"], expected["weights"])


def test_sharding_makes_each_block_and_the_root_a_unit_of_half_the_rows_each(
    other: OtherRank,
) -> None:
    mine, theirs = _both(other, sharded_step, [1.0, 1.0], None)
    assert mine["same"]
    assert mine["units"] == UNITS
    assert mine["local"]["blocks.0.linear.weight"] == (4, 7)
    assert theirs["local"]["blocks.0.linear.weight"] == (3, 7)
    assert mine["local"]["head.weight"] == (1, 7)  # one row: rank 1 holds none of it
    assert theirs["local"]["head.weight"] == (0, 7)
    assert mine["joined"]  # gk.save and gk.load then meet in the group made while sharding
    assert theirs["joined"]


def test_the_optimizer_follows_the_sharded_parameters_in_its_own_groups_and_options(
    other: OtherRank,
) -> None:
    mine, theirs = _both(other, sharded_step, [1.0, 1.0], None)
    embed = ["embed.weight", "embed.bias"]
    rest = [n for n, _ in work.model().named_parameters() if n not in embed]
    assert mine["groups"] == [(embed, 0.25), (rest, 0.5)]
    assert theirs["groups"] == mine["groups"]


class _Tied(nn.Module):
    """An input embedding and an output head that is its own weight, around a stack."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(6, 4, dtype=torch.float64)
        self.blocks = nn.ModuleList(work.Block(4).double() for _ in range(2))
        self.head = nn.Linear(4, 6, bias=False, dtype=torch.float64)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tied_step(rank: int) -> dict[str, Any]:
    """Shard the tied model (its blocks: the embedding and the head stay in the root) with
    its optimizer and take one step: is the tie kept, in the model and in the optimizer?"""
    net = _Tied()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    shard_model(net, [work.Block], device=CPU, weight=lambda: 1.0, optimizer=opt)
    net(torch.tensor([[rank, 5 - rank]])).sum().backward()
    opt.step()
    params = opt.param_groups[0]["params"]
    return {
        "tied": net.head.weight is net.embed.weight,
        "optimized": [any(p is q for q in params) for p in net.parameters()],
        "count": len(params),
        "embed": _full(net.embed.weight),
    }


def test_tied_weights_stay_one_parameter_of_the_model_and_of_its_optimizer(
    other: OtherRank,
) -> None:
    mine, theirs = _both(other, tied_step)
    plain = _Tied()
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    for rank in (0, 1):
        plain(torch.tensor([[rank, 5 - rank]])).sum().backward()  # gradients add up
    opt.step()
    for seen in (mine, theirs):
        assert seen["tied"]
        assert seen["optimized"] == [True] * 5  # embed (= head), two blocks' weight and bias
        assert seen["count"] == 5
        assert torch.equal(seen["embed"], plain.embed.weight.detach())


def refusal(rank: int, kind: str) -> tuple[str, str, str | None]:
    """What shard_model says of an optimizer that holds state, or a parameter not the model's."""
    net = work.model()
    if kind == "state":
        opt: torch.optim.Optimizer = torch.optim.AdamW(net.parameters())
        net(_inputs(rank)).sum().backward()
        opt.step()
    else:
        opt = torch.optim.SGD([*net.parameters(), nn.Parameter(torch.zeros(2))], lr=0.1)
    return _error(lambda: shard_model(net, True, device=CPU, weight=lambda: 1.0, optimizer=opt))


def test_an_optimizer_that_holds_state_already_is_refused_on_every_rank(other: OtherRank) -> None:
    mine, theirs = _both(other, refusal, "state")
    message = (
        "prepare(..., shard=...) got an optimizer that holds state already; its moments "
        "belong to the whole parameters, which sharding replaces."
    )
    hint = (
        "Call prepare() with a fresh optimizer, then load the saved training state into the "
        "prepared model and optimizer."
    )
    assert mine == ("InvalidArgumentError", f"{message} {hint}", hint)
    assert theirs == mine


def test_an_optimizer_over_a_parameter_of_another_model_is_refused_counting_it(
    other: OtherRank,
) -> None:
    mine, theirs = _both(other, refusal, "foreign")
    message = (
        "the optimizer holds 1 parameter(s) that are not the model's, so sharding the model "
        "cannot move them."
    )
    hint = "Build the optimizer over model.parameters() of the model passed to prepare()."
    assert mine == ("InvalidArgumentError", f"{message} {hint}", hint)
    assert theirs == mine


def sharded_twice(rank: int) -> tuple[str, str, str | None]:
    net = shard(work.model(), device=CPU, weight=lambda: 1.0)
    return _error(lambda: shard(net, device=CPU, weight=lambda: 1.0))


def test_a_model_sharded_already_is_refused(other: OtherRank) -> None:
    mine, theirs = _both(other, sharded_twice)
    hint = "Shard a model once: pass the plain model to prepare(..., shard=...)."
    # fully_shard made the model's class FSDPStack
    assert mine == ("InvalidArgumentError", f"the Stack is sharded already. {hint}", hint)
    assert theirs == mine


def own_group(rank: int) -> dict[str, Any]:
    """Each rank shards its own model over a group of itself alone; one step's gradients."""
    groups = [tdist.new_group([0]), tdist.new_group([1])]  # every rank makes every group
    # The blocks only: the root unit holds the layers around them.
    net = shard(work.model(), [work.Block], device=CPU, weight=lambda: 0.5, group=groups[rank])
    net(_inputs(rank)).sum().backward()
    return {
        "mesh": {n: p.device_mesh.size() for n, p in net.named_parameters()},
        "local": {n: tuple(p.to_local().shape) for n, p in net.named_parameters()},
        "grads": {n: _full(p.grad) for n, p in net.named_parameters()},
        "joined": sharded_model._JOIN_GROUPS.get(net) is not None,
    }


def test_a_model_sharded_over_a_group_of_one_keeps_every_row_and_its_own_gradients(
    other: OtherRank,
) -> None:
    for rank, seen in enumerate(_both(other, own_group)):
        plain = work.model()
        plain(_inputs(rank)).sum().backward()
        assert set(seen["mesh"].values()) == {1}
        assert seen["local"] == {n: tuple(p.shape) for n, p in plain.named_parameters()}
        # A group of one reduces nothing: no other rank's gradient, and no weight either.
        _assert_equal(seen["grads"], {n: p.grad for n, p in plain.named_parameters()})
        assert not seen["joined"]  # not sharded over the whole job: gk.save makes its group


def precision(rank: int, dtype: torch.dtype | None) -> dict[str, Any]:
    """Each unit's mixed precision with ``param_dtype=dtype`` (the blocks sharded), and the
    output's dtype."""
    net = work.model().float()
    shard_model(net, [work.Block], device=CPU, weight=lambda: 1.0, param_dtype=dtype)
    policies = {
        n: m._get_fsdp_state()._mp_policy
        for n, m in net.named_modules()
        if isinstance(m, FSDPModule)
    }
    return {"policies": policies, "output": net(_inputs(rank).float()).dtype}


def test_a_compute_dtype_shards_every_unit_in_it_and_reduces_in_float32(other: OtherRank) -> None:
    mine, theirs = _both(other, precision, torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # The units of the policy: the blocks alone, and the root.
    assert mine["policies"] == dict.fromkeys(["", "blocks.0", "blocks.1", "blocks.2"], policy)
    assert mine["output"] == torch.bfloat16
    assert theirs == mine


def test_no_compute_dtype_keeps_the_parameters_own(other: OtherRank) -> None:
    mine, theirs = _both(other, precision, None)
    assert set(mine["policies"].values()) == {MixedPrecisionPolicy()}
    assert mine["output"] == torch.float32
    assert theirs == mine


def counted_reduce_scatter(rank: int) -> dict[str, Any]:
    """Shard with a reduce-scatter factory of one's own: how many were made, and used."""
    made: list[Any] = []

    class Counting(WeightedReduceScatter):
        calls = 0

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return super().__call__(*args, **kwargs)

    def factory() -> Counting:
        made.append(Counting(lambda: 1.0))
        return made[-1]

    net = work.model()
    shard_model(net, True, device=CPU, weight=lambda: 0.0, reduce_scatter=factory)
    net(_inputs(rank)).sum().backward()
    return {"made": len(made), "calls": [m.calls for m in made], "grad": _full(net.head.bias.grad)}


def test_a_reduce_scatter_factory_gives_each_unit_its_own_in_place_of_the_weighted_one(
    other: OtherRank,
) -> None:
    mine, theirs = _both(other, counted_reduce_scatter)
    assert mine["made"] == 6  # one per unit
    assert sorted(mine["calls"]) == [0] + [1] * 5  # the root holds no parameter of its own
    plain = [work.model(), work.model()]
    for rank in (0, 1):
        plain[rank](_inputs(rank)).sum().backward()
    summed = plain[0].head.bias.grad + plain[1].head.bias.grad  # type: ignore[operator]
    assert torch.equal(mine["grad"], summed)  # its weight of 1, not shard_model's 0
    assert theirs["made"] == 6
    assert torch.equal(theirs["grad"], summed)


# --- the weighted reduce-scatter, called as FSDP calls it ---------------------------------------


def reduce_scattered(
    rank: int, weights: list[float], own: bool, async_op: bool
) -> tuple[list[float], bool]:
    """Reduce-scatter ``[1, 2, nan, 4] * (rank + 1)`` with this rank's weight, over the whole
    group or (``own``) a group of this rank alone: this rank's output, and whether a Work
    came back."""
    groups = [tdist.new_group([0]), tdist.new_group([1])]
    group = groups[rank] if own else tdist.group.WORLD
    values = torch.tensor([1.0, 2.0, float("nan"), 4.0], dtype=torch.float64) * (rank + 1)
    out = torch.full((4 if own else 2,), -1.0, dtype=torch.float64)
    scatter = WeightedReduceScatter(lambda: weights[rank])
    if async_op:
        work_ = scatter(out, values, group, tdist.ReduceOp.AVG, async_op=True)
    else:  # as FSDP calls it: it waits for no Work
        work_ = scatter(out, values, group, tdist.ReduceOp.AVG)
    if work_ is not None:
        work_.wait()
    return out.tolist(), work_ is not None


def test_the_reduce_scatter_sums_each_ranks_weighed_input_and_zeroes_a_rank_of_weight_0(
    other: OtherRank,
) -> None:
    mine, theirs = _both(other, reduce_scattered, [3.0, 0.0], False, False)
    # Rank 1's nan, weighed by 0, is gone; the sum is taken though FSDP asked for an average.
    assert mine == ([3.0, 6.0], False)
    assert str(theirs) == str(([float("nan"), 12.0], False))


def test_the_reduce_scatter_hands_back_the_work_of_an_asynchronous_call(other: OtherRank) -> None:
    mine, theirs = _both(other, reduce_scattered, [1.0, 0.5], False, True)
    assert mine == ([2.0, 4.0], True)
    assert str(theirs) == str(([float("nan"), 8.0], True))


def test_the_reduce_scatter_sums_over_the_group_it_is_given(other: OtherRank) -> None:
    mine, theirs = _both(other, reduce_scattered, [2.0, 1.0], True, False)
    assert str(mine) == str(([2.0, 4.0, float("nan"), 8.0], False))
    assert str(theirs) == str(([2.0, 4.0, float("nan"), 8.0], False))


def test_plain_buffers_are_fresh_of_the_size_dtype_and_device_asked() -> None:
    buffers: PlainBuffers = WeightedReduceScatter(lambda: 1.0)
    first = buffers.allocate((3, 2), dtype=torch.float64, device=torch.device("meta"))
    assert (first.shape, first.dtype, first.device.type) == ((3, 2), torch.float64, "meta")
    a = buffers.allocate((5,), dtype=torch.float16, device=CPU)
    b = buffers.allocate((5,), dtype=torch.float16, device=CPU)
    assert (a.shape, a.dtype, a.device) == ((5,), torch.float16, CPU)
    assert a.data_ptr() != b.data_ptr()


def test_mixed_precision_computes_in_the_dtype_asked_and_reduces_in_float32() -> None:
    assert mixed_precision(torch.bfloat16) == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    assert mixed_precision(torch.float16).reduce_dtype == torch.float32
    assert mixed_precision(None) == MixedPrecisionPolicy()


# --- the sharded part of a training state ------------------------------------------------------


def _local(net: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """This rank's rows of every weight and (with ``opt``) of each moment, and AdamW's steps."""
    out = {n: p.detach().to_local().clone() for n, p in net.named_parameters()}
    for name, param in net.named_parameters() if opt is not None else ():
        for key, value in opt.state.get(param, {}).items():  # type: ignore[union-attr]
            value = value.to_local() if hasattr(value, "to_local") else value
            out[f"{name}.{key}"] = value.detach().clone()
    return out


def _prepared(lr: float = 0.01) -> tuple[nn.Module, torch.optim.Optimizer]:
    net = work.model()
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    shard_model(net, True, device=CPU, weight=lambda: 0.5, optimizer=opt)
    return net, opt


def _train(net: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        net(_inputs(rank)).sum().backward()
        opt.step()


def save_part(rank: int, folder: str) -> dict[str, Any]:
    """Take two AdamW steps sharded, write this rank's shards into ``folder``: what
    ``sharded_state`` gave before the first step and at the save, and the state saved."""
    net, opt = _prepared()
    alone = _sharded_part.sharded_state(net, None)
    fresh = _sharded_part.sharded_state(net, opt)
    untouched = len(opt.state)
    _train(net, opt, rank, 2)
    state = _sharded_part.sharded_state(net, opt)
    weight = state["model"]["blocks.0.linear.weight"]
    live = weight.to_local().data_ptr() == net.blocks[0].linear.weight.to_local().data_ptr()
    _sharded_part.write(Path(folder), state, tdist.group.WORLD)
    return {
        "alone": sorted(alone),
        "fresh": sorted(fresh),
        "untouched": untouched,
        "parts": sorted(state),
        "live": live,
        "saved": _local(net, opt),
    }


def read_part(rank: int, folder: str, with_optimizer: bool) -> dict[str, torch.Tensor]:
    """Read ``folder`` into a fresh sharded model (and optimizer): this rank's state."""
    net, opt = _prepared(lr=0.5)
    _sharded_part.read(Path(folder), net, opt if with_optimizer else None, tdist.group.WORLD)
    return _local(net, opt)


@pytest.fixture(scope="module")
def saved(other: OtherRank, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A sharded part both ranks wrote after two steps: its folder, what each rank saved."""
    folder = tmp_path_factory.mktemp("part") / "sharded"
    folder.mkdir()
    mine, theirs = _both(other, save_part, str(folder))
    return {"folder": folder, "ranks": [mine, theirs]}


def test_sharded_state_leaves_out_an_optimizer_without_state_and_takes_no_step_of_it(
    saved: dict[str, Any],
) -> None:
    for seen in saved["ranks"]:
        assert seen["alone"] == ["model"]
        assert seen["fresh"] == ["model"]
        assert seen["untouched"] == 0  # AdamW's step count is not made by saving
        assert seen["parts"] == ["model", "optimizer"]
        assert seen["live"]  # the shards themselves, not copies


def test_each_rank_writes_only_its_own_shards_and_rank_0_the_metadata(
    saved: dict[str, Any],
) -> None:
    folder = saved["folder"]
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    stored = open_dcp(folder).checked.storage_data
    chunks = {
        (i.fqn, tuple(i.offset)): info.relative_path
        for i, info in stored.items()
        if i.offset is not None  # a tensor's chunk, not plain data
    }
    assert chunks[("model.blocks.0.linear.weight", (0, 0))] == "__0_0.distcp"
    assert chunks[("model.blocks.0.linear.weight", (4, 0))] == "__1_0.distcp"
    assert chunks[("optimizer.state.blocks.0.linear.weight.exp_avg", (4, 0))] == "__1_0.distcp"


def test_a_sharded_part_reads_back_every_weight_and_moment_bitwise(
    other: OtherRank, saved: dict[str, Any]
) -> None:
    got = _both(other, read_part, str(saved["folder"]), True)
    for rank in (0, 1):
        _assert_equal(got[rank], saved["ranks"][rank]["saved"])


def test_a_sharded_part_read_without_the_optimizer_restores_the_weights_alone(
    other: OtherRank, saved: dict[str, Any]
) -> None:
    got = _both(other, read_part, str(saved["folder"]), False)
    for rank in (0, 1):
        weights = {n: t for n, t in saved["ranks"][rank]["saved"].items() if n in got[rank]}
        _assert_equal(got[rank], weights)  # no moment: the fresh optimizer holds none


def read_refused(
    rank: int, folders: list[str], width: int = 7, trained: bool = False
) -> tuple[Any, ...]:
    """Read ``folders[rank]`` into a sharded model of ``width`` (``trained`` a step first): the
    error, whether the model (and a trained optimizer) kept its own state, and how many
    parameters the optimizer holds a state of."""
    torch.manual_seed(0)
    net = work.Stack(width).double()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    shard_model(net, True, device=CPU, weight=lambda: 1.0, optimizer=opt)
    if trained:
        _train(net, opt, rank, 1)
    before = _local(net, opt if trained else None)
    error = _error(lambda: _sharded_part.read(Path(folders[rank]), net, opt, tdist.group.WORLD))
    after = _local(net, opt if trained else None)
    kept = list(before) == list(after) and all(torch.equal(before[n], after[n]) for n in before)
    return (*error, kept, len(opt.state))


def test_a_part_damaged_on_one_rank_is_refused_on_every_rank_before_loading(
    other: OtherRank, saved: dict[str, Any], tmp_path: Path
) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(saved["folder"], damaged)
    (damaged / "__1_0.distcp").unlink()
    good = str(saved["folder"])
    mine, theirs = _both(other, read_refused, [good, str(damaged)])
    hint = "Every rank must see the same save (a file system they share)."
    message = f"{good} cannot be read on another rank. {hint}"
    assert mine == ("CheckpointError", message, hint, True, 0)
    assert theirs[0] == "CheckpointError"
    assert theirs[1].startswith(f"{damaged / '__1_0.distcp'} is missing: ")
    assert theirs[3:] == (True, 0)


def test_a_shard_file_damaged_inside_fails_the_read_on_every_rank(
    other: OtherRank, saved: dict[str, Any], tmp_path: Path
) -> None:
    # The rows 4-6 of one weight, zeroed in place: the file's size is right (the check before
    # reading passes), only rank 1 reads those bytes, and both ranks learn of it in the read's
    # own group.
    damaged = tmp_path / "damaged"
    shutil.copytree(saved["folder"], damaged)
    stored = open_dcp(damaged).checked.storage_data
    chunk = next(
        info
        for index, info in stored.items()
        if index.fqn == "model.blocks.0.linear.weight" and tuple(index.offset) == (4, 0)
    )
    with open(damaged / chunk.relative_path, "r+b") as data:
        data.seek(chunk.offset)
        data.write(bytes(chunk.length))
    mine, theirs = _both(other, read_refused, [str(damaged), str(damaged)])
    assert mine[0] == "CheckpointError"
    assert mine[1].startswith(f"{damaged} cannot be read")
    assert mine[4] == 0  # the fresh optimizer still without state
    assert theirs[0] == "CheckpointError"


def test_a_part_of_another_model_is_refused_on_every_rank_before_loading(
    other: OtherRank, saved: dict[str, Any]
) -> None:
    folder = str(saved["folder"])
    mine, theirs = _both(other, read_refused, [folder, folder], 5)
    assert mine[0] == "CheckpointError"
    assert mine[1].startswith(f"{folder} does not fit the state it is loaded into: ")
    assert mine[3:] == (True, 0)  # the weights untouched, the fresh optimizer still without state
    assert theirs == mine


def test_a_refused_read_leaves_a_trained_optimizers_state_as_it_was(
    other: OtherRank, saved: dict[str, Any]
) -> None:
    folder = str(saved["folder"])
    mine, theirs = _both(other, read_refused, [folder, folder], 5, True)
    assert mine[1].startswith(f"{folder} does not fit the state it is loaded into: ")
    assert mine[3:] == (True, len(list(work.Stack(5).parameters())))  # weights and moments kept
    assert theirs == mine


def own_group_part(rank: int, folders: list[str]) -> dict[str, Any]:
    """Each rank shards its own model over a group of itself alone, writes it into
    ``folders[rank]`` meeting that group only, then reads it back (rank 1's folder damaged in
    between): its files, and what the read gave."""
    groups = [tdist.new_group([0]), tdist.new_group([1])]  # every rank makes every group

    def prepared() -> tuple[nn.Module, torch.optim.Optimizer]:
        net = shard(work.model(), [work.Block], device=CPU, weight=lambda: 1.0, group=groups[rank])
        return net, torch.optim.AdamW(net.parameters(), lr=0.01)

    folder = Path(folders[rank])
    net, opt = prepared()
    _train(net, opt, rank, 1)
    _sharded_part.write(folder, _sharded_part.sharded_state(net, opt), groups[rank])
    files = sorted(p.name for p in folder.iterdir())
    if rank == 1:
        (folder / "__0_0.distcp").unlink()  # a group of one: this rank is its rank 0
    saved = _local(net, opt)
    fresh, fresh_opt = prepared()
    error = _error(lambda: _sharded_part.read(folder, fresh, fresh_opt, groups[rank]))
    read = _local(fresh, fresh_opt)
    restored = list(read) == list(saved) and all(torch.equal(read[n], saved[n]) for n in saved)
    return {"files": files, "error": error[0], "restored": restored}


def test_a_part_is_written_and_read_in_the_group_given_and_no_other(
    other: OtherRank, tmp_path: Path
) -> None:
    # The saves' own gloo group, not the default group (NCCL on GPUs): a failure on a rank
    # outside the group given holds nobody back.
    folders = [tmp_path / "zero", tmp_path / "one"]
    for folder in folders:
        folder.mkdir()
    mine, theirs = _both(other, own_group_part, [str(f) for f in folders])
    assert mine == {
        "files": [".metadata", "__0_0.distcp"],
        "error": "no error",
        "restored": True,
    }
    assert theirs == {
        "files": [".metadata", "__0_0.distcp"],
        "error": "CheckpointError",
        "restored": False,
    }


def load_whole(
    rank: int, model_state: Any, optimizer_state: Any, lr: float, without: bool = False
) -> dict[str, Any]:
    """Put a whole state into a fresh sharded model and AdamW (of ``lr``; ``without``: into
    the model alone); this rank's rows of every weight and moment, its learning rate, and
    whether it holds state."""
    net, opt = _prepared(lr)
    _sharded_part.load_whole(net, None if without else opt, model_state, optimizer_state)
    return {"local": _local(net, opt), "lr": opt.param_groups[0]["lr"], "state": len(opt.state)}


def _rows(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s rows of each whole tensor (7 rows: 4 + 3; 1 row: 1 + 0)."""
    out = {}
    for name, value in tensors.items():
        if value.dim() == 0:
            out[name] = value
            continue
        cut = (value.shape[0] + 1) // 2
        out[name] = value[:cut] if rank == 0 else value[cut:]
    return out


def test_a_whole_state_of_one_process_loads_into_each_ranks_rows(other: OtherRank) -> None:
    net = work.model()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    _train(net, opt, 0, 2)
    whole = {n: p.detach() for n, p in net.named_parameters()}
    for name, param in net.named_parameters():
        for key, value in opt.state[param].items():
            whole[f"{name}.{key}"] = value
    got = _both(other, load_whole, net.state_dict(), opt.state_dict(), 0.5)
    for rank in (0, 1):
        _assert_equal(got[rank]["local"], _rows(whole, rank))
        assert got[rank]["lr"] == 0.01  # the saved options too


def test_a_whole_state_without_moments_gives_the_optimizer_its_options_alone(
    other: OtherRank,
) -> None:
    net = work.model()
    options = torch.optim.AdamW(net.parameters(), lr=0.03).state_dict()
    mine, theirs = _both(other, load_whole, net.state_dict(), options, 0.5)
    assert (mine["lr"], mine["state"]) == (0.03, 0)
    assert (theirs["lr"], theirs["state"]) == (0.03, 0)
    _assert_equal(mine["local"], _rows(dict(net.named_parameters()), 0))


def test_a_whole_state_without_the_optimizers_leaves_it_as_it_is(other: OtherRank) -> None:
    net = work.bumped(work.model())
    mine, theirs = _both(other, load_whole, net.state_dict(), None, 0.5)
    assert (mine["lr"], mine["state"]) == (0.5, 0)
    assert (theirs["lr"], theirs["state"]) == (0.5, 0)
    _assert_equal(theirs["local"], _rows(dict(net.named_parameters()), 1))


def test_a_whole_state_loads_into_a_sharded_model_without_an_optimizer(
    other: OtherRank,
) -> None:
    net = work.bumped(work.model())
    options = torch.optim.AdamW(net.parameters(), lr=0.03).state_dict()
    mine, theirs = _both(other, load_whole, net.state_dict(), options, 0.5, True)
    assert (mine["lr"], mine["state"]) == (0.5, 0)
    _assert_equal(mine["local"], _rows(dict(net.named_parameters()), 0))
    _assert_equal(theirs["local"], _rows(dict(net.named_parameters()), 1))


def whole_refused(rank: int, model_state: Any, optimizer_state: Any) -> tuple[Any, ...]:
    net, opt = _prepared()
    return _error(lambda: _sharded_part.load_whole(net, opt, model_state, optimizer_state))


def test_a_whole_optimizer_state_of_other_parameters_is_refused_on_every_rank(
    other: OtherRank,
) -> None:
    net = work.model()
    opt = torch.optim.AdamW(net.parameters())
    _train(net, opt, 0, 1)
    saved = opt.state_dict()
    saved["state"][10] = saved["state"][0]  # 10 parameters here: numbered 0 to 9
    mine, theirs = _both(other, whole_refused, net.state_dict(), saved)
    hint = "Resume with the optimizer the run saved (same parameters, same groups)."
    message = "The saved optimizer state does not fit this optimizer over 10 parameters."
    assert mine == ("CheckpointError", f"{message} {hint}", hint)
    assert theirs == mine


def _by_name_refusal(state: object, groups: object) -> str:
    net = nn.Linear(2, 2)
    extra = nn.Parameter(torch.zeros(1))  # the optimizer's, not the model's: it has no name
    opt = torch.optim.SGD([*net.parameters(), extra], lr=0.1)
    with pytest.raises(CheckpointError) as caught:
        _sharded_part._by_name({"state": state, "param_groups": groups}, opt, net)
    return str(caught.value)


@pytest.mark.parametrize(
    ("state", "groups"),
    [
        ({3: {}}, []),  # past the last parameter
        ({-1: {}}, []),
        ({True: {}}, []),  # a bool is not a parameter's number
        ({"0": {}}, []),
        ({2: {}}, []),  # the optimizer's parameter the model does not have
        ({}, [{"params": [0, 3]}]),
        ({}, [{"lr": 0.1}]),
        ({}, 7),
        ([], []),  # no mapping of numbers
    ],
)
def test_an_optimizer_state_whose_numbers_name_no_parameter_of_the_model_is_refused(
    state: object, groups: object
) -> None:
    assert _by_name_refusal(state, groups).startswith(
        "The saved optimizer state does not fit this optimizer over 3 parameters."
    )


def test_an_optimizer_state_by_number_is_given_the_parameters_names() -> None:
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    saved = {"state": {1: {"m": 5}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    named = _sharded_part._by_name(saved, opt, net)
    assert named == {
        "state": {"bias": {"m": 5}},
        "param_groups": [{"lr": 0.1, "params": ["weight", "bias"]}],
    }


class _OnDevice(nn.Module):
    """A model whose one parameter's local part lives on ``device`` (a stand-in: no GPU here)."""

    def __init__(self, device: str, sharded: bool) -> None:
        super().__init__()
        local = SimpleNamespace(device=torch.device(device))
        self.fake = SimpleNamespace(to_local=lambda: local) if sharded else local

    def parameters(self, recurse: bool = True) -> Iterator[Any]:  # type: ignore[override]
        yield self.fake


@pytest.mark.parametrize(
    ("model", "on_gpu"),
    [
        (nn.Linear(2, 2), False),
        (nn.Sequential(), False),  # no parameter at all
        (_OnDevice("cpu", sharded=True), False),
        (_OnDevice("cuda", sharded=True), True),
        (_OnDevice("cuda", sharded=False), True),
    ],
    ids=["cpu", "no parameter", "cpu shards", "gpu shards", "gpu"],
)
def test_the_stager_pins_host_memory_and_copies_without_waiting_for_a_gpu_model_only(
    model: nn.Module, on_gpu: bool
) -> None:
    with mock.patch("torch.distributed.checkpoint.staging.DefaultStager") as made:
        _sharded_part.stager(model)
    (options,), _ = made.call_args
    assert options.use_pinned_memory is on_gpu
    assert options.use_non_blocking_copy is on_gpu
    assert options.use_shared_memory is False
    assert options.use_async_staging is False  # save() returns once the copy is made


def test_the_stager_of_a_cpu_model_copies_each_shard_into_host_memory() -> None:
    tensor = torch.arange(4.0)
    staged = _sharded_part.stager(nn.Linear(2, 2)).stage({"w": tensor})
    assert torch.equal(staged["w"], tensor)
    tensor.add_(1.0)
    assert torch.equal(staged["w"], torch.arange(4.0))  # a copy, made before stage() returned
