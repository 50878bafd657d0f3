"""Device-mismatch diagnosis: ``gk.check_devices`` and ``gk.explain_device_errors``.

``check_devices`` looks before a forward: it groups a module's parameters, buffers and input
tensors by device and says what to move. ``explain_device_errors`` looks after a failure: it
turns PyTorch's "tensors on different devices" errors into a
:class:`~gpukit.errors.DeviceMismatchError` naming the module whose forward failed, where its
tensors and inputs were, and the likely cause.

``explain_device_errors`` registers no hooks. The module that failed, and the arguments it was
called with, are still in the traceback's frames (``nn.Module._call_impl(self, *args,
**kwargs)``), so they are read from there once an error has happened. A block that does not
fail pays for one ``try`` and nothing per forward; a global forward pre-hook, the other way to
know the running module, would cost a Python call on every forward of every module, and would
turn off the fast path that ``nn.Module.__call__`` takes when no hooks exist.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ContextDecorator
from types import FrameType, TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from gpukit import _tree
from gpukit.errors import DeviceMismatchError, InvalidArgumentError

__all__ = ["check_devices", "explain_device_errors", "is_device_mismatch"]

F = TypeVar("F", bound=Callable[..., Any])

# The ways PyTorch says "these tensors are on different devices", across ops and backends.
_MISMATCH_MESSAGES = (
    "Expected all tensors to be on the same device",
    "is not on the expected device",
    "found at least two devices",
    "Expected object of device type",
    "must be on the same device",
    "are not at the same device",
    "should be the same device",
    "Expected tensor for argument",
)
_CALL_CODES = {nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__}


def is_device_mismatch(exc: BaseException) -> bool:
    """Whether ``exc`` is one of PyTorch's "tensors on different devices" errors.

    A :class:`~gpukit.errors.DeviceMismatchError` (gpukit's own diagnosis) is not.

    Args:
        exc: the exception to look at; only a ``RuntimeError`` or ``ValueError`` can be one.
    """
    if isinstance(exc, DeviceMismatchError) or not isinstance(exc, (RuntimeError, ValueError)):
        return False
    text = str(exc)
    return any(m in text for m in _MISMATCH_MESSAGES) and "device" in text


# -- collecting tensors -------------------------------------------------------------------------
def _walk(obj: object, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``obj`` (any nesting gk.to_device walks), named from ``name`` down."""
    try:
        for path, tensor in _tree.leaves_with_paths(obj, torch.Tensor):
            yield _tree.format_path(path, name, obj), tensor
    except InvalidArgumentError:
        # A structure that contains itself: what was found before the loop is reported, and
        # the diagnosis goes on rather than fail on something it was not asked about.
        return


def _named_inputs(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Input tensors named by ``forward``'s parameter names where the call binds to them."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        named: list[tuple[str, object]] = []
        for name, value in bound.arguments.items():
            kind = inspect.signature(module.forward).parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                named += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
            elif kind is inspect.Parameter.VAR_KEYWORD:
                named += [(k, v) for k, v in value.items()]
            else:
                named.append((name, value))
    except (TypeError, ValueError):  # a forward whose signature does not bind: positions
        named = [(f"args[{i}]", v) for i, v in enumerate(args)]
        named += [(k, v) for k, v in kwargs.items()]
    for name, value in named:
        yield from _walk(value, name)


def _plain_tensor_attributes(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors stored as plain attributes: ``module.to()`` does not move them."""
    for prefix, sub in module.named_modules():
        for name, value in vars(sub).items():
            if isinstance(value, torch.Tensor):
                yield (f"{prefix}.{name}" if prefix else name), value


def _group(pairs: Iterator[tuple[str, torch.Tensor]]) -> dict[torch.device, list[str]]:
    groups: defaultdict[torch.device, list[str]] = defaultdict(list)
    for name, t in pairs:
        groups[t.device].append(name)
    return dict(groups)


def _state(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def _describe(groups: dict[torch.device, list[str]]) -> str:
    parts = []
    for dev, names in sorted(groups.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        parts.append(f"{dev}: {shown}")
    return "; ".join(parts) or "none"


def _meta_hint(dev: torch.device) -> str:
    if dev.type != "meta":
        return ""
    return (
        " Tensors on the meta device hold no data: materialise the module with "
        "module.to_empty(device=...) and load its weights, or load_state_dict(sd, assign=True)."
    )


# -- check_devices ------------------------------------------------------------------------------
def check_devices(module: nn.Module, *args: Any, **kwargs: Any) -> dict[torch.device, list[str]]:
    """Group ``module``'s parameters, buffers and these inputs by device; raise if they disagree.

    Call it with the arguments you are about to pass to ``module``. Inputs are named by
    ``forward``'s parameters (``x``, ``batch["mask"]``). CPU scalars (0-dim tensors) are listed
    but never counted as a mismatch, since PyTorch accepts them next to tensors on any device.

    >>> check_devices(torch.nn.Linear(2, 2), torch.ones(1, 2))
    {device(type='cpu'): ['weight', 'bias', 'input']}

    Args:
        module: the model whose parameters and buffers are checked.
        *args: the positional inputs the model is about to be called with.
        **kwargs: its keyword inputs.
    """
    if not isinstance(module, nn.Module):
        raise InvalidArgumentError(
            f"check_devices() needs the nn.Module about to be called, not a "
            f"{type(module).__name__}.",
            hint="Call it as gk.check_devices(model, *inputs, **kwargs).",
        )
    state = list(_state(module))
    inputs = list(_named_inputs(module, args, kwargs))
    groups = _group(iter(state + inputs))
    counted = {t.device for _, t in state + inputs if not (t.device.type == "cpu" and t.dim() == 0)}
    if len(counted) <= 1:
        return groups
    name = type(module).__name__
    state_devs = _group(iter(state))
    if len(state_devs) == 1:
        target = next(iter(state_devs))
        strays = [n for n, t in inputs if t.device != target and t.device in counted]
        hint = (
            f"Move {', '.join(strays[:4])}{' and more' if len(strays) > 4 else ''} to "
            f"{target} before the call, e.g. gk.to_device(batch, {str(target)!r})."
            + _meta_hint(target)
        )
    elif not state_devs:
        hint = (
            "Move every input to the device the computation should run on, e.g. with gk.to_device."
        )
    else:
        target = max(state_devs, key=lambda d: len(state_devs[d]))
        hint = (
            f"Put the whole module on one device with module.to({str(target)!r}) "
            f"(gk.placement(module) lists every name), then move the inputs there too."
        )
    raise DeviceMismatchError(
        f"{name}'s parameters, buffers and inputs are on {len(counted)} devices "
        f"({_describe(groups)}).",
        hint=hint,
    )


# -- explain_device_errors ----------------------------------------------------------------------
def _failing_call(tb: TracebackType | None) -> tuple[list[nn.Module], FrameType | None]:
    """The modules being called when the error was raised (outermost first) and the
    innermost ``Module._call_impl`` frame, read from the traceback."""
    chain: list[nn.Module] = []
    innermost: FrameType | None = None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code in _CALL_CODES:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                if not chain or chain[-1] is not module:
                    chain.append(module)
                innermost = frame
        tb = tb.tb_next
    return chain, innermost


def _path(chain: list[nn.Module]) -> str:
    if len(chain) < 2:
        return type(chain[-1]).__name__ if chain else "?"
    target = chain[-1]
    for name, sub in chain[0].named_modules():
        if sub is target:
            return f"{name} ({type(target).__name__})"
    return type(target).__name__


def _explain(exc: BaseException, tb: TracebackType | None) -> DeviceMismatchError:
    chain, frame = _failing_call(tb)
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if frame is None:
        return DeviceMismatchError(
            f"A computation mixed tensors on different devices: {first_line}",
            hint="It did not happen inside an nn.Module's forward; check the tensors of that "
            "line with t.device, or call gk.check_devices(model, *inputs) before the forward.",
        )
    module = chain[-1]
    args = frame.f_locals.get("args", ())
    kwargs = frame.f_locals.get("kwargs", {})
    state = _group(_state(module))
    inputs = _group(_named_inputs(module, tuple(args), dict(kwargs)))
    everything = set(state) | set(inputs)
    # A plain attribute is suspect when it is not where the module's state is (or, for a
    # module without state, not where any input is).
    if len(state) == 1:
        home: set[torch.device] = set(state)
    else:
        home = everything if len(everything) == 1 or not state else set()
    stray_plain = [
        (n, t) for n, t in _plain_tensor_attributes(module) if home and t.device not in home
    ]
    if stray_plain:
        name, t = stray_plain[0]
        cause = (
            f"self.{name} is a plain tensor attribute on {t.device}, not a registered buffer, "
            f"so module.to() does not move it. Register it in __init__ with "
            f"self.register_buffer({name.rsplit('.', 1)[-1]!r}, tensor)."
        )
    elif len(everything) > 1:
        state_dev = next(iter(state)) if len(state) == 1 else None
        if state_dev is not None:
            cause = (
                f"The inputs are not on {state_dev}, where the parameters are. Move them "
                f"first, e.g. gk.to_device(batch, {str(state_dev)!r})." + _meta_hint(state_dev)
            )
        else:
            cause = "The module is split over devices. Move it whole with module.to(device)."
    else:
        where = next(iter(everything)) if everything else "one device"
        cause = (
            f"Everything this module holds and was given is on {where}, so the other tensor was "
            "most likely created inside forward (torch.zeros/arange/tensor without device=, or "
            "a layer built in forward). Create it with device=x.device, or in __init__ as a "
            "buffer or submodule."
        )
    return DeviceMismatchError(
        f"{_path(chain)} failed in forward: {first_line} Its parameters and buffers: "
        f"{_describe(state)}. Its inputs: {_describe(inputs)}.",
        hint=cause,
    )


class explain_device_errors(ContextDecorator):
    """Re-raise "tensors on different devices" errors with the module, its devices and a cause.

    Use as ``with gk.explain_device_errors(): loss = model(batch)`` or as a decorator on a
    training step. The error raised is a :class:`~gpukit.errors.DeviceMismatchError` whose
    ``__cause__`` is PyTorch's original error. Other errors pass through untouched, and
    nothing is registered on any module: a block that does not fail costs nothing extra.
    """

    def __enter__(self) -> explain_device_errors:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None or not is_device_mismatch(exc):
            return
        raise _explain(exc, tb) from exc

    def __call__(self, func: F) -> F:
        return super().__call__(func)
