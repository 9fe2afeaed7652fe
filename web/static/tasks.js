// Job page: the task table (sortable, filterable, paged), the ETA and per-frame times, the
// failures' short causes with their logs, and the full-size frame viewer with EXR exposure.
import { api, el, $, badge, fmtDuration, fmtTime } from "./app.js";

const FINAL = new Set(["done", "failed", "canceled"]);
const jobId = decodeURIComponent(location.pathname.replace(/^\/jobs\//, "").replace(/\/$/, ""));
const base = "/api/jobs/" + encodeURIComponent(jobId);
const PAGE = 50;
//: frames past which the frame cards scroll in their own box instead of filling the page
const MANY_FRAMES = 24;
const POLL_MS = 3000;

const view = { sort: "frame", state: "", offset: 0 };
let timer = null;
let loading = null;

const COLUMNS = [
  ["frame", "Frame"], ["tile", "Tile"], ["state", "State"], ["worker", "Worker"],
  ["started", "Started"], ["duration", "Duration"], ["render", "Render"], ["memory", "Peak mem"],
  ["attempts", "Attempts"], [null, "Log"], [null, "Cause"],
];

const NUMERIC = new Set(["frame", "tile", "duration", "render", "memory", "attempts"]);
const secs = (s) => (s === null || s === undefined ? "—" : s < 60 ? `${s.toFixed(s < 10 ? 2 : 1)} s` : fmtDuration(s));
const mib = (m) => (m === null || m === undefined ? "—" : m >= 1024 ? `${(m / 1024).toFixed(2)} GiB` : `${m.toFixed(m < 10 ? 1 : 0)} MiB`);

function head() {
  const row = el("tr");
  for (const [key, label] of COLUMNS) {
    if (!key) { row.append(el("th", {}, label)); continue; }
    const active = view.sort.replace(/^-/, "") === key;
    const desc = view.sort.startsWith("-");
    row.append(el("th", {
      class: "sortable" + (active ? " active" : "") + (NUMERIC.has(key) ? " num" : ""), dataset: { sort: key }, tabindex: "0",
      "aria-sort": active ? (desc ? "descending" : "ascending") : "none",
      title: `sort by ${label.toLowerCase()}`,
      onclick: () => sortBy(key), onkeydown: (e) => { if (e.key === "Enter") sortBy(key); },
    }, label, active ? (desc ? " ▾" : " ▴") : ""));
  }
  return row;
}

function sortBy(key) {
  view.sort = view.sort === key ? "-" + key : key;
  view.offset = 0;
  load();
}

function causeCell(t) {
  if (!t.cause) return el("td", { class: "muted" }, "");
  return el("td", { class: "cause" }, t.cause, t.cause_log ? el("a", { class: "log-link", href: t.cause_log, target: "_blank", rel: "noopener" }, "log") : "");
}

function row(t) {
  const attempts = t.attempts.length > 1 || t.attempt > 1
    ? el("span", { title: t.attempts.map((a) => `attempt ${a.attempt}: ${a.outcome}${a.cause ? " — " + a.cause : ""}`).join("\n") }, String(t.attempt))
    : String(t.attempt);
  return el("tr", { dataset: { frame: t.frame, tile: t.tile, state: t.state } },
    el("td", { class: "num" }, String(t.frame)),
    el("td", { class: "num" }, String(t.tile)),
    el("td", {}, badge(t.state)),
    el("td", { class: "small", title: t.device || "" }, t.worker || "—"),
    el("td", { class: "small" }, t.started_s ? fmtTime(t.started_s) : "—"),
    el("td", { class: "num", dataset: { col: "duration" } }, secs(t.duration_s)),
    el("td", { class: "num", dataset: { col: "render" } }, secs(t.render_s)),
    el("td", { class: "num", dataset: { col: "memory" } }, mib(t.peak_memory_mib)),
    el("td", { class: "num" }, attempts),
    el("td", { class: "small" }, t.log ? el("a", { class: "attempt-log", href: t.log, target: "_blank", rel: "noopener" }, `attempt ${t.attempt}`) : ""),
    causeCell(t));
}

function drawProgress(data) {
  const p = data.progress;
  const bits = [`${p.tasks_done} / ${p.tasks_total} tasks done`];
  if (p.median_task_s !== null) bits.push(`median task ${secs(p.median_task_s)}`);
  if (!FINAL.has(data.state)) {
    bits.push(`${p.workers} worker${p.workers === 1 ? "" : "s"}`);
    bits.push(p.eta_s !== null ? `ETA ${fmtDuration(p.eta_s)}` : "ETA after the first task");
  }
  $("#task-progress").textContent = bits.join(" · ");
  const frames = p.frames;
  $("#frame-times-count").textContent = frames.length ? `(${frames.length} frame${frames.length === 1 ? "" : "s"})` : "(none done yet)";
  $("#frame-times").replaceChildren(...frames.map((f) => el("tr", {},
    el("td", { class: "num" }, String(f.frame)), el("td", { class: "num" }, secs(f.render_s)),
    el("td", { class: "num" }, secs(f.wall_s)))));
}

function drawFailures(data) {
  // the job's failed attempts by short cause, above everything else: the cause first, a log a click away
  const frames = (list) => (list.length > 8 ? list.slice(0, 8).join(", ") + ", …" : list.join(", "));
  $("#task-failures").replaceChildren(...data.failures.map((f) => el("div", { class: "callout bad failure" },
    el("strong", {}, f.cause),
    `${f.attempts} failed attempt${f.attempts === 1 ? "" : "s"} · frame${f.frames.length === 1 ? "" : "s"} ${frames(f.frames)}`,
    f.log ? el("a", { class: "log-link", href: f.log, target: "_blank", rel: "noopener" }, "log") : "")));
}

function drawPager(data) {
  const end = Math.min(data.total, data.offset + data.tasks.length);
  $("#task-range").textContent = data.total ? `${data.offset + 1}–${end} of ${data.total}` : "no tasks";
  $("#task-prev").disabled = data.offset === 0;
  $("#task-next").disabled = end >= data.total;
}

async function load() {
  const q = new URLSearchParams({ sort: view.sort, offset: String(view.offset), limit: String(PAGE) });
  if (view.state) q.set("state", view.state);
  const asked = q.toString();
  loading = asked;
  let data;
  try {
    data = await api(`${base}/tasks?${asked}`);
  } catch (e) {
    $("#task-progress").textContent = `Cannot load the tasks: ${e.message}`;
    return;
  }
  if (loading !== asked) return; // a newer view was asked for meanwhile
  $("#tasks thead").replaceChildren(head());
  $("#tasks tbody").replaceChildren(...data.tasks.map(row));
  $("#tasks-empty").hidden = data.tasks.length > 0;
  $("#tasks-empty").textContent = data.trimmed ? "This job's task records were trimmed (it ended long ago)." : view.state ? `No ${view.state} tasks.` : "No tasks.";
  drawProgress(data);
  drawFailures(data);
  drawPager(data);
  document.body.dataset.tasks = String(data.total); // tests wait for this
  if (timer) clearTimeout(timer);
  timer = FINAL.has(data.state) ? null : setTimeout(load, POLL_MS);
  if (data.progress.tasks_total / Math.max(1, tilesPerFrame()) > MANY_FRAMES) $("#frames").classList.add("many");
}

function tilesPerFrame() {
  return Math.max(1, $("#frames .frame .tilegrid")?.childElementCount || 1);
}

// --- the full-size viewer ------------------------------------------------------------------------

let viewing = null; // {frame, preview url, exr: bool}

async function openViewer(frame) {
  const dialog = $("#viewer");
  let files = [];
  try {
    const listed = await api(base + "/frames");
    files = (listed.frames.find((f) => f.frame === frame) || {}).files || [];
  } catch (e) {
    files = [];
  }
  const preview = files.find((f) => /\.(jpg|png)$/i.test(f.name));
  const exr = files.some((f) => /\.exr$/i.test(f.name));
  viewing = { frame, preview: preview ? preview.url : null, exr };
  $("#viewer-title").textContent = `Frame ${frame}`;
  $("#exposure").value = "0";
  $("#exposure").disabled = !exr;
  $("#exposure-value").textContent = exr ? "0 EV" : "no EXR";
  $("#viewer-note").textContent = exr
    ? "Exposure re-renders the frame's EXR on the server (linear to sRGB, Blender's Standard view)."
    : "This job wrote no EXR: the image is the delivered preview.";
  showImage(0);
  if (!dialog.open) dialog.showModal();
}

function showImage(stops) {
  const img = $("#viewer-img");
  if (stops === 0 && viewing.preview) img.src = viewing.preview;
  else if (viewing.exr) img.src = `${base}/frames/${viewing.frame}/view?exposure=${stops}`;
  $("#exposure-value").textContent = viewing.exr ? `${stops > 0 ? "+" : ""}${stops} EV` : "no EXR";
}

function setupViewer() {
  $("#frames").addEventListener("click", (e) => {
    const card = e.target.closest(".frame");
    if (!card || !card.querySelector("img.thumb.shown") || e.target.closest("a")) return;
    openViewer(Number(card.dataset.frame));
  });
  $("#exposure").addEventListener("change", () => showImage(Number($("#exposure").value)));
  $("#exposure").addEventListener("input", () => { $("#exposure-value").textContent = `${$("#exposure").value} EV`; });
  $("#viewer-close").addEventListener("click", () => $("#viewer").close());
}

$("#task-state").addEventListener("change", () => { view.state = $("#task-state").value; view.offset = 0; load(); });
$("#task-prev").addEventListener("click", () => { view.offset = Math.max(0, view.offset - PAGE); load(); });
$("#task-next").addEventListener("click", () => { view.offset += PAGE; load(); });
// a retry runs the job again (job.js queues the tiles): follow it once more
$("#retry").addEventListener("click", () => setTimeout(load, 1500));
setupViewer();
load();
