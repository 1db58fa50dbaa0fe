"""Snapshot ids in both spellings: the short one (``demo/step-25``, what is printed) and the
directory's (``demo/step-000000000025``), in the grammar and in the server's validation."""

from __future__ import annotations

import pytest

from swap_state.common.errors import InvalidRequestError
from swap_state.common.names import (
    SnapshotRef,
    parse_snapshot_id,
    parse_step_dir_name,
    snapshot_id_for,
    step_dir_name,
)
from swap_state.server.rpc.validation import validate_snapshot_id


@pytest.mark.parametrize("text", ["demo/step-25", "demo/step-000000000025", "demo/step-0025"])
def test_a_step_parses_in_either_spelling_and_prints_short(text):
    ref = parse_snapshot_id(text)
    assert ref == SnapshotRef("demo", 25)
    assert str(ref) == "demo/step-25" == snapshot_id_for("demo", 25)


def test_relative_ids_take_the_given_job_in_either_spelling():
    assert parse_snapshot_id("step-000000000025", "demo") == SnapshotRef("demo", 25)
    assert parse_snapshot_id("step-25", "demo") == SnapshotRef("demo", 25)
    assert parse_snapshot_id("latest", "demo").latest


def test_the_directory_name_is_the_padded_spelling():
    assert step_dir_name(25) == "step-000000000025"
    assert parse_step_dir_name("step-000000000025") == 25
    assert parse_step_dir_name("step-25") is None  # a directory is always padded
    assert parse_snapshot_id("demo/" + step_dir_name(25)) == parse_snapshot_id("demo/step-25")


def test_a_bad_id_names_both_spellings():
    with pytest.raises(InvalidRequestError) as err:
        parse_snapshot_id("demo/25")
    assert "demo/step-25 or demo/step-000000000025" in str(err.value)


@pytest.mark.parametrize(
    ("given", "relative", "expected"),
    [
        ("demo/step-000000000025", False, "demo/step-25"),
        ("demo/step-25", False, "demo/step-25"),
        ("step-000000000025", True, "step-25"),  # still relative: the session's job resolves it
        ("demo/latest", True, "demo/latest"),
        ("latest", True, "latest"),
    ],
)
def test_the_server_accepts_both_spellings_and_passes_on_the_short_one(given, relative, expected):
    assert validate_snapshot_id(given, relative=relative, latest=True) == expected


def test_the_server_refuses_latest_where_a_step_is_needed():
    with pytest.raises(InvalidRequestError, match="demo/step-25"):
        validate_snapshot_id("demo/latest", relative=False, latest=False)
    with pytest.raises(InvalidRequestError):
        validate_snapshot_id("step-25", relative=False, latest=False)  # needs its job
