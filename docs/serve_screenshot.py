"""Redraw docs/serve.png: the dashboard of the fake 8-GPU server, in headless Chromium.

    python docs/serve_screenshot.py [--chromium /usr/bin/chromium] [--out docs/serve.png]

Needs the serve and test extras (prometheus_client, playwright) and Debian's chromium package.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _past_hour(sampler: Any, inv: Any) -> None:
    """Give the charts an hour of made-up history that ends at the fixture's readings."""
    for step in range(120, 0, -1):
        gpus = []
        for g in inv.gpus:
            wave = 0.5 + 0.5 * math.sin(step / 9 + g.index)
            busy = (g.utilization_gpu or 0) > 10
            util = round((g.utilization_gpu or 0) * (0.8 + 0.2 * wave)) if busy else 0
            if g.index == 2 and 40 < step < 90:  # a job that ended half an hour ago
                util = 90
            used = g.memory_used or 0
            if g.index == 2 and 40 < step < 90:
                used = 60 * 2**30
            gpus.append(dataclasses.replace(g, utilization_gpu=util, memory_used=used))
        sampler.history.add(
            dataclasses.replace(inv, gpus=tuple(gpus), taken_at=inv.taken_at - step * 30)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--out", default=str(ROOT / "docs" / "serve.png"))
    parser.add_argument("--width", type=int, default=1280)
    args = parser.parse_args()
    os.environ["GPUKIT_FAKE_NVML"] = str(
        ROOT / "src" / "gpukit" / "gpus" / "machines" / "server-8xA100-shared.json"
    )
    with tempfile.TemporaryDirectory() as locks:
        os.environ["GPUKIT_LOCK_DIR"] = locks
        os.environ["LOGNAME"] = "frank"  # the claim's recorded user, like the fixture's users
        from playwright.sync_api import sync_playwright

        import gpukit as gk
        from gpukit.sharing.claims import claim
        from gpukit.serve import DashboardServer, Sampler

        sampler = Sampler(3600, host="gpu-server")
        _past_hour(sampler, gk.inventory())
        with claim(["GPU-a170b338-3926-3059-f28c-105d1fb17c23"], command="python sweep.py"):
            sampler.start()
            server = DashboardServer(("127.0.0.1", 0), sampler)
            server.start()
            try:
                with sync_playwright() as pw:
                    browser = pw.chromium.launch(
                        executable_path=args.chromium, args=["--no-sandbox"]
                    )
                    page = browser.new_page(viewport={"width": args.width, "height": 800})
                    page.goto(server.url)
                    page.wait_for_selector("section.card[data-gpu='7']")
                    page.screenshot(path=args.out, full_page=True)
                    browser.close()
            finally:
                server.close()
                sampler.stop()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
