// Tessera web UI: what every page shares (API calls, the top bar, the current project, formats).
import { ApiError, request } from "./request.js";

export { ApiError };

/** Call the API with the session cookie; JSON in and out. A 401 goes to the login page. */
export async function api(path, { redirect401 = true, ...options } = {}) {
  try {
    return await request(path, options);
  } catch (e) {
    if (e.status === 401 && redirect401) {
      goLogin();
      throw new ApiError(401, { error: { code: "unauthorized", message: "Please sign in." } });
    }
    throw e;
  }
}

export function goLogin() {
  const next = location.pathname + location.search;
  location.assign("/login?next=" + encodeURIComponent(next));
}

/** Build a DOM element: el("td", {class: "num", onclick: f}, "text", child...). Text is never HTML. */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") node.addEventListener(k.slice(2), v);
    else if (k === "class") node.className = v;
    else if (k === "style") node.style.cssText = String(v); // CSSOM: allowed by the CSP, unlike a style attribute
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k in node && typeof v !== "string") node[k] = v;
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

export const $ = (sel, root = document) => root.querySelector(sel);

export function badge(state) {
  return el("span", { class: "badge " + String(state || "").toLowerCase() }, state || "unknown");
}

export function progressBar(done, total, state) {
  const pct = total ? Math.round((100 * done) / total) : 0;
  const cls = state === "done" ? "progress done" : state === "failed" ? "progress failed" : "progress";
  return el("div", { class: cls, title: `${done}/${total} tiles` }, el("div", { style: `width:${pct}%` }));
}

export function fmtBytes(n) {
  if (n === undefined || n === null) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

/** A time given as epoch seconds (or an ISO string) as local date and time. */
export function fmtTime(t) {
  if (t === undefined || t === null || t === "") return "—";
  const d = typeof t === "number" ? new Date(t * 1000) : new Date(t);
  if (isNaN(d)) return String(t);
  const today = new Date().toDateString() === d.toDateString();
  return today ? d.toLocaleTimeString() : d.toLocaleString();
}

export function fmtDuration(s) {
  if (s === undefined || s === null || !isFinite(s)) return "—";
  s = Math.max(0, Math.round(s));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
  if (m) return `${m}m ${String(sec).padStart(2, "0")}s`;
  return `${sec}s`;
}

/** Frames as the farm takes them back: [1,2,3,5] -> "1-3,5". */
export function fmtFrames(frames) {
  if (!Array.isArray(frames) || !frames.length) return String(frames ?? "");
  const out = [];
  let start = frames[0], prev = frames[0];
  for (const f of frames.slice(1).concat([null])) {
    if (f !== null && f === prev + 1) { prev = f; continue; }
    out.push(start === prev ? `${start}` : `${start}-${prev}`);
    start = prev = f;
  }
  return out.join(",");
}

export function toast(message, kind = "") {
  let box = $(".toasts");
  if (!box) { box = el("div", { class: "toasts", role: "status" }); document.body.append(box); }
  const t = el("div", { class: "toast " + kind }, message);
  box.append(t);
  setTimeout(() => t.remove(), 6000);
}

const PROJECT_KEY = "tessera.project";

/** The project the user works in: remembered per browser, one of /api/me's projects. */
export function currentProject(me) {
  const ids = (me.projects || []).map((p) => p.id);
  const saved = localStorage.getItem(PROJECT_KEY);
  const fromUrl = new URLSearchParams(location.search).get("project");
  for (const id of [fromUrl, saved]) if (id && ids.includes(id)) return id;
  return ids[0] || "";
}

export function projectInfo(me, id) {
  return (me.projects || []).find((p) => p.id === id) || { id, name: id, role: "viewer", devices: ["cpu"] };
}

const LOGO = `<svg viewBox="0 0 24 24" aria-hidden="true"><rect x="2" y="2" width="9" height="9" rx="1.5" fill="#4f8cff"/><rect x="13" y="2" width="9" height="9" rx="1.5" fill="#35c27a"/><rect x="2" y="13" width="9" height="9" rx="1.5" fill="#e8a33d"/><rect x="13" y="13" width="9" height="9" rx="1.5" fill="#3a4150"/></svg>`;

export function logo() {
  const a = el("a", { class: "brand", href: "/" });
  a.innerHTML = LOGO; // a constant, not user data
  a.append("Tessera");
  return a;
}

/**
 * Start a page: check the session, draw the top bar, hand (me, project) to the page.
 * Changing the project in the top bar calls onProject(newProject).
 */
export async function startPage(active, onProject) {
  let me;
  try {
    me = await api("/api/me");
  } catch (e) {
    if (e.status !== 401) showFatal(e);
    return null;
  }
  let project = currentProject(me);
  const select = el("select", { id: "project", "aria-label": "Project" },
    (me.projects || []).map((p) => el("option", { value: p.id, selected: p.id === project }, p.name || p.id)));
  select.addEventListener("change", () => {
    project = select.value;
    localStorage.setItem(PROJECT_KEY, project);
    if (onProject) onProject(project);
  });
  const logout = el("button", { class: "small", id: "logout", onclick: () => withButton(logout, async () => {
    try {
      await api("/api/logout", { method: "POST", redirect401: false });
    } catch (e) {
      if (e.status !== 401) throw e; // 401: signed out already, as good as signing out now
    }
    location.assign("/login");
  }) }, "Sign out");
  const links = [["jobs", "/", "Jobs"], ["upload", "/upload", "New render"], ["streams", "/streams", "Streams"], ["workers", "/workers", "Workers"], ["project", "/project", "Project"]];
  const bar = el("header", { class: "topbar" },
    logo(),
    el("nav", { class: "nav" }, links.map(([k, href, label]) => el("a", { href, class: k === active ? "active" : "" }, label))),
    el("div", { class: "spacer" }),
    el("div", { class: "userbox" }, "Project", select, el("span", { id: "user", title: me.admin ? "administrator" : "" }, me.user), logout));
  document.body.prepend(bar);
  // a farm in cells: a cell that did not answer the front door leaves its projects out
  const missing = me.cells_unreachable || [];
  if (missing.length) {
    bar.after(el("div", { class: "callout warn", id: "cells-unreachable", role: "status" },
      `Part of the farm does not answer (cell ${missing.join(", ")}): its projects are not listed. ` +
      "Reload in a moment."));
  }
  localStorage.setItem(PROJECT_KEY, project);
  return { me, project: () => project };
}

export function showFatal(err) {
  const main = $("main") || document.body;
  main.replaceChildren(el("div", { class: "callout bad" }, el("strong", {}, "Something went wrong"), err.message || String(err)));
}

/** Run an async action from a button: disable it meanwhile, show errors as toasts. */
export async function withButton(button, action) {
  button.disabled = true;
  try {
    return await action();
  } catch (e) {
    toast(e.message || String(e), "bad");
    return undefined;
  } finally {
    button.disabled = false;
  }
}
