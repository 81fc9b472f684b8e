// One box's page: its state kept live by its events, its actions, and a tab each for
// the terminal, logs, files, network, stats, code contexts, lineage and recorded steps.
import { enc, followEvents, get, lines, post, put, request } from "./api.js";
import { actionButtons } from "./actions.js";
import { age, bytes, clear, h, toast } from "./dom.js";
import { filesPanel } from "./files.js";
import { terminalPanel } from "./terminal.js";
import { timelinePanel } from "./timeline.js";
import { treePanel } from "./tree.js";

const TABS = ["terminal", "logs", "files", "network", "stats", "code", "tree", "timeline"];
const TITLES = { terminal: "Terminal", logs: "Logs", files: "Files", network: "Network & ports",
  stats: "Stats", code: "Code contexts", tree: "Snapshot tree", timeline: "Timeline" };

export async function boxPage(main, key, tab) {
  let box = await get(`/boxes/${enc(key)}`);
  if (!TABS.includes(tab)) tab = "terminal";
  const head = h("div", { class: "box-head" });
  const panel = h("section", { class: "panel", id: `panel-${tab}` });
  clear(main, head,
    h("nav", { class: "tabs" }, TABS.map((t) => h("a", { href: `#/box/${enc(box.name)}/${t}`,
      class: t === tab ? "active" : "", dataset: { tab: t } }, TITLES[t]))),
    panel);

  function drawHead() {
    clear(head,
      h("h2", {}, h("a", { href: "#/boxes", class: "muted" }, "Boxes"), " / ", h("span", { id: "box-name" }, box.name)),
      h("span", { class: `state ${box.state}`, id: "box-state" }, box.state),
      h("span", { class: "muted" }, `${box.image || ""} · ${box.cpus} vCPU · ${box.memory_mib} MiB · ${box.engine || ""} ${box.accel || ""} · made ${age(box.created_at)} ago`),
      h("span", { class: "grow" }),
      h("span", { class: "actions" }, actionButtons(box, (result) => {
        if (result === "removed") location.hash = "#/boxes";
        else if (result) { box = { ...box, state: result }; drawHead(); }
      })));
  }
  drawHead();
  const stopEvents = followEvents(async (ev) => {
    if (ev.box_id !== box.id) return;
    if (ev.kind === "removed") { toast(`${box.name} was removed`); location.hash = "#/boxes"; return; }
    if (ev.state && ev.state !== box.state) { box = { ...box, state: ev.state }; drawHead(); }
    if (tab === "tree" && ["snapshot", "forked", "rolled_back"].includes(ev.kind)) redraw(); // the lineage grew
  }, { box: box.id });

  let leavePanel = () => {};
  let drawing = 0, left = false; // the newest redraw wins; a page left while one loads stops it
  const redraw = async () => {
    const mine = ++drawing;
    leavePanel();
    leavePanel = () => {};
    const view = h("div"); // this redraw's own: a superseded one draws into it, unseen
    clear(panel, view);
    const stop = (await panels[tab](view, box, redraw)) || (() => {});
    if (left || mine !== drawing) stop();
    else leavePanel = stop;
  };
  const panels = {
    terminal: terminalPanel, files: filesPanel, tree: treePanel, timeline: timelinePanel,
    logs: logsPanel, network: networkPanel, stats: statsPanel, code: codePanel,
  };
  if (tab === "terminal" && box.state !== "running") {
    clear(panel, h("p", { class: "muted" }, `The box is ${box.state}: start it to open a terminal.`));
  } else {
    await redraw();
  }
  return () => { left = true; stopEvents(); leavePanel(); };
}

function logsPanel(panel, box) {
  const out = h("pre", { class: "logs", id: "logs" });
  const follow = h("input", { type: "checkbox", checked: true, id: "logs-follow" });
  clear(panel, h("div", { class: "toolbar" }, h("label", {}, follow, " follow"), h("span", { class: "grow" })), out);
  const control = new AbortController();
  const KEEP = 256 * 1024; // characters shown: the console of a long boot is trimmed at the top
  (async () => {
    try {
      const res = await request("GET", `/boxes/${enc(box.id)}/logs/follow`, { query: { lines: 2000 }, raw: true, signal: control.signal });
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        out.append(document.createTextNode(value));
        if (out.textContent.length > KEEP) out.textContent = out.textContent.slice(-KEEP);
        if (follow.checked) out.scrollTop = out.scrollHeight;
      }
    } catch (e) { if (!control.signal.aborted) out.append(document.createTextNode(`\n[${e.message}]`)); }
  })();
  return () => control.abort();
}

async function networkPanel(panel, box, redraw) {
  const info = await get(`/boxes/${enc(box.id)}/inspect`);
  const { ports } = await get(`/boxes/${enc(box.id)}/ports`);
  const policy = info.network && typeof info.network === "object" ? info.network : { mode: info.network ?? box.network };
  const allowed = policy.allow || info.allow || [];
  const mode = h("select", { id: "network-mode", "aria-label": "mode" },
    ["none", "public", "allowlist", "open"].map((m) => h("option", { value: m }, m)));
  mode.value = policy.mode || "none";
  const allowInput = h("input", { id: "network-allow", placeholder: "pypi.org, *.github.com", "aria-label": "allow",
    value: allowed.map((a) => (typeof a === "string" ? a : a.text || JSON.stringify(a))).join(", ") });
  const previewPort = h("input", { type: "number", min: 1, max: 65535, id: "preview-port", placeholder: "port" });
  const links = h("ul", { id: "previews" });
  async function preview(port) {
    try {
      // on the server's content port, never the console's origin; a host of its own where
      // the server has --port-domain, so not the other boxes' apps' either (docs/console.md)
      const made = await post(`/boxes/${enc(box.id)}/previews`, { port: Number(port) });
      const url = made.host_url || made.url;
      links.append(h("li", {}, h("a", { href: url, target: "_blank", rel: "noopener noreferrer" }, `port ${port}: ${url}`)));
    } catch (e) { toast(e.message, "error"); }
  }
  clear(panel,
    h("h3", {}, "Egress policy"),
    h("form", { class: "row", onsubmit: async (e) => {
      e.preventDefault();
      const list = allowInput.value.split(",").map((x) => x.trim()).filter(Boolean);
      const body = { network: mode.value, allow: mode.value === "allowlist" ? list : [] };
      try { await put(`/boxes/${enc(box.id)}/network`, body); toast("Network policy changed"); redraw(); }
      catch (err) { toast(err.message, "error"); }
    } }, mode, allowInput, h("button", { type: "submit", class: "small" }, "Apply")),
    h("p", { class: "muted" }, "Between public and allowlist a running box changes at once; to or from none or open it must be stopped first."),
    h("pre", { class: "mono", id: "network-policy" }, JSON.stringify(policy, null, 2)),
    h("h3", {}, "Published ports"),
    ports.length
      ? h("table", { class: "ports" }, h("thead", {}, h("tr", {}, ["Guest", "Host", ""].map((t) => h("th", {}, t)))),
        h("tbody", {}, ports.map((p) => h("tr", {}, h("td", {}, p.guest), h("td", {}, p.host ? `${p.address}:${p.host}` : "—"),
          h("td", {}, h("button", { type: "button", class: "small", onclick: () => preview(p.guest) }, "preview link"))))))
      : h("p", { class: "muted" }, "None published."),
    h("h3", {}, "Preview a port"),
    h("form", { class: "row", onsubmit: (e) => { e.preventDefault(); preview(previewPort.value); } },
      previewPort, h("button", { type: "submit", class: "small" }, "Make a signed link")),
    links);
  return () => {};
}

function chart(samples, key, label, format) {
  const points = samples.filter((s) => s[key] != null);
  const W = 560, H = 120;
  const svg = h("svg:svg", { class: "chart", viewBox: `0 0 ${W} ${H + 20}`, width: W, height: H + 20, role: "img", "aria-label": label });
  if (points.length < 2) {
    svg.append(h("svg:text", { x: 10, y: 20, class: "sub" }, `${label}: waiting for samples`));
    return svg;
  }
  const t0 = points[0].at, t1 = points[points.length - 1].at;
  const max = Math.max(...points.map((p) => p[key]), key === "cpu_percent" ? 100 : 1);
  const y = (v) => 20 + (H - 10) * (1 - v / max); // the top 20 px hold the label
  const d = points.map((p, i) => `${i ? "L" : "M"}${((p.at - t0) / (t1 - t0 || 1)) * W},${y(p[key])}`).join(" ");
  svg.append(h("svg:path", { d, class: "line" }),
    h("svg:text", { x: 4, y: 12, class: "sub" }, `${label}: ${format(points[points.length - 1][key])} (max ${format(max)})`));
  return svg;
}

async function statsPanel(panel, box) {
  const area = h("div", { class: "stats", id: "stats" });
  clear(panel, area);
  async function draw() {
    try {
      const samples = await get(`/boxes/${enc(box.id)}/metrics`, { since: -1800 });
      clear(area,
        chart(samples, "cpu_percent", "CPU %", (v) => `${v.toFixed(1)}%`),
        chart(samples, "pss_bytes", "Host memory (PSS)", bytes),
        chart(samples, "guest_memory_used_bytes", "Guest memory used", bytes),
        chart(samples, "net_rx_Bps", "Network in /s", bytes),
        h("p", { class: "muted" }, `${samples.length} samples, one every 10 s while the box runs`));
    } catch (e) { clear(area, h("p", { class: "error" }, e.message)); }
  }
  await draw();
  const timer = setInterval(draw, 10000);
  return () => clearInterval(timer);
}

async function codePanel(panel, box, redraw) {
  const { contexts } = await get(`/boxes/${enc(box.id)}/code/contexts`);
  const language = h("select", { id: "code-language" }, ["python", "javascript", "bash"].map((l) => h("option", { value: l }, l)));
  const target = h("select", { id: "code-context" }, h("option", { value: "" }, "default context"),
    contexts.map((c) => h("option", { value: c.id }, `${c.id} (${c.language})`)));
  const code = h("textarea", { id: "code-text", rows: 6, spellcheck: "false", placeholder: "print(1 + 1)" });
  const out = h("pre", { class: "logs", id: "code-out" });
  const run = async () => {
    clear(out);
    const body = { code: code.value, language: language.value };
    if (target.value) { body.context = target.value; delete body.language; }
    try {
      const res = await request("POST", `/boxes/${enc(box.id)}/code`, { json: body, raw: true });
      for await (const line of lines(res)) {
        if (!line) continue;
        const m = JSON.parse(line);
        if (m.type === "stdout" || m.type === "stderr") out.append(h("span", { class: m.type }, m.text));
        else if (m.type === "result") out.append(h("span", { class: "result" }, `${m.result["text/plain"] ?? Object.keys(m.result).join(", ")}\n`));
        else if (m.type === "error") out.append(h("span", { class: "stderr" }, `${m.error.type}: ${m.error.message}\n`));
        else if (m.type === "execution" && m.execution.error) {
          const err = m.execution.error; // an exception of the cell: its traceback, as the kernel gave it
          const trace = (err.traceback || `${err.name}: ${err.value}`).replace(/\x1b\[[0-9;]*m/g, ""); // no colours
          out.append(h("span", { class: "stderr" }, `${trace}\n`));
        }
      }
    } catch (e) { out.append(h("span", { class: "stderr" }, e.message)); }
  };
  clear(panel,
    h("table", { class: "contexts" }, h("thead", {}, h("tr", {}, ["Context", "Language", "Working directory", ""].map((t) => h("th", {}, t)))),
      h("tbody", { id: "contexts" }, contexts.length ? contexts.map((c) => h("tr", {}, h("td", { class: "mono" }, c.id), h("td", {}, c.language),
        h("td", {}, c.cwd || ""), h("td", {}, h("button", { type: "button", class: "small danger", onclick: async () => {
          try { await request("DELETE", `/boxes/${enc(box.id)}/code/contexts/${enc(c.id)}`); redraw(); } catch (e) { toast(e.message, "error"); }
        } }, "end"))))
        : h("tr", {}, h("td", { colspan: 4, class: "muted" }, "No contexts: a cell runs in the language's default one.")))),
    h("div", { class: "toolbar" }, language, target,
      h("button", { type: "button", class: "small", onclick: async () => {
        try { await post(`/boxes/${enc(box.id)}/code/contexts`, { language: language.value }); redraw(); } catch (e) { toast(e.message, "error"); }
      } }, "New context"),
      h("span", { class: "grow" }), h("button", { type: "button", class: "primary", id: "code-run", onclick: run }, "Run")),
    code, out);
  return () => {};
}
