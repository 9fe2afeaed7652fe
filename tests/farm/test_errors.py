"""Errors cross process boundaries as dicts and come back as the same class."""

from __future__ import annotations

from farm.errors import FarmError, MissingFiles, RenderError, error_class


def _tree(cls: type[FarmError]) -> list[type[FarmError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _tree(sub))]


def test_every_error_comes_back_as_its_own_class() -> None:
    classes = _tree(FarmError)
    assert len({cls.code for cls in classes}) == len(classes), "two errors share a code"
    for cls in classes:
        assert error_class(cls.code) is cls


def test_fields_survive_the_round_trip_and_unknown_codes_fall_back() -> None:
    sent = MissingFiles("2 files missing", paths=["/a.png", "/b.png"]).to_dict()
    cls = error_class(sent.pop("error"))
    back = cls(sent.pop("message"), **sent)
    assert isinstance(back, MissingFiles) and back.fields["paths"] == ["/a.png", "/b.png"]
    assert error_class("from_a_newer_worker") is FarmError
    assert error_class("from_a_newer_worker", default=RenderError) is RenderError
