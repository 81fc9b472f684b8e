// A box's files: browse, download, upload (a button, or files dropped on the list),
// view and edit small text files.
import { del, download, enc, get, post, request } from "./api.js";
import { ask, bytes, clear, h, toast } from "./dom.js";

const EDIT_LIMIT = 1 << 20; // bytes: larger files are downloaded, not edited here

function join(dir, name) {
  return dir.endsWith("/") ? dir + name : `${dir}/${name}`;
}

export function filesPanel(panel, box) {
  let dir = sessionStorage.getItem(`sandlot.files.${box.id}`) || "/";
  const pathInput = h("input", { id: "files-path", "aria-label": "path" });
  const picker = h("input", { type: "file", multiple: true, id: "files-upload", hidden: true });
  const list = h("tbody", { id: "files" });
  const drop = h("div", { class: "drop", id: "files-drop" },
    h("table", { class: "files" },
      h("thead", {}, h("tr", {}, ["Name", "Type", "Size", "Mode", "Modified", ""].map((t) => h("th", {}, t)))),
      list),
    h("p", { class: "muted hint" }, "Drop files here to upload them to this directory."));
  const editor = h("div", { class: "editor", id: "editor", hidden: true });
  clear(panel,
    h("form", { class: "toolbar", onsubmit: (e) => { e.preventDefault(); open(pathInput.value); } },
      h("button", { type: "button", class: "small", onclick: () => open(dir.replace(/\/[^/]*\/?$/, "") || "/") }, "Up"),
      pathInput, h("button", { type: "submit", class: "small" }, "Go"),
      h("span", { class: "grow" }),
      h("button", { type: "button", class: "small", onclick: () => mkdir() }, "New folder"),
      h("button", { type: "button", class: "small", onclick: () => picker.click() }, "Upload"), picker),
    drop, editor);

  let listing = 0; // the newest open(): an older one that answers late is dropped
  async function open(path) {
    const mine = ++listing;
    const here = path || "/";
    dir = here;
    pathInput.value = here;
    sessionStorage.setItem(`sandlot.files.${box.id}`, here);
    editor.hidden = true;
    try {
      const { entries } = await get(`/boxes/${enc(box.id)}/files`, { path: here });
      if (mine !== listing) return;
      entries.sort((a, b) => (a.type === "dir") === (b.type === "dir")
        ? a.name.localeCompare(b.name) : a.type === "dir" ? -1 : 1);
      const frag = document.createDocumentFragment();
      for (const f of entries) frag.append(row(here, f));
      list.replaceChildren(frag);
      if (!entries.length) list.append(h("tr", {}, h("td", { colspan: 6, class: "muted" }, "Empty.")));
    } catch (e) {
      if (mine === listing) clear(list, h("tr", {}, h("td", { colspan: 6, class: "error" }, e.message)));
    }
  }

  function row(here, f) {
    const path = join(here, f.name);
    const isDir = f.type === "dir";
    const opens = isDir || f.type === "symlink"; // a link may lead to a folder: opening it says
    return h("tr", { dataset: { name: f.name } },
      h("td", {}, opens
        ? h("a", { href: "#", class: "file-name", onclick: (e) => { e.preventDefault(); open(path); } }, isDir ? `${f.name}/` : f.name)
        : h("span", { class: "file-name" }, f.name)),
      h("td", { class: "muted" }, f.type + (f.link_target ? ` → ${f.link_target}` : "")),
      h("td", { class: "num" }, isDir ? "" : bytes(f.size)),
      h("td", { class: "mono" }, (f.mode & 0o7777).toString(8).padStart(4, "0")),
      h("td", { class: "muted" }, new Date(f.mtime).toLocaleString()),
      h("td", { class: "actions" },
        f.type === "file" && h("button", { type: "button", class: "small", dataset: { action: "download" },
          onclick: () => download(`/boxes/${enc(box.id)}/files/content`, { path }, f.name).catch((e) => toast(e.message, "error")) }, "download"),
        f.type === "file" && f.size <= EDIT_LIMIT && h("button", { type: "button", class: "small", dataset: { action: "edit" },
          onclick: () => edit(path) }, "view/edit"),
        h("button", { type: "button", class: "small danger", dataset: { action: "remove" }, onclick: () => remove(path, isDir) }, "remove")));
  }

  async function edit(path) {
    const res = await request("GET", `/boxes/${enc(box.id)}/files/content`, { query: { path }, raw: true });
    const raw = new Uint8Array(await res.arrayBuffer());
    let text;
    try { text = new TextDecoder("utf-8", { fatal: true }).decode(raw); } catch { text = null; }
    if (text === null || raw.includes(0)) { toast(`${path} is not text: download it instead`, "error"); return; }
    const area = h("textarea", { id: "editor-text", spellcheck: "false" });
    area.value = text;
    const crlf = text.includes("\r\n"); // a textarea gives back "\n" only: the file's own endings are kept
    clear(editor,
      h("div", { class: "toolbar" }, h("strong", {}, path), h("span", { class: "grow" }),
        h("button", { type: "button", class: "small", onclick: () => { editor.hidden = true; } }, "Close"),
        h("button", { type: "button", class: "small primary", id: "editor-save", onclick: async () => {
          try {
            const body = crlf ? area.value.replace(/\r?\n/g, "\r\n") : area.value;
            await request("PUT", `/boxes/${enc(box.id)}/files/content`, { query: { path }, body });
            toast(`Saved ${path}`);
            open(dir);
          } catch (e) { toast(e.message, "error"); }
        } }, "Save")),
      area);
    editor.hidden = false;
  }

  async function remove(path, isDir) {
    if (!(await ask(`Remove ${path}?`, { danger: true, ok: "Remove" }))) return;
    try { await del(`/boxes/${enc(box.id)}/files`, { path, recursive: isDir }); open(dir); }
    catch (e) { toast(e.message, "error"); }
  }

  async function mkdir() {
    const v = await ask("New folder", { fields: [{ name: "name", label: "Name", required: true }] });
    if (!v) return;
    try { await post(`/boxes/${enc(box.id)}/files/mkdir`, { path: join(dir, v.name) }); open(dir); }
    catch (e) { toast(e.message, "error"); }
  }

  async function upload(files) {
    for (const file of files) {
      const path = join(dir, file.name);
      try {
        await request("PUT", `/boxes/${enc(box.id)}/files/content`, { query: { path }, body: file });
        toast(`Uploaded ${path}`);
      } catch (e) { toast(`${file.name}: ${e.message}`, "error"); }
    }
    open(dir);
  }

  picker.addEventListener("change", () => { upload([...picker.files]); picker.value = ""; });
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    upload([...e.dataTransfer.files]);
  });
  open(dir);
  return () => {};
}
