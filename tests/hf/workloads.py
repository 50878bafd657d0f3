"""A Hugging Face causal language model trained under gpukit: jobs for one or two processes.

Module level, so that rank 1 of ``tests/helpers/two_processes.py`` can import them. The model
is a GPT-2 built from a small config with tied input and output embeddings, random weights
(nothing is downloaded), in float64 so that a sum in another order shows as at most ~1e-15. The
data are token sequences of uneven lengths padded on the right (labels ``-100``), 25 of them
in global batches of 8: each step holds another number of real tokens, and the last step holds
one sequence: a second process, or exact mode's other micro-batches, get a stand-in there
(``stand_in=True``: the model cannot run on 0 rows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import gpukit as gk
from gpukit import distributed as dist

SEQUENCES = 25
LENGTH = 12
VOCAB = 48
GLOBAL_BATCH = 8
EPOCHS = 2
STOP = 3
"""Optimizer steps an interrupted run takes before it saves (inside the first epoch)."""

Weights = dict[str, torch.Tensor]


TOLERANCE = 1e-12
"""float64: one process on the whole batch and micro-batches summed in another order differ
by rounding alone, ~1e-14 after the run's AdamW steps."""


def furthest(got: Weights, want: Weights) -> float:
    """The largest difference between two runs' weights (the same names in both)."""
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)


def equal(got: Weights, want: Weights) -> bool:
    """Whether two runs' weights are bitwise the same."""
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def config(dropout: float = 0.0) -> GPT2Config:
    """Two blocks, tied embeddings; float64 throughout (Llama's norms and eager softmax compute
    in float32 whatever the model's dtype, which would blur a 1e-12 comparison)."""
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )


def model(dropout: float = 0.0) -> GPT2LMHeadModel:
    """The same float64 model in every process (seeded before it is built), built as
    from_pretrained builds it."""
    torch.manual_seed(0)
    net: GPT2LMHeadModel = AutoModelForCausalLM.from_config(config(dropout), dtype=torch.float64)
    return net


class Sequences(Dataset[dict[str, torch.Tensor]]):
    """Token sequences of 2 to LENGTH real tokens, padded with 0 on the right."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(5)
        self.ids = torch.randint(1, VOCAB, (SEQUENCES, LENGTH), generator=gen)
        self.lengths = torch.randint(2, LENGTH + 1, (SEQUENCES,), generator=gen)

    def __len__(self) -> int:
        return SEQUENCES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        real = torch.arange(LENGTH) < self.lengths[index]
        ids = self.ids[index].masked_fill(~real, 0)
        return {
            "input_ids": ids,
            "attention_mask": real.long(),
            "labels": ids.masked_fill(~real, -100),
        }


def loss_of(net: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean next-token loss over the batch's real tokens, in the model's dtype.

    transformers computes ``.loss`` in float32 whatever the model's dtype (it upcasts the
    logits), which leaves micro-batch sums ~1e-8 apart: the float64 tests compute it here.
    """
    logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100
    )


def tokens(labels: torch.Tensor) -> torch.Tensor:
    """The tokens a causal LM's loss averages over: labels shifted by one, padding left out."""
    return (labels[:, 1:] != -100).sum()


def optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)


def full_weights(net: torch.nn.Module) -> Weights:
    """Every parameter, whole (gathered where sharded), on the CPU."""
    out: Weights = {}
    for name, param in net.named_parameters():
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out[name.removeprefix("module.")] = tensor.cpu().clone()  # DDP's prefix
    return out


def reference(
    hf_loss: bool = False, net: torch.nn.Module | None = None, epochs: int = EPOCHS
) -> Weights:
    """One plain process, no gpukit: each global batch whole, its loss the mean over every
    real token of the batch (what transformers' loss gives for the batch at once).

    ``net``: the model to start from (a fresh one by default)."""
    net = model() if net is None else net
    opt = optimizer(net)
    for _ in range(epochs):
        for batch in DataLoader(Sequences(), batch_size=GLOBAL_BATCH):
            opt.zero_grad()
            (net(**batch).loss if hf_loss else loss_of(net, batch)).backward()
            opt.step()
    return full_weights(net)


def prepared(
    accumulate: int = 2, shard: Any = False, exact: bool = False, dropout: float = 0.0
) -> tuple[Any, ...]:
    """The model, its optimizer and the loader after dist.prepare."""
    net = model(dropout)
    opt = optimizer(net)
    loader = DataLoader(Sequences(), batch_size=GLOBAL_BATCH)
    if exact:
        return dist.prepare(
            net,
            opt,
            loader,
            exact=True,
            global_batch_size=GLOBAL_BATCH,
            micro_batch_size=2,
            stand_in=True,
        )
    return dist.prepare(
        net,
        opt,
        loader,
        global_batch_size=GLOBAL_BATCH,
        accumulate=accumulate,
        shard=shard,
        stand_in=True,
    )


def train(
    _rank: int = 0,
    accumulate: int = 2,
    shard: Any = False,
    count: bool = True,
    exact: bool = False,
    hf_loss: bool = False,
    dropout: float = 0.0,
) -> Weights:
    """Train under gpukit; ``count=False`` weighs micro-batches by samples, not tokens;
    ``hf_loss`` takes the model's own ``.loss``."""
    net, _, loader = prepared(accumulate, shard, exact, dropout)
    for _ in range(EPOCHS):
        for batch in loader:
            loss = net(**batch).loss if hf_loss else loss_of(net, batch)
            dist.step(loss, count=tokens(batch["labels"]) if count else None)
    return full_weights(net)


def tied_after_prepare(_rank: int = 0) -> bool:
    """Whether the output layer is still the input embedding after prepare(shard=...)."""
    net, _, _ = prepared(shard=[GPT2Block])
    return net.lm_head.weight is net.transformer.wte.weight


def train_with_state(_rank: int, folder: str, shard: Any = False) -> Weights:
    """A run stops after STOP steps and a save; a new run resumes it and finishes."""

    def run(stop: int | None) -> Weights:
        net, opt, loader = prepared(shard=shard)
        with gk.TrainingState(
            folder, model=net, optimizer=opt, loader=loader, asynchronous=False
        ) as state:
            state.resume()
            for _ in range(loader.epoch, EPOCHS):
                for batch in loader:
                    stepped = dist.step(loss_of(net, batch), count=tokens(batch["labels"]))
                    if stepped and state.step == stop:
                        state.save()
                        return full_weights(net)  # a job that ran out of time
        return full_weights(net)

    run(STOP)  # a job that ran out of time after its save
    return run(None)


def fixed_input() -> dict[str, torch.Tensor]:
    """Two sequences, one with padding: the input whose logits the export must keep."""
    batch = [Sequences()[i] for i in (0, 1)]
    return {key: torch.stack([b[key] for b in batch]) for key in ("input_ids", "attention_mask")}


def logits(net: torch.nn.Module) -> torch.Tensor:
    """The logits of the fixed input, on the CPU (a sharded model's forward is collective)."""
    with torch.no_grad():
        return net(**fixed_input()).logits.detach().cpu()


def train_and_export(_rank: int, folder: str, shard: Any = False) -> torch.Tensor:
    """Train, then export to a Hugging Face folder (gk.save plus the config); the logits."""
    net, _, loader = prepared(shard=shard)
    for batch in loader:
        dist.step(loss_of(net, batch), count=tokens(batch["labels"]))
    # Hugging Face's layout: max_shard_size gathers a sharded model tensor by tensor, a
    # collective every rank joins; a copied model is saved by rank 0 alone.
    if shard is not False or dist.is_main():
        gk.save(net, folder, max_shard_size="5GB")
    if dist.is_main():
        config().save_pretrained(folder)
    dist.barrier()
    return logits(net)


def from_pretrained(folder: str | Path) -> GPT2LMHeadModel:
    """What a Hugging Face user runs next on the folder."""
    net = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float64)
    return net.eval()


def train_on(_rank: int, folder: str) -> Weights:
    """A model loaded with from_pretrained trains on under gpukit, accumulating tokens."""
    net = from_pretrained(folder).train()
    opt = optimizer(net)
    loader = DataLoader(Sequences(), batch_size=GLOBAL_BATCH)
    net, opt, loader = dist.prepare(
        net, opt, loader, global_batch_size=GLOBAL_BATCH, accumulate=2, stand_in=True
    )
    for batch in loader:
        dist.step(loss_of(net, batch), count=tokens(batch["labels"]))
    return full_weights(net)


def train_exact_float32(precision: str) -> tuple[Weights, str]:
    """Exact mode with dropout, the model in float32 under ``precision`` (on a GPU where there
    is one): the final weights and the device they were trained on."""
    net = model(dropout=0.1).float()
    opt = optimizer(net)
    loader = DataLoader(Sequences(), batch_size=GLOBAL_BATCH)
    net, opt, loader = dist.prepare(
        net, opt, loader, exact=True, global_batch_size=GLOBAL_BATCH, micro_batch_size=2,
        precision=precision, stand_in=True,
    )  # fmt: skip
    for _ in range(EPOCHS):
        for batch in loader:
            dist.step(net(**batch).loss, count=tokens(batch["labels"]))
    return full_weights(net), next(net.parameters()).device.type
