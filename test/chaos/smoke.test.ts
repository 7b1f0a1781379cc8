/**
 * The chaos harness in CI: one short seeded run (about 25 s) against the real built
 * daemon: the full load (`/compact` history rewrites included), every fault kind (worker and
 * daemon SIGKILLs, racing commands, failing spawns, dropped and paused clients, clients away
 * during a rewrite) and the thresholds the seed draws (checkpoints
 * every few events, one or two generations retained, a small outbox). Longer runs and the
 * regression seeds are `npm run chaos` and `npm run chaos -- --regressions`.
 *
 * `AGENTD_CHAOS_SEED` picks another seed (the failure message prints the command that reruns it).
 * The second run does the same with sessions sharing worker hosts (`--sessions-per-worker 3`):
 * a worker SIGKILL there is the crash of every session in its host.
 */
import { expect, it } from "vitest"
import { describeResult } from "./report.js"
import { runChaos } from "./run.js"

it("a seeded chaos run of every fault kind, with tiny thresholds, breaks no invariant", async () => {
  const seed = Number(process.env["AGENTD_CHAOS_SEED"] ?? 20261130)
  // Short, for the suite's budget: the long runs and the regression seeds are run by hand.
  const args = { seconds: 20, faults: 16, kinds: undefined, settings: {} }
  const r = await runChaos({ seed, seconds: args.seconds, faults: args.faults })
  expect(r.violation, describeResult(r, args)).toBeUndefined()
}, 90_000)

it("the same with sessions sharing worker hosts (--sessions-per-worker 3): a host's crash is every hosted session's, and breaks no invariant", async () => {
  const seed = Number(process.env["AGENTD_CHAOS_SEED"] ?? 20261203)
  const args = { seconds: 20, faults: 16, kinds: undefined, settings: { AGENTD_SESSIONS_PER_WORKER: "3" } }
  const r = await runChaos({ seed, seconds: args.seconds, faults: args.faults, settings: args.settings })
  expect(r.violation, describeResult(r, args)).toBeUndefined()
}, 90_000)
