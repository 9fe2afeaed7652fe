// The estimate of a job before it is submitted (POST /api/jobs/estimate), as a table per device
// class; and a job's estimate against its actual render time, for the job page.
import { el, fmtDuration } from "./app.js";

const money = (v, cur) => `${Number(v).toFixed(v < 1 ? 4 : 2)} ${cur}`;
const secs = (s) => (s < 60 ? `${Number(s).toFixed(1)} s` : fmtDuration(s));

/** Fill ``table`` (thead + tbody) and ``note`` from the API's estimate answer. */
export function showEstimate(table, note, data) {
  const est = data.estimate;
  const cur = est.currency;
  table.tHead.replaceChildren(el("tr", {},
    ...["Device class", "Per frame", "Devices free", "Wall time", "Device-hours", "Cost", "kWh", "CO2e kg", "Ratio"]
      .map((h) => el("th", {}, h))));
  table.tBodies[0].replaceChildren(...est.classes.map((c) => el("tr", { dataset: { class: c.device_class } },
    el("td", { class: "mono" }, c.device_class),
    el("td", { class: "num", dataset: { field: "frame" } }, secs(c.frame_s)),
    el("td", { class: "num" }, `${c.devices_free} / ${c.devices}`),
    el("td", { class: "num", dataset: { field: "wall" } }, c.wall_s === null ? "no device" : secs(c.wall_s)),
    el("td", { class: "num" }, c.device_hours.toFixed(4)),
    el("td", { class: "num", dataset: { field: "cost" } }, money(c.cost, cur)),
    el("td", { class: "num" }, c.energy_kwh.toFixed(5)),
    el("td", { class: "num" }, c.co2e_kg.toFixed(5)),
    el("td", { class: "num", title: `time on this class / on ${est.probe_class} (${c.ratio_source})` },
      `×${Number(c.ratio).toPrecision(3)} ${c.ratio_source}`))));
  table.hidden = false;
  const parts = [`${est.frames} frame(s); a probe rendered on ${est.probe_class} in ${Number(est.probe_s).toFixed(1)} s.`];
  const b = data.budget;
  if (b) parts.push(`Budget: ${money(b.left, cur)} left of ${money(b.amount, cur)} per ${b.period} (${money(b.spent, cur)} spent, ${money(b.committed, cur)} committed).`);
  note.textContent = parts.join(" ");
}

/** The job page's figure: the estimate against the actual, or the estimate alone until done. */
export function estimateText(job) {
  const a = job.estimate_actual;
  if (a) {
    const pct = Math.round(a.error * 100);
    return `${secs(a.estimated_s)} est. · ${secs(a.actual_s)} actual (${pct >= 0 ? "+" : ""}${pct} %)`;
  }
  const est = job.estimate;
  if (!est) return null;
  const device = (job.spec || {}).device;
  const shown = est.classes.find((c) => (device === "cpu" ? c.device_class === "cpu" : c.device_class !== "cpu")) || est.classes[0];
  return `${secs(shown.render_s)} on ${shown.device_class} (est.)`;
}
