/**
 * The chaos harness in CI: one short seeded run (about a minute) against the real built
 * daemon: the full load (`/compact` history rewrites included), every fault kind (worker and
 * daemon SIGKILLs, racing commands, failing spawns, dropped and paused clients, clients away
 * during a rewrite) and the thresholds the seed draws (checkpoints
 * every few events, one or two generations retained, a small outbox). Longer runs and the
 * regression seeds are `npm run chaos` and `npm run chaos -- --regressions`.
 *
 * `AGENTD_CHAOS_SEED` picks another seed (the failure message prints the command that reruns it).
 */
import { expect, it } from "vitest"
import { describeResult } from "./report.js"
import { runChaos } from "./run.js"

it("a seeded chaos run of every fault kind, with tiny thresholds, breaks no invariant", async () => {
  const seed = Number(process.env["AGENTD_CHAOS_SEED"] ?? 20261130)
  const args = { seconds: 40, faults: 30, kinds: undefined, settings: {} }
  const r = await runChaos({ seed, seconds: args.seconds, faults: args.faults })
  expect(r.violation, describeResult(r, args)).toBeUndefined()
}, 90_000)
