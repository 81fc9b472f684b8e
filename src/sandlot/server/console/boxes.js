// The boxes: a table kept live by the server's events, with filters, actions and a
// form to create one.
import { ApiError, enc, followEvents, get, getAll, post } from "./api.js";
import { actionButtons } from "./actions.js";
import { age, ask, bytes, clear, h, toast } from "./dom.js";

const STATES = ["", "created", "running", "paused", "suspended", "stopped", "crashed"];

export async function boxesPage(main, whoami) {
  performance.mark("sandlot:boxes-open"); // benchmarks/console.py reads these marks
  const boxes = new Map(); // id -> info
  const usage = new Map(); // id -> {cpu, mem}
  let lastSamples = new Map();
  const stateFilter = h("select", { "aria-label": "state", id: "filter-state" },
    STATES.map((s) => h("option", { value: s }, s || "any state")));
  const labelFilter = h("input", { id: "filter-label", placeholder: "label: key=value", "aria-label": "label" });
  const count = h("span", { class: "muted", id: "box-count" });
  const tbody = h("tbody", { id: "boxes" });
  const live = h("span", { class: "live", id: "live", title: "state changes arrive as events" }, "connecting…");
  clear(main,
    h("div", { class: "toolbar" },
      h("h2", {}, "Boxes"), count, live, h("span", { class: "grow" }),
      stateFilter, labelFilter,
      h("button", { class: "primary", id: "create-box", onclick: () => createBox(whoami) }, "Create box")),
    h("table", { class: "boxes" },
      h("thead", {}, h("tr", {}, ["Name", "Image", "State", "Age", "CPU", "Memory", "Labels", ""].map((t) => h("th", {}, t)))),
      tbody));

  function matches(b) {
    if (stateFilter.value && b.state !== stateFilter.value) return false;
    const want = labelFilter.value.trim();
    if (want) {
      const [k, ...v] = want.split("=");
      const have = (b.labels || {})[k.trim()];
      if (have === undefined || (v.length && have !== v.join("=").trim())) return false;
    }
    return true;
  }

  function row(b) {
    const u = usage.get(b.id) || {};
    const labels = Object.entries(b.labels || {}).filter(([k]) => !k.startsWith("sandlot."));
    return h("tr", { dataset: { id: b.id, name: b.name, state: b.state } },
      h("td", {}, h("a", { href: `#/box/${enc(b.name)}`, class: "box-name" }, b.name)),
      h("td", { class: "muted" }, b.image || (b.origin ? `from ${b.origin.slice(0, 12)}` : "")),
      h("td", {}, h("span", { class: `state ${b.state}` }, b.state)),
      h("td", { title: new Date(b.created_at * 1000).toLocaleString() }, age(b.created_at)),
      h("td", { class: "num" }, u.cpu == null ? "" : `${u.cpu.toFixed(1)}%`),
      h("td", { class: "num" }, bytes(u.mem)),
      h("td", {}, labels.map(([k, v]) => h("span", { class: "label" }, `${k}=${v}`))),
      h("td", { class: "actions" }, actionButtons(b, async (result) => {
        if (result === "removed") { boxes.delete(b.id); render(); }
        else if (result && boxes.has(b.id)) { boxes.set(b.id, { ...boxes.get(b.id), state: result }); update(boxes.get(b.id)); }
      })));
  }

  let scheduled = false;
  let loaded = false;
  function render() {
    if (scheduled) return;
    scheduled = true;
    requestAnimationFrame(() => {
      scheduled = false;
      const shown = [...boxes.values()].filter(matches).sort((a, b) => a.created_at - b.created_at);
      const frag = document.createDocumentFragment();
      for (const b of shown) frag.append(row(b));
      tbody.replaceChildren(frag);
      if (!shown.length) tbody.append(h("tr", {}, h("td", { colspan: 8, class: "muted" }, "No boxes.")));
      clear(count, `${shown.length} of ${boxes.size}`);
      if (loaded && !performance.getEntriesByName("sandlot:boxes-rendered").length) {
        performance.mark("sandlot:boxes-rendered");
      }
    });
  }
  // One box changed: its row alone is drawn again, unless the filter now shows or hides it
  function update(b) {
    const old = tbody.querySelector(`tr[data-id="${CSS.escape(b.id)}"]`);
    if (!old || !matches(b) || scheduled) { render(); return; }
    old.replaceWith(row(b));
  }
  stateFilter.addEventListener("change", render);
  labelFilter.addEventListener("input", render);

  async function load() {
    const listed = await getAll("/boxes", "boxes");
    boxes.clear();
    for (const b of listed) boxes.set(b.id, b);
    loaded = true;
    render();
  }

  async function sample() {
    try {
      const now = await get("/metrics/latest");
      const next = new Map();
      for (const { id, sample } of now.boxes) {
        if (!sample) continue;
        next.set(id, sample);
        const before = lastSamples.get(id);
        let cpu = usage.get(id)?.cpu ?? null;
        if (before && sample.at > before.at && sample.cpu_seconds >= before.cpu_seconds) {
          cpu = ((sample.cpu_seconds - before.cpu_seconds) / (sample.at - before.at)) * 100;
        }
        usage.set(id, { cpu, mem: sample.pss_bytes ?? sample.rss_bytes });
      }
      lastSamples = next;
      render();
    } catch { /* the next round tries again */ }
  }

  // Events that arrive while the list loads wait for it: the list may be older than
  // they are, so each box they name is read again after it (a removed one stays gone).
  let waiting = null; // the box ids events named while a load ran; null: none runs
  const gone = new Set(); // boxes whose removal was seen: a late read does not bring them back
  const reading = new Set();

  async function reread(id) {
    if (reading.has(id)) return;
    reading.add(id);
    try {
      const b = await get(`/boxes/${enc(id)}`);
      if (!gone.has(id)) { boxes.set(id, b); render(); }
    } catch (e) {
      if (e instanceof ApiError && e.status === 404) { boxes.delete(id); render(); } // removed meanwhile
    }
    finally { reading.delete(id); }
  }

  function onEvent(ev) {
    if (!ev.box_id) return;
    if (ev.kind === "removed") { gone.add(ev.box_id); boxes.delete(ev.box_id); render(); }
    if (waiting) { waiting.add(ev.box_id); return; }
    if (ev.kind === "removed") return;
    const known = boxes.get(ev.box_id);
    if (!known) { reread(ev.box_id); return; }
    if (ev.state && ev.state !== known.state) {
      const b = { ...known, state: ev.state };
      boxes.set(ev.box_id, b);
      update(b);
    }
  }

  async function reload() {
    waiting = new Set();
    try {
      await load();
      for (const id of gone) boxes.delete(id);
      render();
    } catch (e) { toast(e.message, "error"); }
    finally {
      const named = waiting;
      waiting = null;
      for (const id of named) if (!gone.has(id)) reread(id);
    }
  }

  // listed once the stream is open, so no change falls between the two; again after
  // a reconnect, which may have missed changes
  const stop = followEvents(onEvent, { onOpen: () => {
    clear(live, "live");
    live.classList.add("on");
    reload();
  } });
  await sample();
  const timer = setInterval(sample, 10000); // the host samples each box every 10 s
  return () => { stop(); clearInterval(timer); };
}

async function createBox(whoami) {
  const v = await ask("Create a box", { ok: "Create", fields: [
    { name: "image", label: "Image (a reference), or…", placeholder: "python:3.12-slim" },
    { name: "template", label: "…a template (name or id)" },
    { name: "name", label: "Name (optional)" },
    { name: "cpus", label: "vCPUs", type: "number", value: "1", min: 1, max: 64 },
    { name: "memory_mib", label: "Memory (MiB)", type: "number", value: "512", min: 64 },
    { name: "labels", label: "Labels (key=value, comma separated)" },
    { name: "env", label: "Environment (KEY=value, comma separated)" },
    { name: "options", label: "More options, as the API's JSON (network, allow, ports, idle_timeout…)",
      type: "textarea", placeholder: whoami.admin ? '{"network": "none", "rootfs": "/path/on/the/server"}' : '{"network": "none"}' },
  ] });
  if (!v) return;
  const pairs = (s) => Object.fromEntries(s.split(",").map((p) => p.trim()).filter(Boolean)
    .map((p) => { const i = p.indexOf("="); return i < 0 ? [p, ""] : [p.slice(0, i), p.slice(i + 1)]; }));
  let extra = {};
  if (v.options.trim()) {
    try { extra = JSON.parse(v.options); } catch (e) { toast(`More options: ${e.message}`, "error"); return; }
  }
  const body = { ...extra };
  for (const k of ["image", "template", "name"]) if (v[k].trim()) body[k] = v[k].trim();
  if (v.cpus) body.cpus = Number(v.cpus);
  if (v.memory_mib) body.memory_mib = Number(v.memory_mib);
  if (v.labels.trim()) body.labels = pairs(v.labels);
  if (v.env.trim()) body.env = pairs(v.env);
  toast("Creating…");
  try {
    const box = await post("/boxes", body);
    toast(`Created ${box.name}`);
  } catch (e) {
    toast(e.message, "error");
  }
}
