// A smoke run of E2B's JavaScript SDK (npm's `e2b`) against `sandlot serve`'s /e2b:
// create a sandbox from a template, run a command, write and read a file, kill it.
//
// Reads E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (the SDK's own variables),
// E2B_TEMPLATE (the template to create from) and E2B_JS_MODULES (the node_modules
// folder that holds `e2b`; by default the repository's .cache/e2b-js/node_modules,
// where ./scripts/setup installs it). Prints one JSON line: what each step saw and
// its milliseconds. Exits non-zero, with the error, on any failure.
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const modules = process.env.E2B_JS_MODULES || path.join(here, "..", "..", ".cache", "e2b-js", "node_modules");
const template = process.env.E2B_TEMPLATE;

const report = { sdk: null, node: process.version, ms: {} };

function check(condition, message) {
  if (!condition) throw new Error(message);
}

async function step(name, fn) {
  const t0 = performance.now();
  try {
    return await fn();
  } finally {
    report.ms[name] = Math.round(performance.now() - t0);
  }
}

async function main() {
  check(template, "E2B_TEMPLATE is not set");
  for (const name of ["E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"]) check(process.env[name], `${name} is not set`);
  const require = createRequire(path.join(modules, "noop.js"));
  report.sdk = require(path.join(modules, "e2b", "package.json")).version;
  const { Sandbox } = require("e2b"); // resolved from that folder, as a script beside it would

  const sbx = await step("create", () => Sandbox.create(template, { timeoutMs: 300_000 }));
  report.sandbox_id = sbx.sandboxId;
  try {
    const run = await step("run", () => sbx.commands.run("echo js-$((6*7))"));
    report.stdout = run.stdout;
    report.exit_code = run.exitCode;
    check(run.exitCode === 0 && run.stdout === "js-42\n", `commands.run: ${JSON.stringify(run)}`);

    const info = await step("write", () => sbx.files.write("/tmp/js.txt", "from js"));
    report.written = info.path;
    check(info.path === "/tmp/js.txt", `files.write: ${JSON.stringify(info)}`);

    const text = await step("read", () => sbx.files.read("/tmp/js.txt"));
    report.read = text;
    check(text === "from js", `files.read: ${JSON.stringify(text)}`);
  } finally {
    report.killed = await step("kill", () => sbx.kill());
  }
  check(report.killed === true, `kill: ${JSON.stringify(report.killed)}`);
}

try {
  await main();
  report.ok = true;
  console.log(JSON.stringify(report));
} catch (err) {
  report.ok = false;
  report.error = `${err?.name ?? "Error"}: ${err?.message ?? err}`;
  console.log(JSON.stringify(report));
  console.error(err?.stack ?? err);
  process.exit(1);
}
