// Why a job waits: asks /api/jobs/{id}/why while the job waits and says it on the job page.
import { api, el } from "./app.js";

// reasons that hold a running or assembling job back too (a queued job's is always shown)
const BLOCKING = new Set(["no_worker", "all_disabled", "policy"]);
const WORKING = new Set(["running", "assembling"]);
const EVERY_MS = 5000;
let why = null;

/** The job page's note for ``job``, or null when it is not waiting for a worker. */
export function waitingNote(job) {
  if (!why || !job) return null;
  if (job.state !== "queued" && !(WORKING.has(job.state) && BLOCKING.has(why.reason))) return null;
  const kind = BLOCKING.has(why.reason) ? "callout warn" : "callout";
  return el("div", { class: kind, id: "why", dataset: { reason: why.reason } },
    el("strong", {}, "Why is this job waiting?"), why.message,
    el("div", { class: "small muted" }, el("a", { href: "/workers" }, "See the workers")));
}

/** Ask every few seconds while the job is queued or running; ``redraw`` after each answer. */
export function watchWaiting(base, currentJob, redraw) {
  async function tick() {
    const job = currentJob();
    if (!job || !(job.state === "queued" || WORKING.has(job.state))) {
      why = null;
      redraw();
      return;
    }
    try {
      why = await api(base + "/why");
    } catch {
      why = null; // the note is a courtesy: the page goes on without it
    }
    redraw();
    setTimeout(tick, EVERY_MS);
  }
  tick();
}
