import { assert, describe, it } from "@effect/vitest"
import * as ConfigProvider from "effect/ConfigProvider"
import * as Effect from "effect/Effect"
import * as DaemonConfig from "../src/DaemonConfig.js"

const withSettings = (entries: Record<string, string>) =>
  Effect.withConfigProvider(ConfigProvider.fromMap(new Map(Object.entries(entries))))

describe("DaemonConfig", () => {
  it.effect("AGENTD_* settings come from the configuration provider; overrides win; unset ones keep the defaults", () =>
    Effect.gen(function*() {
      const config = yield* DaemonConfig.make({ stateDir: "/tmp/agentd-x", maxRestarts: 9 }, {}).pipe(withSettings({
        AGENTD_MAX_WORKERS: "3",
        AGENTD_MAX_RESTARTS: "0",
        AGENTD_CLIENT_ENV_KEYS: "TERM, LANG ,",
        AGENTD_WARM_SPARE: "0",
        AGENTD_WORKER_NICE: "19",
        AGENTD_SESSIONS_PER_WORKER: "20"
      }))
      assert.strictEqual(config.maxWorkers, 3)
      assert.strictEqual(config.maxRestarts, 9)
      assert.deepStrictEqual(config.clientEnvKeys, ["TERM", "LANG"])
      assert.isFalse(config.warmSpare)
      assert.strictEqual(config.workerNice, 19)
      assert.strictEqual(config.sessionsPerWorker, 20)
      assert.strictEqual(DaemonConfig.defaults().sessionsPerWorker, 1)
      assert.strictEqual(config.retainGenerations, DaemonConfig.defaults().retainGenerations)
      assert.strictEqual(config.socketPath, "/tmp/agentd-x/agentd.sock")
    }))

  it.effect("a setting that is set but invalid fails with a ConfigError naming it", () =>
    Effect.gen(function*() {
      for (const [name, value] of [["AGENTD_MAX_WORKERS", "abc"], ["AGENTD_OUTBOX_BYTES", "0"], ["AGENTD_MAX_RESTARTS", "-1"], ["AGENTD_WORKER_NICE", "20"], ["AGENTD_WORKER_NICE", "-1"], ["AGENTD_SESSIONS_PER_WORKER", "0"], ["AGENTD_SESSIONS_PER_WORKER", "1.5"]]) {
        const error = yield* Effect.flip(DaemonConfig.make({ stateDir: "/tmp/agentd-x" }, {}).pipe(withSettings({ [name!]: value! })))
        assert.include(String(error), name!)
        // What `agentd serve` prints: the name, then why (a lone error's message leaves it out).
        assert.isTrue(DaemonConfig.describeConfigError(error).startsWith(`${name}: `), DaemonConfig.describeConfigError(error))
      }
      const both = yield* Effect.flip(
        DaemonConfig.make({ stateDir: "/tmp/agentd-x" }, {}).pipe(withSettings({ AGENTD_MAX_WORKERS: "abc", AGENTD_RETAIN_GENERATIONS: "0" }))
      )
      assert.strictEqual(
        DaemonConfig.describeConfigError(both),
        `AGENTD_MAX_WORKERS: Expected an integer value but received "abc"; AGENTD_RETAIN_GENERATIONS: must be an integer >= 1`
      )
    }))

  it.effect("the shutdown grace period: 3000 ms by default, AGENTD_SHUTDOWN_GRACE_MS (0 allowed), an override wins, a negative one is refused", () =>
    Effect.gen(function*() {
      assert.strictEqual((yield* DaemonConfig.make({ stateDir: "/tmp/agentd-x" }, {}).pipe(withSettings({}))).shutdownGraceMs, 3000)
      const zero = yield* DaemonConfig.make({ stateDir: "/tmp/agentd-x" }, {}).pipe(withSettings({ AGENTD_SHUTDOWN_GRACE_MS: "0" }))
      assert.strictEqual(zero.shutdownGraceMs, 0)
      const flag = yield* DaemonConfig.make({ stateDir: "/tmp/agentd-x", shutdownGraceMs: 250 }, {}).pipe(
        withSettings({ AGENTD_SHUTDOWN_GRACE_MS: "9000" })
      )
      assert.strictEqual(flag.shutdownGraceMs, 250)
      const error = yield* Effect.flip(DaemonConfig.make({ stateDir: "/tmp/agentd-x" }, {}).pipe(withSettings({ AGENTD_SHUTDOWN_GRACE_MS: "-5" })))
      assert.isTrue(DaemonConfig.describeConfigError(error).startsWith("AGENTD_SHUTDOWN_GRACE_MS: "), DaemonConfig.describeConfigError(error))
    }))
})
