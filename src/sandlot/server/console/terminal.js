// A terminal into a box: xterm over the spawn WebSocket with a PTY. The shell's id
// stays in this tab, so a reload, or a dropped connection, reattaches to the same
// shell (the server holds its output) instead of starting another.
import { Terminal } from "./vendor/xterm.mjs";
import { FitAddon } from "./vendor/addon-fit.mjs";
import { enc, websocket } from "./api.js";
import { clear, h } from "./dom.js";

const SHELL = ["/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash -l; else exec sh -l; fi"];
const STDOUT = 1, STDERR = 2, HEADER = 9; // [stream u8][offset u64 big-endian][bytes]

export function terminalPanel(panel, box) {
  const saved = `sandlot.terminal.${box.id}`;
  const status = h("span", { class: "muted", id: "terminal-status" });
  const button = h("button", { type: "button", class: "small", hidden: true, id: "terminal-new" });
  const screen = h("div", { class: "terminal", id: "terminal" });
  clear(panel, h("div", { class: "toolbar" }, status, h("span", { class: "grow" }), button), screen);
  const term = new Terminal({ cursorBlink: true, fontSize: 13, scrollback: 5000, convertEol: false });
  const fit = new FitAddon();
  term.loadAddon(fit);
  term.open(screen);
  fit.fit();
  let ws = null;
  let link = "down"; // "connecting", then "open" once the socket carries stdin; "down" after an end
  let closing = false; // the panel is being left: a closed socket is no news
  const encoder = new TextEncoder();
  // keys typed while a shell starts or reattaches wait here, as a terminal's type-ahead
  // does, up to a bound; keys typed after an end (an exit, an error, a drop) go nowhere,
  // as on a hung-up terminal, so none reaches the next shell
  let typedAhead = [], typedBytes = 0;
  const TYPE_AHEAD_BYTES = 64 * 1024;

  function offer(label, action) {
    clear(button, label);
    button.onclick = action;
    button.hidden = false;
  }

  function connect() {
    const stored = JSON.parse(sessionStorage.getItem(saved) || "null");
    let heard = false; // output came: the process exists, and a later error is about the stream
    button.hidden = true;
    if (stored) {
      term.reset(); // the server sends the shell's output again from its start: drawn anew
      ws = websocket(`/boxes/${enc(box.id)}/processes/${enc(stored.id)}/attach?stdout=0&stderr=0`);
      clear(status, "reattaching…");
    } else {
      ws = websocket(`/boxes/${enc(box.id)}/spawn`);
      clear(status, "starting a shell…");
    }
    link = "connecting";
    typedAhead = [];
    typedBytes = 0;
    const socket = ws;
    socket.onopen = () => {
      if (stored) {
        clear(status, `shell ${stored.id}`);
        socket.send(JSON.stringify({ type: "resize", rows: term.rows, cols: term.cols }));
      } else {
        socket.send(JSON.stringify({ type: "spawn", argv: SHELL, tty: true, stdin: true, rows: term.rows,
          cols: term.cols, env: { TERM: "xterm-256color" } }));
      }
      // after the spawn request, stdin waits in the socket for the shell the server starts
      link = "open";
      for (const frame of typedAhead) socket.send(frame);
      typedAhead = [];
      typedBytes = 0;
    };
    socket.onmessage = (m) => {
      if (typeof m.data !== "string") {
        const bytes = new Uint8Array(m.data);
        if (bytes[0] === STDOUT || bytes[0] === STDERR) { heard = true; term.write(bytes.subarray(HEADER)); }
        return;
      }
      const msg = JSON.parse(m.data);
      if (msg.type === "started") {
        heard = true;
        sessionStorage.setItem(saved, JSON.stringify({ id: msg.id }));
        clear(status, `shell ${msg.id}`);
      } else if (msg.type === "exit") {
        link = "down";
        sessionStorage.removeItem(saved);
        term.write(`\r\n[the shell exited${msg.exit_code != null ? ` with ${msg.exit_code}` : ""}]\r\n`);
        clear(status, "exited");
        offer("New shell", connect);
      } else if (msg.type === "error") {
        socket.onclose = null;
        link = "down";
        if (stored && !heard) { // the shell is gone (the box restarted, a server forgot it)
          sessionStorage.removeItem(saved);
          connect();
          return;
        }
        term.write(`\r\n[${msg.error.message}]\r\n`);
        clear(status, msg.error.message);
        offer(sessionStorage.getItem(saved) ? "Reattach" : "New shell", connect);
      } else if (msg.type === "gap") {
        term.write("\r\n[earlier output is no longer held]\r\n");
      }
    };
    socket.onclose = () => {
      if (socket === ws) link = "down";
      if (closing || socket !== ws) return;
      clear(status, "disconnected");
      offer(sessionStorage.getItem(saved) ? "Reattach" : "New shell", connect);
    };
  }

  function send(body) {
    const frame = new Uint8Array(body.length + 1);
    frame.set(body, 1); // [0] is stdin
    if (link === "open" && ws.readyState === WebSocket.OPEN) ws.send(frame);
    else if (link === "connecting" && typedBytes + frame.length <= TYPE_AHEAD_BYTES) {
      typedAhead.push(frame);
      typedBytes += frame.length;
    }
  }
  term.onData((data) => send(encoder.encode(data)));
  term.onBinary((data) => send(Uint8Array.from(data, (c) => c.charCodeAt(0) & 0xff))); // mouse reports
  term.onResize(({ rows, cols }) => {
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "resize", rows, cols }));
  });
  const refit = () => fit.fit();
  window.addEventListener("resize", refit);
  connect();
  term.focus();
  return () => {
    closing = true;
    window.removeEventListener("resize", refit);
    if (ws) ws.close();
    term.dispose();
  };
}
