/**
 * The session lifecycle's pure `step`, proven by simulation: seeded random runs of several
 * sessions over fakes of their workers, slots, journal, timers and storage (see
 * test/support/sessionSim.ts), invariants checked after every event:
 * - every request is settled exactly once by the end of the run;
 * - busy exactly when a prompt is reserved or an accepted turn has not ended;
 * - at most one worker per session, none after Closed;
 * - the status after a turn's end says busy:false; a turn's end only where one is owed;
 * - an accepted prompt's turn ends (agent_end or turn_interrupted);
 * - a prompt is refused session_busy only while another prompt holds the session (a turn cut
 *   by a crash only owes its end: a prompt waits for it);
 * - a worker counted on its way out of its slot holds one.
 * A failure prints its seed and the shortest run found that breaks the invariant.
 * AGENTD_SIM_STEPS sets the number of events (default 1,000,000); AGENTD_SIM_SEED the first seed.
 */
import { describe, expect, it } from "vitest"
import { generate, run, shrink, type WorldEvent } from "./support/sessionSim.js"

const STEPS = Number(process.env["AGENTD_SIM_STEPS"] ?? 1_000_000)
const FIRST_SEED = Number(process.env["AGENTD_SIM_SEED"] ?? 1)
const RUN_LENGTH = 400

const show = (events: ReadonlyArray<WorldEvent>) => events.map((e) => JSON.stringify(e)).join("\n")

describe("session lifecycle simulation", () => {
  it(`holds its invariants over ${STEPS} steps of random runs`, () => {
    let steps = 0
    let runs = 0
    for (let seed = FIRST_SEED; steps < STEPS; seed++) {
      const run1 = generate(seed, RUN_LENGTH)
      const result = run(run1)
      runs++
      steps += result.steps
      if (result.violation !== undefined) {
        const shrunk = shrink(run1)
        expect.fail(
          `seed ${seed} (AGENTD_SIM_SEED=${seed}), after ${steps} steps in all: ${result.violation}\nshortest run found (${shrunk.events.length} events): ${shrunk.violation}\n${show(shrunk.events)}`
        )
      }
    }
    expect(runs).toBeGreaterThan(0)
  }, 120_000)

  it("holds its invariants with renames among the commands (each settled once, in every phase)", () => {
    let steps = 0
    for (let seed = FIRST_SEED; steps < STEPS / 10; seed++) {
      const events = generate(seed, RUN_LENGTH, { renames: true })
      const result = run(events)
      steps += result.steps
      if (result.violation !== undefined) {
        const shrunk = shrink(events)
        expect.fail(`seed ${seed} with renames: ${result.violation}\nshortest run found (${shrunk.events.length} events): ${shrunk.violation}\n${show(shrunk.events)}`)
      }
    }
  }, 60_000)

  it("is deterministic: the same seed gives the same run", () => {
    expect(run(generate(7, 300))).toEqual(run(generate(7, 300)))
  })
})
