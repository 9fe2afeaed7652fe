"""The stream secret of the tests' stream services and the tokens made from it."""

from __future__ import annotations

from farm import streamauth

#: FARM_STREAM_SECRET of every stream service the tests start
STREAM_SECRET = "test-stream-secret-" + "x" * 32


def operator() -> str:
    return streamauth.operator_token(STREAM_SECRET, 3600)


def operator_headers() -> dict[str, str]:
    """Headers of an operator's calls to a stream service (every route answers them)."""
    return {"Authorization": f"Bearer {operator()}"}


def viewer(session: str, role: str = "controller", project: str = "", desktop: bool = False) -> str:
    return streamauth.viewer_token(STREAM_SECRET, project, session, role, 300, desktop=desktop)
