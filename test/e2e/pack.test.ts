/**
 * The package as its users get it: `npm pack`, installed into a temp project, imported there by
 * name. The packed daemon (the project's node_modules/.bin/agentd) runs, and a script of the
 * project drives it with the Promise facade of `agentd/client`; the project's TypeScript also
 * type-checks against the installed types.
 *
 * The install is offline: the temp project gets a lockfile made of the tarball and this repo's
 * own lockfile entries of the package's dependencies, so `npm ci --offline` takes them from the
 * npm cache that installing this repo filled (falling back to `--prefer-offline`, which may ask
 * the registry, when the cache lacks one).
 *
 * Packs dist/ as it is: run `npm run build` first.
 */
import { execFileSync, spawn } from "node:child_process"
import { createHash, randomUUID } from "node:crypto"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { afterAll, beforeAll, describe, expect, it } from "vitest"
import { killQuietly, processesWithEnv } from "../support/procfs.js"
import { PROJECT_ROOT, sleep } from "./harness.js"

const npm = (args: ReadonlyArray<string>, cwd: string): string =>
  execFileSync("npm", [...args, "--no-audit", "--no-fund", "--loglevel=error"], { cwd, encoding: "utf8", timeout: 60_000, stdio: ["ignore", "pipe", "pipe"] })

let root = ""
let project = ""
let packed: Array<string> = []
const mark = randomUUID()

beforeAll(() => {
  if (!fs.existsSync(path.join(PROJECT_ROOT, "dist", "src", "client.js"))) throw new Error("dist/ missing: run `npm run build` first")
  root = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-pack-"))
  // --ignore-scripts: `prepare` would rebuild dist/ under the other tests' feet.
  const result = JSON.parse(npm(["pack", "--ignore-scripts", "--json", "--pack-destination", root], PROJECT_ROOT)) as Array<{
    filename: string
    files: Array<{ path: string }>
  }>
  packed = result[0]!.files.map((f) => f.path)
  const tarball = path.join(root, path.basename(result[0]!.filename))

  project = path.join(root, "consumer")
  fs.mkdirSync(project)
  const pkg = JSON.parse(fs.readFileSync(path.join(PROJECT_ROOT, "package.json"), "utf8")) as {
    version: string
    license: string
    engines: Record<string, string>
    bin: Record<string, string>
    dependencies: Record<string, string>
  }
  const lock = JSON.parse(fs.readFileSync(path.join(PROJECT_ROOT, "package-lock.json"), "utf8")) as {
    packages: Record<string, { dev?: boolean }>
  }
  const spec = `file:../${path.basename(tarball)}`
  const packages: Record<string, unknown> = {
    "": { name: "consumer", dependencies: { agentd: spec } },
    "node_modules/agentd": {
      version: pkg.version,
      resolved: spec,
      integrity: `sha512-${createHash("sha512").update(fs.readFileSync(tarball)).digest("base64")}`,
      license: pkg.license,
      dependencies: pkg.dependencies,
      bin: pkg.bin,
      engines: pkg.engines
    }
  }
  // What the package needs at run time is what this repo's lockfile does not mark dev-only.
  for (const [key, entry] of Object.entries(lock.packages)) {
    if (key !== "" && entry.dev !== true) packages[key] = entry
  }
  fs.writeFileSync(
    path.join(project, "package.json"),
    JSON.stringify({ name: "consumer", private: true, type: "module", dependencies: { agentd: spec } }, null, 2)
  )
  fs.writeFileSync(path.join(project, "package-lock.json"), JSON.stringify({ name: "consumer", lockfileVersion: 3, requires: true, packages }, null, 2))
  try {
    npm(["ci", "--offline", "--ignore-scripts"], project)
  } catch {
    npm(["ci", "--prefer-offline", "--ignore-scripts"], project)
  }
}, 120_000)

afterAll(() => {
  for (const pid of processesWithEnv("AGENTD_E2E_MARK", mark)) killQuietly(pid, "SIGKILL")
  if (root !== "") fs.rmSync(root, { recursive: true, force: true })
})

describe("npm pack, installed in another project (e2e)", () => {
  it("the tarball holds dist/src with types and bins and the LICENSE, and no tests, benchmarks, examples, sources or source maps", () => {
    for (const file of ["package.json", "README.md", "dist/src/index.js", "dist/src/index.d.ts", "dist/src/client.js", "dist/src/client.d.ts", "dist/src/Worker.d.ts", "dist/src/bin/agentd.js", "dist/src/bin/worker.js"]) {
      expect(packed).toContain(file)
    }
    expect(packed.filter((f) => !f.startsWith("dist/src/") && f !== "package.json" && f !== "README.md" && f !== "LICENSE")).toEqual([])
    expect(packed).toContain("LICENSE")
    // Source maps are three quarters of dist/ (25 of 31 MB): a clone's build has them.
    expect(packed.filter((f) => f.endsWith(".map"))).toEqual([])
    expect(fs.readdirSync(path.join(project, "node_modules", "agentd", "dist")).sort()).toEqual(["src"])
  })

  it("a script of that project imports agentd/client by name and drives the packed daemon: create, prompt, for await the turn", async () => {
    const stateDir = path.join(root, "state")
    const env: NodeJS.ProcessEnv = { ...process.env, AGENTD_E2E_MARK: mark }
    for (const k of Object.keys(env)) if (k.startsWith("AGENTD_") && k !== "AGENTD_E2E_MARK") delete env[k]
    const daemon = spawn(path.join(project, "node_modules", ".bin", "agentd"), ["serve", "--state-dir", stateDir], {
      cwd: project,
      env,
      stdio: ["ignore", "ignore", "pipe"],
      detached: true
    })
    let log = ""
    daemon.stderr!.setEncoding("utf8").on("data", (d: string) => (log += d))
    try {
      const socketPath = path.join(stateDir, "agentd.sock")
      const deadline = Date.now() + 20_000
      while (!fs.existsSync(socketPath)) {
        if (daemon.exitCode !== null || Date.now() > deadline) throw new Error(`the packed daemon did not start\n${log}`)
        await sleep(50)
      }
      fs.writeFileSync(
        path.join(project, "main.mjs"),
        `import { connect, DaemonError } from "agentd/client"
const client = await connect({ socketPath: process.argv[2] })
const session = await client.create({ name: "packed" })
const types = []
let reply = ""
for await (const event of session.prompt("from a packed install")) {
  types.push(event.type)
  if (event.type === "message_update") reply += event.delta
}
const { total } = await session.getMessages()
const missing = await client.session("s-nope").getState().catch((e) => e instanceof DaemonError && e.code)
await client.close()
console.log(JSON.stringify({ reply, first: types[0], last: types.at(-1), total, missing, resolved: import.meta.resolve("agentd/client") }))
`
      )
      const out = execFileSync(process.execPath, ["main.mjs", socketPath], { cwd: project, encoding: "utf8", timeout: 30_000, env })
      const report = JSON.parse(out.trim().split("\n").at(-1)!) as Record<string, unknown>
      expect(report).toEqual({
        reply: "echo: from a packed install",
        first: "agent_start",
        last: "agent_end",
        total: 2,
        missing: "session_not_found",
        resolved: `file://${fs.realpathSync(path.join(project, "node_modules", "agentd", "dist", "src", "client.js"))}`
      })
    } finally {
      try {
        process.kill(-daemon.pid!, "SIGKILL")
      } catch {
        // gone
      }
    }
  }, 60_000)

  it("that project's TypeScript type-checks against the installed types (agentd and agentd/client)", () => {
    fs.writeFileSync(
      path.join(project, "check.ts"),
      `import { type Daemon, DaemonLive, RecoveryJournal, type SessionManager } from "agentd"
import { connect, type SessionHandle } from "agentd/client"
import type * as Layer from "effect/Layer"
export const daemon: Layer.Layer<SessionManager.SessionManager, Daemon.DaemonStartError> = DaemonLive({ stateDir: "/tmp/x" }, { recoveryJournal: RecoveryJournal.layerMemory })
export const reply = async (socketPath: string): Promise<string> => {
  const client = await connect({ socketPath })
  const session: SessionHandle = await client.create({ name: "typed" })
  let text = ""
  for await (const event of session.prompt("hi")) if (event.type === "message_update") text += event.delta
  // @ts-expect-error: a session id is a string
  client.session(42)
  return text
}
`
    )
    fs.writeFileSync(
      path.join(project, "tsconfig.json"),
      JSON.stringify({
        compilerOptions: { target: "ES2022", module: "NodeNext", moduleResolution: "NodeNext", strict: true, noEmit: true, skipLibCheck: true, types: [] },
        files: ["check.ts"]
      })
    )
    const tsc = path.join(PROJECT_ROOT, "node_modules", "typescript", "bin", "tsc")
    const result = spawnSyncText(process.execPath, [tsc, "-p", "tsconfig.json"], project)
    expect(result.status, result.output).toBe(0)
  }, 60_000)
})

const spawnSyncText = (command: string, args: ReadonlyArray<string>, cwd: string): { status: number | null; output: string } => {
  try {
    return { status: 0, output: execFileSync(command, args, { cwd, encoding: "utf8", timeout: 60_000 }) }
  } catch (e) {
    const err = e as { status: number | null; stdout?: string; stderr?: string }
    return { status: err.status, output: `${err.stdout ?? ""}${err.stderr ?? ""}` }
  }
}
