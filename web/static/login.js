// Login page: turns an access token into a session cookie (POST /api/login) and goes on.
import { api, logo, $ } from "./app.js";

$("#brand").replaceWith(logo());

function nextPath() {
  const next = new URLSearchParams(location.search).get("next") || "/";
  // only a path on this site: "/\\host", "/%09/host" and the like resolve to another
  // origin, so resolve it as the browser would and keep it only if it stays here
  if (!next.startsWith("/") || !URL.canParse(next, location.origin)) return "/";
  const url = new URL(next, location.origin);
  // a path that still starts with "//" ("/.//host") would leave the site when assigned
  if (url.origin !== location.origin || url.pathname.startsWith("//")) return "/";
  return url.pathname + url.search + url.hash;
}

$("#login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const button = $("#signin");
  const error = $("#error");
  error.textContent = "";
  button.disabled = true;
  try {
    await api("/api/login", { method: "POST", json: { token: $("#token").value.trim() }, redirect401: false });
    location.assign(nextPath());
  } catch (e) {
    error.textContent = e.status === 401 ? "That token is not valid (or has been revoked)." : e.message;
    button.disabled = false;
  }
});

$("#signin").disabled = false; // the handler is on: signing in can go through it

// already signed in (a live session cookie): go straight on
api("/api/me", { redirect401: false }).then(() => location.replace(nextPath()), () => {});
