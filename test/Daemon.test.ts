import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { type DaemonStartError, DaemonLive } from "../src/Daemon.js"

describe("DaemonLive", () => {
  it.scoped("fails to start with a typed DaemonStartError (an unknown engine), touching nothing", () =>
    Effect.gen(function*() {
      const stateDir = path.join(fs.mkdtempSync(path.join(os.tmpdir(), "agentd-daemon-test-")), "state")
      const error: DaemonStartError = yield* Effect.flip(Layer.build(DaemonLive({ stateDir, engine: "no-such-engine" })))
      // The union is exhaustive: a switch on its tags needs no default.
      switch (error._tag) {
        case "EngineError":
          assert.strictEqual(error.reason, "unknown_engine")
          break
        case "FsError":
        case "ServerStartError":
        case "EventLogError":
        case "SessionStoreError":
        case "RecoveryJournalError":
          assert.fail(`unexpected ${error._tag}: ${error.message}`)
      }
      assert.isFalse(fs.existsSync(stateDir), "the state dir was not created")
      fs.rmSync(path.dirname(stateDir), { recursive: true, force: true })
    }))
})
