"""Who drives a session's input, and what the controlling viewer's data-channel messages do
(XTest into the session's display, its clipboard both ways); everyone else is view-only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from encoder.catalog import App, check_geometry
from encoder.clipboard import Clipboard, NoClipboard
from encoder.gamepad import MAX_PADS, PadState, VirtualPad, open_pad
from encoder.xinput import XInput
from farm.errors import BadParameter

log = logging.getLogger("tessera.stream")

#: data-channel messages that drive the session (everything but ping needs control)
INPUT_TYPES = frozenset({"mm", "mb", "wh", "kd", "ku", "resize", "clip", "record", "gp"})


class InputControl:
    """One controlling viewer at most; its pointer, buttons, wheel and keys go to ``target``.

    ``video_size`` says the size the video is encoded at (pointer positions arrive in video
    pixels); ``resize`` asks for another size: it gives the display's new size, or None where
    only the video was scaled (no display). ``send`` gives a viewer a message:
    the controlling viewer gets ``{"t": "clip", "text": ...}`` whenever an app copies text.
    ``record`` starts or stops the session's recording, ``recording`` says whether it runs
    (every viewer's pong carries it, so a viewer joining later is told too).
    """

    def __init__(
        self,
        session_id: str,
        app: App,
        target: Callable[[], XInput | None],
        video_size: Callable[[], tuple[int, int]],
        resize: Callable[[int, int], tuple[int, int] | None],
        send: Callable[[str, dict[str, Any]], None] | None = None,
        record: Callable[[bool], None] | None = None,
        recording: Callable[[], bool] | None = None,
        pad_devices: Callable[[], tuple[Path, int, int] | None] | None = None,
    ) -> None:
        self.session_id, self.app = session_id, app
        self.target, self.video_size, self.resize = target, video_size, resize
        self.send, self.record, self.recording = send, record, recording
        self.pad_devices = pad_devices
        self.controller: str | None = None
        self.denied = 0
        self.clipboard: Clipboard | None = None
        #: each gamepad's last state from the controlling viewer, by its Gamepad API index
        self.pads: dict[int, PadState] = {}
        #: each gamepad's virtual controller (None where none can be made)
        self.controllers: dict[int, VirtualPad | None] = {}
        #: the folder each controller's device nodes were last made in (the sandbox's)
        self._exposed: dict[int, Path] = {}
        #: the size of the display the pointer moves on
        self.screen = (app.width, app.height)
        #: the input target ``screen`` was measured on (a restarted display starts anew)
        self._screen_of: XInput | None = None

    def joined(self, viewer_id: str, role: str) -> str:
        """The role a joining viewer gets: the first player controls, later ones watch."""
        if role == "player" and self.controller is None:
            self.controller = viewer_id
            self._watch_clipboard()
            return "player"
        return "spectator"

    def left(self, viewer_id: str) -> None:
        if self.controller == viewer_id:
            self.controller = None
            self.release_all()

    def hand_to(self, viewer_id: str) -> None:
        if self.controller != viewer_id:
            self.release_all()
            self.controller = viewer_id
            self._watch_clipboard()
            log.info("event=control_handed session=%s viewer=%s", self.session_id, viewer_id)

    def release_all(self) -> None:
        """Let go of whatever the previous controller held (no stuck keys or buttons)."""
        for index in list(self.pads):
            self._pad(index, PadState((), ()))
        target = self.target()
        if target is not None:
            with contextlib.suppress(Exception):
                target.release_all()

    def _watch_clipboard(self) -> None:
        """Share the display's clipboard (from when a viewer first takes control; again after
        the display was restarted, which closed the old one's connection)."""
        target = self.target()
        if self.clipboard is not None and not self.clipboard.alive:
            self.clipboard.close()
            self.clipboard = None
        if self.clipboard is not None or self.send is None or target is None:
            return
        loop = asyncio.get_running_loop()

        def copied(text: str) -> None:  # on the clipboard's thread
            with contextlib.suppress(RuntimeError):  # the loop closed: the service stopped
                loop.call_soon_threadsafe(self._copied, text)

        try:
            self.clipboard = Clipboard(
                target.disp.get_display_name(), copied, name=f"clipboard-{self.session_id}"
            ).start()
            log.info("event=clipboard_shared session=%s", self.session_id)
        except NoClipboard as exc:
            log.warning("event=clipboard_unavailable session=%s error=%r", self.session_id, exc)

    def _copied(self, text: str) -> None:
        if self.controller is not None and self.send is not None:
            self.send(self.controller, {"t": "clip", "text": text})

    def close(self) -> None:
        """Stop sharing the clipboard and remove the virtual pads (the session ends)."""
        if self.clipboard is not None:
            self.clipboard.close()
            self.clipboard = None
        for pad in self.controllers.values():
            if pad is not None:
                pad.close()
        self.controllers.clear()
        self._exposed.clear()

    def _pad(self, index: int, state: PadState) -> None:
        self.pads[index] = state
        if index not in self.controllers:
            # uinput's controller, else the shim's for a sandboxed app; else only the state
            sandboxed = self.pad_devices is not None and self.pad_devices() is not None
            self.controllers[index] = open_pad(index, sandboxed=sandboxed)
        pad = self.controllers[index]
        if pad is not None:
            self._expose(index, pad)
            pad.apply(state)

    def _expose(self, index: int, pad: VirtualPad) -> None:
        """Put a controller's device nodes where the sandboxed app sees them, once per sandbox
        (a restarted display's sandbox has a new /dev/input folder)."""
        where = self.pad_devices() if self.pad_devices is not None else None
        if where is None or self._exposed.get(index) == where[0]:
            return
        self._exposed[index] = where[0]  # tried: a failure is not tried again for each state
        try:
            nodes = pad.expose(*where)
        except OSError as exc:  # mknod needs root; the pad then works for host apps only
            log.warning("event=gamepad_not_in_sandbox session=%s error=%r", self.session_id,
                        exc.strerror)  # fmt: skip
            return
        log.info("event=gamepad_in_sandbox session=%s nodes=%s", self.session_id,
                 ",".join(node.name for node in nodes))  # fmt: skip

    def handle(self, viewer_id: str, message: dict[str, Any]) -> dict[str, Any] | None:
        """Apply one data-channel message; the reply to send back, if any."""
        kind = message.get("t")
        if kind == "ping":
            if viewer_id == self.controller:
                self._watch_clipboard()
            recording = self.recording is not None and self.recording()
            return {"t": "pong", "ts": message.get("ts"), "rec": recording}
        if kind not in INPUT_TYPES:
            return None
        if viewer_id != self.controller:
            self.denied += 1
            return {"t": "denied"}
        try:
            self._apply(str(kind), message)
        except (TypeError, ValueError, KeyError, BadParameter) as exc:
            log.debug("event=input_ignored session=%s message=%r error=%r", self.session_id,
                      message, exc)  # fmt: skip
        except Exception as exc:
            log.warning("event=input_failed session=%s error=%r", self.session_id, exc)
        return None

    def _apply(self, kind: str, m: dict[str, Any]) -> None:
        if kind == "gp":
            index = int(m.get("i", 0))
            if not 0 <= index < MAX_PADS:
                raise ValueError(f"gamepad index {index} is not 0 to {MAX_PADS - 1}")
            self._pad(index, PadState.parse(m))
            return
        if kind == "record":
            if self.record is not None:
                self.record(m["on"] is True)
            return
        if kind == "clip":
            text = m["text"]
            if not isinstance(text, str):
                raise TypeError("clipboard text must be a string")
            if self.clipboard is not None:
                self.clipboard.paste(text)
            return
        if kind == "resize":
            # the display takes the viewer's size (within its limit); without a display the
            # video scales instead
            width, height = int(m["w"]) // 2 * 2, int(m["h"]) // 2 * 2
            check_geometry(width, height, self.app.fps)
            screen = self.resize(width, height)
            if screen is not None:
                self.screen, self._screen_of = screen, self.target()
            return
        target = self.target()
        if target is None:
            return
        if kind == "mm":
            width, height = self.video_size()
            if self._screen_of is not target:
                # a display restarted since the last resize has the app's own size again
                self.screen, self._screen_of = (self.app.width, self.app.height), target
            screen_w, screen_h = self.screen
            x = int(m["x"]) * screen_w // width
            y = int(m["y"]) * screen_h // height
            target.move(max(0, min(screen_w - 1, x)), max(0, min(screen_h - 1, y)))
        elif kind == "mb":
            target.button(int(m["b"]), bool(m["d"]))
        elif kind == "wh":
            target.wheel(int(m.get("dx", 0)), int(m.get("dy", 0)))
        else:
            target.key(str(m["code"]), kind == "kd")
