// What can be done to a box, as buttons: the same from the table and a box's page.
import { del, enc, post } from "./api.js";
import { ask, h, toast } from "./dom.js";

const BY_STATE = {
  created: ["start", "snapshot", "remove"],
  running: ["stop", "pause", "suspend", "snapshot", "fork", "remove"],
  paused: ["unpause", "stop", "snapshot", "fork", "remove"],
  suspended: ["resume", "stop", "remove"],
  stopped: ["start", "remove"],
  crashed: ["start", "remove"],
};

export async function act(box, action) {
  const path = `/boxes/${enc(box.id)}`;
  switch (action) {
    case "remove": {
      const ok = await ask(`Remove box ${box.name}?`, { danger: true, ok: "Remove",
        body: h("p", {}, "Its disk and processes are deleted; its snapshots stay.") });
      if (!ok) return null;
      await del(path, { force: true });
      toast(`Removed ${box.name}`);
      return "removed";
    }
    case "stop": {
      const ok = await ask(`Stop box ${box.name}?`, { danger: true, ok: "Stop",
        body: h("p", {}, "Its processes end; the disk stays.") });
      if (!ok) return null;
      return (await post(`${path}/stop`)).state;
    }
    case "fork": {
      const v = await ask(`Fork ${box.name}`, { ok: "Fork", fields: [
        { name: "n", label: "How many copies", type: "number", value: "1", min: 1, max: 64, required: true },
        { name: "name", label: "Name prefix (optional)", placeholder: `${box.name}-fork` }] });
      if (!v) return null;
      const made = await post(`${path}/fork`, { n: Number(v.n), name: v.name || null });
      toast(`Forked ${box.name}: ${made.boxes.map((b) => b.name).join(", ")}`);
      return null;
    }
    case "snapshot": {
      const v = await ask(`Snapshot ${box.name}`, { ok: "Snapshot",
        fields: [{ name: "name", label: "Name (optional)" }] });
      if (!v) return null;
      const snap = await post(`${path}/snapshots`, { name: v.name || null });
      toast(`Snapshot ${snap.name || snap.id} of ${box.name}`);
      return null;
    }
    default:
      return (await post(`${path}/${action}`)).state;
  }
}

export function actionButtons(box, done) {
  return (BY_STATE[box.state] || ["remove"]).map((action) =>
    h("button", { type: "button", class: action === "remove" ? "small danger" : "small",
      dataset: { action }, title: `${action} ${box.name}`,
      onclick: async (e) => {
        e.stopPropagation();
        e.currentTarget.disabled = true;
        try { await done(await act(box, action)); } catch (err) { toast(err.message, "error"); }
        finally { e.target.disabled = false; }
      } }, action));
}
