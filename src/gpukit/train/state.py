"""The training state: all a run needs to continue, saved crash-consistently, resumed exactly.

>>> import torch, tempfile, gpukit as gk
>>> model = torch.nn.Linear(2, 1)
>>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
>>> folder = tempfile.mkdtemp()
>>> with gk.TrainingState(folder, model=model, optimizer=optimizer) as state:
...     resumed = state.resume()          # None: nothing saved yet
...     for _ in range(3):
...         model(torch.ones(1, 2)).sum().backward()
...         optimizer.step()              # counted: state.step is the optimizer's steps
...     saved = state.save()              # blocks only while the state is copied to memory
>>> resumed is None, state.step, saved.name.startswith("step-000000003-")
(True, 3, True)

What is gathered, each by duck type (anything with ``state_dict``/``load_state_dict``): the model
(unwrapped from DDP, DataParallel or ``torch.compile``, so a save resumes in any of them), the
optimizer, an LR scheduler, a gradient scaler, the loader (gpukit's ``DistributedLoader`` keeps
its epoch and its position inside the epoch), the training step (``gk.train.TrainStep``: the
fp16 scaler, the accumulation's place), user extras (stateful objects or plain data), the step
counter, and every rank's random streams.

``state.step`` counts the optimizer's steps (not micro-batches) by itself when the state has an
optimizer: each ``optimizer.step()`` that runs adds one, in a plain loop, under
``dist.step(loss)`` or a ``TrainStep``, and an fp16 step the scaler skips adds none. A run
without an optimizer counts by hand: ``state.step += 1``.

Rank 0 writes what every rank holds alike (the DDP replicas are identical), each rank writes its
own random streams; a model sharded with FSDP2 is saved by every rank writing only its own
shards of the weights and the optimizer's moments (a DCP checkpoint,
:mod:`gpukit.train._sharded_part`), so no rank ever holds the whole model. A save is complete
only when rank 0 has marked it after all ranks' parts are on disk (see
:mod:`gpukit.train.saves`). With ``asynchronous=True`` (the default) ``save`` copies the state
to host memory and returns; a background thread writes it, and the next ``save``, ``resume``,
``wait`` or ``close`` waits for it first.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import secrets
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpukit.train._sharded_part as _sharded_part
import gpukit.train.rng as rng
import gpukit.train.saves as saves
from gpukit import _tree
from gpukit._agree import from_rank_0, gathered
from gpukit.checkpoint.dtensor import is_sharded
from gpukit.checkpoint.keys import unwrap
from gpukit.errors import CheckpointError, GpukitError, InvalidArgumentError, check_bool
from gpukit.train._staging import Stager, check_plain, is_stateful
from gpukit.train._writing import SaveJob
from gpukit.train.contents import check_optimizer_state, check_scheduler_state
from gpukit.untrusted import InvalidInput

__all__ = ["Resumed", "TrainingState"]

log = logging.getLogger("gpukit.train")

# The parts gathered by name, besides the model; each is optional.
_SLOTS = ("optimizer", "scheduler", "scaler", "loader", "train_step")
# Saves made before the training step's part had its name hold it under this one.
_FORMER_TRAIN_STEP = "accumulation"
_MAX_STEP = (1 << 63) - 1


@dataclass(frozen=True)
class Resumed:
    """Which save a run resumed from, and what it held besides the stateful objects.

    Args:
        path: the save's folder (``<folder>/step-<step>-...``).
        step: the step the save was made at, which :attr:`TrainingState.step` now holds.
        world_size: how many processes wrote the save.
        passed_over: the saves found and not taken, one line each saying why.
    """

    path: Path
    step: int
    world_size: int
    """How many processes wrote the save (this run may have another number)."""
    passed_over: list[str] = field(default_factory=list)
    """The saves found and not taken, one line each saying why: newer ones incomplete or
    damaged (a digest that does not match, a file cut short), and saves of any age that are
    not this user's or have no readable marker."""


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class TrainingState:
    """The state of a run in ``folder``: :meth:`save` it at any step, :meth:`resume` it exactly.

    Every rank of a job builds it with its own objects and calls :meth:`save` at the same steps
    (a save is a meeting of all ranks) and :meth:`resume` once, before training. ``keep``
    complete saves are kept; older ones are removed only once a newer one is complete.

    ``train_step`` is the :class:`~gpukit.train.step.TrainStep` (its fp16 scaler and the
    accumulation's place); a prepared loader's (``loader.train_step``) is taken by default.
    ``extras`` are saved once, by rank 0, so they must be alike on every rank (a warning names
    those that differ at a save); what differs per rank goes in ``rank_extras``, saved by each
    rank. ``asynchronous`` makes :meth:`save` return once the state is copied to host memory.

    Args:
        folder: the folder the saves go in (created at the first save); yours, or root's.
        model: the model being trained, wrapped (DDP, FSDP2, DataParallel) or not.
        optimizer: its optimizer, or None.
        scheduler: its learning-rate scheduler, or None.
        scaler: a gradient scaler of your own (prepare's is in the training step), or None.
        loader: the loader (a prepared one resumes mid-epoch), or None.
        train_step: the training step; None: ``loader.train_step`` when the loader has one.
        extras: more objects or plain data, alike on every rank, saved once by rank 0.
        rank_extras: objects or plain data of each rank's own, saved by each rank.
        keep: how many complete saves to keep, 1 or more (2 by default).
        asynchronous: whether :meth:`save` returns once the state is in host memory (True).

    Raises:
        InvalidArgumentError: a part lacks ``state_dict``/``load_state_dict``, an extra is
            neither stateful nor plain data, ``keep`` is not a positive whole number, or
            ``asynchronous`` is not True or False.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        model: nn.Module,
        optimizer: Any = None,
        scheduler: Any = None,
        scaler: Any = None,
        loader: Any = None,
        train_step: Any = None,
        extras: Mapping[str, Any] | None = None,
        rank_extras: Mapping[str, Any] | None = None,
        keep: int = 2,
        asynchronous: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(
                f"TrainingState got model={type(model).__name__}, not a torch.nn.Module.",
                hint="Pass the model being trained (wrapped in DDP or not).",
            )
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidArgumentError(
                f"keep={keep!r} is not a number of saves to keep.",
                hint="Pass a whole number >= 1 (2 keeps one save to fall back on).",
            )
        check_bool("asynchronous", asynchronous)
        self.folder = Path(folder)
        self.model = model
        self.parts: dict[str, Any] = {}
        if train_step is None:
            # A prepared loader carries the training step (scaler, accumulation's place).
            train_step = getattr(loader, "train_step", None)
        given = dict(
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            loader=loader,
            train_step=train_step,
        )
        for name in _SLOTS:
            if given[name] is None:
                continue
            if not is_stateful(given[name]):
                raise InvalidArgumentError(
                    f"TrainingState got {name}={type(given[name]).__name__}, which has no "
                    "state_dict()/load_state_dict().",
                    hint=f"Pass a {name} that has both, or pass it in extras as plain data.",
                )
            self.parts[name] = given[name]
        self.extras: dict[str, Any] = _checked_extras(extras, "extras")
        self.rank_extras: dict[str, Any] = _checked_extras(rank_extras, "rank_extras")
        self._step = 0
        self.keep = keep
        self.asynchronous = asynchronous
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpukit-save")
        self._pending: Future[Path] | None = None
        self._last: Path | None = None
        self._group: Any = None
        self._token = ""
        self._count = 0
        self._stagers = (Stager(), Stager())  # the shared part, this rank's own
        self._shard_stager: Any = None  # torch's, made at the first save of a sharded model
        self._counted = False  # whether an optimizer step was counted (then it counts alone)
        self._paused = False  # while the state itself runs torch code that steps (see below)
        self._counter: Any = None
        if callable(register := getattr(optimizer, "register_step_post_hook", None)):
            self._counter = register(self._count_step)

    @property
    def step(self) -> int:
        """The optimizer steps taken: saved with the state, set back by :meth:`resume`.

        With an optimizer (one with ``register_step_post_hook``: any ``torch.optim``
        optimizer) it counts itself, one per ``optimizer.step()`` that runs (an fp16 step the
        scaler skips never calls it); micro-batches are not steps. It may be set before the
        optimizer's first step (a run's starting step); once it has counted, setting it is
        refused. Without an optimizer, count by hand: ``state.step += 1`` after each step.

        Raises:
            InvalidArgumentError: (on assignment) not a whole number from 0 to 2**63 - 1: a
                save at any other step could never be found again by :meth:`resume`; or the
                state counts the optimizer's steps itself.
        """
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        _check_step(value)
        if self._counted:
            raise InvalidArgumentError(
                f"TrainingState.step = {value} was set by hand, and the state counts its "
                f"optimizer's steps itself (it is at {self._step}): a step counted twice would "
                "save at the wrong step.",
                hint="Remove `state.step += 1` from the loop: state.step already counts each "
                "optimizer.step().",
            )
        self._step = value

    def _count_step(self, *_: object) -> None:
        """The optimizer's step post-hook: one more step taken."""
        if self._paused:
            return
        self._counted = True
        self._step = min(self._step + 1, _MAX_STEP)

    # --- gathering -------------------------------------------------------------------------

    def _shared(self, sharded: list[str]) -> dict[str, Any]:
        """What every rank holds alike: written once, by rank 0. ``sharded`` names the parts
        each rank writes its own shards of instead (a sharded model, its optimizer)."""
        inner, _ = unwrap(self.model)
        state: dict[str, Any] = {"step": self.step, "sharded": sharded}
        if "model" not in sharded:
            state["model"] = inner.state_dict()
        for name, part in self.parts.items():
            if name not in sharded:
                state[name] = part.state_dict()
        state["extras"] = _extras_state(self.extras)
        return state

    def _own(self) -> dict[str, Any]:
        """What is this rank's own: its random streams, its extras."""
        return {"rng": rng.capture(), "extras": _extras_state(self.rank_extras)}

    # --- saving ----------------------------------------------------------------------------

    def _start_run(self, rank: int, world: int) -> None:
        """Agree, once, on a token that names this run's saves (and a group to meet in)."""
        if world > 1:
            # Saves meet in their own group: the writer thread's collectives must not
            # interleave with the training loop's on the default group.
            self._group = dist.new_group(backend="gloo")
            token = from_rank_0(secrets.randbits(48) if rank == 0 else None, self._group)
            self._token = f"{token:012x}"
        else:
            self._token = secrets.token_hex(6)

    def save(self, *, asynchronous: bool | None = None) -> Path:
        """Save the state now into a new folder under ``folder``; return that folder.

        Every rank must call it at the same step. Asynchronous unless ``asynchronous=False``
        (``None``: as the state was built, asynchronous by default): the state is copied to
        host memory, then written by a background thread, and the call returns; the save is
        complete once :meth:`wait` returns (or the next ``save``). ``asynchronous=False``
        returns once the save is complete.

        ``extras`` are written by rank 0 alone: when they differ between the ranks, a warning
        (logger ``gpukit.train``) names those that do; put them in ``rank_extras`` instead.

        Args:
            asynchronous: True: return once the state is in host memory; False: once it is on disk;
                None: as the state was built.

        Raises:
            InvalidArgumentError: ``asynchronous`` is not True, False or None; or the training
                step is between the micro-batches of an optimizer step (on every rank).
            CheckpointError: the previous asynchronous save failed, or this one did (not
                asynchronous); or the folder fails the trust model (another user's, or anyone
                may write it).
        """
        check_bool("asynchronous", asynchronous, allow_none=True)
        # Refused on every rank alike, before any meets the others: rank 0 alone builds the
        # shared part, and the other ranks would wait for it in the saves' meeting.
        for part in self.parts.values():
            if getattr(part, "mid_step", False):
                part.state_dict()  # the training step's refusal: between micro-batches
        self.wait()
        saves.check_root(self.folder)
        rank, world = _rank_and_world()
        if not self._token:
            self._start_run(rank, world)
        name = saves.save_name(self.step, self._token, self._count)
        self._count += 1
        target = self.folder / name
        block = not (self.asynchronous if asynchronous is None else asynchronous)
        if world > 1 and self.extras:
            self._warn_of_differing_extras(rank, world)
        inner, _ = unwrap(self.model)
        # A sharded model: each rank keeps its own shards, never the whole. Torch may step the
        # optimizer once to make its state (lr 0, zero gradients): not a step of the run.
        self._paused = True
        try:
            parted = (
                _sharded_part.sharded_state(inner, self.parts.get("optimizer"))
                if is_sharded(inner)
                else None
            )
        finally:
            self._paused = False
        shared = self._shared(sorted(parted or ())) if rank == 0 else None
        own = self._own()
        if not block:
            # The loop may change the originals as soon as this returns.
            shared, own = self._stagers[0].stage(shared), self._stagers[1].stage(own)
            if parted is not None:
                if self._shard_stager is None:
                    self._shard_stager = _sharded_part.stager(inner)
                parted = self._shard_stager.stage(parted)
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"Cannot save the training state into {target}: {exc.strerror}.",
                hint="Pass a folder this process can create and write (on a shared file "
                "system when the ranks run on several machines).",
            ) from None
        job = SaveJob(target, self.step, rank, world, self.keep, self._group, shared, own, parted)
        if block:
            self._last = job.run()
            return target
        self._pending = self._writer.submit(job.run)
        return target

    def _warn_of_differing_extras(self, rank: int, world: int) -> None:
        """Warn (rank 0) when an extra differs between the ranks: only rank 0's is saved.

        Each rank digests each extra's state; one gather of the digests in the saves' group.
        """
        digests = {name: _digest(state) for name, state in _extras_state(self.extras).items()}
        every = gathered(digests, self._group)
        if rank != 0:
            return
        differ = sorted(
            name for name in digests if any(d.get(name) != digests[name] for d in every)
        )
        if differ:
            log.warning(
                "extras %s differ between the ranks, and only rank 0's are saved: a resumed "
                "run gives every rank rank 0's. Pass what differs per rank in rank_extras= "
                "(saved by each rank).",
                ", ".join(repr(name) for name in differ),
            )

    def wait(self) -> Path | None:
        """Wait for the asynchronous save in progress; return the newest save this object
        completed (None before any).

        Raises:
            CheckpointError: the save failed (the previous complete save is left as it was).
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            self._last = pending.result()
        return self._last

    def close(self) -> None:
        """Wait for the save in progress and stop the writer thread (and the step count)."""
        try:
            self.wait()
        finally:
            if self._counter is not None:
                self._counter.remove()  # the optimizer no longer holds this state
                self._counter = None
            self._writer.shutdown(wait=True)
            if self._shard_stager is not None:
                self._shard_stager.close()  # its host copies of the shards
                self._shard_stager = None

    def __enter__(self) -> TrainingState:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.close()
            return
        try:  # the block's own error is the one to see; a failed save is only logged then
            self.close()
        except Exception:
            log.exception("the last save of %s failed too", self.folder)

    # --- resuming --------------------------------------------------------------------------

    def resume(self, folder: str | os.PathLike[str] | None = None) -> Resumed | None:
        """Load the newest complete save in ``folder`` (this state's folder by default).

        Returns which save was taken (and which newer ones were passed over, and why), or None
        when there is none: a fresh start. Every rank calls it; rank 0 chooses the save, so all
        ranks take the same one. A rank beyond the saved world size takes the random streams of
        rank ``rank % saved_world_size``.

        Saves of other users (root's excepted) are passed over, and so are saves whose files
        do not match the digests written with them: a damaged newest save falls back to the
        newest intact one. What each part holds is checked against the live object before its
        own ``load_state_dict`` sees it.

        Args:
            folder: the folder to resume from; None: this state's ``folder``.

        Raises:
            CheckpointError: the chosen save does not fit these objects (another model, another
                optimizer), a file of it cannot be read, or the folder fails the trust model
                (another user's, or anyone may write it).
        """
        self.wait()
        root = self.folder if folder is None else Path(folder)
        rank, world = _rank_and_world()
        # Rank 0 chooses, reading the chosen save's two files while their digests are checked.
        info, passed, read = saves.newest_read(root, _read_parts) if rank == 0 else (None, [], None)
        if world > 1:
            if not self._token:
                self._start_run(rank, world)
            info = _agree(info, root, self._group)
        if info is None:
            log.info("no complete save in %s: starting from step 0", root)
            return None
        shared, own = read if read is not None else _read_parts(info, rank)
        self._paused = True  # torch may step the optimizer to make its state: not a run's step
        try:
            self._load_shared(shared, info)
        finally:
            self._paused = False
        if not isinstance(own, dict) or "rng" not in own:
            raise _malformed(info.path / saves.rank_file(rank % info.world_size), "rng")
        rng.restore(own["rng"], where=str(info.path))
        _load_extras(self.rank_extras, own.get("extras"), info.path)
        log.info(
            "resumed from %s (step %d, saved by %d process%s)",
            info.path,
            info.step,
            info.world_size,
            "" if info.world_size == 1 else "es",
        )
        return Resumed(info.path, info.step, info.world_size, passed)

    def _load_shared(self, shared: Any, info: saves.SaveInfo) -> None:
        path = info.path
        if not isinstance(shared, dict):
            raise _malformed(path / saves.SHARED, "a mapping")
        step = shared.get("step")
        if type(step) is not int or step < 0:
            raise _malformed(path / saves.SHARED, "the step")
        parted = shared.get("sharded", [])
        # As save writes it: none, the model, or the model and its optimizer (sorted).
        if parted not in ([], ["model"], ["model", "optimizer"]):
            raise _malformed(path / saves.SHARED, "the list of sharded parts")
        if info.sharded != ("model" in parted):
            raise _malformed(path / saves.SHARED, "the sharded part")
        loaded = self._load_model(shared, parted, path)
        for name, part in self.parts.items():
            if name in loaded:
                continue
            stored = _FORMER_TRAIN_STEP if name == "train_step" and name not in shared else name
            a = "an" if name[0] in "aeiou" else "a"  # an optimizer, a scheduler
            if stored not in shared:
                raise CheckpointError(
                    f"{path} holds no {name} state, and this run has {a} {name}.",
                    hint=f"Resume without {a} {name}, or from a save of a run that had one.",
                )
            try:
                _check_part(name, shared[stored], part)
                part.load_state_dict(shared[stored])
            except InvalidInput as exc:
                raise CheckpointError(
                    f"{path / saves.SHARED} holds {a} {name} state that this {name} cannot take: "
                    f"{exc}.",
                    hint=f"Resume with the {name} the run saved (same kind, same parameters).",
                ) from None
            except GpukitError:
                raise
            except (KeyError, IndexError, ValueError, TypeError, RuntimeError) as exc:
                raise CheckpointError(
                    f"{path} holds {a} {name} state that this {name} cannot take: "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                    hint=f"Resume with the {name} the run saved (same kind, same parameters).",
                ) from None
        _load_extras(self.extras, shared.get("extras"), path)
        self._step = _check_step(step)  # set back even where the state counts itself

    def _load_model(self, shared: dict[str, Any], parted: list[str], path: Path) -> set[str]:
        """Load the model (and the optimizer, where it is saved with a sharded model); return
        the parts loaded. Either run may be sharded or not, over any number of processes."""
        inner, _ = unwrap(self.model)
        optimizer = self.parts.get("optimizer")
        if parted:  # every rank reads the chunks its own state needs (DCP reshards)
            with_optimizer = optimizer if "optimizer" in parted else None
            _sharded_part.read(path / saves.SHARDED, inner, with_optimizer, self._group)
            return {"model", "optimizer"} if with_optimizer is not None else {"model"}
        try:
            if is_sharded(inner):  # an unsharded run's save: each rank keeps its rows
                state = shared.get("optimizer") if optimizer is not None else None
                if state is not None:
                    _check_part("optimizer", state, optimizer)
                _sharded_part.load_whole(inner, optimizer, shared["model"], state)
                return {"model", "optimizer"} if state is not None else {"model"}
            inner.load_state_dict(shared["model"])
        except InvalidInput as exc:
            raise CheckpointError(
                f"{path / saves.SHARED} holds an optimizer state that this optimizer cannot "
                f"take: {exc}.",
                hint="Resume with the optimizer the run saved (same kind, same parameters).",
            ) from None
        except (AttributeError, KeyError, RuntimeError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{path} holds another model's weights: {str(exc).splitlines()[0]}",
                hint="Resume with the model the run saved, or start in another folder.",
            ) from None
        return {"model"}


def _check_step(value: object) -> int:
    """A step, checked: a whole number from 0 to 2**63 - 1.

    Raises:
        InvalidArgumentError: anything else: a save at another step could not be resumed.
    """
    if type(value) is not int or not 0 <= value <= _MAX_STEP:
        raise InvalidArgumentError(
            f"TrainingState.step = {value!r} is not a step: a whole number from 0 to "
            f"{_MAX_STEP} (a save at any other step could not be resumed).",
            hint="Leave state.step to the state: it counts each optimizer.step() itself. Set "
            "it by hand only where no optimizer is given, to an int (state.step += 1).",
        )
    return value


def _read_parts(info: saves.SaveInfo, rank: int = 0) -> tuple[Any, Any]:
    """The shared part of a save and ``rank``'s own, read as data (nothing loaded yet)."""
    shared = saves.load_part(info.path, saves.SHARED)
    return shared, saves.load_part(info.path, saves.rank_file(rank % info.world_size))


def _check_part(name: str, saved: object, part: Any) -> None:
    """Check a saved part by structure against the live object, before its loader sees it."""
    if name == "optimizer" and isinstance(part, torch.optim.Optimizer):
        check_optimizer_state(saved, part)
    elif name == "scheduler" and isinstance(part, torch.optim.lr_scheduler.LRScheduler):
        check_scheduler_state(saved, part)


def _agree(info: saves.SaveInfo | None, root: Path, group: Any) -> saves.SaveInfo | None:
    """Rank 0's choice of save, on every rank (each then reads and checks it itself), in the
    saves' gloo group."""
    chosen = from_rank_0(info.path.name if info is not None else "", group)
    if not chosen:
        return None
    return info if info is not None else saves.check(root / chosen)


def _malformed(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a training state's file: {what} is missing or malformed.",
        hint="The save was changed after it was written; resume from another save.",
    )


def _checked_extras(extras: Mapping[str, Any] | None, label: str) -> dict[str, Any]:
    found = dict(extras or {})
    for name, value in found.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(
                f"{label} has the key {name!r}, not a string.", hint="Name each extra by a str."
            )
        if not is_stateful(value):
            check_plain(value, f"{label}[{name!r}]")
    return found


_ON_CPU = _tree.mapper(lambda t: t.detach().cpu(), torch.Tensor)


def _digest(state: object) -> bytes:
    """A digest of an extra's saved state, the same on every rank that holds the same values
    (tensors moved to the CPU first, so each rank's device does not enter it)."""
    buffer = io.BytesIO()
    torch.save(_ON_CPU(state), buffer)
    return hashlib.blake2b(buffer.getvalue(), digest_size=16).digest()


def _extras_state(extras: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in extras.items():
        if is_stateful(value):
            out[name] = {"state_dict": value.state_dict()}
        else:
            check_plain(value, f"extras[{name!r}]")
            out[name] = {"value": value}
    return out


def _load_extras(extras: dict[str, Any], saved: object, path: Path) -> None:
    """Put saved extras back: stateful ones load their state, plain ones are replaced."""
    if not isinstance(saved, dict):
        raise _malformed(path, "the extras")
    for name, value in list(extras.items()):
        entry = saved.get(name)
        if not isinstance(entry, dict):
            raise CheckpointError(
                f"{path} holds no extra named {name!r}; this run has one.",
                hint="Resume with the extras the run saved, or start in another folder.",
            )
        if is_stateful(value):
            value.load_state_dict(entry.get("state_dict"))
        else:
            extras[name] = entry.get("value")
