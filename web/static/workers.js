// Workers page: every render worker and stream service, its state and task; admins drain them.
import { api, el, $, badge, fmtDuration, startPage, toast, withButton } from "./app.js";

const EVERY_MS = 2000;
let page;
let data = { workers: [], may_disable: false };
let clock = null;

function ago(t) {
  if (!t) return "—";
  return fmtDuration(Date.now() / 1000 - t) + " ago";
}

function task(w) {
  if (!w.task && !w.job) return el("span", { class: "muted" }, "—");
  if (!w.job) return w.task;
  const where = [w.frame !== null && w.frame !== undefined ? `frame ${w.frame}` : "",
    w.tile !== null && w.tile !== undefined ? `tile ${w.tile}` : ""].filter(Boolean).join(", ");
  return el("span", {},
    el("span", {}, w.task, " of "), el("a", { href: "/jobs/" + encodeURIComponent(w.job), class: "mono" }, w.job),
    where ? el("div", { class: "muted small" }, where + (w.task_since ? ` · ${fmtDuration(Date.now() / 1000 - w.task_since)}` : "")) : "",
    w.lease ? el("div", { class: "muted small mono", title: "device lease" }, "lease " + w.lease.slice(0, 12)) : "");
}

function action(w) {
  if (!data.may_disable) return "";
  const disabling = !w.disabled;
  const button = el("button", { class: "small" + (disabling ? " danger" : ""), dataset: { action: disabling ? "disable" : "enable" } },
    disabling ? "Disable" : "Enable");
  button.addEventListener("click", () => withButton(button, async () => {
    await api(`/api/workers/${encodeURIComponent(w.name)}/${disabling ? "disable" : "enable"}`, { method: "POST" });
    const drains = w.kind === "stream" ? "it starts no new session, its running ones continue" : "it finishes its task and takes no new ones";
    toast(disabling ? `${w.name} drains: ${drains}` : `${w.name} takes ${w.kind === "stream" ? "sessions" : "tasks"} again`, "ok");
    await load();
  }));
  return button;
}

function row(w) {
  const device = [w.device_class.toUpperCase(), w.model && w.model !== w.device_class ? w.model : ""].filter(Boolean).join(" · ");
  return el("tr", { dataset: { name: w.name, state: w.state } },
    el("td", {}, el("div", { class: "mono" }, w.name), el("div", { class: "muted small" }, `${w.host} · pid ${w.pid}`)),
    el("td", {}, w.kind === "stream" ? "Stream" : `Render (${w.queue.toUpperCase()})`),
    el("td", {}, device, el("div", { class: "muted small mono", title: w.device_id }, w.device_id.slice(0, 24))),
    el("td", {}, badge(w.state), w.disabled && w.disabled_by ? el("div", { class: "muted small" }, "by " + w.disabled_by) : ""),
    el("td", { class: "task" }, task(w)),
    el("td", {}, ago(w.last_beat)),
    el("td", { class: "num" }, `${w.tiles_done_today}`, w.tiles_failed_today ? el("span", { class: "muted" }, ` / ${w.tiles_failed_today} failed`) : ""),
    el("td", { class: "num" }, w.utilization_pct === null || w.utilization_pct === undefined ? "—" : `${w.utilization_pct} %`),
    el("td", { class: "num" }, action(w)));
}

function stat(k, v) {
  return el("div", { class: "stat" }, el("div", { class: "k" }, k), el("div", { class: "v" }, String(v)));
}

function draw() {
  const ws = data.workers || [];
  const count = (pred) => ws.filter(pred).length;
  $("#summary").replaceChildren(
    stat("Online", count((w) => w.state !== "silent")),
    stat("Idle", count((w) => w.state === "idle")),
    stat("Busy", count((w) => ["rendering", "assembling", "inspecting", "streaming", "draining"].includes(w.state))),
    stat("Disabled", count((w) => w.disabled)),
    stat("Silent", count((w) => w.state === "silent")));
  $("#workers tbody").replaceChildren(...ws.map(row));
  $("#empty").hidden = ws.length > 0;
  $("#count").textContent = `${ws.length} worker${ws.length === 1 ? "" : "s"} · silent after ${data.silent_after_s ?? "?"} s without a heartbeat`;
  $("#updated").textContent = "updated " + new Date().toLocaleTimeString();
}

async function load() {
  try {
    data = await api("/api/workers");
    draw();
  } catch (e) {
    toast(e.message, "bad");
  }
}

function schedule() {
  if (clock) clearInterval(clock);
  clock = document.hidden ? null : setInterval(load, EVERY_MS);
}

page = await startPage("workers", load);
if (page) {
  $("#refresh").addEventListener("click", load);
  // refreshes itself while shown; a hidden tab asks nothing
  document.addEventListener("visibilitychange", () => { schedule(); if (!document.hidden) load(); });
  await load();
  schedule();
  document.body.dataset.ready = "1";
}
