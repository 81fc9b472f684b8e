// The console's shell: sign in, the pages by the URL's fragment, sign out.
import { ApiError, auth, get } from "./api.js";
import { clear, h, toast } from "./dom.js";
import { boxesPage } from "./boxes.js";
import { boxPage } from "./box.js";
import { auditPage, templatesPage } from "./admin.js";

const main = document.getElementById("main");
let whoami = null;
let leave = null; // what the current page stops when another opens (streams, sockets)

async function signedIn() {
  try {
    whoami = await get("/info");
    return true;
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) return false;
    throw e;
  }
}

function signInPage(message) {
  const input = h("input", { type: "password", name: "key", autocomplete: "off", required: true,
    placeholder: "sk-…", "aria-label": "API key" });
  const form = h("form", { class: "sign-in", id: "sign-in" },
    h("h2", {}, "Sign in"),
    h("p", { class: "muted" }, "This server needs an API key (sandlot keys create). It stays in this tab only."),
    message ? h("p", { class: "error", role: "alert" }, message) : null,
    input,
    h("button", { type: "submit", class: "primary" }, "Sign in"));
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    auth.key = input.value.trim();
    if (await signedIn()) {
      route();
    } else {
      auth.key = null;
      signInPage("The key was refused.");
    }
  });
  document.getElementById("nav").hidden = true;
  document.getElementById("sign-out").hidden = true;
  clear(main, form);
  input.focus();
}

function showWho() {
  const who = document.getElementById("who");
  const parts = [];
  if (whoami.key) parts.push(`key ${whoami.key}`);
  if (whoami.namespace) parts.push(`namespace ${whoami.namespace}`);
  if (whoami.admin) parts.push("admin");
  clear(who, parts.join(" · ") || "no keys on this server");
  document.getElementById("nav").hidden = false;
  document.getElementById("nav-audit").hidden = !whoami.admin;
  document.getElementById("sign-out").hidden = !auth.key;
}

async function route() {
  if (leave) { leave(); leave = null; }
  if (!whoami && !(await signedIn())) { signInPage(auth.key ? "The key was refused." : null); return; }
  showWho();
  const [page, ...rest] = location.hash.replace(/^#\/?/, "").split("/");
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.page === (page || "boxes"));
  clear(main);
  try {
    if (page === "box" && rest.length) leave = await boxPage(main, decodeURIComponent(rest[0]), rest[1] || "terminal", whoami);
    else if (page === "templates") leave = await templatesPage(main, whoami);
    else if (page === "audit") leave = await auditPage(main, whoami);
    else leave = await boxesPage(main, whoami);
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) { whoami = null; auth.key = null; signInPage("The key was refused."); return; }
    clear(main, h("p", { class: "error", role: "alert" }, e.message));
  }
}

document.getElementById("sign-out").addEventListener("click", () => {
  auth.key = null;
  whoami = null;
  if (leave) { leave(); leave = null; }
  signInPage(null);
});
window.addEventListener("hashchange", route);
window.addEventListener("unhandledrejection", (e) => toast(e.reason?.message || String(e.reason), "error"));
route();
