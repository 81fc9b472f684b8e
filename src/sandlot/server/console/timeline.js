// The flight recorder's page of a box (docs/recorder.md): recording on or off, its
// steps, each with what ran, how it ended and whether its state is kept; a step's
// diff on demand, and "rewind here" and "fork here" where its checkpoint is kept.
import { enc, get, post, put } from "./api.js";
import { ask, clear, h, toast, when } from "./dom.js";

const SHOWN = 500; // the newest steps drawn

function describe(step) {
  const w = step.what || {};
  if (Array.isArray(w.argv)) return w.argv.join(" ");
  if (typeof w.code === "string") return `${w.language || "python"}: ${w.code.split("\n")[0]}`;
  if (w.tool) return `${w.tool}(${Object.entries(w.arguments || {}).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(", ")})`;
  if (w.op) return [w.op, w.path, w.to].filter(Boolean).join(" ");
  if (w.to !== undefined) return `to step ${w.to}`;
  return JSON.stringify(w);
}

function outcome(step) {
  const r = step.result || {};
  if (r.error) return `error: ${r.error}`;
  if (r.signal) return `signal ${r.signal}`;
  if (r.exit_code !== undefined) return `exit ${r.exit_code}`;
  return "ok";
}

// The processes a step started and ended (its result's "processes": the guest's, listed
// after the step, against those after the step before)
function processNames(list) {
  return (list || []).map((p) => (p.argv && p.argv.length ? p.argv.join(" ") : p.name));
}

function processes(step) {
  const p = (step.result || {}).processes;
  if (!p || !p.started) return "";
  const said = [["started", p.started], ["ended", p.ended]].filter(([, l]) => l.length)
    .map(([what, l]) => `${what}: ${processNames(l).join(", ")}`).join("\n");
  return h("span", { class: "procs", title: said }, `+${p.started.length} \u2212${p.ended.length}`);
}

function processList(step) {
  const p = (step.result || {}).processes;
  if (!p || !p.started) return [];
  return [["Started", p.started], ["Ended", p.ended]].filter(([, l]) => l.length).map(([what, l]) =>
    h("p", { class: "procs" }, `${what}: `, ...processNames(l).map((n) => h("code", {}, n, " "))));
}

export async function timelinePanel(panel, box, redraw) {
  const { recording, steps } = await get(`/boxes/${enc(box.id)}/timeline`);
  const shown = steps.slice(-SHOWN);
  const detail = h("div", { id: "step-detail" });
  const toggle = h("button", { type: "button", class: "small", id: "recording-toggle", onclick: async () => {
    try {
      await put(`/boxes/${enc(box.id)}/recording`, { on: !recording });
      toast(recording ? `${box.name} no longer records` : `${box.name} records every step`);
      redraw();
    } catch (e) { toast(e.message, "error"); }
  } }, recording ? "Stop recording" : "Record every step");

  async function showDiff(step) {
    clear(detail, h("p", { class: "muted" }, `Comparing step ${step.seq} with the step before it...`));
    try {
      const one = await get(`/boxes/${enc(box.id)}/timeline/${step.seq}`, { diff: true });
      const changes = one.diff.changes || [];
      clear(detail,
        h("h3", {}, `Step ${one.seq}: ${describe(one)}`),
        h("p", { class: "muted" }, `since step ${one.diff.since_step}: ${changes.length} change(s)`),
        ...processList(one),
        h("ul", { class: "changes" }, changes.map((c) => h("li", {}, h("code", {}, c.status), " ", c.path))),
        h("pre", { class: "mono diff" }, changes.map((c) => c.diff || "").join("")));
    } catch (e) { clear(detail, h("p", { class: "error" }, e.message)); }
  }

  async function rewind(step) {
    if (!(await ask(`Rewind ${box.name} to just after step ${step.seq}?`, { danger: true, ok: "Rewind",
      body: "Memory, processes and disk become what they were then; commands running now end." }))) return;
    try {
      await post(`/boxes/${enc(box.id)}/rewind`, { step: String(step.seq) });
      toast(`Rewound ${box.name} to step ${step.seq}`);
      redraw();
    } catch (e) { toast(e.message, "error"); }
  }

  async function forkHere(step) {
    const values = await ask(`Start boxes from just after step ${step.seq}`, { ok: "Start",
      fields: [{ name: "n", label: "How many", type: "number", min: 1, max: 20, value: 1 }] });
    if (!values) return;
    try {
      const made = await post(`/boxes/${enc(box.id)}/fork_at`, { step: String(step.seq), n: Number(values.n || 1) });
      toast(`Started ${made.boxes.map((b) => b.name).join(", ")}`);
    } catch (e) { toast(e.message, "error"); }
  }

  const rows = shown.map((s) => h("tr", { dataset: { seq: String(s.seq) }, class: s.checkpoint ? "" : "muted" },
    h("td", {}, String(s.seq)),
    h("td", {}, s.kind),
    h("td", { class: "mono" }, describe(s).slice(0, 160)),
    h("td", {}, outcome(s)),
    h("td", {}, `${(s.duration || 0).toFixed(3)} s`),
    h("td", {}, processes(s)),
    h("td", { title: when(s.ended_at) }, s.name || ""),
    h("td", {}, s.checkpoint
      ? [h("button", { type: "button", class: "small", dataset: { action: "diff" }, onclick: () => showDiff(s) }, "diff"),
        h("button", { type: "button", class: "small", dataset: { action: "rewind" }, onclick: () => rewind(s) }, "rewind here"),
        h("button", { type: "button", class: "small", dataset: { action: "fork" }, onclick: () => forkHere(s) }, "fork here")]
      : h("span", { class: "muted" }, (s.result && s.result.no_checkpoint) || "not kept"))));
  clear(panel,
    h("div", { class: "toolbar" }, toggle,
      h("span", { class: "muted" }, recording ? ` recording: ${JSON.stringify(recording)}` : " not recording"),
      h("span", { class: "grow" })),
    steps.length
      ? h("table", { class: "timeline", id: "timeline" },
        h("thead", {}, h("tr", {}, ["#", "kind", "what", "outcome", "took", "processes", "name", ""].map((t) => h("th", {}, t)))),
        h("tbody", {}, rows))
      : h("p", { class: "muted", id: "timeline-empty" }, "No step recorded."),
    detail);
  return () => {};
}
