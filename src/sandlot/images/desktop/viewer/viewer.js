// The viewer of a sandlot desktop: noVNC's RFB client, connected to the WebSocket
// beside this page (websockify, in the box). The page's fragment says how:
//   #password=PW          the VNC password (a view-only one makes a view-only session)
//   &view_only=1          send no input, whatever the password allows
// The fragment never leaves the browser, so the password is in no request line or log.
import RFB from "./novnc/core/rfb.js";

const params = new URLSearchParams(location.hash.slice(1));
const status = document.getElementById("status");
const show = (state, text) => {
  status.dataset.state = state;
  status.textContent = text;
};

const socket = new URL("websockify", location.href);
socket.protocol = location.protocol === "https:" ? "wss:" : "ws:";
socket.hash = "";

const rfb = new RFB(document.getElementById("screen"), socket.href, {
  credentials: { password: params.get("password") || "" },
});
rfb.viewOnly = params.get("view_only") === "1";
rfb.scaleViewport = true;
rfb.background = "#1e1e1e";
rfb.addEventListener("connect", () => {
  show("connected", rfb.viewOnly ? "view only" : "connected");
  setTimeout(() => { status.hidden = true; }, 2000);
});
rfb.addEventListener("disconnect", (e) => {
  status.hidden = false;
  show("disconnected", e.detail.clean ? "disconnected" : "connection lost");
});
rfb.addEventListener("securityfailure", (e) => show("refused", `refused: ${e.detail.reason || "wrong password"}`));
rfb.addEventListener("credentialsrequired", () => show("refused", "a password is needed: open the URL box.desktop.stream_url() gave"));
window.sandlotViewer = rfb; // for tests and the console
