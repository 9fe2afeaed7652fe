"""A display's CLIPBOARD as text, both ways: what a viewer pastes becomes the selection the
display's apps read; what an app copies is handed to ``on_copy`` (python-xlib, XFixes).

One X connection and one thread per clipboard; ``paste`` may be called from any thread. Apps
run it too (encoder/probeapp.py, in a sandbox that holds the encoder package alone), so it
imports nothing of farm/.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import threading
from collections.abc import Callable
from typing import Any

from Xlib import X, Xatom, display, error
from Xlib.ext import xfixes
from Xlib.protocol import event as xevent

log = logging.getLogger("tessera.stream")

#: the most clipboard text taken or given, in UTF-8 bytes (larger texts are cut, no INCR)
MAX_TEXT_BYTES = 256 * 1024
#: how often the thread looks at its stop flag when nothing happens
IDLE_S = 0.5


class NoClipboard(Exception):
    """The display cannot share its clipboard (gone, or without XFIXES)."""


class Clipboard:
    """Owner of CLIPBOARD when a viewer pastes; watcher of every other owner's copies."""

    def __init__(
        self, display_name: str, on_copy: Callable[[str], None], name: str = "clipboard"
    ) -> None:
        try:
            self.disp = display.Display(display_name)
        except (error.DisplayError, error.ConnectionClosedError, OSError) as exc:
            raise NoClipboard(f"cannot open X display {display_name}: {exc}") from exc
        if not self.disp.has_extension("XFIXES"):
            self.disp.close()
            raise NoClipboard(f"X display {display_name} has no XFIXES extension")
        self.on_copy = on_copy
        root = self.disp.screen().root
        self.window = root.create_window(0, 0, 1, 1, 0, X.CopyFromParent, X.InputOnly)
        atom = self.disp.intern_atom
        self.CLIPBOARD, self.UTF8, self.TARGETS = (
            atom("CLIPBOARD"), atom("UTF8_STRING"), atom("TARGETS"))  # fmt: skip
        self.TEXT, self.PROPERTY = atom("TEXT"), atom("TESSERA_CLIPBOARD")
        self.disp.xfixes_query_version()
        self.disp.xfixes_select_selection_input(
            root, self.CLIPBOARD, xfixes.XFixesSetSelectionOwnerNotifyMask
        )
        self._owner_notify = self.disp.extension_event.SetSelectionOwnerNotify
        self.disp.flush()
        #: the text this clipboard offers while it owns the selection
        self.owned: bytes | None = None
        self._pastes: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._guarded, name=name, daemon=True)

    def start(self) -> Clipboard:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """Still serving (its display connection closes when the display goes away)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def paste(self, text: str) -> None:
        """Make ``text`` the display's clipboard (apps read it on their next paste)."""
        self._pastes.put(_cut(text))
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"p")

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"s")
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(2.0)
        with contextlib.suppress(Exception):
            self.disp.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _guarded(self) -> None:
        try:
            self._run()
        except (error.ConnectionClosedError, OSError) as exc:
            if not self._stop.is_set():
                log.info("event=clipboard_closed error=%r", exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            while self.disp.pending_events():
                self._handle(self.disp.next_event())
            ready, _, _ = select.select([self.disp.fileno(), self._wake_r], [], [], IDLE_S)
            if self._wake_r in ready:
                os.read(self._wake_r, 64)
                while not self._pastes.empty():
                    self._own(self._pastes.get())
            if self.disp.fileno() in ready:
                # reads what the server sent (pending_events alone does not read the socket)
                self.disp.pending_events()

    def _own(self, data: bytes) -> None:
        self.owned = data
        self.window.set_selection_owner(self.CLIPBOARD, X.CurrentTime)
        self.disp.flush()

    def _handle(self, ev: Any) -> None:
        # python-xlib clones extension event classes per display: match by code, not class
        if (ev.type, getattr(ev, "sub_code", None)) == self._owner_notify:
            if _id(ev.owner) not in (X.NONE, self.window.id):
                # another client copied: ask it for the text (it answers with SelectionNotify)
                self.window.convert_selection(
                    self.CLIPBOARD, self.UTF8, self.PROPERTY, ev.selection_timestamp
                )
                self.disp.flush()
        elif ev.type == X.SelectionNotify:
            if ev.property != X.NONE and _id(ev.requestor) == self.window.id:
                prop = self.window.get_full_property(self.PROPERTY, X.AnyPropertyType)
                self.window.delete_property(self.PROPERTY)
                if prop is not None and isinstance(prop.value, bytes):
                    self.on_copy(prop.value[:MAX_TEXT_BYTES].decode("utf-8", "replace"))
        elif ev.type == X.SelectionRequest:
            self._answer(ev)
        elif ev.type == X.SelectionClear:
            self.owned = None

    def _answer(self, req: Any) -> None:
        """Give a requesting app the owned text (or the list of targets it can have)."""
        prop = req.property if req.property != X.NONE else req.target
        requestor = self.disp.create_resource_object("window", _id(req.requestor))
        if self.owned is None:
            prop = X.NONE
        elif req.target == self.TARGETS:
            targets = [self.TARGETS, self.UTF8, self.TEXT, Xatom.STRING]
            requestor.change_property(prop, Xatom.ATOM, 32, targets)
        elif req.target in (self.UTF8, self.TEXT, Xatom.STRING):
            requestor.change_property(prop, req.target, 8, self.owned)
        else:
            prop = X.NONE
        reply = xevent.SelectionNotify(
            time=req.time, requestor=_id(req.requestor), selection=req.selection,
            target=req.target, property=prop,
        )  # fmt: skip
        requestor.send_event(reply)
        self.disp.flush()


def _cut(text: str) -> bytes:
    return text.encode("utf-8")[:MAX_TEXT_BYTES].decode("utf-8", "ignore").encode("utf-8")


def _id(resource: Any) -> int:
    """The XID of a window field (python-xlib gives a resource object or a plain number)."""
    return int(getattr(resource, "id", resource))
