// Jobs list: the project's jobs with state, archive and text filters and sorting; rows can be
// selected for a batch action; the list follows the project's live feed (/api/events).
import { api, el, $, badge, progressBar, fmtFrames, fmtTime, fmtDuration, startPage, toast } from "./app.js";

let page;
let jobs = [];
const selected = new Set();
let feed = null;
let reloadTimer = null;

const ACTION_LABEL = { suspend: "Suspended", resume: "Resumed", requeue: "Requeued", archive: "Archived",
  unarchive: "Unarchived", delete: "Deleted", cancel: "Canceled" };

function elapsed(job) {
  if (!job.started_s) return null;
  return (job.finished_s || Date.now() / 1000) - job.started_s;
}

function toggle(id, on) {
  if (on) selected.add(id); else selected.delete(id);
  drawBar();
}

function row(job) {
  const spec = job.spec || {};
  const name = spec.name || job.name || job.id;
  const box = el("input", { type: "checkbox", class: "pick", checked: selected.has(job.id), "aria-label": "Select " + name,
    onclick: (e) => e.stopPropagation(), onchange: (e) => toggle(job.id, e.target.checked) });
  return el("tr", { class: "link" + (job.archived_s ? " archived" : ""), dataset: { id: job.id, state: job.state },
    onclick: () => location.assign("/jobs/" + encodeURIComponent(job.id)) },
    el("td", { class: "pick-cell", onclick: (e) => e.stopPropagation() }, box),
    el("td", {}, el("a", { href: "/jobs/" + encodeURIComponent(job.id) }, name),
      el("div", { class: "muted small mono" }, job.id)),
    el("td", {}, badge(job.state), job.archived_s ? el("div", { class: "muted small" }, "archived") : null),
    el("td", {}, progressBar(job.tiles_done || 0, job.tiles_total || 0, job.state),
      el("div", { class: "progress-label" }, `${job.tiles_done || 0} / ${job.tiles_total || 0} tiles`,
        job.tile_failures ? ` · ${job.tile_failures} failed` : "")),
    el("td", { class: "mono" }, fmtFrames(spec.frames), el("div", { class: "muted small" }, `${job.frames_done || 0}/${job.frames_total || 0} done`)),
    el("td", { class: "mono" }, spec.tiles || ""),
    el("td", {}, (spec.device || "").toUpperCase()),
    el("td", { class: "num" }, spec.priority ?? 0),
    el("td", {}, fmtTime(job.created_s)),
    el("td", { class: "num" }, fmtDuration(elapsed(job))));
}

function shownJobs() {
  const q = $("#search").value.trim().toLowerCase();
  return jobs.filter((j) => !q || (j.id + " " + ((j.spec || {}).name || "")).toLowerCase().includes(q));
}

function drawBar() {
  const ids = shownJobs().map((j) => j.id);
  $("#batch").hidden = selected.size === 0;
  $("#batch-count").textContent = `${selected.size} selected`;
  $("#pick-all").checked = ids.length > 0 && ids.every((id) => selected.has(id));
}

function draw() {
  const shown = shownJobs();
  $("#jobs tbody").replaceChildren(...shown.map(row));
  $("#empty").hidden = shown.length > 0;
  $("#count").textContent = `${shown.length} job${shown.length === 1 ? "" : "s"}`;
  drawBar();
}

/** Read the list; `quiet`: asked by the feed, not the user (a lost session stops the feed, and
 * the next thing the user does goes to the login page). */
async function load(quiet = false) {
  const params = new URLSearchParams({ project: page.project(), sort: $("#sort").value, order: $("#order").value,
    archived: $("#archived").value });
  const state = $("#state").value;
  if (state) params.set("state", state);
  try {
    const data = await api("/api/jobs?" + params, { redirect401: !quiet });
    jobs = data.jobs || [];
    // a selected job that left the list (deleted, archived, filtered out) is no longer selected
    const ids = new Set(jobs.map((j) => j.id));
    for (const id of [...selected]) if (!ids.has(id)) selected.delete(id);
    draw();
  } catch (e) {
    if (quiet && e.status === 401) stopFeed();
    else toast(e.message, "bad");
  }
}

function stopFeed() {
  clearTimeout(reloadTimer);
  if (feed) { feed.close(); feed = null; }
  $("#live").classList.remove("on");
}

/** Reload once the burst of events that asked for it has passed. */
function reloadSoon() {
  clearTimeout(reloadTimer);
  reloadTimer = setTimeout(() => load(true), 250);
}

function follow() {
  if (feed) feed.close();
  feed = new EventSource("/api/events?" + new URLSearchParams({ project: page.project() }), { withCredentials: true });
  feed.onopen = () => { $("#live").classList.add("on"); reloadSoon(); }; // what changed while away
  feed.onmessage = reloadSoon;
  feed.onerror = () => $("#live").classList.remove("on"); // EventSource reconnects by itself
}

async function runBatch(action) {
  const ids = [...selected];
  if (!ids.length) return;
  const body = { action, ids };
  if (action === "delete") {
    if (!confirm(`Delete ${ids.length} job${ids.length === 1 ? "" : "s"} with their frames and files? This cannot be undone.`)) return;
    body.confirm = true;
  }
  const buttons = [...document.querySelectorAll("#batch button")];
  buttons.forEach((b) => { b.disabled = true; });
  try {
    const data = await api("/api/jobs/batch", { method: "POST", json: body });
    const failed = data.results.filter((r) => !r.ok);
    const ok = data.results.length - failed.length;
    if (ok) toast(`${ACTION_LABEL[action]} ${ok} job${ok === 1 ? "" : "s"}`, "ok");
    for (const r of failed) toast(`${r.job_id}: ${r.message}`, "bad");
    $("#batch-result").textContent = failed.length ? `${failed.length} not changed` : "";
    if (action === "delete") for (const r of data.results) if (r.ok) selected.delete(r.job_id);
    await load();
  } catch (e) {
    toast(e.message, "bad");
  } finally {
    buttons.forEach((b) => { b.disabled = false; });
  }
}

page = await startPage("jobs", () => { selected.clear(); follow(); return load(); });
if (page) {
  const query = new URLSearchParams(location.search);
  if (query.get("state")) $("#state").value = query.get("state");
  for (const id of ["#state", "#sort", "#order", "#archived"]) $(id).addEventListener("change", () => load());
  $("#search").addEventListener("input", draw);
  $("#refresh").addEventListener("click", () => load());
  $("#pick-all").addEventListener("change", (e) => {
    for (const j of shownJobs()) { if (e.target.checked) selected.add(j.id); else selected.delete(j.id); }
    draw();
  });
  for (const b of document.querySelectorAll("#batch button[data-action]")) {
    b.addEventListener("click", () => runBatch(b.dataset.action));
  }
  $("#clear-selection").addEventListener("click", () => { selected.clear(); draw(); });
  follow();
  window.addEventListener("pagehide", stopFeed); // leaving (signing out too): no reload behind
  await load();
  document.body.dataset.ready = "1"; // handlers attached (tests wait for this)
}
