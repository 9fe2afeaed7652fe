// Jobs list: the project's jobs with state and text filters; a row opens the job page.
import { api, el, $, badge, progressBar, fmtFrames, fmtTime, fmtDuration, startPage, toast } from "./app.js";

let page;
let jobs = [];

function elapsed(job) {
  if (!job.started_s) return null;
  return (job.finished_s || Date.now() / 1000) - job.started_s;
}

function row(job) {
  const spec = job.spec || {};
  const name = spec.name || job.name || job.id;
  return el("tr", { class: "link", dataset: { id: job.id }, onclick: () => location.assign("/jobs/" + encodeURIComponent(job.id)) },
    el("td", {}, el("a", { href: "/jobs/" + encodeURIComponent(job.id) }, name),
      el("div", { class: "muted small mono" }, job.id)),
    el("td", {}, badge(job.state)),
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

function draw() {
  const q = $("#search").value.trim().toLowerCase();
  const shown = jobs.filter((j) => !q || (j.id + " " + ((j.spec || {}).name || "")).toLowerCase().includes(q));
  $("#jobs tbody").replaceChildren(...shown.map(row));
  $("#empty").hidden = shown.length > 0;
  $("#count").textContent = `${shown.length} job${shown.length === 1 ? "" : "s"}`;
}

async function load() {
  const params = new URLSearchParams({ project: page.project() });
  const state = $("#state").value;
  if (state) params.set("state", state);
  try {
    const data = await api("/api/jobs?" + params);
    jobs = (data.jobs || []).sort((a, b) => (b.created_s || 0) - (a.created_s || 0));
    draw();
  } catch (e) {
    toast(e.message, "bad");
  }
}

page = await startPage("jobs", load);
if (page) {
  const st = new URLSearchParams(location.search).get("state");
  if (st) $("#state").value = st;
  $("#state").addEventListener("change", load);
  $("#search").addEventListener("input", draw);
  $("#refresh").addEventListener("click", load);
  // no timer: the list reloads when the user comes back to the tab or asks for it
  document.addEventListener("visibilitychange", () => { if (!document.hidden) load(); });
  await load();
  document.body.dataset.ready = "1"; // handlers attached (tests wait for this)
}
