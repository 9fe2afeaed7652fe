// Tessera's one way for a page to call an HTTP API: JSON in and out, an error answer thrown as an
// ApiError. The web's pages (web/static/app.js) and the stream player (player.js) import it; it
// lives with the player because the stream service serves only this folder (at /static/), and
// the web serves this same file at its /static/request.js (web/pages.py).

/** An error answered by the API: {"error": {"code", "message", ...}}, or a bare HTTP status. */
export class ApiError extends Error {
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(err.message || `request failed with HTTP ${status}`);
    this.status = status;
    this.code = err.code || "http_" + status;
    this.fields = err;
  }
}

/**
 * Fetch `url` with the page's cookies. `json` goes as a JSON body, `body` as it is. Answers the
 * JSON body (null when the answer has none), or with `as: "blob"` the body as a Blob. An answer
 * that is not 2xx throws an ApiError; a network failure throws fetch's TypeError.
 */
export async function request(url, { method = "GET", json, body, headers = {}, as = "json", keepalive = false } = {}) {
  const init = { method, credentials: "same-origin", keepalive, headers: { ...headers } };
  if (as === "json") init.headers.Accept = "application/json";
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers["Content-Type"] = "application/json";
  } else if (body !== undefined) {
    init.body = body;
  }
  const resp = await fetch(url, init);
  if (!resp.ok) throw new ApiError(resp.status, await errorBody(resp));
  if (as === "blob") return resp.blob();
  const type = resp.headers.get("Content-Type") || "";
  return type.includes("json") ? resp.json() : null;
}

// The error an answer carries: the API's JSON, or (a proxy's page, a cut-off body) the start of
// its text, so that the ApiError says more than the status
async function errorBody(resp) {
  const text = await resp.text();
  if ((resp.headers.get("Content-Type") || "").includes("json")) {
    try {
      return JSON.parse(text);
    } catch (e) {
      return { error: { message: `HTTP ${resp.status}, and its error body is not JSON (${e.message})` } };
    }
  }
  const start = text.trim().slice(0, 200);
  return start && !start.startsWith("<") ? { error: { message: `HTTP ${resp.status}: ${start}` } } : null;
}
