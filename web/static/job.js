// Job page: live tile grid per frame from the job's server-sent events, thumbnails, log, actions.
import { api, el, $, badge, progressBar, fmtBytes, fmtFrames, fmtTime, fmtDuration, startPage, toast, withButton } from "./app.js";
import { estimateText } from "./estimate.js";
import { waitingNote, watchWaiting } from "./waiting.js";

const FINAL = new Set(["done", "failed", "canceled"]);
const jobId = decodeURIComponent(location.pathname.replace(/^\/jobs\//, "").replace(/\/$/, ""));
const base = "/api/jobs/" + encodeURIComponent(jobId);

let job = null;
let grid = { cols: 1, rows: 1 };
const frames = new Map(); // frame number -> {state, tiles: [state], node, cells: [node]}
const seen = new Set(); // keys of log lines already shown
let source = null;
let clock = null;
let lastEventId = ""; // the newest event seen: a new stream goes on from there
let canEdit = true; // a viewer of the job's project follows it but changes nothing
let filesError = null; // why the frame files could not be listed, until they can

function parseGrid(text) {
  const m = /^\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*$/.exec(String(text || "1x1"));
  const cols = m ? parseInt(m[1], 10) : 1;
  return { cols, rows: m && m[2] ? parseInt(m[2], 10) : cols };
}

// --- frames and their tile grids ---------------------------------------------------------------

function frameCard(n) {
  const spec = job.spec || {};
  const ratio = spec.width && spec.height ? (100 * spec.height) / spec.width : 56.25;
  const tg = el("div", { class: "tilegrid", style: `grid-template-columns:repeat(${grid.cols},1fr);grid-template-rows:repeat(${grid.rows},1fr)` });
  const cells = new Array(grid.cols * grid.rows);
  // tile index 0 is the bottom-left tile (Blender's y counts up): draw the top row first
  for (let dr = 0; dr < grid.rows; dr++) {
    const row = grid.rows - 1 - dr;
    for (let col = 0; col < grid.cols; col++) {
      const index = row * grid.cols + col;
      const cell = el("div", { class: "tile queued", title: `tile ${index}`, dataset: { tile: index } });
      cells[index] = cell;
      tg.append(cell);
    }
  }
  const img = el("img", { alt: `frame ${n}`, class: "thumb", loading: "lazy" });
  const view = el("div", { class: "frame-view", style: `padding-top:${Math.min(ratio, 150)}%` }, tg, img);
  const state = el("span", { class: "frame-state" });
  const files = el("div", { class: "files" });
  const node = el("div", { class: "frame", dataset: { frame: n } }, view,
    el("div", { class: "frame-meta" }, el("span", { class: "n" }, `#${n}`), state, files));
  return { state: "queued", tiles: new Array(cells.length).fill("queued"), node, cells, img, view, stateNode: state, files, thumb: false };
}

function setTile(f, index, state) {
  const fr = frames.get(f);
  if (!fr || index < 0 || index >= fr.cells.length) return;
  // a late event cannot undo a finished tile (events may replay after a reconnect)
  if (fr.tiles[index] === "done" && state !== "done" && state !== "queued") return;
  fr.tiles[index] = state;
  fr.cells[index].className = "tile " + state;
  fr.cells[index].title = `tile ${index}: ${state}`;
}

function setFrameState(f, state) {
  const fr = frames.get(f);
  if (!fr) return;
  fr.state = state;
  fr.stateNode.replaceChildren(badge(state));
  if (state === "done") {
    fr.tiles.forEach((_, i) => setTile(f, i, "done"));
    showThumb(f);
  }
}

function showThumb(f) {
  const fr = frames.get(f);
  if (!fr || fr.thumb) return;
  fr.thumb = true;
  fr.img.onload = () => { fr.img.classList.add("shown"); fr.view.classList.add("has-thumb"); };
  fr.img.onerror = () => { fr.thumb = false; };
  fr.img.src = `${base}/frames/${f}/thumbnail`;
}

function showFiles(list) {
  for (const item of list || []) {
    const fr = frames.get(Number(item.frame));
    if (!fr) continue;
    fr.files.replaceChildren(...(item.files || []).map((file) =>
      el("a", { href: file.url || `${base}/frames/${item.frame}/${encodeURIComponent(file.name)}`, download: file.name,
        title: `${file.name} · ${fmtBytes(file.size)}` }, (file.name.split(".").pop() || "file"))));
    if ((item.files || []).length) showThumb(Number(item.frame));
  }
}

async function loadFiles() {
  let data;
  try {
    data = await api(base + "/frames"); // no frame delivered yet: an empty list, not an error
  } catch (e) {
    filesError = e.message || String(e);
    drawNotes();
    return;
  }
  if (filesError) { filesError = null; drawNotes(); }
  showFiles(data.frames);
  // the animation's MP4 preview, delivered with its last frame
  const mp4 = (data.files || []).find((f) => f.name === "preview.mp4");
  const link = $("#preview-mp4");
  if (mp4 && link) {
    link.href = mp4.url;
    link.title = `H.264 preview of every frame · ${fmtBytes(mp4.size)}`;
    link.hidden = false;
  }
}

function buildFrames() {
  const spec = job.spec || {};
  // a sample split renders whole frames in parts: one cell per part
  grid = spec.mode === "sample_split" ? { cols: spec.split_parts || 1, rows: 1 } : parseGrid(spec.tiles);
  frames.clear();
  const numbers = (job.spec && job.spec.frames) || Object.keys(job.frames || {}).map(Number);
  const box = $("#frames");
  box.replaceChildren();
  for (const n of numbers) {
    const fr = frameCard(n);
    frames.set(Number(n), fr);
    box.append(fr.node);
  }
  for (const [n, info] of Object.entries(job.frames || {})) {
    const f = Number(n);
    (info.tiles || []).forEach((s, i) => setTile(f, i, s));
    setFrameState(f, info.state || "queued");
  }
  for (const n of frames.keys()) if (!frames.get(n).stateNode.firstChild) setFrameState(n, "queued");
}

// --- header, stats and notes ---------------------------------------------------------------------

function countTiles() {
  let done = 0, failed = 0, total = 0, framesDone = 0;
  for (const fr of frames.values()) {
    total += fr.tiles.length;
    done += fr.tiles.filter((s) => s === "done").length;
    failed += fr.tiles.filter((s) => s === "failed").length;
    if (fr.state === "done") framesDone++;
  }
  return { done, failed, total, framesDone };
}

function drawHeader() {
  const spec = job.spec || {};
  document.title = `${spec.name || jobId} · Tessera`;
  $("#job-name").textContent = spec.name || jobId;
  $("#job-id").textContent = `${jobId} · ${spec.source ? spec.source.name : ""} · project ${spec.project || ""}`;
  $("#job-state").replaceChildren(badge(job.state));
  if (document.activeElement !== $("#priority")) $("#priority").value = spec.priority ?? 0;
  const final = FINAL.has(job.state) || !canEdit;
  $("#cancel").disabled = final;
  $("#priority").disabled = final;
  $("#set-priority").disabled = final;
  $("#retry").disabled = !canEdit || !(job.state === "failed" || countTiles().failed > 0);
  $("#suspend").hidden = job.state === "suspended";
  $("#suspend").disabled = !canEdit || !(job.state === "queued" || job.state === "running");
  $("#resume").hidden = job.state !== "suspended";
  $("#resume").disabled = !canEdit;
  $("#requeue").disabled = !canEdit;
  $("#archive").textContent = job.archived_s ? "Unarchive" : "Archive";
  $("#archive").disabled = !canEdit || !(FINAL.has(job.state) || job.archived_s);
  $("#delete").disabled = !canEdit;
  const any = countTiles().framesDone > 0 || (job.frames_done || 0) > 0;
  const dl = $("#download-all");
  dl.href = base + "/download.zip";
  dl.classList.toggle("disabled", !any);
  dl.setAttribute("aria-disabled", String(!any));
  dl.title = any ? "Every delivered frame file in one zip" : "No frame has been delivered yet";
  drawStats();
  drawNotes();
}

function drawStats() {
  const spec = job.spec || {};
  const c = countTiles();
  const tilesDone = Math.max(c.done, job.state === "done" ? c.total : 0);
  const elapsed = job.started_s ? (job.finished_s || Date.now() / 1000) - job.started_s : null;
  const stat = (k, v, cls = "") => el("div", { class: "stat" }, el("div", { class: "k" }, k), el("div", { class: "v " + cls }, v));
  $("#stats").replaceChildren(
    el("div", { class: "stat wide" }, el("div", { class: "k" }, "Progress"),
      el("div", { class: "v", id: "progress-text" }, `${c.total ? Math.round((100 * tilesDone) / c.total) : 0}%`),
      progressBar(tilesDone, c.total, job.state)),
    stat("Tiles", `${tilesDone} / ${c.total}`),
    stat("Frames", `${c.framesDone} / ${frames.size}`),
    stat("Failed tiles", String(Math.max(c.failed, 0))),
    stat("Frame list", fmtFrames(spec.frames), "small mono"),
    spec.mode === "sample_split"
      ? stat("Split", `${spec.split_parts} sample parts`, "small")
      : stat("Grid", spec.tiles || "", "small mono"),
    stat("Resolution", spec.width ? `${spec.width}×${spec.height}` : "—", "small"),
    stat("Samples", spec.samples ? String(spec.samples) : "as saved", "small"),
    stat("Device", String(spec.device || "").toUpperCase(), "small"),
    stat("Formats", (spec.formats || []).join(", "), "small"),
    stat("Submitted", fmtTime(job.created_s), "small"),
    stat("Elapsed", fmtDuration(elapsed), "small"),
    estimateText(job) && stat("Render time", estimateText(job), "small estimate"));
}

function drawNotes() {
  const notes = [];
  if (job.state === "failed" && job.reason) {
    notes.push(el("div", { class: "callout bad", id: "reason" }, el("strong", {}, "The job failed"), job.reason));
  } else if (job.state === "canceled") {
    notes.push(el("div", { class: "callout" }, el("strong", {}, "Canceled"), job.reason || "The job was canceled."));
  }
  if (job.state === "waiting") {
    notes.push(el("div", { class: "callout" }, el("strong", {}, "Waiting"),
      `Its tiles are queued once ${((job.spec || {}).depends_on || []).join(", ")} ${((job.spec || {}).depends_on || []).length > 1 ? "are" : "is"} done.`));
  }
  if (job.scripts_blocked) {
    notes.push(el("div", { class: "callout warn" }, el("strong", {}, "Scripts blocked"),
      "This file wanted to run Python (auto-run scripts or drivers); it rendered with scripts off."));
  }
  const waiting = waitingNote(job);
  if (waiting) notes.push(waiting);
  for (const w of job.warnings || []) notes.push(el("div", { class: "callout warn" }, w));
  if (filesError) {
    notes.push(el("div", { class: "callout bad", id: "files-error" }, el("strong", {}, "Cannot list the frame files"), filesError));
  }
  $("#notes").replaceChildren(...notes);
}

// --- log -------------------------------------------------------------------------------------------

function eventKey(ev) {
  return ev.id || [ev.ts, ev.type, ev.state, ev.frame, ev.tile, ev.attempt, ev.message].join("|");
}

function where(ev) {
  if (ev.frame === undefined || ev.frame === null) return "";
  return `frame ${ev.frame}` + (ev.tile !== undefined && ev.tile !== null ? ` tile ${ev.tile}` : "");
}

const said = (ev) => (ev.message ? ": " + ev.message : "");

function logLine(ts, text, level) {
  const log = $("#log");
  const stick = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  log.append(el("div", { class: level }, el("span", { class: "t" }, ts ? new Date(ts * 1000).toLocaleTimeString() : ""), text));
  if (stick) log.scrollTop = log.scrollHeight;
}

function logEvent(ev, kind) {
  const key = eventKey(ev);
  if (seen.has(key)) return;
  seen.add(key);
  const line = kind.log(ev);
  if (line) logLine(ev.ts, line, kind.level(ev));
}

// --- live events -----------------------------------------------------------------------------------

function setLive(on, text) {
  $("#live").classList.toggle("on", on);
  $("#live span").textContent = text;
}

/**
 * Every kind of event the job's stream sends (farm/models.py Event.type), and what the page does
 * with it: `apply` to the grid and the job, `log` (the log line, or "" for none) and its `level`.
 */
const EVENTS = Object.freeze({
  job_state: {
    apply(ev) {
      job.state = ev.state;
      if (ev.message && ev.state === "failed") job.reason = ev.message;
      if (FINAL.has(ev.state)) finish();
    },
    log: (ev) => `job ${ev.state}${said(ev)}`,
    level: (ev) => (ev.state === "failed" ? "err" : ev.state === "done" ? "ok" : ""),
  },
  tile_state: {
    apply(ev) {
      if (ev.frame === null || ev.frame === undefined) return;
      setTile(ev.frame, ev.tile, ev.state);
      const fr = frames.get(ev.frame);
      if (!fr || fr.state === "done") return;
      if (ev.state === "failed") setFrameState(ev.frame, "failed");
      else if (ev.state === "rendering" || ev.state === "queued") {
        setFrameState(ev.frame, fr.tiles.includes("failed") ? "failed" : ev.state === "rendering" || fr.tiles.includes("done") ? "rendering" : "queued");
      }
    },
    // tiles starting are on the grid; the log keeps finished, failed and requeued tiles
    log: (ev) => (ev.state === "rendering" && !ev.message ? "" : `${where(ev)} ${ev.state}${ev.attempt ? ` (attempt ${ev.attempt})` : ""}${said(ev)}`),
    level: (ev) => (ev.state === "failed" ? "err" : ""),
  },
  frame_done: {
    apply(ev) {
      setFrameState(ev.frame, "done");
      loadFiles();
    },
    log: (ev) => `${where(ev)} done${said(ev)}`,
    level: () => "ok",
  },
  job_action: {
    apply(ev) {
      if (ev.state === "archived") job.archived_s = ev.ts;
      if (ev.state === "unarchived") job.archived_s = null;
    },
    log: (ev) => ev.message || `job ${ev.state}`,
    level: () => "",
  },
  warning: {
    apply(ev) {
      if ((ev.message || "").includes("blocklist")) loadBlocklist();
    },
    log: (ev) => `warning: ${ev.message}`,
    level: () => "warn",
  },
});

// A kind this page does not know (a newer server): logged as it came, and said once in the console
const warned = new Set();
const UNKNOWN = {
  apply(ev) {
    if (warned.has(ev.type)) return;
    warned.add(ev.type);
    console.warn(`job page: event kind ${JSON.stringify(ev.type)} is not one it handles`, ev);
  },
  log: (ev) => [ev.type, where(ev), ev.state, ev.message].filter(Boolean).join(" "),
  level: () => "",
};

function onEvent(ev) {
  const kind = Object.hasOwn(EVENTS, ev.type) ? EVENTS[ev.type] : UNKNOWN;
  kind.apply(ev);
  logEvent(ev, kind);
  scheduleDraw();
}

let drawPending = false;
function scheduleDraw() {
  // a replayed history is thousands of events: redraw the header once per animation frame
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => { drawPending = false; drawHeader(); });
}

/** Follow the job's events; the first stream replays its history (the log and grid come from it). */
function connect() {
  if (source) source.close();
  setLive(false, "connecting");
  const after = lastEventId ? "?after=" + encodeURIComponent(lastEventId) : "";
  source = new EventSource(base + "/events" + after, { withCredentials: true });
  source.onopen = () => setLive(true, "live");
  source.onmessage = (msg) => {
    let ev;
    try {
      ev = JSON.parse(msg.data);
    } catch (e) {
      logLine(Date.now() / 1000, `an event the page cannot read (${e.message}): ${msg.data.slice(0, 200)}`, "err");
      return;
    }
    if (!ev.id && msg.lastEventId) ev.id = msg.lastEventId;
    if (ev.id) lastEventId = ev.id;
    onEvent(ev);
  };
  source.onerror = () => {
    // the server ends the stream when the job ends; otherwise EventSource reconnects by itself
    // (sending Last-Event-ID, so nothing is replayed twice)
    if (job && FINAL.has(job.state)) finish();
    else setLive(false, "reconnecting");
  };
  if (!clock && !FINAL.has(job.state)) clock = setInterval(drawStats, 1000); // elapsed time only
}

async function finish() {
  if (source) { source.close(); source = null; }
  if (clock) { clearInterval(clock); clock = null; }
  setLive(false, "finished");
  try {
    job = await api(base);
    for (const [n, info] of Object.entries(job.frames || {})) {
      (info.tiles || []).forEach((s, i) => setTile(Number(n), i, s));
      if (info.state) setFrameState(Number(n), info.state);
    }
  } catch (e) {
    // the page keeps what the events showed; the user is told it may be behind
    toast(`Cannot reload the finished job: ${e.message}`, "bad");
  }
  if (job.state === "canceled") {
    // what was still queued or rendering will not finish: show it as canceled, not busy
    for (const [n, fr] of frames) {
      fr.tiles.forEach((s, i) => { if (s === "queued" || s === "rendering") setTile(n, i, "canceled"); });
      if (fr.state !== "done") setFrameState(n, "canceled");
    }
  }
  drawHeader();
  loadFiles();
}

// --- actions ---------------------------------------------------------------------------------------

async function cancel() {
  if (!confirm("Cancel this job? Tiles already rendered are kept, the rest are dropped.")) return;
  await withButton($("#cancel"), async () => {
    await api(base + "/cancel", { method: "POST" });
    toast("Job canceled", "ok");
    await finish();
  });
  drawHeader(); // withButton re-enabled the button; the job's state decides
}

async function retry() {
  await withButton($("#retry"), async () => {
    const r = await api(base + "/retry", { method: "POST" });
    toast(r && r.retried_tiles !== undefined ? `${r.retried_tiles} tile(s) queued again` : "Failed tiles queued again", "ok");
    job = await api(base);
    buildFrames();
    drawHeader();
    if (!FINAL.has(job.state)) connect();
  });
  drawHeader();
}

/** Suspend, resume, requeue (the frames typed, else the unfinished tiles), archive, delete. */
async function control(action) {
  const button = $("#" + action);
  const body = {};
  if (action === "requeue") {
    const text = $("#requeue-frames").value.trim();
    if (text) {
      const frames = parseFrameList(text);
      if (!frames) { toast("Frames must look like 1-3,7", "bad"); return; }
      body.frames = frames;
    }
  }
  if (action === "archive" && job.archived_s) action = "unarchive";
  if (action === "delete") {
    if (!confirm("Delete this job with its frames and files? This cannot be undone.")) return;
    body.confirm = true;
  }
  await withButton(button, async () => {
    const r = await api(base + "/" + action, { method: "POST", json: body });
    if (action === "delete") { location.assign("/"); return; }
    toast(r.requeued_tiles !== undefined ? `${r.requeued_tiles} tile(s) queued again` : `Job ${action}d`, "ok");
    job = await api(base);
    buildFrames();
    if (!FINAL.has(job.state) && !source) connect();
  });
  if (job) drawHeader();
}

/** "1-3,7" -> [1, 2, 3, 7]; null when it is not a frame list. */
function parseFrameList(text) {
  const out = [];
  for (const part of text.split(",")) {
    const m = /^\s*(-?\d+)(?:\s*-\s*(-?\d+))?\s*$/.exec(part);
    if (!m) return null;
    const a = Number(m[1]), b = m[2] === undefined ? a : Number(m[2]);
    if (b < a || b - a > 100000) return null;
    for (let f = a; f <= b; f++) out.push(f);
  }
  return out;
}

async function setPriority() {
  const value = parseInt($("#priority").value, 10);
  if (Number.isNaN(value)) { toast("Priority must be a whole number", "bad"); return; }
  await withButton($("#set-priority"), async () => {
    const r = await api(base, { method: "PATCH", json: { priority: value } });
    if (r && r.spec) job.spec.priority = r.spec.priority;
    else job.spec.priority = value;
    toast(`Priority set to ${value}`, "ok");
  });
  drawHeader();
}

// --- blocklist: workers that failed too many of this job's tiles take no more of them ------------

async function loadBlocklist() {
  let data;
  try {
    data = await api(base + "/blocklist");
  } catch (e) {
    return; // the panel stays as it was; the log still says who was blocklisted
  }
  const blocked = (data.workers || []).filter((w) => w.blocklisted);
  $("#blocklist").replaceChildren(...blocked.map((w) => el("li", {}, `${w.worker}: ${w.failures} failed tile(s)`)));
  $("#blocklist-panel").hidden = blocked.length === 0;
  $("#clear-blocklist").disabled = !canEdit;
}

async function clearBlocklist() {
  await withButton($("#clear-blocklist"), async () => {
    const r = await api(base + "/blocklist", { method: "DELETE" });
    toast(`${r.cleared} worker(s) may render this job again`, "ok");
  });
  await loadBlocklist();
}

const page = await startPage("jobs", () => location.assign("/"));
if (page) {
  try {
    job = await api(base);
  } catch (e) {
    $("main").replaceChildren(el("div", { class: "callout bad" }, el("strong", {}, e.status === 404 ? "No such job" : "Cannot load the job"),
      e.status === 404 ? `There is no job ${jobId} in your projects.` : e.message, el("div", {}, el("a", { href: "/" }, "Back to the jobs list"))));
  }
  if (job) {
    const project = (page.me.projects || []).find((p) => p.id === (job.spec || {}).project);
    canEdit = !project || project.role !== "viewer";
    buildFrames();
    drawHeader();
    $("#cancel").addEventListener("click", cancel);
    $("#retry").addEventListener("click", retry);
    $("#set-priority").addEventListener("click", setPriority);
    $("#clear-blocklist").addEventListener("click", clearBlocklist);
    loadBlocklist();
    for (const action of ["suspend", "resume", "requeue", "archive", "delete"]) {
      $("#" + action).addEventListener("click", () => control(action));
    }
    loadFiles();
    connect(); // a finished job's stream replays its log and ends
    watchWaiting(base, () => job, drawNotes);
    document.body.dataset.ready = "1"; // handlers attached (tests wait for this)
  }
}
