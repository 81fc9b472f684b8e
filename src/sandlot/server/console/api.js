// The console's one way to the server: the /v1 routes every client uses, with the
// key from this tab's session storage in a header (never a cookie, never a URL).

const KEY = "sandlot.key";

export class ApiError extends Error {
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.code = err.code || "error";
    this.type = err.type || "Error";
  }
}

export const auth = {
  get key() { return sessionStorage.getItem(KEY); },
  set key(value) { if (value) sessionStorage.setItem(KEY, value); else sessionStorage.removeItem(KEY); },
};

function headers(extra = {}) {
  const out = { ...extra };
  if (auth.key) out.Authorization = `Bearer ${auth.key}`;
  return out;
}

export async function request(method, path, { json, body, query, raw = false, signal } = {}) {
  const url = new URL(`/v1${path}`, location.origin);
  for (const [k, v] of Object.entries(query || {})) {
    if (v === undefined || v === null) continue;
    for (const item of Array.isArray(v) ? v : [v]) url.searchParams.append(k, String(item));
  }
  const init = { method, headers: headers(json !== undefined ? { "Content-Type": "application/json" } : {}),
    credentials: "omit", cache: "no-store", signal };
  if (json !== undefined) init.body = JSON.stringify(json);
  else if (body !== undefined) init.body = body;
  const res = await fetch(url, init);
  if (!res.ok) {
    let parsed = null;
    try { parsed = await res.json(); } catch { /* not the error shape */ }
    throw new ApiError(res.status, parsed);
  }
  if (raw) return res;
  if (res.status === 204) return null;
  const type = res.headers.get("content-type") || "";
  return type.includes("json") ? res.json() : res.text();
}

export const get = (path, query) => request("GET", path, { query });

// Every item of a paged list route (``next_page_token``), in order.
export async function getAll(path, field, query = {}) {
  const out = [];
  let token = null;
  do {
    const page = await get(path, { ...query, limit: 1000, page_token: token });
    out.push(...page[field]);
    token = page.next_page_token;
  } while (token);
  return out;
}
export const post = (path, json, query) => request("POST", path, { json: json ?? {}, query });
export const put = (path, json) => request("PUT", path, { json });
export const del = (path, query) => request("DELETE", path, { query });
export const enc = encodeURIComponent;

// Lines of a streamed answer (logs, code cells) as they come.
export async function* lines(res) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += value;
    const parts = pending.split("\n");
    pending = parts.pop();
    yield* parts;
  }
  if (pending) yield pending;
}

// The server's events (SSE over fetch, since EventSource cannot send a header):
// each one to onEvent, reconnecting after the last id seen until stop() is called.
export function followEvents(onEvent, { box, onOpen } = {}) {
  const control = new AbortController();
  let last = null;
  (async () => {
    let delay = 500;
    while (!control.signal.aborted) {
      try {
        const res = await request("GET", "/events", {
          raw: true, signal: control.signal,
          query: last === null ? { box, since: -2 } : { box, after: last },
        });
        if (onOpen) onOpen();
        delay = 500;
        let data = [], id = null;
        for await (const line of lines(res)) {
          if (line === "") {
            if (data.length) {
              if (id !== null) last = Number(id);
              try { onEvent(JSON.parse(data.join("\n"))); } catch (e) { console.error(e); }
            }
            data = []; id = null;
          } else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
          else if (line.startsWith("id:")) id = line.slice(3).trim();
        }
      } catch (e) {
        if (control.signal.aborted) return;
        if (e instanceof ApiError && e.status === 401) { // the key was revoked: the page signs out
          window.dispatchEvent(new Event("sandlot:refused"));
          return;
        }
        if (e instanceof ApiError && e.status === 403) return;
      }
      await new Promise((r) => setTimeout(r, delay));
      delay = Math.min(delay * 2, 8000);
    }
  })();
  return () => control.abort();
}

// A WebSocket to a /v1 route; the key goes as a subprotocol, which the server reads.
export function websocket(path) {
  const url = new URL(`/v1${path}`, location.origin);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  const protocols = ["sandlot"];
  if (auth.key) {
    const b64 = btoa(String.fromCharCode(...new TextEncoder().encode(auth.key)))
      .replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
    protocols.push(`sandlot.key.${b64}`);
  }
  const ws = new WebSocket(url, protocols);
  ws.binaryType = "arraybuffer";
  return ws;
}

// Save a response's bytes as a file the user downloads (the key stays in a header).
export async function download(path, query, filename) {
  const res = await request("GET", path, { query, raw: true });
  const blob = await res.blob();
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = filename;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}
