"""The public job options: one table the CLI and the requests are built from, every number in
it bounded, every default declared once."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from farm.cli import build_parser
from farm.errors import BadParameter
from farm.models import JOB_OPTIONS, JobOption, JobSpec
from farm.settings import Settings
from farm.submission import RenderRequest, check_request, request_from

BOUNDED = [o for o in JOB_OPTIONS.values() if o.low is not None]


def _job_flags(command: str) -> set[str]:
    """The destinations of a CLI command's job flags."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = commands.choices[command]
    others = {"help", "json", "blend", "output", "wait", "workers", "keep_logs", "estimate"}
    return {a.dest for a in sub._actions} - others


@pytest.mark.parametrize("command", ["submit", "render"])
def test_the_cli_takes_exactly_the_public_job_options(command: str) -> None:
    assert _job_flags(command) == set(JOB_OPTIONS)


def test_requests_and_specs_take_their_defaults_from_the_one_table() -> None:
    request = {f.name: f.default for f in dataclasses.fields(RenderRequest)}
    assert set(request) == {*JOB_OPTIONS, "output"}
    assert {name: request[name] for name in JOB_OPTIONS} == {
        name: o.default for name, o in JOB_OPTIONS.items()
    }
    spec = {f.name: f.default for f in dataclasses.fields(JobSpec)}
    # the spec holds the options as the farm runs them: formats as a tuple, the overlap, a
    # name and split_parts (1 in tiles mode) resolved; tags and depends_on as tuples
    dropped = {"formats", "overlap_px", "split_parts", "name", "tags", "depends_on"}
    shared = set(JOB_OPTIONS) & set(spec) - dropped
    with_default = {n for n in shared if spec[n] is not dataclasses.MISSING}
    assert with_default >= {"device", "max_attempts", "tile_timeout_s", "priority", "project"}
    for name in with_default:
        assert spec[name] == JOB_OPTIONS[name].default, name
    # the farm-wide defaults come from the settings, declared there
    assert JOB_OPTIONS["max_attempts"].default == Settings().max_attempts
    assert JOB_OPTIONS["tile_timeout_s"].default == Settings().tile_timeout_s


@pytest.mark.parametrize("option", BOUNDED, ids=lambda o: o.name)
def test_every_number_is_refused_outside_its_bounds_with_the_bounds_named(
    option: JobOption, tmp_path: Path
) -> None:
    name, low, high = option.name, option.low, option.high
    assert low is not None and high is not None
    for value in (low, high):
        check_request(RenderRequest(output=tmp_path, **{name: value}))  # type: ignore[arg-type]
    for value in (low - 1, high + 1):
        with pytest.raises(BadParameter) as err:
            check_request(RenderRequest(output=tmp_path, **{name: value}))  # type: ignore[arg-type]
        assert err.value.fields["field"] == name
        assert f" to {high:.0f}" in err.value.message, err.value.message


def test_a_request_from_given_options_takes_the_farms_settings_for_the_rest(
    tmp_path: Path,
) -> None:
    settings = Settings().with_(max_attempts=5, tile_timeout_s=60.0)
    req = request_from({"max_attempts": None, "priority": 3}, tmp_path, settings)
    assert (req.max_attempts, req.tile_timeout_s, req.priority, req.tiles) == (5, 60.0, 3, "2x2")
    listed = request_from(
        {"frames": [1, "3-4"], "formats": ["exr", "png"], "mode": "sample-split"},
        tmp_path,
        settings,
    )
    assert (listed.frames, listed.formats, listed.mode) == ("1,3-4", "exr,png", "sample_split")
    with pytest.raises(BadParameter, match="unknown job option\\(s\\): vram_mib"):
        request_from({"vram_mib": 1}, tmp_path, settings)


def test_project_names_are_checked_like_the_accounts(tmp_path: Path) -> None:
    with pytest.raises(BadParameter, match="project name"):
        check_request(RenderRequest(output=tmp_path, project="../etc"))
