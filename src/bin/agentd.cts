#!/usr/bin/env node
/**
 * The `agentd` command (docs/protocol.md section 8), the package's bin. A command line is a
 * short-lived process, so this entry does little itself, and is CommonJS: an ES module entry
 * brings Node's ES module loader, and its namespace import of `node:fs` reads every property
 * (fs.promises: streams, readline), ~20 internal modules a command does not need.
 *
 * When the build made bundles of the command line next to it (see scripts/bundle.mjs), it
 * runs them with V8's code cache (`<bundle>.cache`: the bytecode, so a bundle is not compiled
 * again at every start): `agentd-cli.cjs` (the grammar, help and the one-shot commands, no
 * Effect), then, for the commands that need Effect, `agentd-run.cjs`. Without bundles (compiled
 * modules, or tsx on the sources) it imports the command line's modules. `serve` loads the
 * daemon's program, a separate module, only then.
 */
import fs = require("node:fs")
import nodeModule = require("node:module")
import path = require("node:path")
import vm = require("node:vm")
import type * as Main from "../cli/main.js"
import type * as Run from "../cli/run.js"
import type * as Serve from "./serve.js"

const cliBundle = path.join(__dirname, "agentd-cli.cjs")
const runBundle = path.join(__dirname, "agentd-run.cjs")
const serveBundle = path.join(__dirname, "agentd-serve.cjs")
const bundled = fs.existsSync(cliBundle)

const hooks: Main.Hooks = {
  loadRun: () => (bundled ? Promise.resolve(loadBundle<typeof Run>(runBundle)) : import("../cli/run.js")),
  loadServe: () => (bundled ? Promise.resolve(loadBundle<typeof Serve>(serveBundle)) : import("./serve.js")),
  self: [...process.execArgv, process.argv[1]!]
}

/**
 * Runs the CommonJS bundle through `vm.Script` with its code cache. A cache that is missing or
 * rejected (another Node version) is written again after the run, if the directory allows.
 */
function loadBundle<Exports>(bundle: string): Exports {
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
  const module = { exports: {} as Exports }
  script.runInThisContext()(module.exports, nodeModule.createRequire(bundle), module, bundle, __dirname)
  const write = process.env["AGENTD_WRITE_CODE_CACHE"] === "1" ||
    (process.env["AGENTD_NO_CODE_CACHE"] !== "1" && (cachedData === undefined || script.cachedDataRejected === true))
  if (write) {
    // On exit: a daemon ends with process.exit, which emits no beforeExit.
    process.once("exit", () => {
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

const start = (cli: typeof Main) =>
  // `serve` never settles (the daemon's runtime ends the process).
  cli.main(process.argv.slice(2), hooks).then((code) => {
    process.exitCode = code
  })

if (bundled) void start(loadBundle<typeof Main>(cliBundle))
else void import("../cli/main.js").then(start)
