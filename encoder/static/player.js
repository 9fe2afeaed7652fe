// Tessera stream player: starts or joins a session, plays it with the least delay the browser
// allows, sends keyboard and mouse over the "input" data channel, shows live stats.
// Query: ?session=<sid>&role=player|spectator&api=<base url>  (join a session)
//        ?app=<name>&width=&height=&fps=&project=&autostart=1 (start one)
//        &token=<stream token>  (opened on a stream service itself; the web needs none)
//        &transport=ws  (the WebSocket + WebCodecs fallback from the start, not after ICE fails)
// A module (strict, its names its own): it runs once the page has been parsed, and calls the
// API with the request helper the web's pages use too (request.js in this folder, which the
// stream service and the web both serve at /static/request.js).
import { request } from "./static/request.js";

const params = new URLSearchParams(location.search);
const api = (params.get("api") || "").replace(/\/+$/, "");
const token = params.get("token") || "";
const auth = token ? { Authorization: "Bearer " + token } : {};
const $ = (id) => document.getElementById(id);
const video = $("video");
const ICE_GATHER_TIMEOUT_MS = 5000;
const ICE_CONNECT_TIMEOUT_MS = 10000;
const STATS_INTERVAL_MS = 1000;

// Everything a test or a curious user may read: window.tessera.stats, .state, ...
const tessera = {
  state: "idle",
  error: null,
  sessionId: params.get("session"),
  viewerId: null,
  role: null,
  controlling: false,
  frameWidth: 0,
  frameHeight: 0,
  stats: {
    fps: 0, bitrate_kbps: 0, rtt_ms: null, ping_ms: null, decode_ms: null,
    jitter_buffer_ms: null, frames_decoded: 0, frames_dropped: 0, packets_lost: 0,
    bytes_received: 0, codec: null,
    // latency overlay: the service's share (capture to send), the browser's (packet in to
    // frame on screen), and their sum with half the round trip
    service_ms: null, browser_ms: null, latency_ms: null,
  },
  // the text an app of the session last copied (controlling viewer only)
  clipboard: null,
  // the display size this viewer last asked for ([width, height] in device pixels)
  askedSize: null,
  // the session is being recorded (every viewer is told)
  recording: false,
  // gamepad states sent (the controlling viewer's pads, Gamepad API standard mapping)
  gamepadsSent: 0,
  // the files of the session's home folder (controlling viewer): [{name, size}]
  files: null,
  // the session's sound: its MediaStream once it came (null: the session sends none), and
  // whether this page plays it (the browser may refuse sound before a click: then muted)
  audioStream: null,
  // over the WebSocket, the WebAudio node whose output is heard (null over WebRTC)
  soundNode: null,
  muted: false,
  // the WebSocket viewer's sound: packets played, dropped (behind their place) and gaps (the
  // sound ran dry); the last packet's delay from capture to heard, the picture's from capture
  // to decoded, and the jitter margin (ms)
  sound: null,
  // lip sync (sessions with sound, either transport): how long each video frame is held for
  // its sound, and the two delays it is made of (ms), updated each second; null: not holding
  lipSync: null,
  setMuted,
  send,
  takeControl,
  leave,
  paste,
  askResize,
  // how many resizes this viewer asked for (one per settled change of its picture area)
  resizesSent: 0,
  record,
  listFiles,
  uploadFile,
  download,
};
window.tessera = tessera;

let pc = null;
let channel = null;
let prevStats = null;
let statsTimer = null;
let leaving = false;  // the user left: the connection closing is no failure

// ------------------------------------------------------------------ HTTP

// The stream API, on the service itself (with its token) or through the web (its cookie)
function call(method, path, json, options = {}) {
  return request(api + path, { method, json, headers: auth, ...options });
}

// ------------------------------------------------------------------ state and errors

function setState(state) {
  tessera.state = state;
  $("state").textContent = state;
  $("state").classList.toggle("bad", ["failed", "refused", "closed"].includes(state));
}

/** The codes of a session the service refused (not one that failed), and what each says first. */
const REFUSALS = {
  no_capacity: "No room for a new session right now: ",
  never_fits: "This session can never start on this device: ",
};

function showError(err) {
  const code = err.code || "error";
  tessera.error = { code, message: String(err.message || err) };
  const text = (Object.hasOwn(REFUSALS, code) ? REFUSALS[code] : "") + tessera.error.message;
  $("error").textContent = text;
  $("error").hidden = false;
}

function clearError() {
  tessera.error = null;
  $("error").hidden = true;
}

function setRole(role) {
  tessera.role = role;
  tessera.controlling = role === "player";
  $("s-role").textContent = tessera.controlling ? "player (in control)" : "spectator";
  $("control").hidden = tessera.controlling;
  $("lock").hidden = !tessera.controlling;
  $("record").hidden = !tessera.controlling;
  $("files").hidden = !tessera.controlling;
  if (tessera.controlling) {
    listFiles().catch((err) => {
      // 404: the session's app has no home folder (it is not sandboxed): no files to offer
      if (err.status === 404) $("files").hidden = true;
      else showError(err);
    });
  }
  video.classList.toggle("controlling", tessera.controlling);
  if (!tessera.controlling) releaseAll();
}

// ------------------------------------------------------------------ starting and joining

async function loadApps() {
  const form = $("start");
  form.hidden = false;
  try {
    const { apps } = await call("GET", "/api/streams/apps");
    const select = $("app");
    select.replaceChildren();
    for (const app of apps) {
      const opt = document.createElement("option");
      opt.value = app.name;
      opt.textContent = app.title || app.name;
      opt.dataset.width = app.width;
      opt.dataset.height = app.height;
      opt.dataset.fps = app.fps;
      select.append(opt);
    }
    const wanted = params.get("app");
    if (wanted) select.value = wanted;
    select.onchange = () => {
      const opt = select.selectedOptions[0];
      if (!opt) return;
      $("width").value = opt.dataset.width;
      $("height").value = opt.dataset.height;
      $("fps").value = opt.dataset.fps;
    };
    if (!params.get("width")) select.onchange();
  } catch (err) {
    showError(err);
  }
  for (const key of ["width", "height", "fps"]) {
    if (params.get(key)) $(key).value = params.get(key);
  }
}

async function startSession(event) {
  if (event) event.preventDefault();
  clearError();
  setState("starting");
  const body = {
    app: $("app").value || params.get("app"),
    width: Number($("width").value),
    height: Number($("height").value),
    fps: Number($("fps").value),
  };
  if (params.get("project")) body.project = params.get("project");  // the web checks it
  try {
    const session = await call("POST", "/api/streams/sessions", body);
    tessera.sessionId = session.session_id;
    const url = new URL(location.href);
    for (const key of ["app", "width", "height", "fps", "autostart"]) url.searchParams.delete(key);
    url.searchParams.set("session", session.session_id);
    history.replaceState(null, "", url);
    $("start").hidden = true;
    await join(session.session_id, params.get("role") || "player", session);
  } catch (err) {
    setState(Object.hasOwn(REFUSALS, err.code) ? "refused" : "failed");
    showError(err);
  }
}

// The STUN/TURN servers to try; without them (the lookup failed: said on the page) only the
// host's own addresses, which a viewer on the same network still reaches
async function iceServers() {
  try {
    const { iceServers } = await call("GET", "/api/streams/ice");
    return iceServers || [];
  } catch (err) {
    showError({ code: err.code, message: `No STUN/TURN servers (${err.message}): connecting without them.` });
    return [];
  }
}

function gatheringComplete(peer) {
  if (peer.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ICE_GATHER_TIMEOUT_MS); // send what we have
    peer.addEventListener("icegatheringstatechange", () => {
      if (peer.iceGatheringState === "complete") { clearTimeout(timer); resolve(); }
    });
  });
}

async function join(sid, role, session) {
  lipSyncAsked = lipSyncWanted(session || await sessionInfo(sid));
  if (params.get("transport") === "ws" || !window.RTCPeerConnection) return joinWs(sid, role);
  tessera.transport = "webrtc";
  setState("connecting");
  clearError();
  startLipSync(lipSyncAsked && "createEncodedStreams" in RTCRtpReceiver.prototype);
  // insertable streams are asked for when the connection is made, or never
  pc = new RTCPeerConnection({ iceServers: await iceServers(), encodedInsertableStreams: lipSync.on });
  const transceiver = pc.addTransceiver("video", { direction: "recvonly" });
  lowDelay(transceiver.receiver);
  preferH264(transceiver);
  pc.addTransceiver("audio", { direction: "recvonly" }); // sessions of apps with sound fill it
  channel = pc.createDataChannel("input", { ordered: true });
  channel.onmessage = onMessage;
  channel.onclose = () => {
    if (leaving || tessera.state !== "playing") return;
    setState("closed");
    showError({ code: "ended", message: "The session ended." });
  };

  pc.ontrack = (event) => {
    lowDelay(event.receiver);
    if (lipSync.on) holdFrames(event.receiver, event.track.kind);
    if (event.track.kind === "audio") return playAudio(event.track);
    video.srcObject = event.streams[0] || new MediaStream([event.track]);
    playVideo();
  };
  pc.onconnectionstatechange = () => {
    if (leaving) return;
    const cs = pc.connectionState;
    if (cs === "failed" && fallBack(sid, role)) {
      return;
    } else if (cs === "failed") {
      setState("failed");
      showError({ code: "connection_failed", message: "The connection to the stream failed." });
    } else if (cs === "disconnected") {
      setState("reconnecting");  // ICE may come back by itself
    } else if (cs === "connected" && tessera.state === "reconnecting") {
      setState("playing");
    } else if (cs === "closed") {
      setState("closed");
    }
  };

  try {
    await pc.setLocalDescription(await pc.createOffer());
    await gatheringComplete(pc);
    const answer = await call("POST", `/api/streams/sessions/${encodeURIComponent(sid)}/viewers`, {
      type: "offer", sdp: pc.localDescription.sdp, role,
    });
    tessera.viewerId = answer.viewer_id;
    setRole(answer.role);
    await pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
    // ICE that never gets through (UDP blocked, no TURN) does not always say "failed"
    const tried = pc;
    setTimeout(() => {
      if (pc === tried && !["connected", "closed"].includes(tried.connectionState)) fallBack(sid, role);
    }, ICE_CONNECT_TIMEOUT_MS);
  } catch (err) {
    setState(Object.hasOwn(REFUSALS, err.code) ? "refused" : "failed");
    showError(err);
    pc.close();
    return;
  }
  $("leave").hidden = false;
  $("end").hidden = false;
  statsTimer = setInterval(updateStats, STATS_INTERVAL_MS);
}

// The service sends H.264: put it first in the offer (the rest stay, for other servers)
function preferH264(transceiver) {
  if (!transceiver.setCodecPreferences || !RTCRtpReceiver.getCapabilities) return;
  const codecs = RTCRtpReceiver.getCapabilities("video").codecs;
  const h264 = codecs.filter((c) => c.mimeType === "video/H264");
  if (h264.length) {
    transceiver.setCodecPreferences([...h264, ...codecs.filter((c) => c.mimeType !== "video/H264")]);
  }
}

// Ask the browser to play frames as soon as they decode: no playout delay, no jitter target
// (where it has these knobs).
function lowDelay(receiver) {
  if (!receiver) return;
  if ("playoutDelayHint" in receiver) receiver.playoutDelayHint = 0;
  if ("jitterBufferTarget" in receiver) receiver.jitterBufferTarget = 0;
}

// Muted video may play by itself; a browser that refuses waits for a click on the picture.
function playVideo() {
  video.play().catch((err) => {
    if (err.name === "AbortError") return; // a newer source replaced this one: its play counts
    showError({ code: "autoplay", message: `The browser did not start the picture (${err.message}): click it to play.` });
    video.addEventListener("click", () => { clearError(); video.play().catch(showError); }, { once: true });
  });
}

async function takeControl() {
  if (!tessera.sessionId || !tessera.viewerId) return;
  try {
    await call("POST", `/api/streams/sessions/${encodeURIComponent(tessera.sessionId)}/control`,
      { viewer_id: tessera.viewerId });
    setRole("player");
    clearError();
  } catch (err) {
    showError(err);
  }
}

// ------------------------------------------------------------------ sound
function playAudio(track) {
  const audio = $("audio");
  tessera.audioStream = new MediaStream([track]);
  audio.srcObject = tessera.audioStream;
  $("sound").hidden = false;
  setMuted(tessera.muted);
}

function setMuted(muted) {
  const audio = $("audio");
  tessera.muted = muted;
  audio.muted = muted;
  $("sound").textContent = muted ? "Sound off" : "Sound on";
  $("sound").setAttribute("aria-pressed", String(!muted));
  if (wsSound) {
    wsSound.volume.gain.value = muted ? 0 : 1;
    if (!muted) wsSound.start();
    return;
  }
  if (!muted && audio.srcObject) {
    // without a click first the browser may refuse to play sound: show it as muted
    audio.play().catch(() => setMuted(true));
  }
}

async function leave(endSession) {
  leaving = true;
  setState(endSession ? "ending" : "leaving");
  clearInterval(statsTimer);
  releaseAll();
  const sid = encodeURIComponent(tessera.sessionId || "");
  try {
    if (endSession) await call("DELETE", `/api/streams/sessions/${sid}`);
    else if (tessera.viewerId) {
      await call("DELETE", `/api/streams/sessions/${sid}/viewers/${encodeURIComponent(tessera.viewerId)}`);
    }
  } catch (err) {
    showError(err);
  }
  if (pc) pc.close();
  if (ws) ws.close();
  tessera.viewerId = null;
  setState("closed");
  $("leave").hidden = $("end").hidden = $("control").hidden = $("lock").hidden = true;
}

// ------------------------------------------------------------------ WebSocket fallback
// The same session over one WebSocket: binary messages are H.264 access units or Opus packets
// (a 10-byte header: version, flags (1 = keyframe, 2 = sound), capture time in microseconds),
// decoded with WebCodecs into the same <video> and into WebAudio; text messages are the data
// channel's JSON, both ways.

let ws = null;
let wsSound = null;  // the WebSocket viewer's sound player, once the session sent sound
let wsHello = null;  // what the WebSocket viewer starts once the service said hello
let fellBack = false;

// ICE failed before anything played: leave that viewer and join again over the WebSocket
function fallBack(sid, role) {
  if (fellBack || leaving || tessera.state === "playing" || !window.VideoDecoder) return false;
  fellBack = true;
  const old = pc, oldViewer = tessera.viewerId;
  pc = null;
  clearInterval(statsTimer);
  if (old) old.close();
  tessera.viewerId = null;
  // that viewer leaves first: it holds control, which the new one is to have
  const left = oldViewer
    ? call("DELETE", `/api/streams/sessions/${encodeURIComponent(sid)}/viewers/${encodeURIComponent(oldViewer)}`)
    : Promise.resolve();
  left.then(() => joinWs(sid, role), (err) => {
    joinWs(sid, role);
    // said after joinWs cleared the page's error: the old viewer may still hold control
    showError({ code: err.code, message: `The WebRTC viewer did not leave (${err.message}): this one may only watch.` });
  });
  return true;
}

function wsUrl(sid, role) {
  const url = new URL(api + `/api/streams/sessions/${encodeURIComponent(sid)}/ws`, location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  url.searchParams.set("role", role);
  if (token) url.searchParams.set("token", token);
  return url;
}

// "avc1.PPCCLL" from the SPS of an Annex B access unit, or null
function avcCodec(bytes) {
  for (let i = 0; i + 7 < bytes.length; i++) {
    if (bytes[i] === 0 && bytes[i + 1] === 0 && bytes[i + 2] === 1 && (bytes[i + 3] & 0x1f) === 7) {
      const hex = (b) => b.toString(16).padStart(2, "0");
      return "avc1." + hex(bytes[i + 4]) + hex(bytes[i + 5]) + hex(bytes[i + 6]);
    }
  }
  return null;
}

function videoSink() {
  if (window.MediaStreamTrackGenerator) {
    const generator = new MediaStreamTrackGenerator({ kind: "video" });
    const writer = generator.writable.getWriter();
    video.srcObject = new MediaStream([generator]);
    playVideo();
    return (frame) => {
      if (writer.desiredSize !== null && writer.desiredSize <= 0) { frame.close(); return; }
      writer.write(frame).catch((err) => {  // the writer closes the frame, written or not
        tessera.stats.frames_dropped++;
        if (!leaving) showError({ code: "video", message: `A frame could not be shown: ${err.message}` });
      });
    };
  }
  const canvas = document.createElement("canvas");
  const ctx = canvas.getContext("2d");
  video.srcObject = canvas.captureStream();
  playVideo();
  return (frame) => {
    if (canvas.width !== frame.displayWidth) canvas.width = frame.displayWidth;
    if (canvas.height !== frame.displayHeight) canvas.height = frame.displayHeight;
    ctx.drawImage(frame, 0, 0);
    frame.close();
  };
}

async function joinWs(sid, role) {
  tessera.transport = "websocket";
  setState("connecting");
  clearError();
  if (!window.VideoDecoder) {
    setState("failed");
    showError({ code: "unsupported", message: "This browser has no WebCodecs for the WebSocket fallback." });
    return;
  }
  const sink = videoSink();
  const st = tessera.stats;
  const decodeStarted = new Map();
  // configured: the codec the decoder has; streamCodec: the one the stream's last keyframe named
  let decoder = null, configured = null, streamCodec = null, waitKey = true, bytes = 0, frames = 0, decodeSum = 0;
  let last = { at: performance.now(), frames: 0, bytes: 0 };
  // how late the picture is without the lip sync's hold (capture to decoded), the last frame's
  // and the sum over this second's frames
  let pictureDelayMs = null, pictureSum = 0;
  startLipSync(lipSyncAsked);  // it holds nothing until sound comes
  st.codec = "video/H264 (WebSocket)";

  function newDecoder() {
    decoder = new VideoDecoder({
      output: (frame) => {
        const times = decodeStarted.get(frame.timestamp);
        decodeStarted.delete(frame.timestamp);
        let heldMs = 0;
        if (times !== undefined) {
          decodeSum += performance.now() - times.decoding;
          heldMs = times.decoding - times.arrived;
          latencyArrived(frame.timestamp, times.arrived);
        }
        frames++;
        st.frames_decoded++;
        pictureDelayMs = performance.timeOrigin + performance.now() - frame.timestamp / 1000 - heldMs;
        pictureSum += pictureDelayMs;
        tessera.frameWidth = frame.displayWidth;
        tessera.frameHeight = frame.displayHeight;
        if (tessera.state === "connecting") setState("playing");
        sink(frame);
      },
      error: () => { configured = null; behind(); },
    });
  }

  // decoding fell behind (or failed): drop to a keyframe, asked for now
  function behind() {
    if (waitKey) return;
    waitKey = true;
    send({ t: "keyframe" });
  }

  function onMedia(buf) {
    const view = new DataView(buf);
    if (buf.byteLength < 10 || view.getUint8(0) !== 1) return;
    const key = (view.getUint8(1) & 1) === 1;
    const at = Number(view.getBigUint64(2));
    const data = new Uint8Array(buf, 10);
    bytes += buf.byteLength;
    st.bytes_received += buf.byteLength;
    if ((view.getUint8(1) & 2) === 2) {
      // the sound is placed with the picture as shown: its delay and the hold
      if (!wsSound) wsSound = soundPlayer(() => pictureDelayMs === null ? null : pictureDelayMs + lipSync.holdMs);
      if (wsSound) wsSound.decode(at, data);
      return;
    }
    // a keyframe names its codec (its SPS); the decoder takes it when the keyframe leaves the
    // lip sync's hold, after the frames before it
    const codec = key ? avcCodec(data) || streamCodec : null;
    if (key) {
      streamCodec = codec;
      waitKey = false;
    }
    if (waitKey || !streamCodec) { st.frames_dropped++; return; }
    if (!key && decoder && decoder.decodeQueueSize > 2) {
      st.frames_dropped++;
      behind();
      return;
    }
    holdVideo({ codec, chunk: new EncodedVideoChunk({ type: key ? "key" : "delta", timestamp: at, data }) });
  }

  const holdVideo = holder(({ codec, chunk }, arrived) => {
    if (codec) {
      if (!decoder || decoder.state === "closed") { newDecoder(); configured = null; }
      if (codec !== configured) {
        decoder.configure({ codec, optimizeForLatency: true, hardwareAcceleration: "no-preference" });
        configured = codec;
      }
    }
    if (!decoder || decoder.state !== "configured") { st.frames_dropped++; return; }
    decodeStarted.set(chunk.timestamp, { arrived, decoding: performance.now() });
    decoder.decode(chunk);
  });

  function wsStats() {
    send({ t: "ping", ts: performance.now() });
    const now = performance.now(), dt = (now - last.at) / 1000;
    if (dt > 0) {
      st.fps = round((frames - last.frames) / dt, 1);
      st.bitrate_kbps = round(8 * (bytes - last.bytes) / dt / 1000, 0);
      if (frames > last.frames) st.decode_ms = round(decodeSum / (frames - last.frames), 2);
    }
    const sound = wsSound && wsSound.earliest();
    if (lipSync.on && sound !== null && frames > last.frames) setHold(sound, pictureSum / (frames - last.frames));
    decodeSum = pictureSum = 0;
    last = { at: now, frames, bytes };
    if (decodeStarted.size > 100) decodeStarted.clear();
    render();
  }

  ws = new WebSocket(wsUrl(sid, role));
  ws.binaryType = "arraybuffer";
  const socket = ws;
  channel = {
    get readyState() { return socket.readyState === WebSocket.OPEN ? "open" : "closed"; },
    send: (text) => socket.send(text),
  };
  wsHello = () => { statsTimer = setInterval(wsStats, STATS_INTERVAL_MS); };
  socket.onmessage = (event) => {
    if (typeof event.data !== "string") onMedia(event.data);
    else onMessage(event);
  };
  socket.onclose = () => {
    clearInterval(statsTimer);
    if (decoder && decoder.state !== "closed") decoder.close();
    if (wsSound) { wsSound.close(); wsSound = null; }
    if (leaving) return;
    if (tessera.state === "playing") showError({ code: "ended", message: "The session ended." });
    else if (!tessera.error) showError({ code: "connection_failed", message: "The WebSocket to the stream closed." });
    setState(tessera.state === "playing" ? "closed" : "failed");
  };
}

// The WebSocket viewer's sound: Opus decoded with WebCodecs, played with WebAudio, each packet
// at the moment that keeps it with the picture (its capture time plus the picture's delay now)
// and never sooner than a margin from now that covers the packets' arrival jitter (it grows
// when the sound runs dry and shrinks back while it does not). Sound later than the picture is
// played as soon as the margin allows, and the lip sync holds the picture for it (its delay
// when played that soon is earliest()).
const SOUND_MARGIN_S = { least: 0.01, most: 0.08, step: 0.01, calm_s: 10 };
// a packet that would play this far beyond its place (a burst after a stall) is dropped;
// nearer, the sound plays this much faster until it is back at its place (NetEq's accelerate,
// without keeping the pitch: 2 % is a third of a semitone)
const SOUND_BEHIND_S = 0.04;
const SOUND_CATCH_UP_RATE = 1.02;
// the browser may refuse to start sound before a click: after this long the page says muted
const SOUND_START_WAIT_MS = 1000;

function soundPlayer(pictureDelayMs) {
  if (!window.AudioDecoder || !window.AudioContext) return null;
  const ctx = new AudioContext({ latencyHint: "interactive", sampleRate: 48000 });
  const volume = ctx.createGain();
  volume.connect(ctx.destination);
  const tap = ctx.createMediaStreamDestination();  // tessera.audioStream, as over WebRTC
  const stats = tessera.sound = {
    played: 0, dropped: 0, gaps: 0, delay_ms: null, picture_ms: null,
    margin_ms: SOUND_MARGIN_S.least * 1000,
  };
  let margin = SOUND_MARGIN_S.least, calmSince = 0, playhead = 0, decoder = null;
  // the capture-to-heard delay of packets played as early as the margin allows, summed
  let earliestSum = 0, earliestCount = 0;

  function newDecoder() {
    decoder = new AudioDecoder({ output: play, error: () => { decoder = null; } });
    decoder.configure({ codec: "opus", sampleRate: 48000, numberOfChannels: 2 });
  }

  // the AudioContext time at which a sound captured at `captureUs` is heard with a picture
  // `delay` ms late (0: no picture yet)
  function placeOf(captureUs, delay, heard) {
    if (delay === null) return 0;
    const wantPerf = captureUs / 1000 + delay - performance.timeOrigin;
    return heard.contextTime + (wantPerf - heard.performanceTime) / 1000;
  }

  function ranDry(now) {
    stats.gaps++;
    margin = Math.min(margin + SOUND_MARGIN_S.step, SOUND_MARGIN_S.most);
    calmSince = now;
  }

  function play(data) {
    const buffer = ctx.createBuffer(data.numberOfChannels, data.numberOfFrames, data.sampleRate);
    for (let c = 0; c < data.numberOfChannels; c++) {
      data.copyTo(buffer.getChannelData(c), { planeIndex: c, format: "f32-planar" });
    }
    const captureUs = data.timestamp;
    data.close();
    const now = ctx.currentTime, heard = ctx.getOutputTimestamp(), delay = pictureDelayMs();
    if (now - calmSince > SOUND_MARGIN_S.calm_s && margin > SOUND_MARGIN_S.least) {
      margin = Math.max(margin - SOUND_MARGIN_S.step / 2, SOUND_MARGIN_S.least);
      calmSince = now;
    }
    const soonest = now + margin;
    earliestSum += heard.performanceTime + (soonest - heard.contextTime) * 1000
      + performance.timeOrigin - captureUs / 1000;
    earliestCount++;
    const place = Math.max(placeOf(captureUs, delay, heard), soonest);
    if (playhead < now) {
      if (playhead > 0) ranDry(now);
      else calmSince = now;
      playhead = place;
    } else if (playhead > place + SOUND_BEHIND_S) {
      stats.dropped++;
      return;
    } else if (playhead < place - SOUND_BEHIND_S) {
      playhead = place;  // the picture's delay grew: the sound waits with it
    }
    const source = ctx.createBufferSource();
    source.buffer = buffer;
    const rate = playhead > place + 0.005 ? SOUND_CATCH_UP_RATE : 1;
    source.playbackRate.value = rate;
    source.connect(volume);
    source.connect(tap);
    source.start(playhead);
    stats.played++;
    stats.delay_ms = round(heard.performanceTime + (playhead - heard.contextTime) * 1000
      + performance.timeOrigin - captureUs / 1000, 1);
    stats.picture_ms = delay === null ? null : round(delay, 1);
    stats.margin_ms = round(margin * 1000, 0);
    playhead += buffer.duration / rate;
  }

  const player = {
    volume,
    decode(captureUs, data) {
      if (!decoder || decoder.state === "closed") newDecoder();
      decoder.decode(new EncodedAudioChunk({ type: "key", timestamp: captureUs, data }));
    },
    // this second's mean delay of sound played as soon as it can be (null: none played)
    earliest() {
      const mean = earliestCount ? earliestSum / earliestCount : null;
      earliestSum = earliestCount = 0;
      return mean;
    },
    start() {
      ctx.resume();
      setTimeout(() => { if (ctx.state !== "running" && !tessera.muted) setMuted(true); }, SOUND_START_WAIT_MS);
    },
    close() {
      if (decoder && decoder.state !== "closed") decoder.close();
      ctx.close();
    },
  };
  tessera.audioStream = tap.stream;
  // what the viewer hears, in the context that plays it (a second context listening to
  // audioStream hears it later, by the crossing between contexts)
  tessera.soundNode = volume;
  $("sound").hidden = false;
  // setMuted reads wsSound: the player is in place before it is called
  queueMicrotask(() => setMuted(tessera.muted));
  return player;
}

// ------------------------------------------------------------------ data channel

function send(message) {
  if (channel && channel.readyState === "open") {
    channel.send(JSON.stringify(message));
    return true;
  }
  return false;
}

// Every message the service sends a viewer (encoder/control.py, session.py, routes.py), on
// the data channel or the WebSocket, and what the page does with it
const MESSAGES = Object.freeze({
  // the answer to a ping: the input round trip, the service's share of the latency, and
  // whether the session records (a viewer joining later learns it here)
  pong(msg) {
    tessera.stats.ping_ms = round(performance.now() - msg.ts, 1);
    if (typeof msg.rec === "boolean") setRecording(msg.rec);
    if (typeof msg.service_ms === "number") tessera.stats.service_ms = msg.service_ms;
    if (typeof msg.sound_lead_ms === "number") lipSync.leadMs = msg.sound_lead_ms;
    render();
  },
  // input from a viewer not in control: control went to someone else
  denied() {
    if (tessera.controlling) setRole("spectator");
  },
  // control was handed over: to this viewer or away from it
  control(msg) {
    setRole(msg.controlling === true ? "player" : "spectator");
  },
  recording(msg) {
    setRecording(msg.on === true);
  },
  // an app of the session copied text (the controlling viewer only)
  clip(msg) {
    if (typeof msg.text === "string") copied(msg.text);
  },
  // WebSocket only: the viewer joined
  hello(msg) {
    tessera.viewerId = msg.viewer_id;
    setRole(msg.controlling ? "player" : "spectator");
    $("leave").hidden = false;
    $("end").hidden = false;
    if (wsHello) wsHello();
  },
  // WebSocket only: the join failed (the socket closes next)
  error(msg) {
    showError(msg);
  },
});

// A message this page does not know (a newer service): said once in the console, per kind
const unknownMessages = new Set();

function onMessage(event) {
  const msg = JSON.parse(event.data);  // the service sends JSON only: anything else throws
  if (Object.hasOwn(MESSAGES, msg.t)) {
    MESSAGES[msg.t](msg);
  } else if (!unknownMessages.has(msg.t)) {
    unknownMessages.add(msg.t);
    console.warn(`player: the service sent a message of kind ${JSON.stringify(msg.t)}, which it does not handle`, msg);
  }
}

// ------------------------------------------------------------------ clipboard

// An app copied: the text goes to the local clipboard where the browser lets us write it
function copied(text) {
  tessera.clipboard = text;
  if (navigator.clipboard && document.hasFocus()) {
    navigator.clipboard.writeText(text).catch((err) => {
      showError({ code: "clipboard", message: `What the app copied stays in the session: the browser refused its clipboard (${err.message}).` });
    });
  }
}

// Text for the session's apps to paste (what the user pasted into the page)
function paste(text) {
  return inputAllowed() && send({ t: "clip", text: String(text) });
}

// ------------------------------------------------------------------ gamepads

// The controlling viewer's pads are read every frame while any is connected; a pad's state
// goes out when it changes (buttons 0..1, axes -1..1, standard mapping)
const PAD_POLL_MS = 16;
const lastPad = new Map();
let padTimer = null;

function pollPads() {
  const pads = navigator.getGamepads ? Array.from(navigator.getGamepads()) : [];
  if (!pads.some((pad) => pad)) {
    clearInterval(padTimer);
    padTimer = null;
    return;
  }
  if (!inputAllowed()) return;
  for (const pad of pads) {
    if (!pad || pad.index > 3) continue;
    const message = {
      t: "gp",
      i: pad.index,
      b: Array.from(pad.buttons, (button) => round(button.value, 3)),
      a: Array.from(pad.axes, (axis) => round(axis, 3)),
    };
    const text = JSON.stringify(message);
    if (lastPad.get(pad.index) !== text && send(message)) {
      lastPad.set(pad.index, text);
      tessera.gamepadsSent += 1;
    }
  }
}

window.addEventListener("gamepadconnected", () => {
  if (padTimer === null) padTimer = setInterval(pollPads, PAD_POLL_MS);
});

// ------------------------------------------------------------------ files

// The session's home folder, for its controlling viewer: upload into it, download from it
function filesPath(name) {
  const base = `/api/streams/sessions/${encodeURIComponent(tessera.sessionId)}/files`;
  return name === undefined ? base : `${base}/${encodeURIComponent(name)}`;
}

async function listFiles() {
  const data = await call("GET", filesPath());
  tessera.files = data.files;
  const list = $("file-list");
  list.replaceChildren(...data.files.map((file) => {
    const item = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = file.name;
    button.title = `Download ${file.name} (${file.size} bytes)`;
    button.addEventListener("click", () => saveFile(file.name).catch(showError));
    item.append(button);
    return item;
  }));
  return data.files;
}

async function uploadFile(file) {
  await call("PUT", filesPath(file.name), undefined, { body: file });
  return listFiles();
}

function download(name) {
  return call("GET", filesPath(name), undefined, { as: "blob" });
}

async function saveFile(name) {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(await download(name));
  link.download = name;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 60000);
}

$("upload").addEventListener("change", (event) => {
  for (const file of event.target.files) uploadFile(file).catch(showError);
  event.target.value = "";
});

// ------------------------------------------------------------------ recording

// Recording is announced on every viewer's picture; the controlling viewer starts and stops it
function setRecording(on) {
  tessera.recording = on;
  $("rec").hidden = !on;
  $("record").textContent = on ? "Stop recording" : "Record";
  $("record").setAttribute("aria-pressed", String(on));
}

function record(on) {
  return inputAllowed() && send({ t: "record", on: Boolean(on) });
}

// ------------------------------------------------------------------ resize

// The session's display follows the controlling viewer's picture area (the video's
// container, whatever changed it: the window, the page's layout), in device pixels, asked
// for once it stops changing (the service keeps it within its limit). A session starts at
// the size it was started with: what the area was until this viewer could drive the
// session is where it starts following from, not a change.
const RESIZE_SETTLE_MS = 250;
let resizeTimer = null;
let areaFollowed = null;  // the picture area the display was last asked to take, "WxH"

function pictureArea() {
  const stage = $("stage");
  const scale = window.devicePixelRatio || 1;
  const w = Math.max(64, Math.floor((stage.clientWidth * scale) / 2) * 2);
  const h = Math.max(64, Math.floor((stage.clientHeight * scale) / 2) * 2);
  return [w, h];
}

function askResize() {
  if (!inputAllowed()) return false;
  const [w, h] = pictureArea();
  areaFollowed = `${w}x${h}`;
  tessera.askedSize = [w, h];
  if (!send({ t: "resize", w, h })) return false;
  tessera.resizesSent += 1;
  return true;
}

new ResizeObserver(() => {
  clearTimeout(resizeTimer);
  if (!inputAllowed()) {
    areaFollowed = pictureArea().join("x");
    return;
  }
  resizeTimer = setTimeout(() => {
    if (pictureArea().join("x") !== areaFollowed) askResize();
  }, RESIZE_SETTLE_MS);
}).observe($("stage"));

window.addEventListener("paste", (event) => {
  if (!inputAllowed() || typingInForm(event) || !event.clipboardData) return;
  const text = event.clipboardData.getData("text/plain");
  if (text) paste(text);
});

// ------------------------------------------------------------------ input

const pressed = new Set();
const pointer = { x: 0, y: 0 };
let pendingMove = false;

function inputAllowed() {
  return tessera.controlling && channel && channel.readyState === "open";
}

function typingInForm(event) {
  const tag = event.target && event.target.tagName;
  return tag === "INPUT" || tag === "SELECT" || tag === "TEXTAREA";
}

// Where a point of the page falls in the video's own pixels (object-fit: contain letterboxes)
function videoPixel(clientX, clientY) {
  const rect = video.getBoundingClientRect();
  const vw = video.videoWidth, vh = video.videoHeight;
  if (!vw || !vh || !rect.width || !rect.height) return null;
  const scale = Math.min(rect.width / vw, rect.height / vh);
  const left = rect.left + (rect.width - vw * scale) / 2;
  const top = rect.top + (rect.height - vh * scale) / 2;
  const x = Math.floor((clientX - left) / scale);
  const y = Math.floor((clientY - top) / scale);
  if (x < 0 || y < 0 || x >= vw || y >= vh) return null;
  return { x, y };
}

const sent = { x: -1, y: -1 };

// the pointer's position, if it moved since it was last sent
function flushMove() {
  if (pointer.x === sent.x && pointer.y === sent.y) return;
  if (send({ t: "mm", x: pointer.x, y: pointer.y })) { sent.x = pointer.x; sent.y = pointer.y; }
}

function queueMove() {
  if (pendingMove) return;
  pendingMove = true;
  requestAnimationFrame(() => {  // at most one move per displayed frame
    pendingMove = false;
    flushMove();
  });
}

function locked() {
  return document.pointerLockElement === video;
}

video.addEventListener("mousemove", (event) => {
  if (!inputAllowed()) return;
  if (locked()) {
    pointer.x = clamp(pointer.x + event.movementX, 0, video.videoWidth - 1);
    pointer.y = clamp(pointer.y + event.movementY, 0, video.videoHeight - 1);
  } else {
    const p = videoPixel(event.clientX, event.clientY);
    if (!p) return;
    pointer.x = p.x; pointer.y = p.y;
  }
  queueMove();
});

function buttonEvent(event, down) {
  if (!inputAllowed()) return;
  if (!locked()) {
    const p = videoPixel(event.clientX, event.clientY);
    if (!p) return;
    pointer.x = p.x; pointer.y = p.y;
  }
  flushMove();  // the button acts where the pointer is now, not where it was a frame ago
  event.preventDefault();
  video.focus();
  const b = { 0: 1, 1: 2, 2: 3 }[event.button];
  if (b === undefined) return;
  const key = "mouse" + b;
  if (down) pressed.add(key); else pressed.delete(key);
  send({ t: "mb", b, d: down });
}

video.addEventListener("mousedown", (event) => buttonEvent(event, true));
window.addEventListener("mouseup", (event) => {
  if (pressed.has("mouse" + ({ 0: 1, 1: 2, 2: 3 }[event.button]))) buttonEvent(event, false);
});
video.addEventListener("contextmenu", (event) => event.preventDefault());
video.addEventListener("wheel", (event) => {
  if (!inputAllowed()) return;
  event.preventDefault();
  // one notch = 1; pixel-mode wheels (touchpads) send ~100 per notch
  const unit = event.deltaMode === 0 ? 100 : event.deltaMode === 1 ? 3 : 1;
  const dx = Math.round(event.deltaX / unit), dy = Math.round(event.deltaY / unit);
  flushMove();
  if (dx || dy) send({ t: "wh", dx: dx || 0, dy: dy || 0 });
}, { passive: false });

window.addEventListener("keydown", (event) => {
  if (!inputAllowed() || typingInForm(event) || !event.code) return;
  event.preventDefault();
  if (event.repeat && pressed.has(event.code)) return;  // the remote side repeats on its own
  pressed.add(event.code);
  send({ t: "kd", code: event.code });
});
window.addEventListener("keyup", (event) => {
  if (!inputAllowed() || typingInForm(event) || !event.code) return;
  event.preventDefault();
  pressed.delete(event.code);
  send({ t: "ku", code: event.code });
});

// A key or button held while the page loses focus would stay down on the remote side
function releaseAll() {
  for (const key of pressed) {
    if (key.startsWith("mouse")) send({ t: "mb", b: Number(key.slice(5)), d: false });
    else send({ t: "ku", code: key });
  }
  pressed.clear();
}
window.addEventListener("blur", releaseAll);
document.addEventListener("visibilitychange", () => { if (document.hidden) releaseAll(); });

// ------------------------------------------------------------------ stats

async function updateStats() {
  if (!pc) return;
  send({ t: "ping", ts: performance.now() });
  const report = await pc.getStats();
  let inbound = null, pairId = null, pair = null;
  const pairs = {};
  report.forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "video") inbound = s;
    else if (s.type === "transport" && s.selectedCandidatePairId) pairId = s.selectedCandidatePairId;
    else if (s.type === "candidate-pair") pairs[s.id] = s;
  });
  pair = pairs[pairId] || Object.values(pairs).find((p) => p.nominated && p.state === "succeeded");
  const st = tessera.stats;
  if (pair && pair.currentRoundTripTime !== undefined) st.rtt_ms = round(pair.currentRoundTripTime * 1000, 1);
  if (inbound) {
    if (prevStats) {
      const dt = (inbound.timestamp - prevStats.timestamp) / 1000;
      const frames = (inbound.framesDecoded || 0) - (prevStats.framesDecoded || 0);
      if (dt > 0) {
        st.fps = round(frames / dt, 1);
        st.bitrate_kbps = round(8 * ((inbound.bytesReceived || 0) - (prevStats.bytesReceived || 0)) / dt / 1000, 0);
      }
      const decode = (inbound.totalDecodeTime || 0) - (prevStats.totalDecodeTime || 0);
      if (frames > 0) st.decode_ms = round(1000 * decode / frames, 2);
      const emitted = (inbound.jitterBufferEmittedCount || 0) - (prevStats.jitterBufferEmittedCount || 0);
      const delay = (inbound.jitterBufferDelay || 0) - (prevStats.jitterBufferDelay || 0);
      if (emitted > 0) st.jitter_buffer_ms = round(1000 * delay / emitted, 1);
    } else if (inbound.framesDecoded) {
      st.decode_ms = round(1000 * (inbound.totalDecodeTime || 0) / inbound.framesDecoded, 2);
    }
    st.frames_decoded = inbound.framesDecoded || 0;
    st.frames_dropped = inbound.framesDropped || 0;
    st.packets_lost = inbound.packetsLost || 0;
    st.bytes_received = inbound.bytesReceived || 0;
    const codec = inbound.codecId && report.get(inbound.codecId);
    if (codec) st.codec = codec.mimeType;
    prevStats = inbound;
    if (inbound.frameWidth) { tessera.frameWidth = inbound.frameWidth; tessera.frameHeight = inbound.frameHeight; }
    if (st.frames_decoded > 0 && tessera.state === "connecting") setState("playing");
  }
  followSound(report);
  render();
}

// ------------------------------------------------------------------ lip sync
// Over WebRTC a session's sound reaches the ear later than its picture reaches the screen: an
// Opus packet holds 20 ms of sound before it is sent, and the browser keeps sound in its jitter
// buffer (20-40 ms) and its output device (30 ms headless) while a frame is shown as soon as it
// is decoded. Chromium's own lip sync does not hold this picture back (a video receiver's
// jitterBufferTarget changed nothing in Chromium 156), so the player does: each encoded video
// frame waits `holdMs` before the decoder gets it (encoded insertable streams), holdMs
// following, each second, the sound's delay over the picture's from the receivers' stats. Only
// sessions with sound, and only while it is heard, pay it in latency; ?lipsync=0 turns it off
// (latency first: a game). The sound's wait in the session's sound server before the capture
// (the app's stream buffer and the sink, from the server's own figures) comes in each pong as
// sound_lead_ms; what an app buffers before its sound server is not seen.
// Over the WebSocket the encoded frames wait the same way before the decoder, the hold
// following the sound's capture-to-heard delay (when played as soon as it can be) over the
// picture's capture-to-decoded one.
// an Opus packet's 20 ms and the encoder's 6.5 ms look-ahead
const OPUS_PACKET_MS = 26.5;
const LIPSYNC_MAX_MS = 300;
// after its first value the hold moves at most this much a second (no visible jump)
const LIPSYNC_STEP_MS = 20;
// leadMs: how long the sound waited in the session's sound server before its capture (pongs)
const lipSync = { on: false, holdMs: 0, prev: null, held: 0, heldMs: 0, leadMs: 0 };
// whether this viewer holds the picture for the sound: the session's `lip_sync` (sound, and an
// app that does not put latency first), or ?lipsync=1 / ?lipsync=0
let lipSyncAsked = false;

function startLipSync(on) {
  Object.assign(lipSync, { on, holdMs: 0, prev: null });
  tessera.lipSync = null;
}

function lipSyncWanted(session) {
  const asked = params.get("lipsync");
  if (asked === "0" || !session.sound) return false;
  return asked === "1" || !!session.lip_sync;
}

async function sessionInfo(sid) {
  try {
    return await call("GET", `/api/streams/sessions/${encodeURIComponent(sid)}`);
  } catch (err) {
    return {};  // joining goes on; the error, if it matters, comes from the join itself
  }
}

// Encoded video frames handed on in order, each at its arrival plus the hold at that moment.
function holder(deliver) {
  const queue = [];
  let timer = null;
  const release = () => {
    timer = null;
    const now = performance.now();
    while (queue.length && queue[0].at <= now + 0.5) {
      const { frame, came } = queue.shift();
      lipSync.held += 1;
      lipSync.heldMs += now - came;
      deliver(frame, came);
    }
    if (queue.length) timer = setTimeout(release, queue[0].at - now);
  };
  return (frame) => {
    const came = performance.now();
    const last = queue.length ? queue[queue.length - 1].at : 0;
    queue.push({ frame, came, at: Math.max(last, came + lipSync.holdMs) });
    if (timer === null) release();
  };
}

// With insertable streams on, every receiver's frames pass the page: sound as it comes, video
// through the holder.
function holdFrames(receiver, kind) {
  const { readable, writable } = receiver.createEncodedStreams();
  if (kind !== "video") {
    readable.pipeTo(writable);
    return;
  }
  const writer = writable.getWriter();
  const hold = holder((frame) => writer.write(frame));
  readable.pipeTo(new WritableStream({ write: hold }));
}

// a total's growth per item counted between two reports (seconds to ms unless `scale` says)
function perItem(now, before, total, count, scale = 1000) {
  const n = (now[count] || 0) - (before[count] || 0);
  return n > 0 ? scale * ((now[total] || 0) - (before[total] || 0)) / n : null;
}

// The hold for the next second: the sound's delay (its wait in the sound server, the packet,
// the browser's jitter buffer and output device) over the picture's (jitter buffer less what
// was held, decoding).
function followSound(report) {
  if (!lipSync.on) return;
  const now = { held: lipSync.held, heldMs: lipSync.heldMs };
  report.forEach((s) => {
    if (s.type === "inbound-rtp") now[s.kind] = s;
    else if (s.type === "media-playout") now.playout = s;
  });
  const before = lipSync.prev;
  lipSync.prev = now;
  if (!before || !now.audio || !now.video || !before.audio || !before.video) return;
  const soundBuffer = perItem(now.audio, before.audio, "jitterBufferDelay", "jitterBufferEmittedCount");
  const pictureBuffer = perItem(now.video, before.video, "jitterBufferDelay", "jitterBufferEmittedCount");
  if (soundBuffer === null || pictureBuffer === null) return;
  const output = now.playout && before.playout
    ? perItem(now.playout, before.playout, "totalPlayoutDelay", "totalSamplesCount") || 0 : 0;
  const held = perItem(now, before, "heldMs", "held", 1) || 0;
  const decode = perItem(now.video, before.video, "totalDecodeTime", "framesDecoded") || 0;
  setHold(lipSync.leadMs + OPUS_PACKET_MS + soundBuffer + output, Math.max(0, pictureBuffer - held) + decode);
}

// The next second's hold, from the sound's delay and the picture's without the hold (ms).
function setHold(soundMs, pictureMs) {
  const wanted = tessera.muted ? 0 : Math.min(LIPSYNC_MAX_MS, Math.max(0, soundMs - pictureMs));
  // the first value is taken at once, later ones step (tessera.lipSync: null until then)
  const step = tessera.lipSync ? LIPSYNC_STEP_MS : LIPSYNC_MAX_MS;
  lipSync.holdMs += Math.max(-step, Math.min(step, wanted - lipSync.holdMs));
  tessera.lipSync = { hold_ms: round(lipSync.holdMs, 1), sound_ms: round(soundMs, 1), picture_ms: round(pictureMs, 1) };
}

// ------------------------------------------------------------------ latency overlay
// What a viewer waits for a change on the remote screen, from its parts: the service's
// (capture to send, in each pong), the network's (half the ICE round trip; over the WebSocket
// half its ping) and the browser's (last packet of a frame received, or its WebSocket message,
// to the frame's display, from requestVideoFrameCallback): median over the last BROWSER_FRAMES
// frames (a second at 30 fps).
const BROWSER_FRAMES = 30;
// arrivals: over the WebSocket, when each of the newest decoded frames' message arrived and
// when it went to the video (the video frame callback's receiveTime is WebRTC's only). A
// frame's callback may run after the next frame was decoded, so it finds its own arrival by
// its timestamp (the callback's mediaTime, from a track generator); where the video has no
// such times (a canvas), by the newest frame that went to the video before its presentation.
const ARRIVALS_KEPT = 64;
const latency = { on: false, browserMs: [], arrivals: [] };

// the WebSocket frame with this timestamp (µs) arrived at this time (performance.now(), ms)
function latencyArrived(timestampUs, arrived) {
  latency.arrivals.push({ timestampUs, arrived, sunk: performance.now() });
  if (latency.arrivals.length > ARRIVALS_KEPT) latency.arrivals.shift();
}

function arrivalOf(meta) {
  const found = latency.arrivals;
  const us = meta.mediaTime * 1e6;
  for (let i = found.length - 1; i >= 0; i--) {
    if (Math.abs(found[i].timestampUs - us) < 500) return found[i].arrived;
  }
  for (let i = found.length - 1; i >= 0; i--) {
    if (found[i].sunk <= meta.presentationTime) return found[i].arrived;
  }
  return null;
}

function latencyFrame(now, meta) {
  const received = meta.receiveTime !== undefined ? meta.receiveTime : arrivalOf(meta);
  if (received !== null && meta.expectedDisplayTime !== undefined) {
    latency.browserMs.push(meta.expectedDisplayTime - received);
    if (latency.browserMs.length > BROWSER_FRAMES) latency.browserMs.shift();
  }
  if (latency.on) video.requestVideoFrameCallback(latencyFrame);
}

function showLatency(on) {
  const was = latency.on;
  latency.on = on && !!video.requestVideoFrameCallback;
  $("latency").hidden = !latency.on;
  $("latency-toggle").setAttribute("aria-pressed", String(latency.on));
  if (latency.on && !was) { latency.browserMs = []; video.requestVideoFrameCallback(latencyFrame); }
  render();
}
tessera.showLatency = showLatency;

function median(values) {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted.length ? sorted[Math.floor(sorted.length / 2)] : null;
}

function renderLatency(st) {
  st.browser_ms = latency.browserMs.length ? round(median(latency.browserMs), 1) : null;
  // the network's share: half the ICE round trip, over the WebSocket half its ping
  const trip = tessera.transport === "websocket" ? st.ping_ms : st.rtt_ms;
  const parts = [st.service_ms, trip === null ? null : trip / 2, st.browser_ms];
  st.latency_ms = parts.every((v) => typeof v === "number") ? round(parts[0] + parts[1] + parts[2], 1) : null;
  if (!latency.on) return;
  $("latency").textContent = st.latency_ms === null ? "latency \u2013"
    : `latency ${st.latency_ms} ms \u00b7 service ${st.service_ms} \u00b7 network ${round(parts[1], 1)} \u00b7 browser ${st.browser_ms}`;
}

function render() {
  const st = tessera.stats;
  renderLatency(st);
  const w = tessera.frameWidth || video.videoWidth, h = tessera.frameHeight || video.videoHeight;
  $("s-res").textContent = w ? `${w}\u00d7${h}` : "\u2013";
  $("s-fps").textContent = st.fps;
  $("s-bitrate").textContent = st.bitrate_kbps >= 1000 ? `${(st.bitrate_kbps / 1000).toFixed(2)} Mbit/s` : `${st.bitrate_kbps} kbit/s`;
  $("s-rtt").textContent = st.rtt_ms === null ? "\u2013" : `${st.rtt_ms} ms`;
  $("s-ping").textContent = st.ping_ms === null ? "\u2013" : `${st.ping_ms} ms`;
  $("s-decode").textContent = st.decode_ms === null ? "\u2013" : `${st.decode_ms} ms`;
  $("s-jitter").textContent = st.jitter_buffer_ms === null ? "\u2013" : `${st.jitter_buffer_ms} ms`;
  $("s-dropped").textContent = st.frames_dropped;
  $("s-lost").textContent = st.packets_lost;
  $("s-codec").textContent = st.codec || "\u2013";
}

video.addEventListener("resize", () => {
  tessera.frameWidth = video.videoWidth;
  tessera.frameHeight = video.videoHeight;
  render();
});
video.addEventListener("playing", () => { if (tessera.state === "connecting") setState("playing"); });

function round(value, digits) {
  const f = 10 ** digits;
  return Math.round(value * f) / f;
}

function clamp(value, lo, hi) {
  return Math.max(lo, Math.min(hi, value));
}

// ------------------------------------------------------------------ wiring

$("start").addEventListener("submit", startSession);
$("control").addEventListener("click", takeControl);
$("record").addEventListener("click", () => record(!tessera.recording));
$("latency-toggle").addEventListener("click", () => showLatency(!latency.on));
$("sound").addEventListener("click", () => setMuted(!tessera.muted));
if (params.get("latency") === "1") showLatency(true);
$("leave").addEventListener("click", () => leave(false));
$("end").addEventListener("click", () => leave(true));
$("lock").addEventListener("click", () => {
  if (video.requestPointerLock) video.requestPointerLock();
  video.focus();
});
window.addEventListener("pagehide", () => {
  if (!tessera.viewerId || !tessera.sessionId) return;
  const path = `/api/streams/sessions/${encodeURIComponent(tessera.sessionId)}/viewers/${encodeURIComponent(tessera.viewerId)}`;
  // the page is going: a failure has nowhere to show but the console (as unhandled)
  call("DELETE", path, undefined, { keepalive: true });
});

if (tessera.sessionId) {
  join(tessera.sessionId, params.get("role") || "player");
} else {
  loadApps().then(() => { if (params.get("autostart")) startSession(); });
}
