/**
 * The client and the daemon's line limit, against scripted daemons on temp sockets: the limit
 * taken from the hello (or the option, or 16 MiB), a hello whose limits cannot be read, a prompt
 * refused without a byte written, and a `line_too_long` answered with `id: null` (a daemon that
 * could not read the id) failing the request it belongs to instead of leaving it waiting.
 * The same against the real daemon: test/e2e/oversize.test.ts.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { DaemonClient } from "../src/client.js"

const HELLO = {
  type: "daemon_hello",
  protocol: { name: "agentd", version: 1 },
  clientId: "c-fake",
  supervisorGeneration: 1,
  supervisorPid: 4242,
  appVersion: "0.0.0",
  serverCapabilities: ["attach_snapshot", "event_sequence"]
}

const line = (value: unknown) => JSON.stringify(value) + "\n"

interface Received {
  readonly bytes: number
  readonly envelope: Record<string, any> | undefined
}

/**
 * A scripted daemon: greets with `hello`, then calls `answer` with each line received (its size,
 * and its envelope when the line is at most `limit` bytes; a longer line is not parsed, as a
 * daemon that cannot read its id). Closed with the scope.
 */
const scriptedDaemon = (
  hello: Record<string, unknown>,
  limit: number,
  answer: (received: Received, socket: net.Socket) => void
) =>
  Effect.gen(function*() {
    const dir = yield* Effect.acquireRelease(
      Effect.sync(() => fs.mkdtempSync(path.join(os.tmpdir(), "agentd-limits-"))),
      (d) => Effect.sync(() => fs.rmSync(d, { recursive: true, force: true }))
    )
    const socketPath = path.join(dir, "fake.sock")
    const received: Array<Received> = []
    const sockets = new Set<net.Socket>()
    const server = net.createServer((socket) => {
      sockets.add(socket)
      socket.on("close", () => sockets.delete(socket))
      socket.on("error", () => {})
      socket.write(line(hello))
      let pieces: Array<Buffer> = []
      socket.on("data", (chunk: Buffer) => {
        let start = 0
        for (let nl = chunk.indexOf(0x0a); nl !== -1; nl = chunk.indexOf(0x0a, start)) {
          const whole = Buffer.concat([...pieces, chunk.subarray(start, nl)])
          pieces = []
          start = nl + 1
          const r: Received = { bytes: whole.length, envelope: whole.length > limit ? undefined : JSON.parse(whole.toString("utf8")) }
          received.push(r)
          answer(r, socket)
        }
        if (start < chunk.length) pieces.push(chunk.subarray(start))
      })
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
    return { socketPath, received }
  })

const tooLongWithoutId = (limit: number) =>
  line({
    type: "response",
    id: null,
    command: "parse",
    success: false,
    error: { code: "line_too_long", message: `The line is longer than ${limit} bytes.`, details: { maxLineBytes: limit } }
  })

const ok = (envelope: Record<string, any>, data: unknown) =>
  line({ type: "response", id: envelope["id"], command: envelope["command"]["type"], success: true, data })

const failureOf = <A, E>(exit: Exit.Exit<A, E>): E => {
  if (Exit.isSuccess(exit)) assert.fail(`expected a failure, got ${JSON.stringify(exit.value)}`)
  if (exit.cause._tag !== "Fail") assert.fail(`expected a typed failure, got ${String(exit.cause)}`)
  return exit.cause.error
}

describe("DaemonClient and the line limit", () => {
  it.scopedLive("the limit is the hello's; a prompt over it fails PromptTooLarge and nothing is written", () =>
    Effect.gen(function*() {
      const { received, socketPath } = yield* scriptedDaemon({ ...HELLO, limits: { maxLineBytes: 500 } }, Infinity, (r, socket) => {
        socket.write(ok(r.envelope!, { pong: true }))
      })
      const client = yield* DaemonClient.make({ socketPath })
      const e = failureOf(yield* Effect.exit(client.prompt("s-1", "a".repeat(600)).pipe(Effect.timeout("5 seconds"))))
      assert.strictEqual(e._tag, "PromptTooLarge")
      if (e._tag !== "PromptTooLarge") return
      assert.strictEqual(e.maxLineBytes, 500)
      assert.isAbove(e.bytes, 600)
      assert.include(e.message, "500 bytes")
      assert.deepStrictEqual(yield* client.ping(), { pong: true })
      assert.deepStrictEqual(received.map((r) => r.envelope?.["command"]?.type), ["ping"], "the prompt was never written")
      assert.strictEqual(received[0]!.envelope!["id"], "r1", "a refused prompt takes no id")
    }))

  it.scopedLive("without limits in the hello: the option, else 16 MiB; limits it cannot read are ignored", () =>
    Effect.gen(function*() {
      for (const limits of [undefined, "big", { maxLineBytes: "big" }, { maxLineBytes: -1 }, { maxLineBytes: 1.5 }]) {
        const hello = limits === undefined ? HELLO : { ...HELLO, limits }
        const { received, socketPath } = yield* scriptedDaemon(hello, Infinity, () => {})
        const client = yield* DaemonClient.make({ socketPath })
        const e = failureOf(yield* Effect.exit(client.prompt("s-1", "a".repeat(16 * 1024 * 1024)).pipe(Effect.timeout("5 seconds"))))
        assert.strictEqual(e._tag === "PromptTooLarge" && e.maxLineBytes, 16 * 1024 * 1024, JSON.stringify(limits))
        const withOption = yield* DaemonClient.make({ socketPath, maxLineBytes: 100 })
        const e2 = failureOf(yield* Effect.exit(withOption.prompt("s-1", "a".repeat(100)).pipe(Effect.timeout("5 seconds"))))
        assert.strictEqual(e2._tag === "PromptTooLarge" && e2.maxLineBytes, 100)
        assert.strictEqual(received.length, 0)
      }
    }))

  it.scopedLive("a line_too_long with id null fails the waiting request whose line was over the limit, not another", () =>
    Effect.gen(function*() {
      const LIMIT = 1000
      let held: Record<string, any> | undefined
      const { socketPath } = yield* scriptedDaemon(HELLO, LIMIT, (r, socket) => {
        if (r.envelope === undefined) {
          // As a daemon that cannot read the id of a line over its limit; the earlier `list`
          // is still unanswered (answered after it, below).
          socket.write(tooLongWithoutId(LIMIT))
          if (held !== undefined) socket.write(ok(held, { sessions: [] }))
          return
        }
        if (r.envelope["command"]["type"] === "list") held = r.envelope
        else socket.write(ok(r.envelope, { pong: true }))
      })
      // The option says 10 MiB and the daemon announces nothing: the 5000-byte lines are sent.
      const client = yield* DaemonClient.make({ socketPath, maxLineBytes: 10 * 1024 * 1024 })
      const listing = yield* Effect.fork(client.list())
      while (held === undefined) yield* Effect.sleep("5 millis")
      const prompt = yield* Effect.exit(client.prompt("s-1", "a".repeat(5000)).pipe(Effect.timeout("5 seconds")))
      const e = failureOf(prompt)
      assert.strictEqual(e._tag, "DaemonError")
      if (e._tag !== "DaemonError") return
      assert.strictEqual(e.code, "line_too_long")
      assert.strictEqual(e.command, "prompt")
      assert.deepStrictEqual(yield* Fiber.join(listing).pipe(Effect.timeout("5 seconds")), { sessions: [] })
      // Another command over the limit: the same.
      const e2 = failureOf(yield* Effect.exit(client.create({ config: { pad: "x".repeat(5000) } }).pipe(Effect.timeout("5 seconds"))))
      assert.strictEqual(e2._tag === "DaemonError" && e2.code, "line_too_long")
      assert.deepStrictEqual(yield* client.ping(), { pong: true })
    }))

  it.scopedLive("a line_too_long with id null that no waiting request can have caused is ignored", () =>
    Effect.gen(function*() {
      const { socketPath } = yield* scriptedDaemon(HELLO, Infinity, (r, socket) => {
        socket.write(tooLongWithoutId(1000))
        socket.write(ok(r.envelope!, { pong: true }))
      })
      const client = yield* DaemonClient.make({ socketPath })
      assert.deepStrictEqual(yield* client.ping().pipe(Effect.timeout("5 seconds")), { pong: true })
    }))
})
