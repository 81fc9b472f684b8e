// Building the page: every piece of text goes in as a text node, never as markup,
// so a box name, a label, a path or a log line cannot become HTML.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElementNS(
    tag.startsWith("svg:") ? "http://www.w3.org/2000/svg" : "http://www.w3.org/1999/xhtml",
    tag.replace(/^svg:/, ""),
  );
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function clear(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

export function age(seconds) {
  if (seconds == null) return "";
  const s = Math.max(0, Date.now() / 1000 - seconds);
  if (s < 60) return `${Math.floor(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h`;
  return `${Math.floor(s / 86400)}d`;
}

export function bytes(n) {
  if (n == null) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
}

export function when(seconds) {
  return seconds ? new Date(seconds * 1000).toLocaleString() : "";
}

// A message at the top of the page: errors of actions, what was done.
export function toast(text, kind = "info") {
  const box = document.getElementById("toasts");
  const t = h("div", { class: `toast ${kind}`, role: kind === "error" ? "alert" : "status" }, text);
  box.append(t);
  setTimeout(() => t.remove(), kind === "error" ? 8000 : 3000);
}

// A modal asking to confirm, or for values; resolves to null when cancelled.
export function ask(title, { fields = [], danger = false, ok = "OK", body = null } = {}) {
  return new Promise((resolve) => {
    const inputs = fields.map((f) => {
      const input = f.type === "textarea"
        ? h("textarea", { name: f.name, rows: 6, placeholder: f.placeholder || "" })
        : h("input", { name: f.name, type: f.type || "text", placeholder: f.placeholder || "",
          min: f.min, max: f.max, required: f.required });
      if (f.value !== undefined) input.value = f.value;
      return h("label", {}, h("span", {}, f.label), input);
    });
    const dialog = h("dialog", { class: "ask" });
    const form = h("form", { method: "dialog" },
      h("h3", {}, title), body, inputs,
      h("div", { class: "buttons" },
        h("button", { type: "button", class: "secondary", onclick: () => { dialog.close(); } }, "Cancel"),
        h("button", { type: "submit", class: danger ? "danger" : "primary", value: "ok" }, ok)));
    dialog.append(form);
    let answered = false;
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      answered = true;
      const values = {};
      for (const f of fields) values[f.name] = form.elements[f.name].value;
      dialog.close();
      resolve(values);
    });
    dialog.addEventListener("close", () => { dialog.remove(); if (!answered) resolve(null); });
    document.body.append(dialog);
    dialog.showModal();
    (inputs[0]?.querySelector("input,textarea") || form.querySelector("button[type=submit]")).focus();
  });
}
