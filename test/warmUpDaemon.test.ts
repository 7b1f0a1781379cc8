/**
 * The daemon's start-up warm-up (src/internal/warmUpDaemon.ts): it runs echo turns through the
 * real event path (entity, event log of files, worker frame inbox, outbox), leaves no trace
 * (nothing listed, nothing in the state dir or the temp dir, no metric counted), and gives way
 * once a real session's worker sends frames.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Layer from "effect/Layer"
import * as Metric from "effect/Metric"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { CoreLive } from "../src/Daemon.js"
import type { DaemonConfig } from "../src/DaemonConfig.js"
import { realFramesArrived } from "../src/internal/delivery/warmUp.js"
import { warmUpDaemon } from "../src/internal/warmUpDaemon.js"
import * as Metrics from "../src/Metrics.js"
import { SessionManager } from "../src/SessionManager.js"

/** Every path under `dir`, relative to it. */
const tree = (dir: string): Array<string> =>
  fs.existsSync(dir) ? (fs.readdirSync(dir, { recursive: true }) as Array<string>).sort() : []

/**
 * This process's warm-up temp dirs now in the temp dir: only its own, since the daemons other test
 * files start at the same time make and remove theirs.
 */
const warmUpDirs = () => fs.readdirSync(os.tmpdir()).filter((d) => d.startsWith(`agentd-warm-up-${process.pid}-`))

/** A daemon's core on a temp state dir, no worker process (no spare), no warm-up of its own. */
const withCore = <A, E>(f: (stateDir: string) => Effect.Effect<A, E, SessionManager | DaemonConfig>) =>
  Effect.acquireUseRelease(
    Effect.sync(() => fs.mkdtempSync(path.join(os.tmpdir(), "agentd-warm-up-test-"))),
    (root) => {
      const stateDir = path.join(root, "state")
      return f(stateDir).pipe(Effect.provide(CoreLive({ stateDir, warmSpare: false, warmUp: false }).pipe(Layer.orDie)))
    },
    (root) => Effect.sync(() => fs.rmSync(root, { recursive: true, force: true }))
  )

const counted = Effect.all([Metric.value(Metrics.eventsAppended), Metric.value(Metrics.eventsDelivered.socket)])

describe("the daemon's start-up warm-up", () => {
  it.scopedLive("runs echo turns through the real event path and leaves no trace (not listed, no file, no metric); removes a dead daemon's dir", () =>
    Effect.gen(function*() {
      // What a daemon SIGKILLed while it warmed up leaves (its pid gone), and a live daemon's.
      const orphan = path.join(os.tmpdir(), `agentd-warm-up-${spawnSync("true").pid}-test`)
      const live = path.join(os.tmpdir(), `agentd-warm-up-${process.ppid}-test`)
      for (const dir of [orphan, live]) fs.mkdirSync(path.join(dir, "events"), { recursive: true })
      yield* Effect.addFinalizer(() => Effect.sync(() => [orphan, live].forEach((dir) => fs.rmSync(dir, { recursive: true, force: true }))))
      yield* withCore((stateDir) =>
        Effect.gen(function*() {
          const manager = yield* SessionManager
          const before = { state: tree(stateDir), temp: warmUpDirs(), metrics: yield* counted }
          const outcome = yield* warmUpDaemon({ turns: 2, words: 2000 })
          // Both turns ended (their `agent_end` logged, the session idle again): each event went
          // through the worker's inbox, the entity, the log and the outbox to the client.
          assert.strictEqual(outcome.turns, 2)
          assert.strictEqual(outcome.events, 2 * 2009)
          // A wire line per event (over 100 bytes each), and the statuses.
          assert.isAbove(outcome.deliveredBytes, 2 * 2009 * 100)
          assert.deepStrictEqual((yield* manager.list).sessions, [])
          assert.deepStrictEqual(tree(stateDir), before.state)
          assert.deepStrictEqual(warmUpDirs(), before.temp)
          // The dead daemon's dir removed at the start, the live one's kept.
          assert.isFalse(fs.existsSync(orphan))
          assert.isTrue(fs.existsSync(live))
          assert.deepStrictEqual(yield* counted, before.metrics)
        })
      )
    }))

  // Last in this file: the module's flag stays set.
  it.live("gives way once a real session's worker sends frames: stops within its turn, cleans up", () =>
    Effect.gen(function*() {
      const before = warmUpDirs()
      // Turns of 20,000 words: one takes seconds on a loaded machine, so the stop falls inside one.
      const fiber = yield* Effect.fork(withCore(() => warmUpDaemon({ turns: 1000, words: 20_000 })))
      for (let i = 0; i < 2000 && warmUpDirs().length === before.length; i++) yield* Effect.sleep("5 millis")
      yield* Effect.sleep("300 millis")
      realFramesArrived("s-00000000-0000-0000-0000-000000000000")
      const outcome = yield* Fiber.join(fiber).pipe(Effect.timeout("20 seconds"))
      assert.isBelow(outcome.turns, 1000)
      assert.isBelow(outcome.events, 1000 * 20_009)
      assert.deepStrictEqual(warmUpDirs(), before)
      // Given way for good: a warm-up started now does nothing.
      assert.deepStrictEqual(yield* withCore(() => warmUpDaemon({ turns: 2, words: 2000 })), { turns: 0, events: 0, deliveredBytes: 0 })
    }))
})
