/**
 * Oversized commands are answered, and the command line's log lines go to stderr:
 * - the daemon answers a line over `maxLineBytes` with the id (and command type) read from the
 *   line's head, on a real socket, and the connection goes on (a 17 MiB line);
 * - the Effect client, the Promise facade and `agentd prompt` (`--file`, stdin) refuse a prompt
 *   over the limit with `PromptTooLarge` before sending it, at once;
 * - a command over the limit that the client sends anyway is answered with its id, so its
 *   request fails (`line_too_long`) instead of waiting forever;
 * - the command line's client logs (a warning of the SDK) never reach stdout.
 *
 * Each wait is bounded: the behaviour these tests replace hung for good.
 * Needs `npm run build` first.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Stream from "effect/Stream"
import { spawn } from "node:child_process"
import { randomUUID } from "node:crypto"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { onTestFinished } from "vitest"
import * as Client from "../../src/client.js"
import { DaemonClient } from "../../src/client.js"
import * as Protocol from "../../src/Protocol.js"
import { cleanUpAfterTests, createSession, DAEMON_BIN, MAX_LINE_BYTES, type Msg, PROTOCOL, sharedDaemon } from "./harness.js"

cleanUpAfterTests()

const MiB = 1024 * 1024

/** A line of `size` bytes (no `\n`): `head`, then `a` padding, then `tail`. */
const lineOf = (head: string, size: number, tail = `"}`): Buffer => {
  const line = Buffer.alloc(size, 0x61)
  line.write(head, 0)
  line.write(tail, size - Buffer.byteLength(tail))
  return line
}

const expectTooLong = (r: Msg, id: string | null, command: string, limit: number) => {
  assert.strictEqual(r["type"], "response")
  assert.strictEqual(r["success"], false, JSON.stringify(r))
  assert.strictEqual(r["error"]?.code, "line_too_long", JSON.stringify(r))
  assert.strictEqual(r["error"]?.details?.maxLineBytes, limit)
  assert.strictEqual(r["id"], id, JSON.stringify(r))
  assert.strictEqual(r["command"], command, JSON.stringify(r))
}

const failureOf = <A, E>(exit: Exit.Exit<A, E>): E => {
  if (Exit.isSuccess(exit)) assert.fail(`expected a failure, got ${JSON.stringify(exit.value)}`)
  if (exit.cause._tag !== "Fail") assert.fail(`expected a typed failure, got ${String(exit.cause)}`)
  return exit.cause.error
}

/** A temp dir removed after the test. */
const tempDir = (): string => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-oversize-"))
  onTestFinished(() => fs.rmSync(dir, { recursive: true, force: true }))
  return dir
}

/** Runs the CLI with a bounded wait: killed (code null) if it runs longer than `timeoutMs`. */
const cli = (args: ReadonlyArray<string>, options: { input?: Buffer; timeoutMs?: number } = {}) =>
  new Promise<{ code: number | null; stdout: string; stderr: string; ms: number }>((resolve, reject) => {
    const started = Date.now()
    const proc = spawn(process.execPath, [DAEMON_BIN, ...args], {
      stdio: [options.input === undefined ? "ignore" : "pipe", "pipe", "pipe"],
      env: { ...Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith("AGENTD_"))), NO_COLOR: "1" }
    })
    const timer = setTimeout(() => proc.kill("SIGKILL"), options.timeoutMs ?? 30_000)
    onTestFinished(() => {
      clearTimeout(timer)
      if (proc.exitCode === null && proc.signalCode === null) proc.kill("SIGKILL")
    })
    let stdout = ""
    let stderr = ""
    proc.stdout!.setEncoding("utf8").on("data", (d: string) => (stdout += d))
    proc.stderr!.setEncoding("utf8").on("data", (d: string) => (stderr += d))
    // The CLI may exit before reading all of a large stdin: that is no failure of the test.
    proc.stdin?.on("error", () => {})
    if (options.input !== undefined) proc.stdin!.end(options.input)
    proc.once("error", reject)
    proc.once("close", (code) => {
      clearTimeout(timer)
      resolve({ code, stdout, stderr, ms: Date.now() - started })
    })
  })

describe("the daemon answers a line over maxLineBytes with the id of its head", () => {
  const daemon = sharedDaemon()

  it("a 17 MiB prompt envelope: line_too_long with its id and `prompt`; the next command on the connection is answered", async () => {
    const d = daemon()
    const c = await d.connect()
    const head = `{"type":"command","id":"big-1","protocol":${JSON.stringify(PROTOCOL)},"command":{"type":"prompt","activeSessionId":"s-x","message":"`
    await c.sendRaw(lineOf(head, 17 * MiB, `"}}`))
    await c.sendRaw(`\n{"type":"ping","id":"after-big-1"}\n`)
    const answer = await c.response("big-1", 30_000)
    expectTooLong(answer, "big-1", "prompt", MAX_LINE_BYTES)
    const after = await c.response("after-big-1", 30_000)
    assert.deepStrictEqual(after["data"], { pong: true })
    assert.isBelow(c.all.indexOf(answer), c.all.indexOf(after))
    assert.strictEqual(c.received((m) => m["type"] === "response").length, 2, "one response per line")
    // The hello announces the limit (an extension, docs/protocol.md section 9).
    assert.deepStrictEqual(c.hello!["limits"], { maxLineBytes: MAX_LINE_BYTES })
  }, 60_000)

  it("bare commands: an id after a nested one is read; an id past the head is not; the connection goes on", async () => {
    const d = daemon()
    const c = await d.connect()
    // Nested objects and strings full of JSON syntax before the id: only the top-level id counts.
    const nested = `{"meta":{"id":"inner","note":"}\\",\\"id\\":\\"fake\\"{["},"\\u0069d":"outer","type":"ping","pad":"`
    await c.sendRaw(Buffer.concat([lineOf(nested, MAX_LINE_BYTES + 1), Buffer.from("\n")]))
    expectTooLong(await c.waitFor((m) => m["type"] === "response", 30_000), "outer", "ping", MAX_LINE_BYTES)
    // The id after a field longer than the head (64 KiB): not recoverable, id null.
    const late = Buffer.concat([Buffer.from(`{"type":"ping","pad":"${"b".repeat(70_000)}","id":"late","more":"`), Buffer.alloc(MAX_LINE_BYTES, 0x61), Buffer.from(`"}\n`)])
    await c.sendRaw(late)
    expectTooLong(await c.waitFor((m) => m["type"] === "response", 30_000), null, "ping", MAX_LINE_BYTES)
    assert.deepStrictEqual(await c.ok({ type: "ping" }), { pong: true })
  }, 60_000)
})

describe("the clients refuse a prompt over the limit, before sending it", () => {
  const daemon = sharedDaemon()

  it.scopedLive("Effect client: prompt and promptTurn fail with PromptTooLarge at once; the connection goes on", () =>
    Effect.gen(function*() {
      const d = daemon()
      const client = yield* DaemonClient.make({ socketPath: d.socketPath })
      const { activeSessionId } = yield* client.create({ config: { tokenDelayMs: 0 } })
      const big = "a".repeat(17 * MiB)
      const e1 = failureOf(yield* Effect.exit(client.prompt(activeSessionId, big).pipe(Effect.timeout("10 seconds"))))
      assert.strictEqual(e1._tag, "PromptTooLarge")
      if (e1._tag !== "PromptTooLarge") return
      assert.strictEqual(e1.maxLineBytes, MAX_LINE_BYTES)
      assert.isAbove(e1.bytes, 17 * MiB)
      assert.strictEqual(e1.activeSessionId, activeSessionId)
      assert.include(e1.message, `${MAX_LINE_BYTES} bytes`)
      assert.include(e1.message, "16 MiB")
      const e2 = failureOf(yield* Effect.exit(Stream.runDrain(client.promptTurn(activeSessionId, big)).pipe(Effect.timeout("10 seconds"))))
      assert.strictEqual(e2._tag, "PromptTooLarge")
      // Refused before the attach a turn would need.
      assert.isFalse(client.isAttached(activeSessionId))
      assert.deepStrictEqual(yield* client.ping(), { pong: true })
      // A prompt under the limit still runs.
      const turn = yield* Stream.runCollect(client.promptTurn(activeSessionId, "small")).pipe(Effect.timeout("20 seconds"))
      assert.strictEqual([...turn].at(-1)?.event.type, "agent_end")
      assert.deepStrictEqual(client.hello.limits, { maxLineBytes: MAX_LINE_BYTES })
    }), 60_000)

  it("Promise facade: session.prompt rejects with PromptTooLarge at once", async () => {
    const d = daemon()
    const client = await Client.connect({ socketPath: d.socketPath })
    onTestFinished(() => client.close())
    const session = await client.create({ config: { tokenDelayMs: 0 } })
    const big = "é".repeat(9 * MiB) // 9 Mi characters, 18 MiB of UTF-8: bytes count, not characters
    const outcome = await Promise.race([
      (async () => {
        for await (const _ of session.prompt(big)) {
          // no event may come
        }
        return "ended"
      })().catch((e: unknown) => e),
      new Promise((resolve) => setTimeout(() => resolve("still waiting after 15 s"), 15_000))
    ])
    assert.instanceOf(outcome, Client.PromptTooLarge, String(outcome))
    const e = outcome as Client.PromptTooLarge
    assert.strictEqual(e.maxLineBytes, MAX_LINE_BYTES)
    assert.isAbove(e.bytes, 18 * MiB)
    assert.deepStrictEqual(await client.ping(), { pong: true })
  }, 60_000)

  it("agentd prompt --file and - (stdin): exit 1 at once, the limit on stderr, nothing on stdout", async () => {
    const d = daemon()
    const c = await d.connect()
    const { id } = await createSession(c, { config: { tokenDelayMs: 0 } })
    const file = path.join(tempDir(), "big.txt")
    const big = Buffer.alloc(17 * MiB, 0x61)
    fs.writeFileSync(file, big)
    for (const [how, run] of [
      ["--file", () => cli(["prompt", id, "--file", file, "--socket", d.socketPath])],
      ["stdin", () => cli(["prompt", id, "-", "--socket", d.socketPath], { input: big })]
    ] as const) {
      const r = await run()
      assert.strictEqual(r.code, 1, `${how}: exit code (null: still running after 30 s); stderr: ${r.stderr}`)
      assert.strictEqual(r.stdout, "", how)
      assert.match(r.stderr, /^agentd: the prompt is too large to send: .* over the limit of 16777216 bytes \(16 MiB/, how)
    }
    // Nothing was prompted.
    const state = await c.ok({ type: "get_state", activeSessionId: id })
    assert.strictEqual(state["messageCount"], 0)
  }, 90_000)
})

describe("against a daemon with a small limit", () => {
  const LIMIT = 1000
  const daemon = sharedDaemon({ env: { AGENTD_MAX_LINE_BYTES: String(LIMIT) } })

  it("the head read is min(64 KiB, maxLineBytes): an id ending within the limit is echoed, one past it is not", async () => {
    const c = await daemon().connect()
    const within = `{"pad":"${"x".repeat(LIMIT - 60)}","id":"in","type":"ping","more":"`
    assert.isAtMost(within.indexOf(`"ping"`) + 6, LIMIT)
    await c.sendRaw(Buffer.concat([lineOf(within, LIMIT + 500), Buffer.from("\n")]))
    expectTooLong(await c.waitFor((m) => m["type"] === "response"), "in", "ping", LIMIT)
    const past = `{"type":"ping","pad":"${"x".repeat(LIMIT - 30)}","id":"out","more":"`
    await c.sendRaw(Buffer.concat([lineOf(past, LIMIT + 500), Buffer.from("\n")]))
    expectTooLong(await c.waitFor((m) => m["type"] === "response"), null, "ping", LIMIT)
    assert.deepStrictEqual(c.hello!["limits"], { maxLineBytes: LIMIT })
  })

  it.scopedLive("the client takes the announced limit, counts UTF-8 bytes of the envelope; a line of exactly the limit goes", () =>
    Effect.gen(function*() {
      const d = daemon()
      const client = yield* DaemonClient.make({ socketPath: d.socketPath })
      const { activeSessionId } = yield* client.create({ config: { tokenDelayMs: 0 } })
      // The next request's id is r2 (ids count from r1 on a connection).
      const overhead = Buffer.byteLength(Protocol.encodeCommand("r2", { type: "prompt", activeSessionId, message: "" }, client.hello.clientId)) - 1
      // Under the limit in characters, over it in bytes.
      const chars = LIMIT - overhead
      const e = failureOf(yield* Effect.exit(client.prompt(activeSessionId, "é".repeat(chars - 10)).pipe(Effect.timeout("10 seconds"))))
      assert.strictEqual(e._tag, "PromptTooLarge")
      if (e._tag !== "PromptTooLarge") return
      assert.strictEqual(e.maxLineBytes, LIMIT)
      assert.strictEqual(e.bytes, overhead + 2 * (chars - 10))
      assert.include(e.message, "the daemon's maxLineBytes")
      // Exactly the limit (the refused prompt used no id: this one is r2 too).
      assert.deepStrictEqual(yield* client.prompt(activeSessionId, "a".repeat(chars)), { accepted: true })
    }), 60_000)

  it.scopedLive("a client option above the announced limit is capped to it; one below it wins", () =>
    Effect.gen(function*() {
      const d = daemon()
      const above = yield* DaemonClient.make({ socketPath: d.socketPath, maxLineBytes: 10 * MiB })
      const e1 = failureOf(yield* Effect.exit(above.prompt("s-x", "a".repeat(2 * LIMIT)).pipe(Effect.timeout("10 seconds"))))
      assert.strictEqual(e1._tag === "PromptTooLarge" && e1.maxLineBytes, LIMIT)
      const below = yield* DaemonClient.make({ socketPath: d.socketPath, maxLineBytes: 200 })
      const e2 = failureOf(yield* Effect.exit(below.prompt("s-x", "a".repeat(300)).pipe(Effect.timeout("10 seconds"))))
      assert.strictEqual(e2._tag === "PromptTooLarge" && e2.maxLineBytes, 200)
      assert.notInclude(e2.message, "the daemon's maxLineBytes")
    }))

  it.scopedLive("another command over the limit is sent and fails with line_too_long (its id echoed), not waiting forever", () =>
    Effect.gen(function*() {
      const d = daemon()
      const client = yield* DaemonClient.make({ socketPath: d.socketPath })
      const e = failureOf(yield* Effect.exit(client.create({ config: { pad: "x".repeat(2 * LIMIT) } }).pipe(Effect.timeout("10 seconds"))))
      assert.strictEqual(e._tag, "DaemonError")
      if (e._tag !== "DaemonError") return
      assert.strictEqual(e.code, "line_too_long")
      assert.strictEqual(e.command, "create")
      assert.deepStrictEqual(yield* client.ping(), { pong: true })
    }))
})

describe("the command line's log lines go to stderr", () => {
  it("agentd prompt against a daemon whose extra lines make the SDK warn: stdout holds the reply alone", async () => {
    const dir = tempDir()
    const socketPath = path.join(dir, "peer.sock")
    const sessionId = `s-${randomUUID()}`
    const hello = {
      type: "daemon_hello",
      protocol: PROTOCOL,
      clientId: "c-peer",
      supervisorGeneration: 1,
      supervisorPid: 4242,
      appVersion: "0.0.0",
      serverCapabilities: ["attach_snapshot", "event_sequence", "slim_attach", "chunked_snapshot"]
    }
    const summary = {
      activeSessionId: sessionId,
      engine: "echo",
      createdAt: "2026-01-01T00:00:00.000Z",
      messageCount: 0,
      busy: false,
      worker: "ready",
      restarts: 0,
      telemetry: false
    }
    const line = (v: unknown) => JSON.stringify(v) + "\n"
    const event = (sequence: number, ev: unknown) =>
      line({ type: "session_event", activeSessionId: sessionId, event: ev, meta: { cursor: { generation: 1, sequence }, emittedAt: 1 } })
    const server = net.createServer((socket) => {
      socket.on("error", () => {})
      socket.write(line(hello))
      let buffered = ""
      socket.on("data", (d) => {
        buffered += d.toString("utf8")
        let nl: number
        while ((nl = buffered.indexOf("\n")) >= 0) {
          const envelope = JSON.parse(buffered.slice(0, nl)) as Msg
          buffered = buffered.slice(nl + 1)
          const type = envelope["command"]["type"] as string
          const ok = (data: unknown) => socket.write(line({ type: "response", id: envelope["id"], command: type, success: true, data }))
          if (type === "get_state") ok(summary)
          else if (type === "attach") {
            ok({
              protocol: PROTOCOL,
              activeSessionId: sessionId,
              snapshot: { snapshotId: `${sessionId}~g1`, messageCount: 0, messages: [] },
              replay: { status: "unavailable", reason: "no_cursor" },
              lastEventSequence: -1,
              client: { id: "c-peer", capabilities: ["event_sequence", "slim_attach"] }
            })
          } else if (type === "prompt") {
            ok({ accepted: true })
            // Lines the SDK cannot use: each makes it log a warning.
            socket.write("this line is not JSON\n")
            socket.write(line({ type: "response", id: "nobody-waits", command: "ping", success: true, data: { pong: true } }))
            // The turn's first status carries the prompt's id (docs/protocol.md section 9).
            const promptId = envelope["command"]["promptId"] as string
            socket.write(line({ type: "session_status", activeSessionId: sessionId, state: { ...summary, busy: true }, promptId, meta: { cursor: { generation: 1, sequence: 0 }, emittedAt: 1 } }))
            socket.write(event(1, { type: "agent_start" }))
            socket.write(event(2, { type: "message_start", message: { id: "m1", role: "assistant", content: "", timestamp: 1 } }))
            socket.write(event(3, { type: "message_update", messageId: "m1", delta: "the reply" }))
            socket.write(event(4, { type: "agent_end" }))
          } else {
            socket.write(line({ type: "response", id: envelope["id"], command: type, success: false, error: { code: "internal", message: "not scripted" } }))
          }
        }
      })
    })
    await new Promise<void>((resolve) => server.listen(socketPath, resolve))
    onTestFinished(() => new Promise<void>((resolve) => server.close(() => resolve())))
    const r = await cli(["prompt", sessionId, "hi", "--socket", socketPath])
    assert.strictEqual(r.code, 0, r.stderr)
    assert.strictEqual(r.stdout, "the reply\n")
    assert.include(r.stderr, "not JSON")
    assert.include(r.stderr, "nobody waits for")
    assert.include(r.stderr, "level=WARN")
  })
})
