/**
 * vitest's global setup: the tests' child programs (test/fixtures/*Child.ts) bundled once for
 * the run, each into one file. The tests start them tens of times (SIGKILLed at random
 * moments); as compiled modules each start read and compiled hundreds of Effect's ES modules
 * (~1 s of CPU on this 2-core machine), bundled ~0.35 s.
 */
import * as esbuild from "esbuild"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import type { TestProject } from "vitest/node"

const fixtures = path.join(path.dirname(fileURLToPath(import.meta.url)), "..", "fixtures")
/**
 * The child programs, and the power-loss harness's preload (test/fixtures/powerLossPreload.ts,
 * loaded with `node --import` before a child: bundled the same way, an ES module).
 */
export const CHILDREN = ["eventLogChild", "eventLogPowerChild", "idleGcChild", "journalChild", "lockChild", "powerLossPreload"] as const

export default async function setup(project: TestProject) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-fixtures-"))
  await esbuild.build({
    entryPoints: CHILDREN.map((name) => path.join(fixtures, `${name}.ts`)),
    outdir: dir,
    outExtension: { ".js": ".mjs" },
    bundle: true,
    platform: "node",
    target: "node20",
    format: "esm",
    logLevel: "warning",
    // Some dependencies call require(); an ES module bundle has to provide it.
    banner: { js: `import { createRequire as __fixtureRequire } from "node:module"; const require = __fixtureRequire(import.meta.url);` }
  })
  project.provide("agentdFixtureDir", dir)
  return () => fs.rmSync(dir, { recursive: true, force: true })
}
