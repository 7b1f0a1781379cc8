/**
 * The client (`agentd/client`) against fake daemons on temp sockets: the hello check, the
 * unreachable and disconnected paths, response decoding, and the package's entry points
 * (exports map, `npm pack` contents, the client's import graph). The client against the real
 * daemon is test/e2e/client.test.ts.
 *
 * The entry-point tests read dist/: run `npm run build` first.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Stream from "effect/Stream"
import { execFileSync, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import * as Client from "../src/client.js"
import { DaemonClient } from "../src/client.js"

const PROJECT_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..")
const DIST = path.join(PROJECT_ROOT, "dist", "src")

const tempDir = Effect.acquireRelease(
  Effect.sync(() => fs.mkdtempSync(path.join(os.tmpdir(), "agentd-client-"))),
  (dir) => Effect.sync(() => fs.rmSync(dir, { recursive: true, force: true }))
)

const HELLO = {
  type: "daemon_hello",
  protocol: { name: "agentd", version: 1 },
  clientId: "c-fake",
  supervisorGeneration: 1,
  supervisorPid: 4242,
  appVersion: "0.0.0",
  serverCapabilities: ["attach_snapshot", "event_sequence", "some_future_capability"]
}

const line = (value: unknown) => JSON.stringify(value) + "\n"

/**
 * A fake daemon on a temp socket: `onConnection` gets each accepted socket and the JSON lines
 * it receives. Closed with the scope.
 */
const fakeDaemon = (onConnection: (socket: net.Socket, lines: AsyncIterable<Record<string, unknown>>) => void) =>
  Effect.gen(function*() {
    const dir = yield* tempDir
    const socketPath = path.join(dir, "fake.sock")
    const sockets = new Set<net.Socket>()
    const server = net.createServer((socket) => {
      sockets.add(socket)
      socket.on("close", () => sockets.delete(socket))
      socket.on("error", () => {})
      onConnection(socket, readLines(socket))
    })
    yield* Effect.acquireRelease(
      Effect.async<void>((resume) => {
        server.listen(socketPath, () => resume(Effect.void))
      }),
      () =>
        Effect.async<void>((resume) => {
          for (const s of sockets) s.destroy()
          server.close(() => resume(Effect.void))
        })
    )
    return socketPath
  })

async function* readLines(socket: net.Socket): AsyncIterable<Record<string, unknown>> {
  let buffer = ""
  for await (const chunk of socket) {
    buffer += String(chunk)
    let nl: number
    while ((nl = buffer.indexOf("\n")) >= 0) {
      const text = buffer.slice(0, nl)
      buffer = buffer.slice(nl + 1)
      if (text.trim() !== "") yield JSON.parse(text) as Record<string, unknown>
    }
  }
}

/** A fake daemon that greets, then answers each command with `answer(command envelope)`. */
const answeringDaemon = (answer: (envelope: Record<string, unknown>, socket: net.Socket) => void) =>
  fakeDaemon((socket, lines) => {
    socket.write(line(HELLO))
    void (async () => {
      try {
        for await (const envelope of lines) answer(envelope, socket)
      } catch {
        // the client went away
      }
    })()
  })

/** A fake's answer to `attach` of session `s-1` from its event 4 (nothing replayed). */
const ATTACHED_AT_4 = {
  protocol: { name: "agentd", version: 1 },
  activeSessionId: "s-1",
  snapshot: { snapshotId: "s-1~g1", messageCount: 0, messages: [] },
  replay: { status: "complete", eventCount: 0 },
  lastEventSequence: 4,
  client: { id: "c-fake", capabilities: ["event_sequence", "slim_attach"] }
}

const failureOf = <A, E>(exit: Exit.Exit<A, E>): E => {
  if (Exit.isSuccess(exit)) assert.fail(`expected a failure, got ${JSON.stringify(exit.value)}`)
  const failure = exit.cause._tag === "Fail" ? exit.cause.error : undefined
  if (failure === undefined) assert.fail(`expected a typed failure, got ${String(exit.cause)}`)
  return failure
}

describe("DaemonClient: connecting", () => {
  it.scopedLive("a hello with another protocol version is a ProtocolMismatch naming both", () =>
    Effect.gen(function*() {
      const socketPath = yield* fakeDaemon((socket) => {
        socket.write(line({ ...HELLO, protocol: { name: "agentd", version: 2 } }))
      })
      const error = failureOf(yield* Effect.exit(Effect.scoped(DaemonClient.make({ socketPath }))))
      assert.strictEqual(error._tag, "ProtocolMismatch")
      if (error._tag !== "ProtocolMismatch") return
      assert.deepStrictEqual(error.received, { name: "agentd", version: 2 })
      assert.deepStrictEqual(error.expected, { name: "agentd", version: 1 })
      assert.include(error.message, `"version":2`)
      assert.include(error.message, socketPath)
    }))

  it.scopedLive("a hello naming another protocol, and a first message that is no hello, are ProtocolMismatch", () =>
    Effect.gen(function*() {
      const other = yield* fakeDaemon((socket) => {
        socket.write(line({ ...HELLO, protocol: { name: "prime", version: 7 } }))
      })
      const notHello = yield* fakeDaemon((socket) => {
        socket.write(line({ type: "response", id: null, command: "parse", success: true, data: {} }))
      })
      const notJson = yield* fakeDaemon((socket) => {
        socket.write("HTTP/1.1 400 Bad Request\r\n\r\n")
      })
      const e1 = failureOf(yield* Effect.exit(Effect.scoped(DaemonClient.make({ socketPath: other }))))
      assert.strictEqual(e1._tag, "ProtocolMismatch")
      assert.include(e1.message, `"prime"`)
      const e2 = failureOf(yield* Effect.exit(Effect.scoped(DaemonClient.make({ socketPath: notHello }))))
      assert.strictEqual(e2._tag, "ProtocolMismatch")
      assert.include(e2.message, "did not greet with daemon_hello")
      const e3 = failureOf(yield* Effect.exit(Effect.scoped(DaemonClient.make({ socketPath: notJson }))))
      assert.strictEqual(e3._tag, "ProtocolMismatch")
      assert.include(e3.message, "not JSON")
    }))

  it.scopedLive("the Promise facade rejects with the typed error itself", () =>
    Effect.gen(function*() {
      const socketPath = yield* fakeDaemon((socket) => {
        socket.write(line({ ...HELLO, protocol: { name: "agentd", version: 2 } }))
      })
      const error = yield* Effect.promise(() => Client.connect({ socketPath }).then(() => undefined, (e: unknown) => e))
      assert.instanceOf(error, Client.ProtocolMismatch)
      assert.instanceOf(error, Error)
    }))

  it.scopedLive("nothing listening is DaemonUnreachable: no file, a stale socket file, a peer that hangs up or stays silent", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const missing = path.join(dir, "missing.sock")
      const e1 = failureOf(yield* Effect.exit(Effect.scoped(DaemonClient.make({ socketPath: missing }))))
      assert.strictEqual(e1._tag, "DaemonUnreachable")
      assert.include(e1.message, "ENOENT")

      // What a SIGKILLed daemon leaves: a socket file nobody listens on.
      const stale = path.join(dir, "stale.sock")
      const made = spawnSync(process.execPath, [
        "-e",
        `require("net").createServer().listen(${JSON.stringify(stale)}, () => process.exit(0))`
      ])
      assert.strictEqual(made.status, 0)
      const e2 = failureOf(yield* Effect.exit(Effect.scoped(DaemonClient.make({ socketPath: stale }))))
      assert.strictEqual(e2._tag, "DaemonUnreachable")
      assert.include(e2.message, "ECONNREFUSED")

      const hangsUp = yield* fakeDaemon((socket) => socket.end())
      const e3 = failureOf(yield* Effect.exit(Effect.scoped(DaemonClient.make({ socketPath: hangsUp }))))
      assert.strictEqual(e3._tag, "DaemonUnreachable")
      assert.include(e3.message, "before the daemon's hello")

      const silent = yield* fakeDaemon(() => {})
      const e4 = failureOf(
        yield* Effect.exit(Effect.scoped(DaemonClient.make({ socketPath: silent, helloTimeout: "200 millis" })))
      )
      assert.strictEqual(e4._tag, "DaemonUnreachable")
      assert.include(e4.message, "no daemon_hello")

      const viaPromise = yield* Effect.promise(() => Client.connect({ socketPath: missing }).then(() => undefined, (e: unknown) => e))
      assert.instanceOf(viaPromise, Client.DaemonUnreachable)
    }))

  it.scopedLive("DaemonClient.layer provides the service; capabilities unknown to the client are no mismatch", () =>
    Effect.gen(function*() {
      const socketPath = yield* answeringDaemon((envelope, socket) => {
        socket.write(line({ type: "response", id: envelope["id"], command: "ping", success: true, data: { pong: true } }))
      })
      const program = Effect.gen(function*() {
        const client = yield* DaemonClient
        return { hello: client.hello, pong: yield* client.ping() }
      })
      const { hello, pong } = yield* Effect.provide(program, DaemonClient.layer({ socketPath }))
      assert.strictEqual(hello.clientId, "c-fake")
      assert.deepStrictEqual(hello.serverCapabilities, ["attach_snapshot", "event_sequence"])
      assert.deepStrictEqual(pong, { pong: true })
    }))
})

describe("DaemonClient: responses and messages", () => {
  it.scopedLive("sends envelopes of this protocol; decodes data, error responses and malformed ones", () =>
    Effect.gen(function*() {
      const received: Array<Record<string, unknown>> = []
      const socketPath = yield* answeringDaemon((envelope, socket) => {
        received.push(envelope)
        const id = envelope["id"]
        const command = envelope["command"] as { type: string }
        switch (command.type) {
          case "ping":
            return socket.write(line({ type: "response", id, command: "ping", success: true, data: { pong: true, extra: 1 } }))
          case "get_state":
            return socket.write(line({
              type: "response",
              id,
              command: "get_state",
              success: false,
              error: { code: "session_not_found", message: "No session `s-x`.", details: { activeSessionId: "s-x" } }
            }))
          case "list":
            // `sessions` must be an array.
            return socket.write(line({ type: "response", id, command: "list", success: true, data: { sessions: 3 } }))
          case "status":
            return socket.write(line({ type: "response", id, command: "status", success: false, error: { code: "brand_new_code" } }))
        }
      })
      const client = yield* DaemonClient.make({ socketPath })
      assert.deepStrictEqual(yield* client.ping(), { pong: true })
      assert.deepStrictEqual(received[0], {
        type: "command",
        id: received[0]!["id"],
        protocol: { name: "agentd", version: 1 },
        clientId: "c-fake",
        command: { type: "ping" }
      })

      const notFound = yield* Effect.flip(client.getState("s-x"))
      assert.strictEqual(notFound._tag, "DaemonError")
      if (notFound._tag === "DaemonError") {
        assert.strictEqual(notFound.code, "session_not_found")
        assert.strictEqual(notFound.command, "get_state")
        assert.strictEqual(notFound.message, "No session `s-x`.")
        assert.deepStrictEqual(notFound.details, { activeSessionId: "s-x" })
        assert.isTrue(Client.isDaemonError("session_not_found", "session_busy")(notFound))
        assert.isFalse(Client.isDaemonError("session_busy")(notFound))
      }
      // What a caller writes: catch one code, let the others through.
      const recovered = yield* client.getState("s-x").pipe(
        Effect.map((s) => s.activeSessionId),
        Effect.catchIf(Client.isDaemonError("session_not_found"), () => Effect.succeed("gone"))
      )
      assert.strictEqual(recovered, "gone")

      const badData = yield* Effect.flip(client.list())
      assert.strictEqual(badData._tag, "InvalidResponse")
      assert.include(badData.message, "sessions")
      const badError = yield* Effect.flip(client.status())
      assert.strictEqual(badError._tag, "InvalidResponse")
      // The connection stays usable.
      assert.deepStrictEqual(yield* client.ping(), { pong: true })
    }))

  it.scopedLive("server messages come decoded, in order, to every subscriber; unreadable lines are skipped", () =>
    Effect.gen(function*() {
      const event = (sequence: number, ev: unknown) =>
        line({
          type: "session_event",
          activeSessionId: "s-1",
          event: ev,
          meta: { cursor: { generation: 1, sequence }, emittedAt: 1 }
        })
      const socketPath = yield* answeringDaemon((envelope, socket) => {
        const id = envelope["id"]
        socket.write(line({ type: "response", id, command: "ping", success: true, data: { pong: true } }))
        socket.write(event(0, { type: "agent_start" }))
        socket.write(line({ type: "no_such_message" }))
        socket.write(event(1, { type: "message_update", messageId: "m", delta: "hi" }))
        socket.write(line({ type: "daemon_closing", reason: "shutdown" }))
      })
      const client = yield* DaemonClient.make({ socketPath })
      const a = yield* client.subscribe
      const b = yield* client.subscribe
      yield* client.ping()
      const fromA = yield* Stream.runCollect(Stream.take(a, 3))
      const fromB = yield* Stream.runCollect(Stream.take(b, 3))
      assert.deepStrictEqual([...fromA].map((m) => m.type), ["session_event", "session_event", "daemon_closing"])
      assert.deepStrictEqual([...fromA], [...fromB])
      const second = [...fromA][1]!
      assert.deepStrictEqual(second, {
        type: "session_event",
        activeSessionId: "s-1",
        event: { type: "message_update", messageId: "m", delta: "hi" },
        meta: { cursor: { generation: 1, sequence: 1 }, emittedAt: 1 }
      })
    }))

  it.scopedLive("promptTurn: a resync snapshot that swallowed the turn's end ends the turn once the session is idle (never waits forever)", () =>
    Effect.gen(function*() {
      const summary = (busy: boolean, sequence: number) => ({
        activeSessionId: "s-1",
        engine: "echo",
        createdAt: "2026-01-01T00:00:00.000Z",
        messageCount: 2,
        busy,
        worker: "ready",
        restarts: 0,
        telemetry: false,
        lastEventCursor: { generation: 1, sequence }
      })
      const push = (sequence: number, ev: unknown) =>
        line({ type: "session_event", activeSessionId: "s-1", event: ev, meta: { cursor: { generation: 1, sequence }, emittedAt: 1 } })
      let states = 0
      const socketPath = yield* answeringDaemon((envelope, socket) => {
        const id = envelope["id"]
        const type = (envelope["command"] as { type: string }).type
        const ok = (data: unknown) => socket.write(line({ type: "response", id, command: type, success: true, data }))
        if (type === "get_state") return ok(summary(false, states++ === 0 ? 4 : 12))
        if (type === "attach") return ok(ATTACHED_AT_4)
        ok({ accepted: true })
        // The turn starts; then the connection falls behind and its events are pruned: a resync.
        const promptId = (envelope["command"] as { promptId: string }).promptId
        socket.write(line({ type: "session_status", activeSessionId: "s-1", state: summary(true, 5), promptId, meta: { cursor: { generation: 1, sequence: 5 }, emittedAt: 1 } }))
        socket.write(push(6, { type: "agent_start" }))
        socket.write(push(7, { type: "turn_start" }))
        const frame = { activeSessionId: "s-1", snapshotId: "s-1~g2" }
        socket.write(line({ type: "session_snapshot_begin", ...frame, messageCount: 4, targetChunkBytes: 524288, purpose: "resync", cursor: { generation: 1, sequence: 12 } }))
        socket.write(line({ type: "session_snapshot_chunk", ...frame, index: 0, messages: [] }))
        socket.write(line({ type: "session_snapshot_end", ...frame, chunkCount: 1, lastEventSequence: 12, lastEventCursor: { generation: 1, sequence: 12 } }))
      })
      const client = yield* DaemonClient.make({ socketPath })
      const turn = yield* Stream.runCollect(client.promptTurn("s-1", "hello")).pipe(Effect.timeout("5 seconds"))
      assert.deepStrictEqual([...turn].map((m) => m.event.type), ["agent_start", "turn_start"])
      assert.strictEqual(states, 2, "the state was asked again after the resync")
    }))

  it.scopedLive("promptTurn follows its own prompt's turn: not a restore's cut turn still ending, nor another client's turn", () =>
    Effect.gen(function*() {
      const summary = (busy: boolean, sequence: number, worker = "ready") => ({
        activeSessionId: "s-1",
        engine: "echo",
        createdAt: "2026-01-01T00:00:00.000Z",
        messageCount: 2,
        busy,
        worker,
        restarts: 0,
        telemetry: false,
        lastEventCursor: { generation: 1, sequence }
      })
      const meta = (sequence: number) => ({ cursor: { generation: 1, sequence }, emittedAt: 1 })
      const push = (sequence: number, ev: unknown) => line({ type: "session_event", activeSessionId: "s-1", event: ev, meta: meta(sequence) })
      const status = (sequence: number, busy: boolean, promptId?: string) =>
        line({ type: "session_status", activeSessionId: "s-1", state: summary(busy, sequence), ...(promptId === undefined ? {} : { promptId }), meta: meta(sequence) })
      const prompts: Array<Record<string, unknown>> = []
      const socketPath = yield* answeringDaemon((envelope, socket) => {
        const id = envelope["id"]
        const command = envelope["command"] as { type: string; promptId?: string }
        const ok = (data: unknown) => socket.write(line({ type: "response", id, command: command.type, success: true, data }))
        // A session loaded at the daemon's start with a cut turn: idle until its restore is stepped.
        if (command.type === "get_state") return ok(summary(false, 4, "passivated"))
        if (command.type === "attach") return ok(ATTACHED_AT_4)
        prompts.push(command)
        // The restore ends the cut turn, then another client's tagged turn runs whole, then this prompt's.
        socket.write(status(5, true))
        socket.write(push(6, { type: "turn_interrupted", reason: "daemon_restarted" }))
        socket.write(status(7, false))
        socket.write(status(8, true, "someone-else"))
        socket.write(push(9, { type: "agent_start" }))
        socket.write(push(10, { type: "message_update", messageId: "m-other", delta: "not mine" }))
        socket.write(push(11, { type: "agent_end" }))
        socket.write(status(12, false))
        ok({ accepted: true })
        socket.write(status(13, true, command.promptId))
        socket.write(push(14, { type: "agent_start" }))
        socket.write(push(15, { type: "message_update", messageId: "m-mine", delta: "mine" }))
        socket.write(push(15, { type: "message_update", messageId: "m-mine", delta: "mine" })) // sent again: dropped
        socket.write(push(16, { type: "agent_end" }))
      })
      const client = yield* DaemonClient.make({ socketPath })
      const turn = yield* Stream.runCollect(client.promptTurn("s-1", "hello")).pipe(Effect.timeout("5 seconds"))
      assert.deepStrictEqual([...turn].map((m) => m.meta.cursor.sequence), [14, 15, 16])
      assert.strictEqual(prompts.length, 1)
      assert.match(String(prompts[0]!["promptId"]), /^[0-9a-f-]{36}$/, "each prompt goes with a UUID of its own")
      // A second promptTurn tags its prompt with another id.
      yield* Stream.runDrain(client.promptTurn("s-1", "again")).pipe(Effect.timeout("5 seconds"))
      assert.notStrictEqual(prompts[1]!["promptId"], prompts[0]!["promptId"])
    }))

  it.scopedLive("a daemon that goes away fails what waits with DaemonDisconnected; later commands fail at once", () =>
    Effect.gen(function*() {
      let peer: net.Socket | undefined
      const socketPath = yield* answeringDaemon((_envelope, socket) => {
        peer = socket
      })
      const client = yield* DaemonClient.make({ socketPath })
      const messages = yield* client.subscribe
      const streaming = yield* Effect.fork(Stream.runDrain(messages))
      const waiting = yield* Effect.fork(client.ping())
      while (peer === undefined) yield* Effect.sleep("5 millis")
      peer.destroy()
      const e1 = failureOf(yield* Fiber.await(waiting))
      assert.strictEqual(e1._tag, "DaemonDisconnected")
      assert.include(e1.message, "closed the connection")
      const e2 = failureOf(yield* Fiber.await(streaming))
      assert.strictEqual(e2._tag, "DaemonDisconnected")
      const e3 = yield* Effect.flip(client.list())
      assert.strictEqual(e3._tag, "DaemonDisconnected")
      // A subscription made after the end fails at once instead of waiting forever.
      const late = yield* Effect.either(Stream.runDrain(client.messages))
      assert.isTrue(Either.isLeft(late))
    }))

  it.live("closing the Promise client fails a pending command and ends its subscriptions", () =>
    Effect.gen(function*() {
      const result = yield* Effect.scoped(Effect.gen(function*() {
        const socketPath = yield* answeringDaemon(() => {})
        return yield* Effect.promise(async () => {
          const client = await Client.connect({ socketPath })
          const pending = client.ping().then(() => undefined, (e: unknown) => e)
          const iterating = (async () => {
            // A turn that never starts: the fake daemon never answers.
            for await (const _ of client.session("s-1").prompt("hi")) {
              // nothing
            }
          })().then(() => undefined, (e: unknown) => e)
          await new Promise((resolve) => setTimeout(resolve, 50))
          await client.close()
          await client.close() // twice is harmless
          return { pending: await pending, iterating: await iterating }
        })
      }))
      assert.instanceOf(result.pending, Client.DaemonDisconnected)
      assert.include((result.pending as Error).message, "client was closed")
      assert.instanceOf(result.iterating, Client.DaemonDisconnected)
    }))
})

// ---------------------------------------------------------------------------------------------
// The package's entry points (built files)
// ---------------------------------------------------------------------------------------------

const needDist = () => {
  if (!fs.existsSync(path.join(DIST, "client.js")) || !fs.existsSync(path.join(DIST, "index.js"))) {
    assert.fail(`${DIST}/{index,client}.js missing: run \`npm run build\` first`)
  }
}

describe("package entry points", () => {
  it("`agentd` and `agentd/client` resolve through the exports map from an installed package; internals do not", () => {
    needDist()
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-consumer-"))
    try {
      fs.mkdirSync(path.join(dir, "node_modules"))
      fs.symlinkSync(PROJECT_ROOT, path.join(dir, "node_modules", "agentd"))
      fs.writeFileSync(path.join(dir, "package.json"), JSON.stringify({ name: "consumer", type: "module" }))
      fs.writeFileSync(
        path.join(dir, "main.mjs"),
        `
const client = await import("agentd/client")
const lib = await import("agentd")
const report = {
  clientUrl: import.meta.resolve("agentd/client"),
  libUrl: import.meta.resolve("agentd"),
  client: Object.keys(client).sort(),
  lib: Object.keys(lib).sort(),
  tag: client.DaemonClient.key,
  hasLayer: typeof client.DaemonClient.layer === "function",
  sessionManagerTag: lib.SessionManager.SessionManager.key,
  daemonLive: typeof lib.DaemonLive,
  pkg: (await import("agentd/package.json", { with: { type: "json" } })).default.name
}
for (const deep of ["agentd/dist/src/internal/fileIo.js", "agentd/src/SessionManager.ts", "agentd/dist/src/Daemon.js"]) {
  try { await import(deep); report[deep] = "resolved" } catch (e) { report[deep] = e.code }
}
console.log(JSON.stringify(report))
`
      )
      const out = execFileSync(process.execPath, ["main.mjs"], { cwd: dir, encoding: "utf8", timeout: 30_000 })
      const report = JSON.parse(out.trim().split("\n").pop()!) as Record<string, unknown>
      // Node resolves the symlinked package to its real path.
      assert.strictEqual(report["clientUrl"], `file://${path.join(fs.realpathSync(PROJECT_ROOT), "dist", "src", "client.js")}`)
      assert.strictEqual(report["libUrl"], `file://${path.join(fs.realpathSync(PROJECT_ROOT), "dist", "src", "index.js")}`)
      for (
        const name of [
          "connect",
          "DaemonClient",
          "DaemonError",
          "DaemonUnreachable",
          "DaemonDisconnected",
          "ProtocolMismatch",
          "PromptTooLarge",
          "TurnInterrupted",
          "Protocol",
          "Cursor"
        ]
      ) assert.include(report["client"] as Array<string>, name)
      for (
        const name of [
          "Daemon",
          "DaemonLive",
          "DaemonConfig",
          "SessionManager",
          "EventLog",
          "SessionStore",
          "RecoveryJournal",
          "SnapshotCache",
          "WorkerPool",
          "Engine",
          "Protocol",
          "Cursor"
        ]
      ) assert.include(report["lib"] as Array<string>, name)
      assert.strictEqual(report["tag"], "agentd/DaemonClient")
      assert.strictEqual(report["hasLayer"], true)
      assert.strictEqual(report["sessionManagerTag"], "agentd/SessionManager")
      assert.strictEqual(report["daemonLive"], "function")
      assert.strictEqual(report["pkg"], "agentd")
      assert.strictEqual(report["agentd/dist/src/internal/fileIo.js"], "ERR_PACKAGE_PATH_NOT_EXPORTED")
      assert.strictEqual(report["agentd/src/SessionManager.ts"], "ERR_PACKAGE_PATH_NOT_EXPORTED")
      assert.strictEqual(report["agentd/dist/src/Daemon.js"], "ERR_PACKAGE_PATH_NOT_EXPORTED")
    } finally {
      fs.rmSync(dir, { recursive: true, force: true })
    }
  }, 30_000)

  it("the exports map names built files, types included", () => {
    needDist()
    const pkg = JSON.parse(fs.readFileSync(path.join(PROJECT_ROOT, "package.json"), "utf8")) as {
      main: string
      types: string
      exports: Record<string, string | { types: string; default: string }>
    }
    assert.deepStrictEqual(Object.keys(pkg.exports), [".", "./client", "./worker", "./package.json"])
    const files = [pkg.main, pkg.types]
    for (const target of Object.values(pkg.exports)) {
      if (typeof target === "string") files.push(target)
      else files.push(target.types, target.default)
    }
    for (const file of files) assert.isTrue(fs.existsSync(path.join(PROJECT_ROOT, file)), `${file} does not exist`)
  })

  it("the client entry loads no daemon module (its import graph is the protocol's modules)", () => {
    needDist()
    const seen = new Set<string>()
    const visit = (file: string) => {
      if (seen.has(file)) return
      seen.add(file)
      const text = fs.readFileSync(file, "utf8")
      for (const match of text.matchAll(/(?:from|import)\s*\(?\s*"(\.{1,2}\/[^"]+)"/g)) {
        visit(path.resolve(path.dirname(file), match[1]!))
      }
    }
    visit(path.join(DIST, "client.js"))
    const modules = [...seen].map((f) => path.relative(DIST, f)).sort()
    assert.deepStrictEqual(modules, [
      "Cursor.js",
      "DaemonClient.js",
      "JsonLines.js",
      "Protocol.js",
      "SessionClient.js",
      // The session fold, shared with the web page (no Node, no Effect).
      "SessionFold.js",
      "SessionTarget.js",
      "StatePaths.js",
      "client.js",
      // The named synchronous fs calls (the cursor file, the token file).
      "internal/fileIoSync.js",
      // The transport over a URL and the pure helpers it shares with the HTTP front (no Effect).
      "internal/http/listen.js",
      "internal/http/security.js",
      "internal/http/token.js",
      "internal/remote.js"
    ])
  })

  it("npm pack ships dist/src (with types) and neither tests nor benchmarks", () => {
    const out = execFileSync("npm", ["pack", "--dry-run", "--ignore-scripts", "--json", "--offline", "--loglevel=error"], {
      cwd: PROJECT_ROOT,
      encoding: "utf8",
      timeout: 30_000
    })
    const files = (JSON.parse(out) as Array<{ files: Array<{ path: string }> }>)[0]!.files.map((f) => f.path)
    for (const file of ["dist/src/index.js", "dist/src/index.d.ts", "dist/src/client.js", "dist/src/client.d.ts", "dist/src/bin/agentd.js", "dist/src/bin/worker.js", "package.json"]) {
      assert.include(files, file)
    }
    assert.deepStrictEqual(files.filter((f) => f.startsWith("dist/test") || f.startsWith("dist/bench") || f.startsWith("src/") || f.startsWith("test/")), [])
  }, 30_000)
})
