#!/usr/bin/env node
/**
 * The `agentd` command (docs/protocol.md section 8). A command line is a short-lived process,
 * so this entry does little itself: when the build made a bundle of the command line next to
 * it (`agentd-cli.cjs`, see scripts/bundle.mjs), it runs that bundle with V8's code cache
 * (`agentd-cli.cjs.cache`: the bytecode, so the bundle is not compiled again at every start);
 * otherwise (compiled modules, or tsx on the sources) it imports the command line's modules.
 * `serve` loads the daemon's program, a separate module, only then.
 */
import * as fs from "node:fs"
import { createRequire } from "node:module"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import * as v8 from "node:v8"
import * as vm from "node:vm"
import type * as Main from "../cli/main.js"

const here = path.dirname(fileURLToPath(import.meta.url))
const bundle = path.join(here, "agentd-cli.cjs")

const hooks: Main.Hooks = {
  loadServe: () => import("./serve.js"),
  self: [...process.execArgv, process.argv[1]!]
}

/**
 * Runs the CommonJS bundle through `vm.Script` with its code cache. A cache that is missing or
 * rejected (another Node version) is written again after the run, if the directory allows.
 */
const runBundle = (): typeof Main => {
  // Start-up allocates a few MB at once: letting the young generation grow in one step instead
  // of doubling saves two of the four scavenges `agentd status` made (--trace-gc). Set before
  // the script is compiled: V8's code cache is only taken under the flags it was made with.
  v8.setFlagsFromString("--semi-space-growth-factor=8")
  // The bundle is a function expression (esbuild's banner and footer): no copy of it is made.
  const source = fs.readFileSync(bundle, "utf8")
  const cacheFile = `${bundle}.cache`
  let cachedData: Buffer | undefined
  try {
    // AGENTD_NO_CODE_CACHE=1: compile as if there were none (to measure what it saves).
    cachedData = process.env["AGENTD_NO_CODE_CACHE"] === "1" ? undefined : fs.readFileSync(cacheFile)
  } catch {
    cachedData = undefined
  }
  const script = new vm.Script(source, { filename: bundle, ...(cachedData === undefined ? {} : { cachedData }) })
  const module = { exports: {} as typeof Main }
  script.runInThisContext()(module.exports, createRequire(bundle), module, bundle, here)
  const write = process.env["AGENTD_WRITE_CODE_CACHE"] === "1" ||
    (process.env["AGENTD_NO_CODE_CACHE"] !== "1" && (cachedData === undefined || script.cachedDataRejected === true))
  if (write) {
    process.once("beforeExit", () => {
      try {
        const temp = `${cacheFile}.${process.pid}.tmp`
        fs.writeFileSync(temp, script.createCachedData())
        fs.renameSync(temp, cacheFile)
      } catch {
        // A read-only install: the bundle still runs, compiled at each start.
      }
    })
  }
  return module.exports
}

const cli: typeof Main = fs.existsSync(bundle) ? runBundle() : await import("../cli/main.js")
// Not awaited at the top level: `serve` never settles (the daemon's runtime ends the process),
// and a pending top-level await would make Node exit with code 13.
void cli.main(process.argv.slice(2), hooks).then((code) => {
  process.exitCode = code
})
