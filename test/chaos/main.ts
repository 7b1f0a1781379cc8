/**
 * `npm run chaos -- [--seed S] [--seconds N] [--faults K] [--kinds a,b] [--store postgres] [--runs R] [--verbose] [--keep]`
 * (`--store postgres`: the daemon over a private PostgreSQL of the run, scripts/pg-test-server.sh;
 * its default kinds add `store_restart` and leave out `damage_files`)
 * `npm run chaos -- --regressions [--store postgres]` runs every seed of seeds.json (over PostgreSQL
 * too: each seed keeps its kinds, and `damage_files` is skipped there).
 * `npm run chaos -- --cluster N [--seed S] [--seconds N] [--lease MS] [--kinds runner_kill,runner_partition] [--runs R] [--verbose]`
 * runs N cluster runners over a private PostgreSQL with the runner faults (cluster.ts); the
 * shard lease is 10 s unless told (at 6 s and load 15+, lock refreshes time out and every
 * runner drops its shards again and again).
 *
 * Each run starts the real built daemon, loads it, injects faults and checks the protocol's
 * promises (run.ts). A failed run prints its seed, its settings, the fault schedule up to the
 * failure and the first violated invariant, and exits 1. The same seed makes the same choices
 * again (the timing of real processes still differs from run to run).
 */
import * as fs from "node:fs"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { CLUSTER_FAULT_KINDS, type ClusterFaultKind, runClusterChaos } from "./cluster.js"
import { describeResult } from "./report.js"
import { FAULT_KINDS, type FaultKind, runChaos } from "./run.js"

const here = path.dirname(fileURLToPath(import.meta.url))

interface RegressionSeed {
  readonly seed: number
  readonly seconds: number
  readonly faults: number
  readonly kinds?: ReadonlyArray<FaultKind>
  readonly settings?: Readonly<Record<string, string>>
  readonly promptAtEnd?: number
  /** What the seed found when it was recorded (the defect and the invariant it broke). */
  readonly found: string
}

const usage = () => {
  console.error(
    "usage: npm run chaos -- [--seed S] [--seconds N] [--faults K] [--kinds " + FAULT_KINDS.join(",") +
      "] [--store files|postgres] [--set AGENTD_X=V]... [--prompt-at-end P] [--runs R] [--verbose] [--keep] | --regressions" +
      " | --cluster N [--seed S] [--seconds N] [--lease MS] [--kinds " + CLUSTER_FAULT_KINDS.join(",") + "] [--runs R] [--verbose]"
  )
  process.exit(2)
}

const settings: Record<string, string> = {}

const parse = (argv: ReadonlyArray<string>) => {
  const out: Record<string, string | boolean> = {}
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!
    if (!a.startsWith("--")) usage()
    const key = a.slice(2)
    if (["verbose", "keep", "regressions"].includes(key)) out[key] = true
    else if (key === "set") {
      // --set AGENTD_X=V, repeatable: a daemon setting instead of the drawn one.
      const v = argv[++i]
      const eq = v?.indexOf("=") ?? -1
      if (v === undefined || eq <= 0) usage()
      settings[v!.slice(0, eq)] = v!.slice(eq + 1)
    } else {
      const v = argv[++i]
      if (v === undefined) usage()
      out[key] = v!
    }
  }
  return out
}

const int = (v: string | boolean | undefined, fallback: number): number => {
  if (v === undefined) return fallback
  const n = Number(v)
  if (!Number.isFinite(n) || n < 0) usage()
  return n
}

const kindsOf = <K extends string>(v: string | boolean | undefined, all: ReadonlyArray<K>): ReadonlyArray<K> | undefined => {
  if (typeof v !== "string") return undefined
  const kinds = v.split(",").map((k) => k.trim()).filter((k) => k.length > 0)
  for (const k of kinds) if (!(all as ReadonlyArray<string>).includes(k)) usage()
  return kinds as Array<K>
}

/** `--cluster N`: the runner faults over N runners (cluster.ts); one line per run, the schedule of a failed one. */
const mainCluster = async (args: Record<string, string | boolean>) => {
  const runners = int(args["cluster"], 3)
  if (runners < 2) usage()
  const seconds = int(args["seconds"], 120)
  const runs = int(args["runs"], 1)
  const kinds = kindsOf<ClusterFaultKind>(args["kinds"], CLUSTER_FAULT_KINDS)
  const leaseMs = int(args["lease"], 10_000)
  let seed = args["seed"] === undefined ? Math.floor(Math.random() * 2 ** 31) : int(args["seed"], 0)
  let failed = 0
  for (let i = 0; i < runs; i++, seed++) {
    const r = await runClusterChaos({ seed, runners, seconds, leaseMs, ...(kinds ? { kinds } : {}), verbose: args["verbose"] === true })
    console.log(
      `seed ${seed} --cluster ${runners} --seconds ${seconds} --lease ${leaseMs}: ${r.violation === undefined ? "green" : "FAILED"}; faults ${JSON.stringify(r.counts)}; ` +
        `${JSON.stringify(r.stats)}; ${r.census}`
    )
    if (r.violation !== undefined) {
      failed++
      console.log(`  violation: ${r.violation}\n  schedule:\n${r.schedule.map((l) => `    ${l}`).join("\n")}`)
    }
  }
  process.exit(failed === 0 ? 0 : 1)
}

const main = async () => {
  const args = parse(process.argv.slice(2))
  if (args["cluster"] !== undefined) return mainCluster(args)
  const store = args["store"] ?? "files"
  if (store !== "files" && store !== "postgres") usage()
  if (args["regressions"] === true) {
    const seeds = JSON.parse(fs.readFileSync(path.join(here, "seeds.json"), "utf8")) as { seeds: Array<RegressionSeed> }
    let failed = 0
    for (const s of seeds.seeds) {
      console.log(`\n# regression seed ${s.seed} (found: ${s.found})`)
      const r = await runChaos({
        seed: s.seed,
        seconds: s.seconds,
        faults: s.faults,
        ...(s.kinds ? { kinds: s.kinds } : {}),
        ...(s.settings ? { settings: s.settings } : {}),
        ...(s.promptAtEnd === undefined ? {} : { promptAtEnd: s.promptAtEnd }),
        // A seed's own kinds are kept; `damage_files` is skipped over PostgreSQL (run.ts).
        store: store as "files" | "postgres"
      })
      console.log(describeResult(r, { seconds: s.seconds, faults: s.faults, kinds: s.kinds, settings: s.settings ?? {}, promptAtEnd: s.promptAtEnd }))
      if (r.violation !== undefined) failed++
    }
    console.log(`\n${seeds.seeds.length - failed} of ${seeds.seeds.length} regression seeds green`)
    process.exit(failed === 0 ? 0 : 1)
  }
  const seconds = int(args["seconds"], 60)
  const faults = int(args["faults"], Math.max(10, Math.round(seconds * 0.8)))
  const runs = int(args["runs"], 1)
  const kinds = kindsOf<FaultKind>(args["kinds"], FAULT_KINDS)
  const promptAtEnd = args["prompt-at-end"] === undefined ? undefined : Number(args["prompt-at-end"])
  if (promptAtEnd !== undefined && !(promptAtEnd >= 0 && promptAtEnd <= 1)) usage()
  let seed = args["seed"] === undefined ? Math.floor(Math.random() * 2 ** 31) : int(args["seed"], 0)
  let failed = 0
  for (let i = 0; i < runs; i++, seed++) {
    const r = await runChaos({
      seed,
      seconds,
      faults,
      ...(kinds ? { kinds } : {}),
      verbose: args["verbose"] === true,
      keep: args["keep"] === true,
      settings,
      store: store as "files" | "postgres",
      ...(promptAtEnd === undefined ? {} : { promptAtEnd })
    })
    console.log(describeResult(r, { seconds, faults, kinds, settings, promptAtEnd }))
    if (r.violation !== undefined) failed++
  }
  process.exit(failed === 0 ? 0 : 1)
}

await main()
