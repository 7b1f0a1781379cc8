/** How a chaos run is reported: a line when it passed; everything needed to chase it when it failed. */
import type { FaultKind, RunResult } from "./run.js"

export interface RunArgs {
  readonly seconds: number
  readonly faults: number
  readonly kinds: ReadonlyArray<FaultKind> | undefined
  readonly settings: Readonly<Record<string, string>>
  readonly promptAtEnd?: number | undefined
}

/** The command line that runs the same seed with the same options again. */
export const reproduce = (seed: number, a: RunArgs): string =>
  `npm run chaos -- --seed ${seed} --seconds ${a.seconds} --faults ${a.faults}` +
  (a.kinds === undefined ? "" : ` --kinds ${a.kinds.join(",")}`) +
  (a.promptAtEnd === undefined ? "" : ` --prompt-at-end ${a.promptAtEnd}`) +
  Object.entries(a.settings).map(([k, v]) => ` --set ${k}=${v}`).join("")

export const describeResult = (r: RunResult, a: RunArgs): string => {
  const out: Array<string> = []
  const counts = Object.entries(r.counts).sort().map(([k, n]) => `${k} ${n}`).join(", ")
  const stats = Object.entries(r.stats).map(([k, n]) => `${k} ${n}`).join(", ")
  if (r.violation === undefined) {
    out.push(`seed ${r.seed}: PASS (${a.seconds} s; faults: ${counts || "none"}; ${stats})`)
  } else {
    out.push(`seed ${r.seed}: FAIL`, `  first violated invariant: ${r.violation.invariant}`, `  ${r.violation.details}`)
    out.push(`  settings: ${JSON.stringify(r.settings)}`, `  faults: ${counts || "none"}; ${stats}`, `  fault schedule up to the failure:`)
    const lines = r.schedule.length > 80 ? ["...", ...r.schedule.slice(-80)] : r.schedule
    for (const l of lines) out.push(`    ${l}`)
    if (r.postMortem.length > 0) out.push(`  post-mortem:`, ...r.postMortem.map((l) => `    ${l}`))
    out.push(`  daemon log tail:`, ...r.daemonLog.split("\n").slice(-25).map((l) => `    ${l}`))
    out.push(`  state dir kept: ${r.stateDir}`, `  reproduce: ${reproduce(r.seed, a)}`)
  }
  for (const n of r.notes.slice(0, 10)) out.push(`  note: ${n}`)
  return out.join("\n")
}
