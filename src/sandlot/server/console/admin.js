// Templates with their warm pools, and the audit trail (admin keys).
import { get } from "./api.js";
import { bytes, clear, h, when } from "./dom.js";

export async function templatesPage(main) {
  const [{ snapshots }, { pools }] = await Promise.all([get("/snapshots", { kind: "template" }), get("/pools")]);
  const poolOf = new Map(pools.map((p) => [p.template_id, p]));
  clear(main,
    h("div", { class: "toolbar" }, h("h2", {}, "Templates & pools")),
    h("table", { id: "templates" },
      h("thead", {}, h("tr", {}, ["Template", "Made", "Size", "Pool size", "Ready", "Filling", "Memory each", "Host PSS"].map((t) => h("th", {}, t)))),
      h("tbody", {}, snapshots.length ? snapshots.map((s) => {
        const p = poolOf.get(s.id) || {};
        return h("tr", {}, h("td", {}, s.name || s.id.slice(0, 12)), h("td", {}, when(s.created_at)), h("td", { class: "num" }, bytes(s.size)),
          h("td", { class: "num" }, p.size ?? 0), h("td", { class: "num" }, p.ready ?? 0), h("td", { class: "num" }, p.filling ?? 0),
          h("td", { class: "num" }, p.memory_mib ? `${p.memory_mib} MiB` : ""), h("td", { class: "num" }, p.pss_mib != null ? `${p.pss_mib} MiB` : ""));
      }) : h("tr", {}, h("td", { colspan: 8, class: "muted" }, "No templates.")))),
    pools.length ? h("p", { class: "muted" }, `Pools' guest memory is capped at ${pools[0].cap_mib} MiB on this host.`) : null);
  return () => {};
}

export async function auditPage(main, whoami) {
  if (!whoami.admin) { clear(main, h("p", { class: "error" }, "The audit trail needs an admin key.")); return () => {}; }
  const { entries } = await get("/audit", { limit: 500 });
  clear(main,
    h("div", { class: "toolbar" }, h("h2", {}, "Audit"), h("span", { class: "muted" }, `the last ${entries.length}`)),
    h("table", { id: "audit" },
      h("thead", {}, h("tr", {}, ["When", "Key", "Namespace", "Action", "Box", "Status", "Error", "ms"].map((t) => h("th", {}, t)))),
      h("tbody", {}, entries.slice().reverse().map((e) => h("tr", {},
        h("td", {}, when(e.at)), h("td", {}, e.key_name || ""), h("td", {}, e.namespace || ""), h("td", { class: "mono" }, e.action),
        h("td", {}, e.box || ""), h("td", { class: e.status >= 400 ? "error" : "" }, e.status), h("td", {}, e.error || ""),
        h("td", { class: "num" }, Math.round((e.duration || 0) * 1000)))))));
  return () => {};
}
