"""Random streams keyed by the data, never by the rank.

Before it hands out a micro-batch, a prepared loader seeds the torch stream of its device (and
the CPU's) from ``(seed, epoch, position)``, where ``position`` is the place of the
micro-batch's first sample in the epoch's order. Dropout, stochastic depth and any noise the
forward draws then depend on which samples the micro-batch holds, not on which process computes
it: no two micro-batches of a step share a mask (with one seed per process, every rank drew rank
0's masks), a resumed run draws what the uninterrupted one drew, and in exact mode the masks are
the same for every number of processes.

A dataset that draws per sample (augmentation) takes its stream from
:func:`sample_generator`, keyed by the sample's index and the epoch: the same draw in a loader
worker or in the main process, on any rank and for any number of processes. A dataset with a
``set_epoch(epoch)`` method is told the epoch before each pass, as torch's samplers are.

Seeding a ``torch.Generator`` costs microseconds; ``torch.manual_seed`` seeds every CUDA device
of the machine and is avoided here.
"""

from __future__ import annotations

import hashlib

import torch

from gpukit.distributed.position import checked_epoch, checked_seed
from gpukit.errors import InvalidArgumentError

__all__ = ["micro_batch_seed", "sample_generator", "seed_micro_batch"]


def _key(kind: str, seed: int, epoch: int, where: int) -> int:
    digest = hashlib.blake2b(f"{kind}:{seed}:{epoch}:{where}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def micro_batch_seed(seed: int, epoch: int, position: int) -> int:
    """The seed of the micro-batch whose first sample is ``position`` in ``epoch``'s order.

    >>> micro_batch_seed(0, 0, 8) == micro_batch_seed(0, 0, 8) != micro_batch_seed(0, 0, 16)
    True

    Args:
        seed: the loader's seed.
        epoch: the epoch.
        position: where the micro-batch starts in the epoch's order of samples.
    """
    return _key("micro-batch", seed, epoch, position)


def seed_micro_batch(device: torch.device, seed: int, epoch: int, position: int) -> None:
    """Seed the torch stream of ``device`` (and the CPU's) for one micro-batch.

    Args:
        device: the device the micro-batch is computed on.
        seed: the loader's seed.
        epoch: the epoch.
        position: where the micro-batch starts in the epoch's order of samples.
    """
    value = micro_batch_seed(seed, epoch, position)
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(value)


def sample_generator(index: int, *, epoch: int, seed: int = 0) -> torch.Generator:
    """A CPU generator for the random draws of one sample (its augmentation, its noise).

    The same ``(index, epoch, seed)`` gives the same stream in any process, worker or run, so a
    sample is augmented alike for any number of processes and after a resume::

        class Crops(Dataset):
            def set_epoch(self, epoch):  # a prepared loader calls it before each pass
                self.epoch = epoch

            def __getitem__(self, i):
                gen = gk.distributed.sample_generator(i, epoch=self.epoch)
                return random_crop(self.images[i], generator=gen)

    Args:
        index: the sample's index in the dataset, 0 or more.
        epoch: the epoch, 0 to 2**63 - 1.
        seed: a seed of your own, 0 to 2**63 - 1 (0 by default).

    Raises:
        InvalidArgumentError: a value is not a whole number in its range.
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise InvalidArgumentError(
            f"sample_generator got index={index!r}, which is not a sample's index.",
            hint="Pass the index __getitem__ received, a whole number from 0.",
        )
    generator = torch.Generator()
    generator.manual_seed(_key("sample", checked_seed(seed), checked_epoch(epoch), index))
    return generator
