// The lineage of a box: the snapshot it came from and that snapshot's box, up to the
// first; then down from there, each box's snapshots in the order they were taken,
// and the boxes started or forked from each. Drawn as an SVG graph; a snapshot's
// node rolls its box back, starts a box from it, exports it or removes it.
import { del, download, enc, get, getAll, post } from "./api.js";
import { ask, bytes, clear, h, toast, when } from "./dom.js";

const COL = 190, ROW = 46, W = 164, HT = 32;

export async function lineage(box) {
  const [boxes, { snapshots }] = await Promise.all([getAll("/boxes", "boxes"), get("/snapshots")]);
  const boxById = new Map(boxes.map((b) => [b.id, b]));
  const snapById = new Map(snapshots.map((s) => [s.id, s]));
  // up: from this box through the snapshots each came from
  let top = { kind: "box", item: boxById.get(box.id) || box };
  for (let guard = 0; guard < 64; guard++) {
    const origin = top.kind === "box" ? snapById.get(top.item.origin) : null;
    if (!origin) break;
    const owner = origin.box_id && boxById.get(origin.box_id);
    top = owner ? { kind: "box", item: owner } : { kind: "snapshot", item: origin };
  }
  const visited = new Set();
  function node(kind, item, depth = 0) {
    const key = `${kind}:${item.id}`;
    if (visited.has(key) || depth > 64) return null;
    visited.add(key);
    const children = [];
    const fromSnap = (s) => boxes.filter((b) => b.origin === s.id).sort((a, b) => a.created_at - b.created_at);
    if (kind === "box") {
      for (const s of snapshots.filter((x) => x.box_id === item.id).sort((a, b) => a.created_at - b.created_at)) {
        children.push(node("snapshot", s, depth + 1));
      }
    } else {
      for (const b of fromSnap(item)) children.push(node("box", b, depth + 1));
    }
    return { kind, item, children: children.filter(Boolean), current: kind === "box" && item.id === box.id };
  }
  return { root: node(top.kind, top.item), boxById };
}

function layout(root) {
  let row = 0;
  const placed = [];
  (function place(n, depth) {
    n.x = depth * COL;
    if (!n.children.length) { n.y = row++ * ROW; }
    else {
      for (const c of n.children) place(c, depth + 1);
      n.y = (n.children[0].y + n.children[n.children.length - 1].y) / 2;
    }
    placed.push(n);
  })(root, 0);
  return placed;
}

export async function treePanel(panel, box, refresh) {
  const { root, boxById } = await lineage(box);
  const nodes = layout(root);
  const width = Math.max(...nodes.map((n) => n.x)) + W + 20;
  const height = Math.max(...nodes.map((n) => n.y)) + HT + 20;
  const svg = h("svg:svg", { class: "tree", id: "tree", width, height, viewBox: `-10 -10 ${width} ${height}`,
    role: "group", "aria-label": `lineage of ${box.name}` });
  const detail = h("div", { class: "node-detail", id: "node-detail" },
    h("p", { class: "muted" }, "Select a snapshot or a box."));
  for (const n of nodes) {
    for (const c of n.children) {
      const x1 = n.x + W, y1 = n.y + HT / 2, x2 = c.x, y2 = c.y + HT / 2, mx = (x1 + x2) / 2;
      svg.append(h("svg:path", { d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`, class: "edge" }));
    }
  }
  for (const n of nodes) {
    const label = n.kind === "box" ? n.item.name : (n.item.name || n.item.id.slice(0, 12));
    const sub = n.kind === "box" ? n.item.state : `${n.item.kind} · ${when(n.item.created_at)}`;
    const g = h("svg:g", { class: `node ${n.kind}${n.current ? " current" : ""}`, transform: `translate(${n.x},${n.y})`,
      tabindex: 0, role: "button", dataset: { kind: n.kind, id: n.item.id, name: label } },
    h("svg:rect", { width: W, height: HT, rx: n.kind === "box" ? 4 : 14 }),
    h("svg:text", { x: 10, y: 14, class: "title" }, label.length > 22 ? `${label.slice(0, 21)}…` : label),
    h("svg:text", { x: 10, y: 27, class: "sub" }, sub.length > 28 ? `${sub.slice(0, 27)}…` : sub),
    h("svg:title", {}, `${n.kind} ${label} (${n.item.id})`));
    const choose = () => {
      for (const x of svg.querySelectorAll(".node.selected")) x.classList.remove("selected");
      g.classList.add("selected");
      select(n);
    };
    g.addEventListener("click", choose);
    g.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); choose(); } });
    svg.append(g);
  }

  function select(n) {
    if (n.kind === "box") {
      clear(detail, h("h3", {}, `box ${n.item.name}`), h("p", { class: "muted" }, `${n.item.state} · ${n.item.id}`),
        n.current ? null : h("a", { href: `#/box/${enc(n.item.name)}/tree`, class: "button" }, "Open its page"));
      return;
    }
    const s = n.item;
    const owner = boxById.has(s.box_id) ? s.box_id : null; // a removed box has nothing to roll back
    const run = (fn) => async () => { try { await fn(); } catch (e) { toast(e.message, "error"); } };
    clear(detail,
      h("h3", {}, `${s.kind} ${s.name || s.id.slice(0, 12)}`),
      h("dl", {}, h("dt", {}, "id"), h("dd", { class: "mono" }, s.id), h("dt", {}, "taken"), h("dd", {}, when(s.created_at)),
        h("dt", {}, "of box"), h("dd", {}, s.box_name || "—"), h("dt", {}, "stored"), h("dd", {}, bytes(s.size)),
        h("dt", {}, "logical"), h("dd", {}, bytes(s.logical_size || s.size))),
      h("div", { class: "buttons" },
        owner && h("button", { type: "button", id: "node-rollback", onclick: run(async () => {
          if (!(await ask(`Roll ${s.box_name} back to ${s.name || s.id.slice(0, 12)}?`, { danger: true, ok: "Roll back",
            body: h("p", {}, "Its memory, processes and disk go back to the snapshot; what came after is lost.") }))) return;
          await post(`/boxes/${enc(owner)}/rollback`, { snapshot: s.id });
          toast(`Rolled ${s.box_name} back`);
          refresh();
        }) }, "Roll back"),
        h("button", { type: "button", id: "node-start", onclick: run(async () => {
          const made = await post(`/snapshots/${enc(s.id)}/start`, { n: 1 });
          toast(`Started ${made.boxes.map((b) => b.name).join(", ")}`);
          refresh();
        }) }, "Start a box"),
        h("button", { type: "button", id: "node-export", onclick: run(async () => {
          toast("Exporting…");
          await download(`/snapshots/${enc(s.id)}/export`, {}, `${s.name || s.id}.sandlot`);
        }) }, "Export"),
        h("button", { type: "button", class: "danger", id: "node-remove", onclick: run(async () => {
          if (!(await ask(`Remove snapshot ${s.name || s.id.slice(0, 12)}?`, { danger: true, ok: "Remove" }))) return;
          await del(`/snapshots/${enc(s.id)}`);
          toast("Removed");
          refresh();
        }) }, "Remove")));
  }
  clear(panel, h("div", { class: "tree-wrap" }, h("div", { class: "tree-scroll" }, svg), detail));
  return () => {};
}
