// `npm start`: `agentd serve` from this clone, building first only when a source changed since
// the last build (the build writes dist/.build-stamp last; a file newer than it, or no stamp,
// means build). Arguments after `--` go to `serve` (`npm start -- --state-dir /tmp/a`).
import { spawn, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"

const stamp = "dist/.build-stamp"
const inputs = ["src", "scripts/bundle.mjs", "package.json", "package-lock.json", "tsconfig.json", "tsconfig.build.json"]

const newest = (p) => {
  let stat
  try {
    stat = fs.statSync(p)
  } catch {
    return 0
  }
  if (!stat.isDirectory()) return stat.mtimeMs
  let max = stat.mtimeMs
  for (const entry of fs.readdirSync(p)) max = Math.max(max, newest(path.join(p, entry)))
  return max
}

const built = fs.existsSync(stamp) ? fs.statSync(stamp).mtimeMs : 0
const changed = Math.max(...inputs.map(newest))
if (built === 0 || changed > built || !fs.existsSync("dist/src/bin/agentd.js")) {
  console.error(built === 0 ? "agentd: building (first start)" : "agentd: sources changed since the last build; building")
  const npm = process.platform === "win32" ? "npm.cmd" : "npm"
  const build = spawnSync(npm, ["run", "build", "--silent"], { stdio: "inherit" })
  if (build.status !== 0) process.exit(build.status ?? 1)
}

// The daemon's young generation capped from its start, as `serve --detach` does (src/internal/youngGeneration.ts).
const { semiSpaceFlags } = await import("../dist/src/internal/youngGeneration.js")
const child = spawn(process.execPath, [...semiSpaceFlags(process.execArgv), "dist/src/bin/agentd.js", "serve", ...process.argv.slice(2)], { stdio: "inherit" })
// Ctrl-C reaches the daemon too (same process group); SIGTERM to this process is passed on.
process.on("SIGINT", () => {})
process.on("SIGTERM", () => child.kill("SIGTERM"))
child.on("exit", (code, signal) => process.exit(code ?? (signal === null ? 1 : 128)))
