// Job page, live preview: a live-preview job's frame converging, tile passes drawn as they land
// (JPEG over server-sent events), with the tile grid, the samples so far and the ETA. The picture
// comes as a WebRTC video where that connects (the server composes the frame: one <video> under
// the grid); the canvas the passes are drawn on is the fallback, shown until the video plays and
// whenever WebRTC is refused, does not connect or drops. `?live=sse` on the page asks for SSE only.
import { api, $, fmtDuration } from "./app.js";

const jobId = decodeURIComponent(location.pathname.replace(/^\/jobs\//, "").replace(/\/$/, ""));
const base = "/api/jobs/" + encodeURIComponent(jobId);

let spec = null;
let frame = null; // the frame shown
let tiles = new Map(); // tile index -> {samples, index, passes} of the frame shown
const held = new Map(); // frame -> (tile index -> latest pass) of frames waiting to be shown
let drawing = Promise.resolve(); // passes are drawn in the order they arrive
let etaAsked = 0;
let pc = null; // the WebRTC peer while it is tried or plays
let path = "sse"; // what the picture comes over: "sse" or "webrtc"
let why = ""; // why not WebRTC, when it was refused or dropped
let ended = false;
// the video must play this soon after the offer, or the page stays on the canvas (ms)
const WEBRTC_CONNECT_MS = 4000;
const ICE_GATHER_MS = 1500;
// what was drawn when (tests and bench/preview_latency.py read it): the pass's publish time
// (epoch s, the worker's clock) and when its pixels were on the canvas (epoch ms, this clock)
window.__livePasses = [];

function cuts(size, parts) {
  return Array.from({ length: parts + 1 }, (_, i) => Math.floor((i * size) / parts));
}

function drawGrid() {
  const canvas = $("#live-grid");
  canvas.width = spec.width;
  canvas.height = spec.height;
  const ctx = canvas.getContext("2d");
  const m = /^\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*$/.exec(String(spec.tiles || "1x1"));
  const cols = m ? parseInt(m[1], 10) : 1;
  const rows = m && m[2] ? parseInt(m[2], 10) : cols;
  ctx.strokeStyle = "rgba(255, 255, 255, 0.45)";
  ctx.lineWidth = Math.max(1, spec.width / 400);
  ctx.setLineDash([4, 3]);
  ctx.beginPath();
  for (const x of cuts(spec.width, cols).slice(1, -1)) { ctx.moveTo(x, 0); ctx.lineTo(x, spec.height); }
  // rows count up from the bottom in Blender (farm.tiling): a cut at y is at height - y here
  for (const y of cuts(spec.height, rows).slice(1, -1)) { ctx.moveTo(0, spec.height - y); ctx.lineTo(spec.width, spec.height - y); }
  ctx.stroke();
}

function showCounts(total) {
  const count = spec ? spec.tile_count : tiles.size;
  const samples = Array.from({ length: count }, (_, i) => (tiles.get(i) || { samples: 0 }).samples);
  const least = Math.min(...samples);
  const most = Math.max(...samples);
  const range = least === most ? `${least}` : `${least}\u2013${most}`;
  const started = samples.filter((s) => s > 0).length;
  $("#live-samples").textContent = `frame ${frame} \u00b7 ${range} of ${total} samples \u00b7 ${started}/${count} tiles`;
  $("#live-canvas").dataset.samples = String(least);
}

async function askEta() {
  const now = Date.now();
  if (now - etaAsked < 1000) return;
  etaAsked = now;
  try {
    const data = await api(base + "/tasks?limit=1");
    const eta = data.progress ? data.progress.eta_s : null;
    $("#live-eta").textContent = eta === null || eta === undefined ? "ETA after the first tile" : `ETA ${fmtDuration(eta)}`;
  } catch (err) {
    $("#live-eta").textContent = "";
  }
}

function bytesOf(b64) {
  const text = atob(b64);
  const out = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) out[i] = text.charCodeAt(i);
  return out;
}

function complete(map) {
  // every tile of the frame at its last pass
  if (!spec || map.size < spec.tile_count) return false;
  for (const t of map.values()) if (t.index !== t.passes) return false;
  return true;
}

async function paint(p) {
  const bitmap = await createImageBitmap(new Blob([bytesOf(p.jpeg)], { type: "image/jpeg" }));
  const canvas = $("#live-canvas");
  const ctx = canvas.getContext("2d");
  ctx.drawImage(bitmap, p.x, p.y, p.w, p.h);
  bitmap.close();
  tiles.set(p.tile, { samples: p.samples, index: p.index, passes: p.passes });
  showCounts(p.total_samples);
  window.__livePasses.push({ frame: p.frame, tile: p.tile, pass: p.index, samples: p.samples, ts: p.ts, shown_ms: performance.timeOrigin + performance.now() });
  canvas.dataset.passes = String(window.__livePasses.length);
}

async function show(f) {
  // a frame on a clean canvas, from the passes of it held so far
  const canvas = $("#live-canvas");
  const ctx = canvas.getContext("2d");
  frame = f;
  tiles = new Map();
  ctx.fillStyle = "#0b0d10";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  const waiting = held.get(f) || new Map();
  held.delete(f);
  for (const p of waiting.values()) await paint(p);
}

async function draw(p) {
  const canvas = $("#live-canvas");
  if (canvas.width !== p.frame_w || canvas.height !== p.frame_h) size(p.frame_w, p.frame_h);
  if (frame === null) await show(p.frame);
  if (p.frame === frame) {
    await paint(p);
  } else {
    // another frame renders meanwhile (several workers): shown once this one is done
    if (!held.has(p.frame)) held.set(p.frame, new Map());
    held.get(p.frame).set(p.tile, p);
  }
  if (complete(tiles) && held.size) await show(held.keys().next().value);
  askEta();
}

function setLive(text, on, title = "") {
  const node = $("#live-link");
  node.classList.toggle("on", on);
  node.querySelector("span").textContent = text;
  node.title = title;
}

function size(width, height) {
  const canvas = $("#live-canvas");
  if (canvas.width !== width || canvas.height !== height) {
    canvas.width = width; // (clears it: only before the first pass, or for a new size)
    canvas.height = height;
  }
  $("#live-view").style.aspectRatio = `${width} / ${height}`;
  $("#live-panel").hidden = false;
  if (spec) drawGrid();
}

function connect() {
  const source = new EventSource(base + "/live", { withCredentials: true });
  source.addEventListener("pass", (ev) => {
    const p = JSON.parse(ev.data);
    drawing = drawing.then(() => draw(p)).catch(() => {});
  });
  source.addEventListener("ready", () => showPath());
  source.addEventListener("end", () => {
    source.close();
    ended = true;
    closeWebrtc();
    setLive("frame done", false);
    $("#live-eta").textContent = "";
  });
  source.onerror = () => setLive("reconnecting", false);
  return source;
}

function showPath() {
  if (ended) return;
  const video = $("#live-video");
  video.hidden = path !== "webrtc";
  $("#live-canvas").hidden = path === "webrtc";
  $("#live-view").dataset.path = path;
  if (path === "webrtc") return setLive("live \u00b7 WebRTC video", true);
  // why not WebRTC in a word on the page, the server's message on hover
  const word = why ? ` (${why.split(":")[0]})` : "";
  setLive(`live \u00b7 JPEG over SSE${word}`, true, why);
}

function closeWebrtc() {
  if (pc) pc.close();
  pc = null;
  const video = $("#live-video");
  video.srcObject = null;
  video.hidden = true;
  $("#live-canvas").hidden = false;
}

function fallBack(reason) {
  // the canvas (kept drawn all along) shows the frame again
  closeWebrtc();
  path = "sse";
  why = reason;
  showPath();
}

function gathered(peer) {
  if (peer.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ICE_GATHER_MS); // send what we have
    peer.addEventListener("icegatheringstatechange", () => {
      if (peer.iceGatheringState === "complete") { clearTimeout(timer); resolve(); }
    });
  });
}

async function tryWebrtc() {
  if (!window.RTCPeerConnection) return fallBack("no WebRTC in this browser");
  let servers;
  try {
    servers = (await api(base + "/live/webrtc")).iceServers || [];
  } catch (err) {
    return fallBack(`WebRTC refused: ${err.message}`);
  }
  const peer = new RTCPeerConnection({ iceServers: servers });
  pc = peer;
  const transceiver = peer.addTransceiver("video", { direction: "recvonly" });
  // frames are shown as soon as they decode (where the browser has these knobs)
  if ("playoutDelayHint" in transceiver.receiver) transceiver.receiver.playoutDelayHint = 0;
  if ("jitterBufferTarget" in transceiver.receiver) transceiver.receiver.jitterBufferTarget = 0;
  const video = $("#live-video");
  peer.ontrack = (ev) => {
    video.srcObject = ev.streams[0] || new MediaStream([ev.track]);
    video.play().catch(() => {});
  };
  video.onplaying = () => {
    if (pc !== peer || ended) return;
    path = "webrtc";
    why = "";
    showPath();
  };
  peer.onconnectionstatechange = () => {
    if (pc === peer && ["failed", "closed"].includes(peer.connectionState)) fallBack("WebRTC connection lost");
  };
  setTimeout(() => {
    if (pc === peer && path !== "webrtc") fallBack("WebRTC did not connect");
  }, WEBRTC_CONNECT_MS);
  try {
    await peer.setLocalDescription(await peer.createOffer());
    await gathered(peer);
    const answer = await api(base + "/live/webrtc", { method: "POST", json: { type: "offer", sdp: peer.localDescription.sdp } });
    if (pc !== peer) return;
    await peer.setRemoteDescription({ type: "answer", sdp: answer.sdp });
  } catch (err) {
    if (pc === peer) fallBack(`WebRTC refused: ${err.message}`);
  }
}

async function start() {
  // the stream opens at once, beside the job's details: a viewer joining mid-frame sees the
  // frame's state without waiting for them (the passes say the frame's size)
  const source = connect();
  let job;
  try {
    job = await api(base);
  } catch (err) {
    source.close();
    throw err;
  }
  const got = job.spec || {};
  if (!got.live_preview) {
    source.close();
    return;
  }
  const m = /^\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*$/.exec(String(got.tiles || "1x1"));
  got.tile_count = m ? parseInt(m[1], 10) * (m[2] ? parseInt(m[2], 10) : parseInt(m[1], 10)) : 1;
  spec = got;
  size(spec.width, spec.height);
  if (new URLSearchParams(location.search).get("live") !== "sse") await tryWebrtc();
}

// job.js shows what went wrong with the job itself (gone, not yours); the preview just stays hidden
start().catch(() => {});
