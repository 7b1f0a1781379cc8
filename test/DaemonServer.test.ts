/**
 * The socket and HTTP servers' promise of one answer per command, on a real socket, when a command's
 * effect is interrupted by someone else than the connection: what a cluster runner sees when the
 * owner it forwarded a command to loses the session's shard mid-command (the reply is an
 * interruption). The session side is a stand-in (the server is what is under test); the cluster
 * case itself runs in chaos `--cluster`.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Context from "effect/Context"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as FiberRef from "effect/FiberRef"
import * as Layer from "effect/Layer"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import * as DaemonConfig from "../src/DaemonConfig.js"
import * as DaemonServer from "../src/DaemonServer.js"
import * as EventLog from "../src/EventLog.js"
import * as HttpServer from "../src/HttpServer.js"
import * as SnapshotCache from "../src/SnapshotCache.js"
import { readOrCreateToken } from "../src/internal/http/token.js"
import { CommandError, CommandTakesEffect, SessionManager, SupervisorInfo } from "../src/SessionManager.js"

const summary = (id: string) => ({
  activeSessionId: id,
  engine: "echo",
  createdAt: new Date(0).toISOString(),
  messageCount: 0,
  busy: false,
  worker: "ready",
  restarts: 0,
  telemetry: false
})

/** What the stand-in's `slow-*` sessions did, in order; their writes wait for `slowWrites`. */
const slowLog: Array<string> = []
const slowWrites = Effect.unsafeMakeLatch(true)

/**
 * Sessions whose id says what their commands do: `interrupted-*` are interrupted from inside
 * (after taking effect, for the commands that may wait), `died-*` die, `slow-*` take effect at
 * once and settle (their writes done) once `slowWrites` opens, others answer.
 */
const standIn = Effect.gen(function*() {
  const outcome = <A>(id: string, ok: A, what: string) =>
    Effect.gen(function*() {
      // A command that may wait has taken effect before it is interrupted: the connection
      // goes on with its next commands meanwhile.
      const progress = yield* FiberRef.get(CommandTakesEffect)
      if (progress !== undefined) yield* Deferred.succeed(progress.taken, undefined)
      slowLog.push(`${what} ${id}`)
      if (id.startsWith("slow-") && progress !== undefined) {
        yield* slowWrites.await
        slowLog.push(`${what} ${id} settled`)
        yield* Deferred.succeed(progress.settled, undefined)
      }
      if (id.startsWith("interrupted-")) return yield* Effect.interrupt
      if (id.startsWith("died-")) return yield* Effect.die(new Error("boom"))
      if (id.startsWith("missing-")) return yield* Effect.fail(new CommandError({ code: "session_not_found", message: `No session \`${id}\`.` }))
      return ok
    })
  return SessionManager.of({
    getState: (id: string) => outcome(id, summary(id), "get_state"),
    prompt: (cmd: { activeSessionId: string }) => outcome(cmd.activeSessionId, { accepted: true as const }, "prompt"),
    abort: (cmd: { activeSessionId: string }) => outcome(cmd.activeSessionId, { aborted: false }, "abort"),
    list: Effect.succeed({ sessions: [] }),
    attachedCount: () => 0,
    detachAll: () => Effect.void,
    settleForShutdown: Effect.void
  } as any)
})

const withServer = Effect.gen(function*() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-server-test-"))
  yield* Effect.addFinalizer(() => Effect.sync(() => fs.rmSync(dir, { recursive: true, force: true })))
  const socketPath = path.join(dir, "agentd.sock")
  const layer = DaemonServer.layer.pipe(
    Layer.provide(Layer.effect(SessionManager, standIn)),
    Layer.provide(DaemonConfig.layer({ ...DaemonConfig.defaults(dir), socketPath })),
    Layer.provide(Layer.succeed(SupervisorInfo, { generation: 1, startedAt: Date.now(), journalPath: "", storeRoot: "", eventLogRoot: "" }))
  )
  yield* Layer.build(layer)
  return socketPath
})

const withHttp = Effect.gen(function*() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-http-test-"))
  yield* Effect.addFinalizer(() => Effect.sync(() => fs.rmSync(dir, { recursive: true, force: true })))
  const layer = HttpServer.layer.pipe(
    Layer.provide(Layer.effect(SessionManager, standIn)),
    Layer.provide(DaemonConfig.layer({ ...DaemonConfig.defaults(dir), http: "127.0.0.1:0" })),
    Layer.provide(EventLog.layerMemory),
    Layer.provide(SnapshotCache.layerMemory),
    Layer.provide(Layer.succeed(SupervisorInfo, { generation: 1, startedAt: Date.now(), journalPath: "", storeRoot: "", eventLogRoot: "" }))
  )
  const front = yield* Layer.build(layer).pipe(Effect.map((ctx) => Context.get(ctx, HttpServer.HttpFront)))
  return { url: front.url, token: readOrCreateToken(dir) }
})

/** Sends every line at once and collects the responses until `count` arrived (or 10 s). */
const exchange = (socketPath: string, lines: ReadonlyArray<object>, count: number) =>
  Effect.async<{ responses: Array<any>; open: boolean }>((resume) => {
    const socket = net.connect(socketPath)
    const responses: Array<any> = []
    let buffer = ""
    let open = true
    const done = () => {
      clearTimeout(timer)
      resume(Effect.succeed({ responses, open }))
      socket.destroy()
    }
    const timer = setTimeout(done, 10_000)
    socket.on("close", () => {
      open = false
      done()
    })
    socket.on("data", (chunk) => {
      buffer += chunk.toString("utf8")
      let nl: number
      while ((nl = buffer.indexOf("\n")) >= 0) {
        const message = JSON.parse(buffer.slice(0, nl))
        buffer = buffer.slice(nl + 1)
        if (message.type === "response") responses.push(message)
        if (responses.length === count) return done()
      }
    })
    socket.write(lines.map((l) => JSON.stringify(l) + "\n").join(""))
    return Effect.sync(() => {
      clearTimeout(timer)
      socket.destroy()
    })
  })

describe("DaemonServer", () => {
  it.scopedLive("answers a command whose effect is interrupted from inside, and the connection goes on", () =>
    Effect.gen(function*() {
      const socketPath = yield* withServer
      // get_state is answered inline, prompt and abort in fibers of their own: each kind once.
      const lines = [
        { type: "get_state", id: "1", activeSessionId: "interrupted-a" },
        { type: "get_state", id: "2", activeSessionId: "ok-a" },
        { type: "prompt", id: "3", activeSessionId: "interrupted-b", message: "hi" },
        { type: "prompt", id: "4", activeSessionId: "ok-b", message: "hi" },
        { type: "abort", id: "5", activeSessionId: "died-c" },
        { type: "get_state", id: "6", activeSessionId: "missing-d" },
        { type: "ping", id: "7" }
      ]
      // And alone: a prompt interrupted, answered in its own fiber, with a ping behind it.
      const [{ responses, open }, alone] = yield* Effect.all([
        exchange(socketPath, lines, lines.length),
        exchange(socketPath, [{ type: "prompt", id: "p", activeSessionId: "interrupted-e", message: "hi" }, { type: "ping", id: "q" }], 2)
      ], { concurrency: 2 })
      assert.deepStrictEqual(alone.responses.map((r) => [r.id, r.success]), [["p", false], ["q", true]])
      assert.isTrue(open, "the connection stays open")
      assert.deepStrictEqual(responses.map((r) => r.id), ["1", "2", "3", "4", "5", "6", "7"], "one answer each, in order")
      const byId = new Map(responses.map((r) => [r.id, r]))
      for (const id of ["1", "3"]) {
        assert.isFalse(byId.get(id).success)
        assert.strictEqual(byId.get(id).error.code, "internal")
        assert.match(byId.get(id).error.message, /interrupted/)
      }
      assert.strictEqual(byId.get("5").error.code, "internal")
      assert.match(byId.get("5").error.message, /boom/)
      assert.strictEqual(byId.get("6").error.code, "session_not_found")
      for (const id of ["2", "4", "7"]) assert.isTrue(byId.get(id).success, `command ${id} answered with success`)
    }))

  it.scopedLive("a prompt's writes do not hold back the next session's prompt; a command that reads sessions waits for them", () =>
    Effect.gen(function*() {
      const socketPath = yield* withServer
      slowLog.length = 0
      slowWrites.unsafeClose()
      const lines = [
        { type: "prompt", id: "1", activeSessionId: "slow-a", message: "hi" },
        { type: "prompt", id: "2", activeSessionId: "ok-b", message: "hi" },
        { type: "abort", id: "3", activeSessionId: "slow-c" },
        { type: "get_state", id: "4", activeSessionId: "ok-d" },
        { type: "prompt", id: "5", activeSessionId: "ok-e", message: "hi" }
      ]
      const exchanged = yield* Effect.fork(exchange(socketPath, lines, lines.length))
      // The prompts to other sessions took effect while slow-a's and slow-c's writes are held;
      // get_state, which reads sessions, waits for them, and so does what comes after it.
      for (let i = 0; i < 500 && slowLog.length < 3; i++) yield* Effect.sleep("10 millis")
      yield* Effect.sleep("100 millis")
      assert.deepStrictEqual(slowLog, ["prompt slow-a", "prompt ok-b", "abort slow-c"])
      slowWrites.unsafeOpen()
      const { responses } = yield* Fiber.join(exchanged)
      assert.deepStrictEqual(responses.map((r) => [r.id, r.success]), [["1", true], ["2", true], ["3", true], ["4", true], ["5", true]], "in order")
      assert.deepStrictEqual(slowLog.slice(3, 5).sort(), ["abort slow-c settled", "prompt slow-a settled"])
      assert.deepStrictEqual(slowLog.slice(5), ["get_state ok-d", "prompt ok-e"])
    }))

  it.scopedLive("HTTP: a command interrupted from inside is answered 500 internal, and the server goes on", () =>
    Effect.gen(function*() {
      const { token, url } = yield* withHttp
      const get = (p: string) =>
        Effect.promise(async () => {
          const r = await fetch(url + p, { headers: { authorization: `Bearer ${token}` } })
          return { status: r.status, body: await r.json() as any }
        })
      const interrupted = yield* get("/v1/sessions/interrupted-a")
      assert.strictEqual(interrupted.status, 500)
      assert.strictEqual(interrupted.body.error.code, "internal")
      assert.match(interrupted.body.error.message, /interrupted/)
      const ok = yield* get("/v1/sessions/ok-a")
      assert.strictEqual(ok.status, 200)
      assert.strictEqual(ok.body.activeSessionId, "ok-a")
    }))
})
