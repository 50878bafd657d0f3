"""The dashboard in a real headless Chromium (Debian's package, driven by Playwright)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpukit.serve import sampler as sampler_module
from gpukit.sharing.claims import claim
from gpukit.sharing.report import Sharing
from gpukit.sharing.tickets import Ticket

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")


def _chromium() -> str | None:
    for candidate in (os.environ.get("GPUKIT_CHROMIUM"), "/usr/bin/chromium"):
        if candidate and Path(candidate).exists():
            return candidate
    return shutil.which("chromium") or shutil.which("chromium-browser")


CHROMIUM = _chromium()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no Chromium found (apt-get install chromium, or set GPUKIT_CHROMIUM)",
    ),
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    opened.problems = []
    opened.on(
        "console", lambda msg: opened.problems.append(msg.text) if msg.type == "error" else None
    )
    opened.on("pageerror", lambda exc: opened.problems.append(str(exc)))
    yield opened
    context.close()


def test_page_shows_every_gpu_of_the_machine_without_console_errors(
    serve_machine: Any, page: Any
) -> None:
    served = serve_machine("server-8xA100-shared", interval=0.2)
    page.goto(served.url)
    page.wait_for_selector("section.card[data-gpu='7']")
    cards = page.locator("section.card")
    assert cards.count() == 8
    gpu0 = page.locator("section.card[data-gpu='0']")
    assert "A100-SXM4-80GB" in gpu0.inner_text()
    assert gpu0.locator(".util-value").inner_text() == "98 %"
    assert gpu0.locator(".mem-value").inner_text() == "71.2 / 80 GiB"
    assert "alice" in gpu0.locator("ul.procs").inner_text()
    assert "python train.py" in gpu0.locator("ul.procs").inner_text()
    assert page.locator("section.card[data-gpu='2'] .badge.free").count() == 1
    assert page.problems == []


def test_page_updates_when_the_gpus_change(serve_machine: Any, page: Any) -> None:
    served = serve_machine("server-8xA100-shared", interval=0.2)
    page.goto(served.url)
    util = page.locator("section.card[data-gpu='2'] .util-value")
    sync_api.expect(util).to_have_text("0 %")
    served.edit(2, utilization_gpu=77)
    sync_api.expect(util).to_have_text("77 %", timeout=10_000)
    with claim(["GPU-8d116ece-1738-f7d9-3d9c-172411e20b8f"], command="python sweep.py"):
        badge = page.locator("section.card[data-gpu='2'] .badge.claimed")
        sync_api.expect(badge).to_contain_text("claimed by", timeout=10_000)
    summary = page.locator("#summary")
    with Ticket():
        sync_api.expect(summary).to_contain_text("1 waiter in line", timeout=10_000)
        sync_api.expect(page.locator("#line")).to_contain_text("waits for 1 GPU")
    sync_api.expect(summary).to_contain_text("0 waiters in line", timeout=10_000)
    sync_api.expect(page.locator("#line")).to_be_hidden()
    assert page.problems == []


def test_page_shows_why_a_lost_gpu_cannot_be_read(serve_machine: Any, page: Any) -> None:
    served = serve_machine("kaggle-2xT4-one-lost")
    page.goto(served.url)
    page.wait_for_selector("section.card[data-gpu='1']")
    assert page.locator("section.card .badge.error").count() == 1
    assert page.problems == []


def test_page_shows_a_hostile_command_line_as_text(serve_machine: Any, page: Any) -> None:
    served = serve_machine("server-8xA100-shared", interval=0.2)
    hostile = "<img src=x onerror=\"document.title='owned'\">"
    served.edit(
        2, processes=[{"pid": 666, "user": "<b>mallory</b>", "name": hostile, "used_memory": 1}]
    )
    served.sampler.sample()
    page.goto(served.url)
    procs = page.locator("section.card[data-gpu='2'] ul.procs")
    sync_api.expect(procs).to_contain_text(hostile)
    assert "<b>mallory</b>" in procs.inner_text()
    assert page.title() == "gpukit"
    assert page.locator("img").count() == 0


def test_page_fits_a_phone_screen(serve_machine: Any, browser: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    context = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2)
    phone = context.new_page()
    try:
        phone.goto(served.url)
        phone.wait_for_selector("section.card[data-gpu='7']")
        overflow = phone.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0
        box = phone.locator("section.card[data-gpu='0']").bounding_box()
        assert box is not None
        assert box["width"] <= 390
    finally:
        context.close()


A100_4 = "GPU-a170b338-3926-3059-f28c-105d1fb17c23"


def test_page_shows_claims_as_unknown_never_free_when_the_lock_folder_is_refused(
    serve_machine: Any, page: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = serve_machine("server-8xA100-shared")
    (tmp_path / "real-locks").mkdir()
    os.symlink(tmp_path / "real-locks", tmp_path / "link-locks")
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(tmp_path / "link-locks"))
    served.sampler.sample()
    page.goto(served.url)
    page.wait_for_selector("section.card[data-gpu='7']")
    assert page.locator(".badge.free").count() == 0
    assert page.locator("section.card[data-gpu='2'] .badge.unknown").inner_text() == (
        "claim unknown"
    )
    summary = page.locator("#summary").inner_text()
    assert "claims unknown" in summary
    assert "0 claimed" not in summary
    banner = page.locator("#error").inner_text()
    assert banner.startswith("Claims unknown: ")
    assert "Reading the GPUs failed" not in banner
    assert "Last reading failed" not in banner
    assert page.problems == []


def test_page_says_the_gpus_shown_are_an_old_reading_when_reading_them_fails(
    serve_machine: Any, page: Any
) -> None:
    served = serve_machine("server-8xA100-shared")
    served.machine.write_text('{"nvml_error": "DriverNotLoaded", "gpus": []}')
    served.sampler.sample()
    page.goto(served.url)
    page.wait_for_selector("section.card[data-gpu='7']")
    banner = page.locator("#error").inner_text()
    assert banner.startswith("Reading the GPUs failed (showing the reading of ")
    assert "Claims unknown" not in banner
    assert page.locator("section.card[data-gpu='2'] .badge.free").count() == 1
    assert page.problems == []


def test_page_shows_each_claims_command_and_how_long_it_has_been_held(
    serve_machine: Any, page: Any
) -> None:
    served = serve_machine("server-8xA100-shared")
    with claim([A100_4], command="python sweep.py --lr 3e-4"):
        served.sampler.sample()
        page.goto(served.url)
        held = page.locator("section.card[data-gpu='4'] p.claim")
        sync_api.expect(held).to_contain_text("python sweep.py --lr 3e-4")
        assert held.locator(".held").inner_text() == "held under a minute"
    assert page.problems == []


def test_page_shows_waiters_commands_as_text(
    serve_machine: Any, page: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    hostile = "<img src=x onerror=\"document.title='owned'\"> train.py"
    real = sampler_module.sharing

    class _WithCommands(Sharing):
        def to_json(self) -> dict[str, Any]:
            doc = super().to_json()
            for waiter in doc["waiters"]:
                waiter["command"] = hostile
            return doc

    def sharing(*args: Any, **kwargs: Any) -> Sharing:
        now = real(*args, **kwargs)
        return _WithCommands(**{f.name: getattr(now, f.name) for f in dataclasses.fields(now)})

    monkeypatch.setattr(sampler_module, "sharing", sharing)
    served = serve_machine("server-8xA100-shared")
    with Ticket(command=hostile):
        served.sampler.sample()
        page.goto(served.url)
        waiter = page.locator("#line li .cmd")
        sync_api.expect(waiter).to_have_text(hostile)
    assert page.title() == "gpukit"
    assert page.locator("img").count() == 0
    assert page.problems == []
