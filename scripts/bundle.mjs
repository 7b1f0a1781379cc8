// Bundles the programs that start often, over the compiled modules' output (dist/src/bin/):
// - agentd-cli.cjs: the command line (src/cli/main.ts, client modules only), CommonJS so that
//   the entry can run it through vm.Script with V8's
//   code cache, agentd-cli.cjs.cache, written here by running the bundle once (the entry,
//   dist/src/bin/agentd.cjs, the package's bin, is as tsc wrote it);
// - serve.js: the daemon's program, loaded by `agentd serve` only;
// - worker.js: the worker program.
// Measured on the 2-core dev machine (`npm run bench -- cliStartup`): Effect as hundreds of ES
// modules cost ~1 s per start; one bundle of everything 0.3 s; the client-only bundle with its
// code cache is what `agentd status` runs now. The rest of dist/ stays as tsc wrote it.
import * as esbuild from "esbuild"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"

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
  entryPoints: { "agentd-cli": "src/cli/main.ts" },
  outdir: "dist/src/bin",
  outExtension: { ".js": ".cjs" },
  format: "cjs",
  // Smaller source: less to read and hash at each start (the code cache holds the bytecode).
  minify: true,
  keepNames: false,
  // The file is one function expression the entry calls as Node calls a CommonJS module.
  banner: { js: "(function (exports, require, module, __filename, __dirname) {" },
  footer: { js: "\n})" }
})

await esbuild.build({
  ...common,
  entryPoints: { serve: "src/bin/serve.ts", worker: "src/bin/worker.ts" },
  outdir: "dist/src/bin",
  format: "esm",
  // Some dependencies call require(); an ES module bundle has to provide it.
  banner: { js: `import { createRequire as __agentdCreateRequire } from "node:module"; const require = __agentdCreateRequire(import.meta.url);` }
})

for (const bin of ["dist/src/bin/agentd.cjs", "dist/src/bin/agentd.js"]) fs.chmodSync(bin, 0o755)

// The code cache: run the command line once (a command that fails at once, no daemon needed;
// what it compiles is what every command needs first) and let it write the cache.
fs.rmSync("dist/src/bin/agentd-cli.cjs.cache", { force: true })
const run = spawnSync(process.execPath, ["dist/src/bin/agentd.cjs", "status", "--socket", "/nonexistent/agentd-bundle.sock"], {
  env: { ...process.env, AGENTD_WRITE_CODE_CACHE: "1", NO_COLOR: "1" },
  encoding: "utf8"
})
if (!fs.existsSync("dist/src/bin/agentd-cli.cjs.cache")) {
  console.error(`bundle: no code cache written (the CLI exited ${run.status}): ${run.stderr}`)
  process.exitCode = 1
}

// Last: what `npm start` compares the sources with (scripts/start.mjs).
if (process.exitCode !== 1) fs.writeFileSync("dist/.build-stamp", `${new Date().toISOString()}\n`)
