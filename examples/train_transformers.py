"""A Hugging Face causal language model trained under gpukit, then opened with from_pretrained.

    python examples/train_transformers.py --small
    gpukit run --ddp -n 2 -- python examples/train_transformers.py --shard

The loss of each micro-batch is its mean over its real tokens, and ``dist.step(loss,
count=tokens)`` weighs it by them: the step's gradient is the mean over every real token of the
global batch, however many processes and micro-batches it is cut into. The model here is a
GPT-2 built from a config (nothing is downloaded); use ``AutoModelForCausalLM.from_pretrained``
for yours. The end of an epoch can leave a process no sequence: ``stand_in=True`` gives it one
weighed 0, since a transformers model cannot run on a batch of 0 rows. At the end the weights
are exported in Hugging Face's layout, with the config, and reopened with ``from_pretrained``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, GPT2Config

import gpukit as gk
from gpukit import distributed as dist


class Sequences(Dataset[dict[str, torch.Tensor]]):
    """Random token sequences of uneven lengths, padded on the right: replace with a tokenized
    corpus."""

    def __init__(self, count: int, length: int, vocab: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (count, length), generator=gen)
        self.lengths = torch.randint(2, length + 1, (count,), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        real = torch.arange(self.ids.shape[1]) < self.lengths[index]
        ids = self.ids[index].masked_fill(~real, 0)
        return {
            "input_ids": ids,
            "attention_mask": real.long(),
            "labels": ids.masked_fill(~real, -100),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/gpt2", help="the run's folder")
    parser.add_argument("--shard", action="store_true", help="FSDP2, one unit per block")
    parser.add_argument("--small", action="store_true", help="a short run with small sizes")
    args = parser.parse_args()
    width, layers, count, epochs = (32, 2, 50, 2) if args.small else (256, 6, 5_000, 3)
    out = Path(args.out)

    dist.init()
    gk.seed_everything(0)
    config = GPT2Config(
        vocab_size=512,
        n_positions=64,
        n_embd=width,
        n_layer=layers,
        n_head=4,
        pad_token_id=0,
        bos_token_id=511,
        eos_token_id=511,
    )
    model = AutoModelForCausalLM.from_config(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Sequences(count, 64, config.vocab_size), shuffle=True)
    blocks = [type(model.transformer.h[0])] if args.shard else False
    model, opt, loader = dist.prepare(
        model, opt, loader, global_batch_size=16, accumulate=2, precision="auto",
        shard=blocks, stand_in=True,
    )  # fmt: skip

    state = gk.TrainingState(out / "state", model=model, optimizer=opt, loader=loader)
    with state, gk.train.Preemption() as preemption:
        state.resume()
        for epoch in range(loader.epoch, epochs):
            for batch in loader:
                loss = model(**batch).loss  # the mean over this micro-batch's real tokens
                tokens = (batch["labels"][:, 1:] != -100).sum()  # what it averages over
                if dist.step(loss, count=tokens) and state.step % 5 == 0:
                    dist.print_main(f"epoch {epoch} step {state.step}: loss {loss.item():.3f}")
                if preemption.should_stop():
                    preemption.stop(state)
            state.save()

    export = out / "hf"
    if args.shard or dist.is_main():  # a sharded model is gathered by every rank
        gk.save(model, export, max_shard_size="5GB")
    if dist.is_main():
        config.save_pretrained(export)
        reopened = AutoModelForCausalLM.from_pretrained(export)
        print(f"exported to {export}; from_pretrained has {reopened.num_parameters()} parameters")


if __name__ == "__main__":
    main()
