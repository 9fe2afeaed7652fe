# Blender declares properties as annotations holding bpy.props calls, on classes of its own:
# mypy: disable-error-code="valid-type, misc"
"""Blender add-on: submit the open .blend to a Tessera render farm (Properties > Output)."""

import threading
from typing import Any

import bpy

from . import client

bl_info = {
    "name": "Tessera Render Farm",
    "author": "Tessera",
    "version": (0, 1, 0),
    "blender": (4, 2, 0),
    "location": "Properties > Output > Tessera Render Farm",
    "description": "Upload the open file to a Tessera farm and render it in tiles on its workers",
    "doc_url": "",
    "category": "Render",
}

DEVICES = [("cpu", "CPU", "Render on CPU workers"), ("gpu", "GPU", "Render on GPU workers")]
FRAME_ORDERS = [
    ("sequential", "Sequential", "Frames in order"),
    ("first-last-middle", "First, last, middle", "Those three frames first, to see problems early"),
]


class TesseraPreferences(bpy.types.AddonPreferences):
    bl_idname = __package__

    farm_url: bpy.props.StringProperty(
        name="Farm URL",
        description="Address of the farm's web service",
        default="http://127.0.0.1:8080",
    )
    token: bpy.props.StringProperty(
        name="Access token",
        description="A token from the farm's administrator (farm token create)",
        subtype="PASSWORD",
    )
    project: bpy.props.StringProperty(
        name="Project",
        description="Project to submit to; empty means the first project the token may use",
    )

    def draw(self, context: Any) -> None:
        col = self.layout.column()
        col.prop(self, "farm_url")
        col.prop(self, "token")
        col.prop(self, "project")
        col.operator(TESSERA_OT_check.bl_idname, icon="URL")


class TesseraJobSettings(bpy.types.PropertyGroup):
    tiles: bpy.props.StringProperty(
        name="Tiles", default="2x2", description="Tile grid per frame, COLSxROWS"
    )
    samples: bpy.props.IntProperty(
        name="Samples", default=0, min=0, description="0 keeps the scene's samples"
    )
    priority: bpy.props.IntProperty(name="Priority", default=0)
    device: bpy.props.EnumProperty(name="Device", items=DEVICES, default="cpu")
    formats: bpy.props.StringProperty(
        name="Formats", default="exr,png", description="exr, png, png16, jpeg (comma separated)"
    )
    accept_missing: bpy.props.BoolProperty(
        name="Allow missing files",
        description="Render even when textures or libraries are missing on the farm",
    )
    tags: bpy.props.StringProperty(
        name="Worker tags", default="", description="Tags a worker must all have (comma separated)"
    )
    frame_order: bpy.props.EnumProperty(
        name="Frame order", items=FRAME_ORDERS, default="sequential"
    )
    last_job_url: bpy.props.StringProperty(name="Last job")


def _prefs(context: Any) -> Any:
    return context.preferences.addons[__package__].preferences


def _client(context: Any) -> client.FarmClient:
    prefs = _prefs(context)
    return client.FarmClient(prefs.farm_url, prefs.token)


def options_from_scene(scene: Any) -> client.SubmitOptions:
    """The job a scene asks for: its frame range and resolution plus the panel's settings."""
    s = scene.tessera
    pct = scene.render.resolution_percentage / 100.0
    width = max(1, int(scene.render.resolution_x * pct))
    height = max(1, int(scene.render.resolution_y * pct))
    return client.SubmitOptions(
        frames=client.frames_text(scene.frame_start, scene.frame_end, scene.frame_step),
        tiles=s.tiles,
        samples=s.samples or None,
        resolution=f"{width}x{height}",
        formats=s.formats,
        priority=s.priority,
        device=s.device,
        accept_missing=s.accept_missing,
        tags=s.tags,
        frame_order=s.frame_order,
        name=bpy.path.display_name_from_filepath(bpy.data.filepath) or None,
        # the scene's own denoise setting; the farm applies it once per stitched frame
        denoise=scene.render.engine == "CYCLES" and bool(scene.cycles.use_denoising),
    )


class TESSERA_OT_check(bpy.types.Operator):
    """Check that the farm answers and accepts the token"""

    bl_idname = "tessera.check_connection"
    bl_label = "Check connection"

    def execute(self, context: Any) -> set[str]:
        try:
            me = _client(context).me()
        except client.FarmClientError as e:
            self.report({"ERROR"}, str(e))
            return {"CANCELLED"}
        names = ", ".join(p.get("id", "") for p in me.get("projects", []))
        self.report({"INFO"}, f"Connected as {me.get('user')} (projects: {names})")
        return {"FINISHED"}


class TESSERA_OT_submit(bpy.types.Operator):
    """Save the file, upload it to the farm and submit a render job of the scene's frame range"""

    bl_idname = "tessera.submit"
    bl_label = "Submit to Tessera"

    _timer: Any = None
    _thread: threading.Thread | None = None
    _state: dict[str, Any]

    def _prepare(self, context: Any) -> tuple[client.FarmClient, client.SubmitOptions, str] | None:
        if not bpy.data.filepath:
            self.report({"ERROR"}, "Save the .blend first; the farm renders the saved file")
            return None
        if bpy.data.is_dirty:
            bpy.ops.wm.save_mainfile()
        try:
            farm = _client(context)
            options = options_from_scene(context.scene)
        except (client.FarmClientError, ValueError) as e:
            self.report({"ERROR"}, str(e))
            return None
        return farm, options, _prefs(context).project

    def _done(self, context: Any, result: client.Submitted) -> set[str]:
        context.scene.tessera.last_job_url = result.job_url
        self.report({"INFO"}, f"Tessera: job {result.job_id} queued: {result.job_url}")
        return {"FINISHED"}

    def execute(self, context: Any) -> set[str]:
        """Submit in the foreground: scripts and `blender -b file.blend --python-expr ...`."""
        prepared = self._prepare(context)
        if prepared is None:
            return {"CANCELLED"}
        farm, options, project = prepared
        try:
            result = farm.submit_blend(bpy.data.filepath, options, project)
        except client.FarmClientError as e:
            self.report({"ERROR"}, f"Tessera: {e}")
            return {"CANCELLED"}
        return self._done(context, result)

    def invoke(self, context: Any, event: Any) -> set[str]:
        """Submit from the UI: the upload runs in a thread, the status bar shows its progress."""
        prepared = self._prepare(context)
        if prepared is None:
            return {"CANCELLED"}
        farm, options, project = prepared
        path = bpy.data.filepath
        self._state = {"stage": "upload", "done": 0, "total": 1, "result": None, "error": None}
        state = self._state

        def progress(stage: str, done: int, total: int) -> None:
            state.update(stage=stage, done=done, total=total)

        def work() -> None:
            try:
                state["result"] = farm.submit_blend(path, options, project, progress)
            except Exception as e:  # any failure must reach modal(), or it waits forever
                state["error"] = str(e)

        # network work runs off Blender's main thread; the thread never touches bpy
        self._thread = threading.Thread(target=work, name="tessera-submit", daemon=True)
        self._thread.start()
        self._timer = context.window_manager.event_timer_add(0.2, window=context.window)
        context.window_manager.modal_handler_add(self)
        return {"RUNNING_MODAL"}

    def modal(self, context: Any, event: Any) -> set[str]:
        if event.type != "TIMER":
            return {"PASS_THROUGH"}
        state = self._state
        if self._thread is not None and self._thread.is_alive():
            if state["stage"] == "upload" and state["total"]:
                pct = 100 * state["done"] // state["total"]
                text = f"Tessera: uploading {pct}%"
            else:
                text = f"Tessera: {state['stage']}…"
            context.workspace.status_text_set(text)
            return {"RUNNING_MODAL"}
        context.window_manager.event_timer_remove(self._timer)
        context.workspace.status_text_set(None)
        if state["error"]:
            self.report({"ERROR"}, f"Tessera: {state['error']}")
            return {"CANCELLED"}
        return self._done(context, state["result"])


class TESSERA_OT_open_job(bpy.types.Operator):
    """Open the last submitted job's page in the web browser"""

    bl_idname = "tessera.open_job"
    bl_label = "Open job page"

    @classmethod
    def poll(cls, context: Any) -> bool:
        return bool(context.scene.tessera.last_job_url)

    def execute(self, context: Any) -> set[str]:
        bpy.ops.wm.url_open(url=context.scene.tessera.last_job_url)
        return {"FINISHED"}


class TESSERA_PT_submit(bpy.types.Panel):
    bl_label = "Tessera Render Farm"
    bl_space_type = "PROPERTIES"
    bl_region_type = "WINDOW"
    bl_context = "output"

    def draw(self, context: Any) -> None:
        s = context.scene.tessera
        layout = self.layout
        layout.use_property_split = True
        col = layout.column()
        col.label(text=_prefs(context).farm_url, icon="WORLD")
        col.prop(s, "tiles")
        col.prop(s, "samples")
        col.prop(s, "device")
        col.prop(s, "formats")
        col.prop(s, "priority")
        col.prop(s, "tags")
        col.prop(s, "frame_order")
        col.prop(s, "accept_missing")
        layout.operator(TESSERA_OT_submit.bl_idname, icon="RENDER_ANIMATION")
        if s.last_job_url:
            layout.operator(TESSERA_OT_open_job.bl_idname, icon="URL")


CLASSES = (
    TesseraPreferences,
    TesseraJobSettings,
    TESSERA_OT_check,
    TESSERA_OT_submit,
    TESSERA_OT_open_job,
    TESSERA_PT_submit,
)


def register() -> None:
    for cls in CLASSES:
        bpy.utils.register_class(cls)
    bpy.types.Scene.tessera = bpy.props.PointerProperty(type=TesseraJobSettings)


def unregister() -> None:
    del bpy.types.Scene.tessera
    for cls in reversed(CLASSES):
        bpy.utils.unregister_class(cls)
