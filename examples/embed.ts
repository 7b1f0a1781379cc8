/**
 * An Effect app that embeds the daemon instead of running `agentd serve`:
 * - its own engine (`reverse`, embed-engine.ts), run by real, supervised worker processes
 *   started from its own worker entry (embed-worker.ts);
 * - the daemon's layers with one replaced: the recovery journal lives in memory
 *   (`RecoveryJournal.layerMemory`), so no recovery.jsonl is written;
 * - in the same program, the daemon's services in-process (`SessionManager`) and a client of
 *   its socket (`DaemonClient`), which any other process could also connect to.
 * It runs a turn, kills the session's worker with SIGKILL, runs another turn on the restored
 * worker, prints the transcript and stops.
 *
 *   node dist/examples/embed.js [state-dir]
 */
import { DaemonLive, RecoveryJournal, SessionManager } from "agentd"
import { DaemonClient, isDaemonError } from "agentd/client"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Schedule from "effect/Schedule"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { Engines } from "./embed-engine.js"

const stateDir = process.argv[2] ?? fs.mkdtempSync(path.join(os.tmpdir(), "agentd-embed-"))
const socketPath = path.join(stateDir, "agentd.sock")

/** The daemon: its socket server and sessions, with the app's engines and the memory journal. */
const Daemon = DaemonLive(
  {
    stateDir,
    socketPath,
    engine: "reverse",
    // The compiled embed-worker.js next to this file.
    workerEntry: fileURLToPath(new URL("./embed-worker.js", import.meta.url)),
    warmSpare: false
  },
  { engines: Engines, recoveryJournal: RecoveryJournal.layerMemory }
)

/** The daemon, then a client connected to its socket. */
const AppLive = DaemonClient.layer({ socketPath }).pipe(Layer.provideMerge(Daemon))

/** Runs one turn through the socket, printing the reply as it streams. */
const turn = (activeSessionId: string, text: string) =>
  Effect.gen(function*() {
    const client = yield* DaemonClient
    yield* Console.log(`> ${text}`)
    yield* client.promptTurn(activeSessionId, text).pipe(
      Stream.runForEach(({ event }) =>
        event.type === "message_update"
          ? Effect.sync(() => process.stdout.write(event.delta))
          : event.type === "agent_end"
          ? Effect.sync(() => process.stdout.write("\n"))
          : Effect.void
      )
    )
  })

const program = Effect.gen(function*() {
  const client = yield* DaemonClient
  const sessions = yield* SessionManager.SessionManager
  // The session named "embedded": the one of an earlier run on the same state dir, or a new one.
  const activeSessionId = yield* client.resolve("embedded").pipe(
    Effect.catchIf(isDaemonError("session_not_found"), () =>
      Effect.map(client.create({ name: "embedded" }), (created) => created.activeSessionId))
  )
  yield* turn(activeSessionId, "one two three")

  // The daemon supervises the worker: kill it, and the session is restored from its files.
  const before = yield* sessions.getState(activeSessionId)
  yield* Console.log(`worker ${before.workerPid} killed`)
  process.kill(before.workerPid!, "SIGKILL")
  yield* sessions.getState(activeSessionId).pipe(
    Effect.repeat({ schedule: Schedule.spaced("20 millis"), until: (s) => s.workerPid !== before.workerPid || s.worker !== "ready" })
  )
  yield* turn(activeSessionId, "four five six")
  const after = yield* sessions.getState(activeSessionId)
  yield* Console.log(`restarts: ${after.restarts}, worker ${after.worker}`)

  const { messages } = yield* client.getMessages(activeSessionId)
  for (const m of messages) yield* Console.log(`${m.role}: ${m.content}`)
  const journal = fs.existsSync(path.join(stateDir, "recovery.jsonl")) ? "on disk" : "in memory"
  yield* Console.log(`journal: ${journal}`)
})

// Leaving `provide` closes the layers: the client disconnects, the workers stop, the socket goes.
Effect.runPromise(program.pipe(Effect.provide(AppLive))).then(
  () => process.exit(0),
  (error: unknown) => {
    console.error(`embed failed: ${String(error)}`)
    process.exit(1)
  }
)
