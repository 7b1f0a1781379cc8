// Bundles the two programs that start often, the CLI (`agentd`) and the worker, each into one
// file over the compiled modules' paths (dist/src/bin/agentd.js, dist/src/bin/worker.js).
// Loading Effect as hundreds of ES modules costs ~1 s of start-up here; one bundle ~0.3 s
// (`agentd status`: 1.3 s -> 0.4 s). The rest of dist/ stays as tsc wrote it, for embedding.
import * as esbuild from "esbuild"
import * as fs from "node:fs"

await esbuild.build({
  entryPoints: { agentd: "src/bin/agentd.ts", worker: "src/bin/worker.ts" },
  outdir: "dist/src/bin",
  bundle: true,
  platform: "node",
  format: "esm",
  target: "node20",
  sourcemap: true,
  allowOverwrite: true,
  logLevel: "warning",
  // Some dependencies call require(); an ES module bundle has to provide it.
  banner: { js: `import { createRequire as __agentdCreateRequire } from "node:module"; const require = __agentdCreateRequire(import.meta.url);` }
})
fs.chmodSync("dist/src/bin/agentd.js", 0o755)
