// Streams page: the app catalog and running sessions; launch, open as player or spectator, end.
import { api, el, $, badge, fmtTime, startPage, toast, withButton } from "./app.js";

let page;

function playerUrl(sid, role) {
  return `/player?session=${encodeURIComponent(sid)}&role=${encodeURIComponent(role)}`;
}

function appCard(app) {
  const launch = el("button", { class: "primary small", dataset: { app: app.name } }, "Launch");
  launch.addEventListener("click", () => withButton(launch, async () => {
    const s = await api("/api/streams/sessions", { method: "POST", json: { app: app.name, project: page.project() } });
    toast(`Started ${app.title || app.name}`, "ok");
    window.open(playerUrl(s.session_id, "player"), "_blank", "noopener");
    await loadSessions();
  }));
  const size = app.width ? `${app.width}×${app.height} @ ${app.fps || 30} fps` : "";
  return el("div", { class: "app" },
    el("div", { class: "row" }, el("div", { class: "icon" }, (app.title || app.name).slice(0, 1).toUpperCase()),
      el("div", {}, el("div", { class: "title" }, app.title || app.name), el("div", { class: "meta mono" }, app.name))),
    el("div", { class: "meta" }, size),
    el("div", { class: "actions" }, launch));
}

function stateBadge(state) {
  const b = badge(state);
  if (["running", "ready", "active", "streaming"].includes(state)) b.classList.add("done");
  return b;
}

function sessionRow(s) {
  const end = el("button", { class: "danger small" }, "End");
  end.addEventListener("click", () => {
    if (!confirm(`End session ${s.session_id}? Every viewer is disconnected.`)) return;
    withButton(end, async () => {
      await api("/api/streams/sessions/" + encodeURIComponent(s.session_id), { method: "DELETE" });
      toast("Session ended", "ok");
      await loadSessions();
    });
  });
  const viewers = s.viewers || [];
  const controller = viewers.find((v) => v.controlling);
  return el("tr", { dataset: { session: s.session_id } },
    el("td", { class: "mono" }, s.session_id),
    el("td", {}, s.app),
    el("td", {}, stateBadge(s.state)),
    el("td", { class: "mono small" }, s.device_id || ""),
    el("td", { class: "mono small" }, s.encoder || ""),
    el("td", {}, s.width ? `${s.width}×${s.height}@${s.fps}` : ""),
    el("td", { class: "num", title: controller ? `controlled by ${controller.viewer_id}` : "no controller" }, String(viewers.length)),
    el("td", {}, fmtTime(s.created)),
    el("td", { style: "text-align:right;white-space:nowrap" },
      el("a", { class: "btn small", href: playerUrl(s.session_id, "player"), target: "_blank" }, "Open"), " ",
      el("a", { class: "btn small", href: playerUrl(s.session_id, "spectator"), target: "_blank" }, "Spectate"), " ",
      end));
}

async function loadApps() {
  try {
    // only what this project lets the user launch (desktop apps by its policy)
    const data = await api("/api/streams/apps?project=" + encodeURIComponent(page.project()));
    const apps = data.apps || [];
    $("#apps").replaceChildren(...apps.map(appCard));
    $("#apps-empty").hidden = apps.length > 0;
    $("#apps-note").textContent = apps.length ? `${apps.length} app${apps.length > 1 ? "s" : ""}` : "";
  } catch (e) {
    $("#apps").replaceChildren();
    $("#apps-empty").hidden = false;
    $("#apps-note").textContent = e.message; // 503: which service is missing or did not answer
    if (e.status !== 503) toast(e.message, "bad");
  }
}

async function loadSessions() {
  try {
    const data = await api("/api/streams/sessions?project=" + encodeURIComponent(page.project()));
    const list = data.sessions || [];
    $("#sessions tbody").replaceChildren(...list.map(sessionRow));
    $("#sessions-empty").hidden = list.length > 0;
  } catch (e) {
    $("#sessions tbody").replaceChildren();
    $("#sessions-empty").hidden = false;
    if (e.status !== 503) toast(e.message, "bad");
  }
}

page = await startPage("streams", () => { loadApps(); loadSessions(); });
if (page) {
  $("#refresh").addEventListener("click", () => { loadApps(); loadSessions(); });
  document.addEventListener("visibilitychange", () => { if (!document.hidden) loadSessions(); });
  loadApps();
  loadSessions();
  document.body.dataset.ready = "1"; // handlers attached (tests wait for this)
}
