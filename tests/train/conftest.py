"""Fixtures of the training tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as tdist


@pytest.fixture
def group_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A gloo group of this process alone."""
    store = tmp_path_factory.mktemp("group") / "store"
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        tdist.destroy_process_group()
