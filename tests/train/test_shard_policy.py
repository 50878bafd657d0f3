"""Which modules prepare(..., shard=...) makes FSDP units, decided without a process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpukit.errors import InvalidArgumentError
from gpukit.train.shard import blocks_to_shard, repeated_blocks, shard_model
from tests.train.shard_workloads import Block, Stack


class Attention(nn.Module):
    """A block whose own projections are siblings of one class: they are not blocks of the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(Attention() for _ in range(3))
        self.norm = nn.LayerNorm(4)


def _names(model: nn.Module, chosen: list[nn.Module]) -> list[str]:
    by_id = {id(m): name for name, m in model.named_modules()}
    return [by_id[id(m)] for m in chosen]


def test_the_default_policy_shards_each_layer_of_a_stack_not_the_projections_inside_it() -> None:
    model = Transformer()
    assert _names(model, repeated_blocks(model)) == ["layers.0", "layers.1", "layers.2"]


def test_the_default_policy_skips_repeated_modules_without_parameters() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Tanh(), nn.Linear(3, 1))
    assert _names(model, repeated_blocks(model)) == ["0", "3"]


def test_a_class_policy_names_every_module_of_that_class_innermost_first() -> None:
    model = Stack()
    assert _names(model, blocks_to_shard(model, [Block])) == ["blocks.2", "blocks.1", "blocks.0"]


def test_a_policy_may_nest_a_block_inside_a_block_inner_one_first() -> None:
    model = Stack()
    chosen = _names(model, blocks_to_shard(model, (Block, nn.Linear)))
    assert chosen.index("blocks.0.linear") < chosen.index("blocks.0")


def test_a_function_policy_is_asked_about_each_submodule_but_never_the_root() -> None:
    model = Stack()
    asked: list[str] = []

    def policy(module: nn.Module) -> bool:
        asked.append(type(module).__name__)
        return isinstance(module, Block)

    assert _names(model, blocks_to_shard(model, policy)) == ["blocks.2", "blocks.1", "blocks.0"]
    assert "Stack" not in asked


@pytest.mark.parametrize("policy", ["yes", 3, [], [Block, "Linear"], nn.Linear(1, 1)])
def test_a_policy_that_is_neither_classes_nor_a_function_is_refused_with_the_choices(
    policy: object,
) -> None:
    with pytest.raises(InvalidArgumentError, match="is not a sharding policy") as caught:
        blocks_to_shard(Stack(), policy)  # type: ignore[arg-type]
    assert "shard=True" in caught.value.hint


def test_one_process_keeps_its_model_and_optimizer_as_they_are() -> None:
    model = Stack()
    opt = torch.optim.AdamW(model.parameters())
    before = [id(p) for p in model.parameters()]
    got = shard_model(model, True, device=torch.device("cpu"), weight=lambda: 1.0, optimizer=opt)
    assert got is model
    assert [id(p) for p in opt.param_groups[0]["params"]] == before


def test_one_process_still_refuses_a_bad_policy() -> None:
    with pytest.raises(InvalidArgumentError):
        shard_model(Stack(), "blocks", device=torch.device("cpu"), weight=lambda: 1.0)  # type: ignore[arg-type]


class TiedLanguageModel(nn.Module):
    """An embedding, layers, and an output head that is the embedding's own weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(Attention() for _ in range(2))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def _shard(model: nn.Module, policy: object) -> nn.Module:
    return shard_model(model, policy, device=torch.device("cpu"), weight=lambda: 1.0)  # type: ignore[arg-type]


def test_a_policy_that_splits_tied_weights_over_two_units_is_refused_naming_them() -> None:
    # FSDP2 would give each unit its own sharded copy: the head and the embedding trained apart.
    with pytest.raises(
        InvalidArgumentError, match=r"head\.weight = embed\.weight|embed\.weight = head\.weight"
    ) as raised:
        _shard(TiedLanguageModel(), [Attention, nn.Linear])
    assert "root unit" in raised.value.hint
    with pytest.raises(InvalidArgumentError, match="tied parameter"):
        _shard(TiedLanguageModel(), [nn.Embedding])


def test_tied_weights_in_one_unit_are_accepted() -> None:
    model = TiedLanguageModel()
    assert _shard(model, [Attention]) is model  # the embedding and the head stay in the root
    assert model.head.weight is model.embed.weight
    both = nn.Sequential(TiedLanguageModel())
    assert _shard(both, [TiedLanguageModel]) is both  # both inside one unit of their own


def test_a_weight_two_sibling_blocks_share_is_refused() -> None:
    model = Transformer()
    model.layers[1].q.weight = model.layers[0].q.weight
    with pytest.raises(InvalidArgumentError, match=r"layers\.0\.q\.weight = layers\.1\.q\.weight"):
        _shard(model, True)


def test_one_module_class_names_every_module_of_that_class() -> None:
    model = Stack()
    assert _names(model, blocks_to_shard(model, Block)) == ["blocks.2", "blocks.1", "blocks.0"]


@pytest.mark.parametrize("policy", [int, [int], "Block"])
def test_a_class_that_is_no_module_is_refused_with_the_whole_message_and_hint(
    policy: object,
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        blocks_to_shard(Stack(), policy)  # type: ignore[arg-type]
    assert caught.value.args[0].startswith(f"shard={policy!r} is not a sharding policy. ")
    assert caught.value.hint == (
        "Pass shard=True (each repeated block), a module class or a list of classes "
        "(shard=[Block]), or a function that takes a module and returns True to shard it."
    )


def test_tied_weights_over_two_units_are_refused_with_the_whole_message_and_hint() -> None:
    hint = (
        "Leave the module that shares it out of shard= (a language model's head and its input "
        "embedding can both stay in the root unit), or untie them."
    )
    message = (
        "shard= puts the tied parameter embed.weight = head.weight into two sharded units, "
        "which would train it as two parameters."
    )
    with pytest.raises(InvalidArgumentError) as raised:
        _shard(TiedLanguageModel(), [nn.Embedding])
    assert str(raised.value) == f"{message} {hint}"
    assert raised.value.hint == hint
