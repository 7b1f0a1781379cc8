// Bundles the programs that start often, over the compiled modules' output (dist/src/bin/):
// - agentd-cli.cjs: the command line's grammar, help and one-shot commands (src/cli/main.ts;
//   no Effect), and agentd-run.cjs: the commands that run on Effect and the client SDK
//   (src/cli/run.ts: prompt, attach, serve, logs). Two bundles so that `agentd status` reads
//   and deserializes only the first. CommonJS so that the entry can run them through vm.Script
//   with V8's code cache, `<bundle>.cache`, written here by running each once (the entry,
//   dist/src/bin/agentd.cjs, the package's bin, is as tsc wrote it). Each bundle has its own
//   copy of the modules both use (args.ts, errors.ts: see isCliError);
// - agentd-serve.cjs: the daemon's program, loaded by `agentd serve` only (with its code cache);
// - worker.js: the worker program.
// Measured on the 2-core dev machine (`npm run bench -- cliStartup`): Effect as hundreds of ES
// modules cost ~1 s per start; one bundle of everything 0.3 s; the client-only bundle with its
// code cache 0.17 s (1.66x `node -e 0`); the one-shot commands without Effect 1.1x. The rest of dist/ stays as tsc wrote it.
import * as esbuild from "esbuild"
import { spawn, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import * as zlib from "node:zlib"

const common = {
  bundle: true,
  platform: "node",
  target: "node20",
  sourcemap: true,
  allowOverwrite: true,
  logLevel: "warning"
}

await esbuild.build({
  ...common,
  entryPoints: { "agentd-cli": "src/cli/main.ts", "agentd-run": "src/cli/run.ts" },
  outdir: "dist/src/bin",
  outExtension: { ".js": ".cjs" },
  format: "cjs",
  // Loaded from node_modules on the first connection to a URL only (src/internal/remote.ts):
  // bundled, it would be read at every start of every command.
  external: ["ws"],
  // ...through require(): the bundle runs in vm.Script, which has no import() of its own.
  supported: { "dynamic-import": false },
  // Smaller source: less to read and hash at each start (the code cache holds the bytecode).
  minify: true,
  keepNames: false,
  // The file is one function expression the entry calls as Node calls a CommonJS module.
  banner: { js: "(function (exports, require, module, __filename, __dirname) {" },
  footer: { js: "\n})" }
})

const esmBundle = {
  ...common,
  outdir: "dist/src/bin",
  format: "esm",
  // Less to read at every worker start, and less source kept in every worker's heap: identifiers
  // are minified too (the shared chunk of an echo worker 506 -> 298 KB; an idle echo worker's RSS
  // ~0.3 MB lower, bench/workerMemory.ts). A worker's stack trace names minified functions: the
  // bundle's source map (worker.js.map, worker-chunks/*.map) maps them back.
  minify: true,
  // Some dependencies call require(); an ES module bundle has to provide it (each chunk too).
  banner: { js: `import { createRequire as __agentdCreateRequire } from "node:module"; const require = __agentdCreateRequire(import.meta.url);` }
}
// The daemon's program as a CommonJS bundle too, run through vm.Script with its code cache as the
// command line's are: compiling it was ~90 ms of CPU at every daemon start (with the cache: a
// third of that). Its modules locate files next to themselves (the worker program, the web
// page) by import.meta.url, which is the bundle's own URL here. What it loads only when asked for
// (the PostgreSQL store, a cluster runner's code) stays in the file, evaluated at its first use.
await esbuild.build({
  ...common,
  entryPoints: { "agentd-serve": "src/bin/serve.ts" },
  outdir: "dist/src/bin",
  outExtension: { ".js": ".cjs" },
  format: "cjs",
  supported: { "dynamic-import": false },
  minifyWhitespace: true,
  minifySyntax: true,
  define: { "import.meta.url": "__agentdBundleUrl" },
  banner: {
    js: "(function (exports, require, module, __filename, __dirname) {const __agentdBundleUrl = require(\"node:url\").pathToFileURL(__filename).href;"
  },
  footer: { js: "\n})" }
})
// The worker splits at its dynamic imports: the model engines' code (@effect/ai and its
// providers, ~60% of the bundle) is in chunks under worker-chunks/, read only by a worker whose
// session runs a model engine. An echo worker (and every spare) reads worker.js and the chunk of
// what it shares with them: its idle RSS went from 61 to ~50 MB (a bare node: 39 MB).
fs.rmSync("dist/src/bin/worker-chunks", { recursive: true, force: true })
await esbuild.build({ ...esmBundle, entryPoints: { worker: "src/bin/worker.ts" }, splitting: true, chunkNames: "worker-chunks/[name]-[hash]" })

// The web page the HTTP front serves at `/` (web/): its script bundled for browsers (with the
// SDK's session fold, src/SessionFold.ts), its HTML and CSS copied, into dist/src/web/, which
// the package ships. The gzipped size of the script is printed: its budget is 100 KB.
fs.mkdirSync("dist/src/web", { recursive: true })
await esbuild.build({
  entryPoints: { app: "web/app.ts" },
  outdir: "dist/src/web",
  bundle: true,
  platform: "browser",
  format: "esm",
  target: ["chrome109", "firefox115", "safari16"],
  minify: true,
  sourcemap: false,
  allowOverwrite: true,
  logLevel: "warning",
  legalComments: "none"
})
for (const file of ["index.html", "app.css"]) fs.copyFileSync(`web/${file}`, `dist/src/web/${file}`)
{
  const script = fs.readFileSync("dist/src/web/app.js")
  console.error(`web page: app.js ${(script.length / 1024).toFixed(1)} KB, ${(zlib.gzipSync(script).length / 1024).toFixed(1)} KB gzipped`)
}

for (const bin of ["dist/src/bin/agentd.cjs", "dist/src/bin/agentd.js"]) fs.chmodSync(bin, 0o755)

// The code caches: run a command of each bundle once (commands that fail at once, no daemon
// needed; what they compile is what every command of the bundle needs first) and let them
// write the caches. `status` last: the cache of agentd-cli.cjs holds what it needs, no more.
for (const [bundle, command] of [["agentd-run", "prompt"], ["agentd-cli", "status"]]) {
  const cache = `dist/src/bin/${bundle}.cjs.cache`
  fs.rmSync(cache, { force: true })
  // A whole session id: prompt goes straight to the SDK's connect (what its start compiles).
  const args = command === "prompt" ? ["prompt", "s-00000000-0000-0000-0000-000000000000", "hello"] : [command]
  const run = spawnSync(process.execPath, ["dist/src/bin/agentd.cjs", ...args, "--socket", "/nonexistent/agentd-bundle.sock"], {
    env: { ...process.env, AGENTD_WRITE_CODE_CACHE: "1", NO_COLOR: "1" },
    encoding: "utf8"
  })
  if (!fs.existsSync(cache)) {
    console.error(`bundle: no code cache written for ${bundle} (agentd ${command} exited ${run.status}): ${run.stderr}`)
    process.exitCode = 1
  }
}

// The daemon's code cache: one daemon started on a temporary state dir and stopped once it
// listens writes it as it exits (what it compiled to start and stop).
{
  const cache = "dist/src/bin/agentd-serve.cjs.cache"
  fs.rmSync(cache, { force: true })
  const home = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-bundle-"))
  const env = { ...process.env, AGENTD_HOME: home, AGENTD_WRITE_CODE_CACHE: "1", AGENTD_WARM_UP: "0", AGENTD_WARM_SPARE: "0", AGENTD_HTTP: "" }
  delete env.AGENTD_SOCKET
  delete env.AGENTD_STORE
  const daemon = spawn(process.execPath, ["dist/src/bin/agentd.cjs", "serve"], { env, stdio: ["ignore", "ignore", "pipe"] })
  let stderr = ""
  daemon.stderr.on("data", (chunk) => (stderr += chunk))
  const exited = new Promise((resolve) => daemon.once("exit", resolve))
  const deadline = Date.now() + 30_000
  while (!fs.existsSync(path.join(home, "agentd.sock")) && Date.now() < deadline && daemon.exitCode === null) {
    await new Promise((resolve) => setTimeout(resolve, 20))
  }
  spawnSync(process.execPath, ["dist/src/bin/agentd.cjs", "shutdown"], { env, stdio: "ignore" })
  const timer = setTimeout(() => daemon.kill("SIGKILL"), 30_000)
  await exited
  clearTimeout(timer)
  fs.rmSync(home, { recursive: true, force: true })
  if (!fs.existsSync(cache)) {
    console.error(`bundle: no code cache written for agentd-serve (the daemon exited ${daemon.exitCode}): ${stderr}`)
    process.exitCode = 1
  }
}

// Last: what `npm start` compares the sources with (scripts/start.mjs).
if (process.exitCode !== 1) fs.writeFileSync("dist/.build-stamp", `${new Date().toISOString()}\n`)
