"""The one training loop: resumable, preemptible, accumulating, in mixed precision.

    python examples/train_loop.py                        # one process: CPU, or the first GPU
    gpukit run --ddp -n 4 -- python examples/train_loop.py  # four processes, one GPU each
    torchrun --nproc-per-node 4 examples/train_loop.py      # the same, through torchrun

Run it again and it resumes from the newest intact save in ``--out``; stop it with SIGTERM,
SIGINT or SIGUSR1 (Slurm's ``--signal=USR1@90``) and it saves at the end of the optimizer step
and exits 75 (asking Slurm to requeue the job when it runs under one). ``--small`` is a
minute-long run on a laptop CPU. Copy this file and replace the model and the data.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk
from gpukit import distributed as dist


def dataset(samples: int) -> TensorDataset:
    """Noisy points of a 16-dimensional linear function: replace with your own data."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=gen)
    y = x @ torch.linspace(-1, 1, 16).unsqueeze(1) + 0.1 * torch.randn(samples, 1, generator=gen)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/loop", help="the training state's folder")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="a short run with small sizes")
    args = parser.parse_args()
    samples, epochs, every = (1_000, 3, 10) if args.small else (100_000, args.epochs, 100)

    dist.init()
    gk.seed_everything(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * samples // 64)
    loader = DataLoader(dataset(samples), shuffle=True)
    model, opt, loader = dist.prepare(
        model, opt, loader, global_batch_size=64, accumulate=2, precision="auto", seed=0
    )

    state = gk.TrainingState(
        args.out, model=model, optimizer=opt, scheduler=sched, loader=loader, keep=2
    )
    with state, gk.train.Preemption() as preemption:
        resumed = state.resume()
        if resumed is not None:
            dist.print_main(f"resumed from {resumed.path.name} (step {resumed.step})")
        for epoch in range(loader.epoch, epochs):
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                result = dist.step(loss, clip_grad_norm=1.0)
                if result:  # the optimizer stepped
                    sched.step()
                    if state.step % every == 0:
                        dist.print_main(
                            f"epoch {epoch} step {state.step}: loss {loss.item():.4f}, "
                            f"grad norm {result.grad_norm.item():.3f}",
                            flush=True,
                        )
                if preemption.should_stop():  # every rank, after every batch
                    preemption.stop(state)  # save, wait for it, requeue, exit 75
            state.save()  # every rank, at the end of each epoch
    dist.print_main(f"done: {state.step} steps, precision {loader.precision.name}")


if __name__ == "__main__":
    main()
