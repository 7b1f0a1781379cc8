/**
 * Start-up of the command line (the package's bin): wall time of `agentd status` (spawn to exit, against a daemon
 * already listening) next to `node -e 0` in the same run, the runs interleaved so that both see
 * the same machine load; the median of each. The project aims at most 1.5x `node -e 0`: a
 * command line is a short-lived process and most of its life is start-up.
 *
 * Also shown: `agentd --version` (the command line loaded, no connection), `agentd status` run
 * without the code cache (AGENTD_NO_CODE_CACHE=1), to see what the cache saves, and `agentd
 * prompt` (a whole echo turn), whose command loads Effect and the client SDK (the one-shot
 * commands such as `status` do not), with and without its code cache.
 */
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { nowMs, withDaemon } from "./daemonHarness.js"
import { percentiles } from "./report.js"

/** The package's bin, as `npm install -g` links it. */
const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..")
const BIN = path.join(root, (JSON.parse(fs.readFileSync(path.join(root, "package.json"), "utf8")) as { bin: { agentd: string } }).bin.agentd)

const RUNS = Number(process.env["AGENTD_BENCH_CLI_RUNS"] ?? 21)
const TARGET = 1.5

const spawn = (args: ReadonlyArray<string>, env: NodeJS.ProcessEnv) => {
  const r = spawnSync(process.execPath, args, { stdio: ["ignore", "pipe", "pipe"], env })
  if (r.status !== 0) throw new Error(`${args.join(" ")} exited ${r.status}: ${r.stderr.toString()}`)
  return r.stdout.toString()
}

const time = (args: ReadonlyArray<string>, env: NodeJS.ProcessEnv = process.env): number => {
  const start = nowMs()
  spawn(args, env)
  return nowMs() - start
}

export default async (): Promise<void> => {
  await withDaemon({}, async (d) => {
    const env = { ...process.env, AGENTD_SOCKET: d.socketPath }
    const session = spawn([BIN, "create"], env).trim()
    const cases: ReadonlyArray<{ readonly name: string; readonly run: () => number }> = [
      { name: "node -e 0", run: () => time(["-e", "0"]) },
      { name: "agentd status", run: () => time([BIN, "status"], env) },
      { name: "agentd --version", run: () => time([BIN, "--version"], env) },
      { name: "agentd status (no code cache)", run: () => time([BIN, "status"], { ...env, AGENTD_NO_CODE_CACHE: "1" }) },
      { name: "agentd prompt (a whole turn)", run: () => time([BIN, "prompt", session, "hello there"], env) },
      { name: "agentd prompt (no code cache)", run: () => time([BIN, "prompt", session, "hello there"], { ...env, AGENTD_NO_CODE_CACHE: "1" }) }
    ]
    // Warm the file cache once.
    for (const c of cases) c.run()
    const samples = cases.map(() => [] as Array<number>)
    for (let i = 0; i < RUNS; i++) cases.forEach((c, j) => samples[j]!.push(c.run()))
    const medians = samples.map((s) => percentiles(s).median)
    const node = medians[0]!
    cases.forEach((c, j) => console.log(`${c.name.padEnd(32)} median ${medians[j]!.toFixed(0).padStart(4)} ms  (${(medians[j]! / node).toFixed(2)}x node -e 0)`))
    const ratio = medians[1]! / node
    console.log(
      `CLI start-up (agentd status): agentd ${medians[1]!.toFixed(0)} ms | baseline (node -e 0) ${node.toFixed(0)} ms | ratio ${
        ratio.toFixed(2)
      }x  (target <= ${TARGET}x: ${ratio <= TARGET ? "met" : "MISSED"}; ${RUNS} interleaved runs each)`
    )
  })
}
