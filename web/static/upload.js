// Upload page: resumable upload of a .blend/.zip, the inspection report, and the submit form.
import { api, ApiError, el, $, fmtBytes, fmtTime, startPage, toast, withButton } from "./app.js";
import { showEstimate } from "./estimate.js";

const CHUNK_BYTES = 8 * 1024 * 1024;
const CHUNK_TRIES = 4;

let page;
let upload = null; // the Upload JSON of the chosen file
let report = null; // its InspectionReport

function setStep(name) {
  const order = ["upload", "inspect", "submit"];
  const at = order.indexOf(name);
  order.forEach((s, i) => {
    const node = $("#step-" + s);
    node.classList.toggle("active", i === at);
    node.classList.toggle("complete", i < at);
  });
}

function showProgress(sent, total, label) {
  $("#upload-progress").hidden = false;
  $("#upload-bar").style.width = total ? `${(100 * sent) / total}%` : "100%";
  $("#upload-label").textContent = label || `${fmtBytes(sent)} of ${fmtBytes(total)}`;
}

/** Send the file in chunks through an upload session; a lost chunk resumes at the server's offset. */
async function uploadResumable(file, project) {
  let session;
  try {
    session = await api("/api/uploads/sessions", { method: "POST", json: { project, name: file.name, size: file.size } });
  } catch (e) {
    if (e.status === 404 || e.status === 405) return uploadWhole(file, project);
    throw e;
  }
  const url = "/api/uploads/sessions/" + encodeURIComponent(session.session_id);
  let offset = session.offset || 0;
  let tries = 0;
  while (offset < file.size) {
    const chunk = file.slice(offset, Math.min(offset + CHUNK_BYTES, file.size));
    try {
      const r = await api(url, {
        method: "PATCH", body: chunk,
        headers: { "Upload-Offset": String(offset), "Content-Type": "application/offset+octet-stream" },
      });
      offset = r.offset;
      tries = 0;
    } catch (e) {
      if (e instanceof ApiError && e.status === 409 && typeof e.fields.offset === "number") {
        offset = e.fields.offset; // the server has a different offset: continue from there
      } else if (++tries < CHUNK_TRIES && !(e instanceof ApiError && e.status < 500)) {
        offset = (await api(url)).offset; // network trouble: ask where to resume
      } else {
        throw e;
      }
    }
    showProgress(offset, file.size);
  }
  showProgress(file.size, file.size, "Finishing upload…");
  return api(url + "/complete", { method: "POST" });
}

async function uploadWhole(file, project) {
  showProgress(0, file.size, "Uploading…");
  return api("/api/uploads?project=" + encodeURIComponent(project), {
    method: "POST", body: file, headers: { "X-Filename": file.name, "Content-Type": "application/octet-stream" },
  });
}

async function chooseFile(file) {
  if (!file) return;
  if (!/\.(blend|zip)$/i.test(file.name)) {
    toast(`${file.name} is not a .blend or .zip file`, "bad");
    return;
  }
  $("#file").disabled = true;
  try {
    const up = await uploadResumable(file, page.project());
    showProgress(file.size, file.size, `Uploaded ${file.name} (${fmtBytes(file.size)})`);
    await useUpload(up);
    loadUploads();
  } catch (e) {
    showProgress(0, file.size, "Upload failed: " + e.message);
    toast(e.message, "bad");
  } finally {
    $("#file").disabled = false;
  }
}

async function useUpload(up) {
  upload = up;
  report = null;
  setStep("inspect");
  $("#inspect-panel").hidden = false;
  $("#inspect-busy").hidden = false;
  $("#inspection").hidden = true;
  $("#submit-form").hidden = true;
  $("#inspect-note").textContent = `${up.name} · ${fmtBytes(up.size)} · sha256 ${String(up.upload_id).slice(0, 12)}…`;
  try {
    report = await api(`/api/uploads/${encodeURIComponent(up.upload_id)}/inspect`, { method: "POST" });
  } catch (e) {
    $("#inspect-busy").hidden = true;
    $("#inspection").hidden = false;
    $("#problems").replaceChildren(el("div", { class: "callout bad" }, el("strong", {}, "The farm cannot render this file"), e.message));
    $("#report").replaceChildren();
    return;
  }
  showReport(up, report);
  fillForm(up, report);
  setStep("submit");
}

function missingLibraries(r) {
  if (Array.isArray(r.missing_libraries)) return r.missing_libraries;
  const missing = new Set(r.missing_files || []);
  return (r.libraries || []).filter((l) => missing.has(l));
}

/** A path as the user knows it: relative to the uploaded file's folder, not the farm's disk. */
function shortPath(path) {
  const marker = upload ? `/${upload.upload_id}/` : null;
  const at = marker ? String(path).indexOf(marker) : -1;
  return at >= 0 ? String(path).slice(at + marker.length) : String(path);
}

function list(items) {
  return el("ul", {}, items.map((x) => el("li", { title: x }, shortPath(x))));
}

function showReport(up, r) {
  const libsMissing = missingLibraries(r);
  const filesMissing = (r.missing_files || []).filter((f) => !libsMissing.includes(f));
  const problems = [];
  if (filesMissing.length) {
    problems.push(el("div", { class: "callout bad", id: "missing-files" },
      el("strong", {}, `${filesMissing.length} external file${filesMissing.length > 1 ? "s are" : " is"} missing`),
      "Upload a .zip with these files next to the .blend, or pack them into the .blend (File › External Data › Pack Resources).",
      list(filesMissing)));
  }
  if (libsMissing.length) {
    problems.push(el("div", { class: "callout bad", id: "missing-libraries" },
      el("strong", {}, `${libsMissing.length} linked librar${libsMissing.length > 1 ? "ies are" : "y is"} missing`),
      list(libsMissing)));
  }
  if (r.wants_scripts || r.autoexec_fail) {
    problems.push(el("div", { class: "callout warn", id: "scripts" },
      el("strong", {}, "This file wanted to run Python scripts"),
      "Scripts stay blocked on the farm: auto-run text blocks and Python drivers do not run. Check the result if the scene relies on them.",
      (r.scripts || []).length ? list(r.scripts) : null));
  }
  if (!r.camera) {
    problems.push(el("div", { class: "callout bad" }, el("strong", {}, "No active camera"),
      "Set a scene camera in Blender and upload again."));
  }
  if (!problems.length) {
    problems.push(el("div", { class: "callout ok" }, el("strong", {}, "Ready to render"),
      "No missing files or libraries, no scripts."));
  }
  $("#problems").replaceChildren(...problems);

  const step = r.frame_step && r.frame_step !== 1 ? ` (step ${r.frame_step})` : "";
  const rows = [
    ["File", up.kind === "zip" ? `${up.name} › ${up.blend}` : up.name],
    ["Blender", r.version],
    ["Scene", r.scene],
    ["Frame range", `${r.frame_start} – ${r.frame_end}${step}` + (r.fps ? ` · ${r.fps} fps` : "")],
    ["Resolution", `${r.width} × ${r.height} px`],
    ["Engine", engineText(r.engine)],
    ["Samples", `${r.samples}` + (r.adaptive_sampling ? " · adaptive" : "") + (r.denoising ? " · denoise" : "")],
    ["Cameras", el("div", { class: "chips" }, (r.cameras || []).map((c) => el("span", { class: "chip" + (c === r.camera ? " active" : ""), title: c === r.camera ? "active camera" : "" }, c)))],
    ["Libraries", (r.libraries || []).length ? `${r.libraries.length} linked` : "none"],
    ["Missing files", String((r.missing_files || []).length)],
    ["Scripts", r.wants_scripts || r.autoexec_fail ? "wanted (blocked)" : "none"],
  ];
  if (r.vram_estimate_mib) rows.push(["Memory estimate", `${r.vram_estimate_mib} MiB`]);
  $("#report").replaceChildren(...rows.flatMap(([k, v]) => [el("div", { class: "k" }, k), el("div", { class: "v", dataset: { field: k.toLowerCase().replace(/ /g, "-") } }, v)]));
  $("#inspect-busy").hidden = true;
  $("#inspection").hidden = false;
}

/** The file's engine, and for any engine but Cycles what the farm does with it. */
function engineText(engine) {
  const name = String(engine || "").replace("BLENDER_", "").replace(/_/g, " ");
  if (!engine || engine === "CYCLES") return name;
  return el("span", {}, name, el("div", { class: "engine-note", id: "engine-note" },
    `The farm renders every job with Cycles, not ${name}: the file's ${name} settings `
    + "(its look, its samples) do not carry over; check the first frame."));
}

function fillForm(up, r) {
  const step = r.frame_step && r.frame_step > 1 ? `x${r.frame_step}` : "";
  $("#name").value = String(up.blend || up.name).replace(/^.*\//, "").replace(/\.(blend|zip)$/i, "");
  $("#frames").value = r.frame_start === r.frame_end ? `${r.frame_start}` : `${r.frame_start}-${r.frame_end}${step}`;
  $("#samples").value = r.samples || "";
  $("#samples").placeholder = r.samples ? `${r.samples} (as saved)` : "";
  $("#resolution").value = `${r.width}x${r.height}`;
  $("#denoise").checked = Boolean(r.denoising);
  const missing = (r.missing_files || []).length > 0;
  $("#accept-box").hidden = !missing;
  $("#accept-missing").checked = false;
  $("#submit-form").hidden = false;
  syncSubmit();
}

function syncSubmit() {
  const blocked = report && (report.missing_files || []).length > 0 && !$("#accept-missing").checked;
  $("#submit").disabled = !report || blocked;
  $("#submit").title = blocked ? "Missing files: tick “Render anyway” to submit" : "";
}

function formBody() {
  const body = {
    project: page.project(),
    upload_id: upload.upload_id,
    name: $("#name").value.trim() || undefined,
    frames: $("#frames").value.trim(),
    tiles: $("#tiles").value.trim(),
    formats: [...document.querySelectorAll("#formats input:checked")].map((c) => c.value).join(","),
    priority: parseInt($("#priority").value || "0", 10),
    device: $("#device").value,
  };
  const samples = parseInt($("#samples").value, 10);
  if (samples && samples !== report.samples) body.samples = samples;
  const res = $("#resolution").value.trim();
  if (res && res !== `${report.width}x${report.height}`) body.resolution = res;
  if ((report.missing_files || []).length) body.accept_missing = $("#accept-missing").checked;
  body.denoise = $("#denoise").checked;
  body.passes = $("#passes").checked;
  body.preview = $("#preview").checked;
  if ($("#live-preview").checked) body.live_preview = true;
  body.mode = $("#mode").value;
  const tags = $("#tags").value.trim();
  if (tags) body.tags = tags;
  const deps = [...$("#depends-on").selectedOptions].map((o) => o.value);
  if (deps.length) body.depends_on = deps;
  body.frame_order = $("#frame-order").value;
  if (body.mode === "sample_split") body.split_parts = parseInt($("#split-parts").value || "2", 10);
  if (body.device === "gpu") {
    if ($("#backend").value) body.backend = $("#backend").value;
    body.allow_cpu_fallback = $("#cpu-fallback").checked;
  }
  return body;
}

async function submit(ev) {
  ev.preventDefault();
  const err = $("#submit-error");
  err.textContent = "";
  for (const f of document.querySelectorAll("[data-error-for]")) f.textContent = "";
  if (!$("#formats input:checked")) { err.textContent = "Choose at least one output format."; return; }
  $("#submit").disabled = true;
  try {
    const job = await api("/api/jobs", { method: "POST", json: formBody() });
    location.assign("/jobs/" + encodeURIComponent(job.id || job.job_id));
  } catch (e) {
    // the API names the field a bad value came in (tags, depends_on, frame_order...)
    const field = e instanceof ApiError && e.fields.field
      ? document.querySelector(`[data-error-for="${CSS.escape(e.fields.field)}"]`) : null;
    if (field) field.textContent = e.message;
    else err.textContent = e.message;
    syncSubmit();
  }
}

/** The project's jobs a new job may wait for, newest first (those ended too: a done one lets it run). */
async function loadJobs() {
  let data;
  try {
    data = await api("/api/jobs?project=" + encodeURIComponent(page.project()) + "&limit=100");
  } catch (e) {
    toast(`Cannot list the project's jobs: ${e.message}`, "bad");
    return;
  }
  const chosen = new Set([...$("#depends-on").selectedOptions].map((o) => o.value));
  $("#depends-on").replaceChildren(...(data.jobs || []).map((j) => el("option",
    { value: j.job_id, selected: chosen.has(j.job_id) }, `${j.name || j.job_id} · ${j.state} · ${j.job_id}`)));
}

async function estimate() {
  const note = $("#estimate-note");
  note.textContent = "Rendering the probe…";
  await withButton($("#estimate"), async () => {
    try {
      showEstimate($("#estimate-table"), note, await api("/api/jobs/estimate", { method: "POST", json: formBody() }));
    } catch (e) {
      note.textContent = e.message;
    }
  });
}

async function loadUploads() {
  let data;
  try {
    data = await api("/api/uploads?project=" + encodeURIComponent(page.project()));
  } catch (e) {
    toast(`Cannot list the recent uploads: ${e.message}`, "bad");
    return;
  }
  const ups = (data.uploads || []).sort((a, b) => Number(b.created || 0) - Number(a.created || 0)).slice(0, 12);
  $("#uploads").replaceChildren(...ups.map((u) => el("li", {},
    el("div", { class: "name", title: u.name }, u.name,
      el("div", { class: "muted small" }, `${fmtBytes(u.size)} · ${fmtTime(u.created)}`)),
    el("span", { class: "actions" },
      el("button", { class: "small", onclick: () => useUpload(u) }, "Use"),
      viewer() ? null : el("button", { class: "small danger", title: "Delete this upload and its stored file",
        dataset: { delete: u.upload_id }, onclick: () => deleteUpload(u) }, "Delete")))));
  $("#uploads-empty").hidden = ups.length > 0;
}

function viewer() {
  const info = ((page && page.me && page.me.projects) || []).find((p) => p.id === page.project());
  return Boolean(info && info.role === "viewer");
}

/** Delete an upload after a confirmation; a job that has not finished keeps it (409, said). */
async function deleteUpload(u) {
  if (!confirm(`Delete ${u.name} from this project? Its stored file goes too unless another project has it.`)) return;
  try {
    await api(`/api/uploads/${encodeURIComponent(u.upload_id)}?project=${encodeURIComponent(page.project())}`, { method: "DELETE" });
  } catch (e) {
    toast(`Cannot delete ${u.name}: ${e.message}`, "bad");
    return;
  }
  toast(`Deleted ${u.name}`);
  if (upload && upload.upload_id === u.upload_id) {
    upload = null;
    report = null;
    $("#inspect-panel").hidden = true;
    $("#submit-form").hidden = true;
    setStep("upload");
  }
  loadUploads();
}

function fillDevices(me) {
  const info = (me.projects || []).find((p) => p.id === page.project());
  const viewer = info && info.role === "viewer";
  $("#file").disabled = Boolean(viewer);
  $("#submit").hidden = Boolean(viewer);
  $("#submit-error").textContent = viewer ? "Your role in this project is viewer: you can follow its jobs but not submit." : "";
  $("#dropzone .big").textContent = viewer ? "Viewers cannot upload to this project" : "Drop a .blend or .zip here";
  const devices = (info && info.devices && info.devices.length) ? info.devices : ["cpu"];
  $("#device").replaceChildren(...devices.map((d) => el("option", { value: d }, d.toUpperCase())));
  syncOptions();
}

/** Show only the settings that apply: GPU backend for GPU jobs, parts for a sample split. */
function syncOptions() {
  const gpu = $("#device").value === "gpu";
  $("#backend-field").hidden = !gpu;
  $("#fallback-field").hidden = !gpu;
  $("#split-field").hidden = $("#mode").value !== "sample_split";
  $("#tiles").disabled = $("#mode").value === "sample_split";
}

page = await startPage("upload", () => { fillDevices(page.me); loadUploads(); loadJobs(); });
if (page) {
  fillDevices(page.me);
  const dz = $("#dropzone");
  $("#file").addEventListener("change", (e) => chooseFile(e.target.files[0]));
  dz.addEventListener("dragover", (e) => { e.preventDefault(); dz.classList.add("over"); });
  dz.addEventListener("dragleave", () => dz.classList.remove("over"));
  dz.addEventListener("drop", (e) => { e.preventDefault(); dz.classList.remove("over"); chooseFile(e.dataTransfer.files[0]); });
  $("#accept-missing").addEventListener("change", syncSubmit);
  $("#device").addEventListener("change", syncOptions);
  $("#mode").addEventListener("change", syncOptions);
  $("#submit-form").addEventListener("submit", submit);
  $("#estimate").addEventListener("click", estimate);
  loadUploads();
  loadJobs();
  document.body.dataset.ready = "1"; // handlers attached (tests wait for this)
}
