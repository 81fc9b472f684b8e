// A terminal into a box: xterm over the spawn WebSocket with a PTY. The process id
// and how far its output was read stay in this tab, so a reload reattaches to the
// same shell (the server holds its output) instead of starting another.
import { Terminal } from "./vendor/xterm.mjs";
import { FitAddon } from "./vendor/addon-fit.mjs";
import { enc, websocket } from "./api.js";
import { clear, h } from "./dom.js";

const SHELL = ["/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash -l; else exec sh -l; fi"];
const STDOUT = 1;

export function terminalPanel(panel, box) {
  const saved = `sandlot.terminal.${box.id}`;
  const status = h("span", { class: "muted", id: "terminal-status" });
  const again = h("button", { type: "button", class: "small", hidden: true, id: "terminal-new" }, "New shell");
  const screen = h("div", { class: "terminal", id: "terminal" });
  clear(panel, h("div", { class: "toolbar" }, status, h("span", { class: "grow" }), again), screen);
  const term = new Terminal({ cursorBlink: true, fontSize: 13, scrollback: 5000, convertEol: false });
  const fit = new FitAddon();
  term.loadAddon(fit);
  term.open(screen);
  fit.fit();
  let ws = null;
  let process = null;
  const encoder = new TextEncoder();

  function connect() {
    const stored = JSON.parse(sessionStorage.getItem(saved) || "null");
    again.hidden = true;
    if (stored) {
      // again from the start of what the server holds: the screen is drawn anew
      ws = websocket(`/boxes/${enc(box.id)}/processes/${enc(stored.id)}/attach?stdout=0&stderr=0`);
      process = stored.id;
      clear(status, "reattaching…");
    } else {
      ws = websocket(`/boxes/${enc(box.id)}/spawn`);
      process = null;
      clear(status, "starting a shell…");
    }
    ws.onopen = () => {
      if (!stored) {
        ws.send(JSON.stringify({ type: "spawn", argv: SHELL, tty: true, stdin: true, rows: term.rows,
          cols: term.cols, env: { TERM: "xterm-256color" } }));
      } else {
        clear(status, `shell ${stored.id}`);
        ws.send(JSON.stringify({ type: "resize", rows: term.rows, cols: term.cols }));
      }
    };
    ws.onmessage = (m) => {
      if (typeof m.data !== "string") {
        const bytes = new Uint8Array(m.data);
        if (bytes[0] === STDOUT || bytes[0] === 2) term.write(bytes.subarray(9));
        return;
      }
      const msg = JSON.parse(m.data);
      if (msg.type === "started") {
        process = msg.id;
        sessionStorage.setItem(saved, JSON.stringify({ id: msg.id }));
        clear(status, `shell ${msg.id}`);
      } else if (msg.type === "exit") {
        sessionStorage.removeItem(saved);
        term.write(`\r\n[the shell exited${msg.exit_code != null ? ` with ${msg.exit_code}` : ""}]\r\n`);
        clear(status, "exited");
        again.hidden = false;
      } else if (msg.type === "error") {
        if (stored) { sessionStorage.removeItem(saved); ws.onclose = null; ws.close(); connect(); return; }
        term.write(`\r\n[${msg.error.message}]\r\n`);
        clear(status, msg.error.message);
        again.hidden = false;
      } else if (msg.type === "gap") {
        term.write("\r\n[earlier output is no longer held]\r\n");
      }
    };
    ws.onclose = () => { if (process && again.hidden) clear(status, "disconnected"); };
  }

  term.onData((data) => {
    if (!ws || ws.readyState !== WebSocket.OPEN) return;
    const body = encoder.encode(data);
    const frame = new Uint8Array(body.length + 1);
    frame.set(body, 1); // [0] is stdin
    ws.send(frame);
  });
  term.onResize(({ rows, cols }) => {
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "resize", rows, cols }));
  });
  const refit = () => fit.fit();
  window.addEventListener("resize", refit);
  again.addEventListener("click", () => { term.reset(); connect(); });
  connect();
  term.focus();
  return () => {
    window.removeEventListener("resize", refit);
    if (ws) { ws.onclose = null; ws.close(); }
    term.dispose();
  };
}
