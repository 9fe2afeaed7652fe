// Project settings page: the project's webhooks (add, rotate the secret, enable, delete) and
// each one's latest deliveries. Project admins only (the API answers 403 to others).
import { api, el, $, badge, fmtTime, projectInfo, startPage, toast, withButton } from "./app.js";

let page;
let shown = null; // the hook whose deliveries are shown

const base = () => `/api/projects/${encodeURIComponent(page.project())}/webhooks`;

function mayManage() {
  return page.me.admin || projectInfo(page.me, page.project()).role === "admin";
}

function showSecret(title, secret) {
  $("#secret-title").textContent = title;
  $("#secret").textContent = secret;
  $("#secret-box").hidden = false;
}

function state(h) {
  if (!h.disabled) return badge("active");
  return el("span", {}, badge("disabled"),
    el("div", { class: "muted small" }, `${h.disabled_reason || "disabled"} · ${fmtTime(h.disabled_s)}`));
}

function secretNote(h) {
  if (!h.rotated_s) return el("span", { class: "muted small" }, "since " + fmtTime(h.created_s));
  const grace = h.previous_until_s > Date.now() / 1000
    ? ` · the old one signs too until ${fmtTime(h.previous_until_s)}` : "";
  return el("span", { class: "muted small" }, `rotated ${fmtTime(h.rotated_s)}${grace}`);
}

function actions(h) {
  const call = (button, path, after) => withButton(button, async () => {
    const out = await api(`${base()}/${encodeURIComponent(h.id)}${path}`, { method: "POST" });
    after(out);
    await load();
  });
  const rotate = el("button", { class: "small", dataset: { action: "rotate" } }, "Rotate secret");
  rotate.addEventListener("click", () => {
    if (!confirm("Make a new signing secret? The old one keeps signing deliveries during the grace period.")) return;
    call(rotate, "/rotate", (out) => showSecret(`New signing secret of ${h.url}`, out.secret));
  });
  const enable = el("button", { class: "small", dataset: { action: "enable" } }, "Enable");
  enable.addEventListener("click", () => call(enable, "/enable", () => toast(`${h.url} gets deliveries again`, "ok")));
  const del = el("button", { class: "small danger", dataset: { action: "delete" } }, "Delete");
  del.addEventListener("click", () => withButton(del, async () => {
    if (!confirm(`Delete the webhook to ${h.url}? Its pending deliveries are dropped.`)) return;
    await api(`${base()}/${encodeURIComponent(h.id)}`, { method: "DELETE" });
    if (shown === h.id) { shown = null; $("#deliveries-panel").hidden = true; }
    await load();
  }));
  const log = el("button", { class: "small", dataset: { action: "deliveries" } }, "Deliveries");
  log.addEventListener("click", () => withButton(log, () => deliveries(h)));
  return el("span", { class: "actions" }, log, rotate, h.disabled ? enable : null, del);
}

async function deliveries(h) {
  shown = h.id;
  const data = await api(`${base()}/${encodeURIComponent(h.id)}/deliveries`);
  $("#deliveries-of").textContent = h.url;
  $("#deliveries tbody").replaceChildren(...data.deliveries.map((d) => el("tr", { dataset: { state: d.state } },
    el("td", { class: "mono" }, d.event),
    el("td", {}, d.job_id ? el("a", { href: "/jobs/" + encodeURIComponent(d.job_id), class: "mono" }, d.job_id) : "—"),
    el("td", {}, badge(d.state)),
    el("td", { class: "num" }, String(d.attempts)),
    el("td", { class: "small" }, d.last_result || "—",
      d.next_s ? el("div", { class: "muted small" }, "next try " + fmtTime(d.next_s)) : null),
    el("td", { class: "small" }, fmtTime(d.ended_s || d.created_s)))));
  $("#deliveries-empty").hidden = data.deliveries.length > 0;
  $("#deliveries-panel").hidden = false;
}

async function load() {
  $("#project-name").textContent = projectInfo(page.me, page.project()).name || page.project();
  const manage = mayManage();
  $("#not-admin").hidden = manage;
  $("#hooks-panel").hidden = !manage;
  if (!manage) { $("#deliveries-panel").hidden = true; return; }
  let data;
  try {
    data = await api(base());
  } catch (e) {
    toast(`Cannot list the webhooks: ${e.message}`, "bad");
    return;
  }
  $("#hooks tbody").replaceChildren(...data.webhooks.map((h) => el("tr", { dataset: { id: h.id, state: h.disabled ? "disabled" : "active" } },
    el("td", { class: "mono" }, h.url),
    el("td", { class: "small" }, h.events.join(", ")),
    el("td", {}, state(h)),
    el("td", {}, secretNote(h)),
    el("td", {}, actions(h)))));
  $("#hooks-empty").hidden = data.webhooks.length > 0;
  const current = data.webhooks.find((h) => h.id === shown);
  if (current) await deliveries(current);
}

async function add(ev) {
  ev.preventDefault();
  $("#hook-error").textContent = "";
  const events = [...document.querySelectorAll("#hook-events input:checked")].map((c) => c.value);
  try {
    const hook = await api(base(), { method: "POST", json: { url: $("#hook-url").value.trim(), events } });
    showSecret(`Signing secret of ${hook.url}`, hook.secret);
    $("#hook-url").value = "";
  } catch (e) {
    $("#hook-error").textContent = e.message;
    return;
  }
  await load();
}

page = await startPage("project", () => { shown = null; $("#secret-box").hidden = true; load(); });
if (page) {
  $("#add-hook").addEventListener("submit", add);
  await load();
  document.body.dataset.ready = "1"; // handlers attached (tests wait for this)
}
