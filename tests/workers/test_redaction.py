"""What a member may read of an error: other jobs' ids hidden, in a farm of cells too."""

from __future__ import annotations

from workers import redaction


def test_other_jobs_ids_are_hidden_with_their_cell_and_the_own_one_kept() -> None:
    own, other = "c2-20261207-101500-0123abcd", "c1-20261207-101501-89abcdef"
    plain = "20261207-101502-fedcba98"
    text = f"frame of {own} waits for {other} and {plain}"
    assert redaction.public(text, own) == f"frame of {own} waits for … and …"
