"""Mixed precision: what "auto" picks per device, refusals, the fp16 scaler, bf16 on the CPU."""

from __future__ import annotations

import logging
import pickle
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk
from gpukit import distributed as dist
from gpukit.errors import DeviceError, InvalidArgumentError
from gpukit.train import TrainStep, resolve_precision
from gpukit.train.precision import Precision, autocast_forward

CUDA0 = torch.device("cuda:0")
CPU = torch.device("cpu")
FP16_ON_CPU = Precision("fp16-mixed", "cpu", torch.float16)  # a scaler on the CPU, for tests


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], name: str) -> None:
    """Make torch.cuda describe one GPU of ``capability``; it also claims bf16 support."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # What torch answers on V100 and T4 through emulation: "auto" must not believe it.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


# -- what "auto" picks, and what is refused -----------------------------------------------------


def test_auto_picks_bf16_autocast_on_an_ampere_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    chosen = resolve_precision("auto", CUDA0)
    assert (chosen.name, chosen.dtype, chosen.scaled) == ("bf16-mixed", torch.bfloat16, False)


def test_auto_picks_fp16_with_a_scaler_before_ampere_even_when_torch_claims_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_gpu(monkeypatch, (7, 5), "Tesla T4")
    chosen = resolve_precision("auto", CUDA0)
    assert (chosen.name, chosen.dtype, chosen.scaled) == ("fp16-mixed", torch.float16, True)


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "picked"),
    [(True, False, "bf16-mixed"), (False, True, "bf16-mixed"), (False, False, "fp32")],
    ids=["avx512-bf16", "amx", "neither"],
)
def test_auto_on_the_cpu_picks_bf16_only_with_bf16_instructions(
    monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool, picked: str
) -> None:
    # Without them a bf16 autocast step is several times slower than fp32 (docs/benchmarks.md).
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_precision("auto", CPU).name == picked


def test_bf16_on_a_gpu_before_ampere_is_refused_naming_the_gpu_and_fp16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_gpu(monkeypatch, (7, 0), "Tesla V100-SXM2-16GB")
    with pytest.raises(DeviceError) as caught:
        resolve_precision("bf16-mixed", CUDA0)
    assert "cuda:0 (Tesla V100-SXM2-16GB, compute capability 7.0)" in caught.value.message
    assert "fp16-mixed" in (caught.value.hint or "")


def test_fp16_on_the_cpu_is_refused_with_bf16_and_fp32_as_the_alternatives() -> None:
    with pytest.raises(DeviceError, match="on the CPU") as caught:
        dist.prepare(nn.Linear(1, 1), precision="fp16-mixed")
    assert "'bf16-mixed'" in (caught.value.hint or "")
    assert "'fp32'" in (caught.value.hint or "")


def test_mixed_precision_on_another_device_type_is_refused() -> None:
    with pytest.raises(DeviceError, match="mps device"):
        resolve_precision("bf16-mixed", torch.device("mps"))


@pytest.mark.parametrize("request_", ["bf16", "FP32", None, 16])
def test_an_unknown_precision_is_refused_listing_the_known_ones(request_: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="is not a precision") as caught:
        resolve_precision(request_, CPU)
    assert "'bf16-mixed'" in (caught.value.hint or "")


# -- the fp16 scaler ------------------------------------------------------------------------------


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def test_the_scaler_skips_a_step_with_an_inf_gradient_and_the_weights_stay() -> None:
    model = _linear()
    before = [p.detach().clone() for p in model.parameters()]
    train_step = TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision=FP16_ON_CPU
    )
    assert train_step.scaler is not None
    scale = train_step.scaler.scale_value
    x = torch.tensor([[1.0, float("inf"), 0.0]])
    assert not train_step(model(x).mean())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert train_step.skipped_steps == 1
    assert train_step.scaler.scale_value < scale  # backed off, so the next step can fit


def test_a_scheduler_driven_by_the_steps_answer_does_not_advance_on_a_skipped_step() -> None:
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train_step = TrainStep(model, opt, precision=FP16_ON_CPU)
    for x in (torch.ones(1, 3), torch.full((1, 3), float("nan")), torch.ones(1, 3)):
        if train_step(model(x).mean()):
            scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)
    assert train_step.skipped_steps == 1


def test_clipping_under_the_scaler_sees_the_true_gradients() -> None:
    # Clipping scaled gradients (x 65536) to norm 0.5 would shrink them 65536 times too much.
    scaled, plain = _linear(), _linear()
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    step_scaled = TrainStep(
        scaled, torch.optim.SGD(scaled.parameters(), lr=1.0), precision=FP16_ON_CPU
    )
    step_plain = TrainStep(plain, torch.optim.SGD(plain.parameters(), lr=1.0))
    assert step_scaled(nn.functional.mse_loss(scaled(x), y), clip_grad_norm=0.5)
    assert step_plain(nn.functional.mse_loss(plain(x), y), clip_grad_norm=0.5)
    for a, b in zip(scaled.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_gradients_seen_before_an_fp16_optimizer_step_are_unscaled() -> None:
    # Read scaled (x 65536), a gradient check or a log would report nonsense.
    scaled, plain = _linear(), _linear()
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    seen: dict[str, list[torch.Tensor]] = {}

    def grads_of(name: str, model: nn.Module) -> Any:
        return lambda: seen.setdefault(name, [p.grad.clone() for p in model.parameters()])

    step_scaled = TrainStep(
        scaled, torch.optim.SGD(scaled.parameters(), lr=1.0), precision=FP16_ON_CPU
    )
    step_plain = TrainStep(plain, torch.optim.SGD(plain.parameters(), lr=1.0))
    step_scaled(
        nn.functional.mse_loss(scaled(x), y), before_optimizer_step=grads_of("fp16", scaled)
    )
    step_plain(nn.functional.mse_loss(plain(x), y), before_optimizer_step=grads_of("fp32", plain))
    for a, b in zip(seen["fp16"], seen["fp32"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_train_step_takes_the_precision_names_prepare_takes() -> None:
    model = nn.Linear(4, 2)
    train_step = TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16-mixed"
    )
    assert (train_step.precision.name, train_step.precision.device_type) == ("bf16-mixed", "cpu")
    out = model(torch.ones(3, 4))
    assert out.dtype == torch.float32
    assert torch.equal(out, out.bfloat16().float())  # its forward runs under bf16 autocast
    assert train_step(out.sum())


def test_a_train_step_resolves_auto_against_the_models_device_and_says_what_it_chose(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    model = nn.Linear(4, 2)
    with caplog.at_level(logging.INFO, logger="gpukit.train"):
        train_step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="auto")
    assert train_step.precision.name == "fp32"
    chose = [r.getMessage() for r in caplog.records if "precision='auto' chose" in r.getMessage()]
    assert len(chose) == 1
    assert "'fp32'" in chose[0]
    assert "bf16 instructions" in chose[0]


def test_a_prepared_loader_says_what_auto_chose_and_the_log_says_it_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.ones(4, 1)), batch_size=2)
    with caplog.at_level(logging.INFO, logger="gpukit.train"):
        _, _, loader = dist.prepare(model, opt, data, global_batch_size=2, precision="auto")
    assert loader.precision is not None
    assert loader.precision.name == "bf16-mixed"
    assert loader.train_step is not None
    assert loader.train_step.precision is loader.precision
    chose = [r for r in caplog.records if "precision='auto' chose" in r.getMessage()]
    assert [(r.name, r.levelno) for r in chose] == [("gpukit.train", logging.INFO)]
    assert "'bf16-mixed'" in chose[0].getMessage()


@pytest.mark.parametrize(
    "precision", ["bf16", "FP32", 16, object()], ids=["bf16", "FP32", "int", "object"]
)
def test_a_train_step_refuses_what_is_no_precision_with_the_names_it_takes(
    precision: object,
) -> None:
    model = nn.Linear(1, 1)
    with pytest.raises(InvalidArgumentError) as caught:
        TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)  # type: ignore[arg-type]
    assert "'bf16-mixed'" in (caught.value.hint or "")


def test_the_scaler_state_round_trips_with_its_scale_and_skips() -> None:
    model = _linear()
    first = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=FP16_ON_CPU)
    first(model(torch.full((1, 3), float("inf"))).mean())
    second = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=FP16_ON_CPU)
    second.load_state_dict(first.state_dict())
    assert second.scaler is not None
    assert first.scaler is not None
    assert second.scaler.scale_value == first.scaler.scale_value
    assert second.skipped_steps == 1


def test_a_scaler_state_loaded_into_a_step_without_a_scaler_is_refused() -> None:
    model = _linear()
    scaled = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=FP16_ON_CPU)
    plain = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(InvalidArgumentError, match="with an fp16 gradient scaler"):
        plain.load_state_dict(scaled.state_dict())


# -- bf16 autocast on the CPU -------------------------------------------------------------------


def _train(precision: str, steps: int = 20) -> tuple[list[torch.Tensor], float]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 8, generator=gen)
    y = torch.sin(x @ torch.randn(8, 1, generator=gen))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model, opt, loader = dist.prepare(model, opt, loader, global_batch_size=32, precision=precision)
    loss = torch.zeros(())
    for _ in range(steps // len(loader)):
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            dist.step(loss)
    return [p.detach().clone() for p in model.parameters()], loss.item()


def test_bf16_on_the_cpu_trains_like_fp32_within_bf16s_precision() -> None:
    # bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ~ 0.002 per product): after 16
    # steps the fp32 master weights stay within 0.02 of fp32 training, the loss within 5%.
    bf16, bf16_loss = _train("bf16-mixed", 16)
    fp32, fp32_loss = _train("fp32", 16)
    for a, b in zip(bf16, fp32, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)
    assert bf16_loss == pytest.approx(fp32_loss, rel=0.05)
    assert not all(torch.equal(a, b) for a, b in zip(bf16, fp32, strict=True))  # it did run bf16


def test_under_bf16_the_model_returns_fp32_and_keeps_fp32_weights_and_pickles() -> None:
    model = dist.prepare(nn.Linear(4, 2), precision="bf16-mixed")
    out = model(torch.ones(3, 4))
    assert out.dtype == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(out, out.bfloat16().float())  # computed in bf16, handed back as fp32
    assert pickle.loads(pickle.dumps(model))(torch.ones(1, 4)).dtype == torch.float32


def test_fp32_after_a_mixed_precision_gives_the_plain_forward_back() -> None:
    model = nn.Linear(2, 2)
    autocast_forward(model, resolve_precision("bf16-mixed", CPU))
    autocast_forward(model, resolve_precision("fp32", CPU))
    assert "forward" not in vars(model)


def test_data_parallel_runs_under_the_prepared_autocast_on_every_replica() -> None:
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    single = autocast_forward(nn.Linear(4, 2), resolve_precision("bf16-mixed", CPU))
    single.load_state_dict(net.state_dict())
    parallel = autocast_forward(
        gk.DataParallel(net, device_ids=["cpu", "cpu"]), resolve_precision("bf16-mixed", CPU)
    )
    x = torch.randn(6, 4)
    out = parallel(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, single(x), rtol=0, atol=0)
    out.sum().backward()
    assert net.weight.grad is not None
    assert net.weight.grad.dtype == torch.float32


def test_find_batch_size_searches_a_model_under_bf16_autocast() -> None:
    model = dist.prepare(nn.Linear(4, 2), precision="bf16-mixed")
    seen: list[torch.dtype] = []

    def probe(batch: int) -> None:
        if batch > 24:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        seen.append(model(torch.ones(batch, 4)).dtype)

    assert gk.find_batch_size(probe, start=4, maximum=64) == 24
    assert set(seen) == {torch.float32}


# -- a real GPU ------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.gpu
@needs_gpu
def test_auto_on_a_real_gpu_follows_its_compute_capability() -> None:
    chosen = resolve_precision("auto", CUDA0)
    native = torch.cuda.get_device_capability(0) >= (8, 0)
    assert chosen.name == ("bf16-mixed" if native else "fp16-mixed")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["auto", "fp16-mixed"])
def test_mixed_precision_on_a_real_gpu_trains_like_fp32(precision: str) -> None:
    mixed, mixed_loss = _train(precision, 16)
    fp32, fp32_loss = _train("fp32", 16)
    for a, b in zip(mixed, fp32, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)
    assert mixed_loss == pytest.approx(fp32_loss, rel=0.05)
