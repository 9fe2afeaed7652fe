"""Fixtures of the worker tests: one Blender child per test module."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from workers.child import BlenderChild


@pytest.fixture(scope="module")
def child(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BlenderChild]:
    """A Blender child for the module's renders, named after the module (its log file's name)."""
    name = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    work = tmp_path_factory.mktemp(f"{name}-child")
    with BlenderChild(python=sys.executable, work_dir=work, name=name) as c:
        yield c
