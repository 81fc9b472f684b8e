// The console's shell: sign in, the pages by the URL's fragment, sign out.
import { ApiError, auth, get } from "./api.js";
import { clear, h, toast } from "./dom.js";
import { boxesPage } from "./boxes.js";
import { boxPage } from "./box.js";
import { auditPage, templatesPage } from "./admin.js";

const main = document.getElementById("main");
let whoami = null;
let leave = null; // what the current page stops when another opens (streams, sockets)
let navigation = 0; // which route() is the current one: a page that finishes loading late is stopped

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
  const mine = ++navigation;
  if (leave) { leave(); leave = null; }
  if (!whoami && !(await signedIn())) {
    if (mine === navigation) signInPage(auth.key ? "The key was refused." : null);
    return;
  }
  if (mine !== navigation) return;
  showWho();
  const [page, ...rest] = location.hash.replace(/^#\/?/, "").split("/");
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.page === (page || "boxes"));
  const view = h("div", { class: "view" }); // this navigation's own: a late page draws into it, unseen
  clear(main, view);
  try {
    let stop;
    if (page === "box" && rest.length) stop = await boxPage(view, decodeURIComponent(rest[0]), rest[1] || "terminal");
    else if (page === "templates") stop = await templatesPage(view, whoami);
    else if (page === "audit") stop = await auditPage(view, whoami);
    else stop = await boxesPage(view, whoami);
    if (mine === navigation) leave = stop;
    else stop();
  } catch (e) {
    if (mine !== navigation) return;
    if (e instanceof ApiError && e.status === 401) { signOut("The key was refused."); return; }
    clear(view, h("p", { class: "error", role: "alert" }, e.message));
  }
}

// Forget the key and what this tab kept for it (terminals, folders), and ask again.
function signOut(message = null) {
  navigation++;
  if (leave) { leave(); leave = null; }
  auth.key = null;
  whoami = null;
  for (const k of Object.keys(sessionStorage)) if (k.startsWith("sandlot.")) sessionStorage.removeItem(k);
  signInPage(message);
}

// A page that opened this window keeps a handle on it, and a page of this origin (an app
// in a box, through a port route or a preview) could read what is typed here: the
// console runs only in a window of its own.
if (window.opener !== null) {
  clear(main, h("p", { class: "error", role: "alert" },
    "The console was opened by another page: open it from the address bar instead."));
  throw new Error("opened by another page");
}
document.getElementById("sign-out").addEventListener("click", () => signOut());
window.addEventListener("sandlot:refused", () => signOut("The key was refused.")); // api.js: a 401 mid-page
window.addEventListener("hashchange", route);
window.addEventListener("unhandledrejection", (e) => toast(e.reason?.message || String(e.reason), "error"));
route();
