"""The stream service's pure parts: catalog, TURN credentials, stamp, key names."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from av.codec.context import CodecContext
from av.video.frame import VideoFrame

from encoder.catalog import Catalog
from encoder.testpattern import MIN_HEIGHT, MIN_WIDTH, Scene, draw, read_stamp
from encoder.turn import ice_servers
from encoder.videoencoder import EncoderConfig, X264Encoder
from encoder.xinput import keysym_name
from farm.errors import BadParameter, NotFound
from farm.settings import Settings


def test_the_catalog_has_the_built_ins_and_a_file_adds_or_replaces_apps(tmp_path: Path) -> None:
    assert {"desktop", "game", "testpattern"} <= set(Catalog.load(None).apps)
    path = tmp_path / "apps.json"
    path.write_text(json.dumps([
        {"name": "glxgears", "command": ["glxgears"], "width": 800, "height": 600, "fps": 30},
        {"name": "desktop", "title": "Bigger desktop", "command": ["xterm"], "width": 1920,
         "height": 1080},
    ]))  # fmt: skip
    catalog = Catalog.load(path)
    assert catalog.get("glxgears").fps == 30 and catalog.get("desktop").width == 1920
    toml = tmp_path / "apps.toml"
    toml.write_text('[[apps]]\nname = "x"\ncommand = ["xeyes"]\nfps = 30\n')
    assert Catalog.load(toml).get("x").command == ("xeyes",)
    with pytest.raises(NotFound, match="no app 'nope'"):
        catalog.get("nope")
    assert catalog.get("game").sized(320, 240, None).fps == 60


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"name": "a", "command": "xterm"}, "list of strings"),
        ({"name": "a", "command": ["x"], "width": 7}, "width"),
        ({"name": "a", "command": ["x"], "width": 641}, "even"),
        ({"name": "a", "command": ["x"], "colour": 1}, "unknown field"),
        ({"name": "testpattern", "command": ["x"]}, "name"),
    ],
)
def test_a_bad_catalog_file_is_refused_with_the_reason(
    tmp_path: Path, entry: dict[str, object], match: str
) -> None:
    path = tmp_path / "apps.json"
    path.write_text(json.dumps([entry]))
    with pytest.raises(BadParameter, match=match):
        Catalog.load(path)
    with pytest.raises(BadParameter, match="cannot be read"):
        Catalog.load(tmp_path / "missing.json")


def test_turn_credentials_follow_the_rest_scheme() -> None:
    settings = Settings().with_(
        stun_urls="stun:stun.example:3478",
        turn_urls="turn:turn.example:3478?transport=udp, turns:turn.example:5349",
        turn_secret="s3cret",
        turn_ttl_s=600,
    )
    stun, turn = ice_servers(settings, "alice", now_s=1_000_000)
    assert stun == {"urls": ["stun:stun.example:3478"]}
    assert turn["urls"] == ["turn:turn.example:3478?transport=udp", "turns:turn.example:5349"]
    assert turn["username"] == "1000600:alice"
    expected = hmac.new(b"s3cret", b"1000600:alice", hashlib.sha1).digest()
    assert base64.b64decode(turn["credential"]) == expected
    assert ice_servers(Settings(), "bob") == []


def test_the_stamp_survives_encoding_and_decoding() -> None:
    scene = Scene(MIN_WIDTH, MIN_HEIGHT * 2)
    encoder = X264Encoder(EncoderConfig(MIN_WIDTH, MIN_HEIGHT * 2, 30, 300_000, 300_000, 300_000))
    decoder = CodecContext.create("h264", "r")
    stamps = [(i * 7919, 1_764_000_000_000_000 + i * 33_333) for i in range(5)]
    read: list[tuple[int, int]] = []
    for counter, capture_us in stamps:
        frame = VideoFrame.from_ndarray(scene.yuv420p(counter, capture_us), format="yuv420p")
        frame.pts = counter
        for packet in encoder.encode(frame):
            read.extend(read_stamp(gray(decoded)) for decoded in decoder.decode(packet))
    # zero latency: each frame is out of the encoder and the decoder before the next goes in
    assert read == stamps
    bgra = draw(12345, 6789, 640, 360)
    assert bgra.shape == (360, 640, 4)
    assert read_stamp(gray(VideoFrame.from_ndarray(bgra, format="bgra"))) == (12345, 6789)


def gray(frame: VideoFrame) -> npt.NDArray[np.uint8]:
    return np.asarray(frame.to_ndarray(format="gray"), dtype=np.uint8)


def test_dom_key_codes_map_to_x_keysyms() -> None:
    assert keysym_name("KeyW") == "w" and keysym_name("Digit7") == "7"
    assert keysym_name("ArrowLeft") == "Left" and keysym_name("Enter") == "Return"
    assert keysym_name("F12") == "F12" and keysym_name("Numpad4") == "KP_4"
    assert keysym_name("ShiftLeft") == "Shift_L"
    assert keysym_name("F99") is None and keysym_name("Unknown") is None
