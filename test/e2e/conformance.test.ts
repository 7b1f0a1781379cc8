/**
 * Wire conformance of the real daemon (docs/protocol.md sections 1-3, docs/protocol.md section 9):
 * handshake, file modes, every command's success shape, every error code reachable from the
 * socket, framing, half-close, bad input, logging, and a refused second daemon. Most tests share
 * one daemon (each on sessions of its own); lifecycle.test.ts has the ones that stop daemons.
 *
 * Needs `npm run build` first (it drives `dist/src/bin/agentd.js serve`).
 */
import * as fs from "node:fs"
import { describe, expect, it } from "vitest"
import {
  agentMessageProblems,
  cleanUpAfterTests,
  Client,
  collectTurn,
  createSession,
  cursorGap,
  type Daemon,
  describeMsg,
  isAlive,
  isEvent,
  isIdleStatus,
  MAX_LINE_BYTES,
  modeOf,
  type Msg,
  PROTOCOL,
  sharedDaemon,
  sleep,
  startDaemon,
  summaryProblems
} from "./harness.js"

cleanUpAfterTests()

/**
 * The daemon most tests share (each works on sessions of its own); tests that stop, crash or
 * restart a daemon, or need a pristine state dir, start their own with `useDaemon`.
 */
const shared = sharedDaemon()

/** Asserts an error response: code, echoed id, command. */
const expectError = (r: Msg, code: string, id: string | null, command?: string): void => {
  expect(r["type"]).toBe("response")
  expect(r["success"], `expected ${code}, got ${JSON.stringify(r)}`).toBe(false)
  expect(r["error"]?.code, JSON.stringify(r)).toBe(code)
  expect(typeof r["error"]?.message).toBe("string")
  expect((r["error"]?.message as string).length).toBeGreaterThan(0)
  expect(r["id"]).toBe(id)
  if (command !== undefined) expect(r["command"]).toBe(command)
  expect("data" in r).toBe(false)
}

/** Sends one raw line and waits for the response carrying `id`. */
const rawRequest = async (c: Client, line: string, id: string | null): Promise<Msg> => {
  await c.sendRaw(line + "\n")
  return c.response(id)
}

// ---------------------------------------------------------------------------------------------

describe("handshake and files", () => {
  it("greets every connection with daemon_hello before anything else", async () => {
    const d = shared()
    const a = await d.connect("a", { awaitHello: false })
    // Send a command at once: the hello must still come first.
    a.send({ type: "ping", id: "early" })
    await a.response("early")
    const hello = a.all[0]!
    expect(hello["type"]).toBe("daemon_hello")
    expect(hello["protocol"]).toEqual(PROTOCOL)
    expect(typeof hello["clientId"]).toBe("string")
    expect((hello["clientId"] as string).length).toBeGreaterThan(0)
    expect(Number.isInteger(hello["supervisorGeneration"])).toBe(true)
    expect(hello["supervisorGeneration"]).toBeGreaterThanOrEqual(0)
    expect(hello["supervisorPid"]).toBe(d.pid)
    expect(hello["appVersion"]).toMatch(/^\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$/)
    expect([...(hello["serverCapabilities"] as Array<string>)].sort()).toEqual(
      ["attach_snapshot", "chunked_snapshot", "event_sequence", "slim_attach"]
    )
    // Per-connection ids; same generation for every connection of one daemon.
    const b = await d.connect("b")
    const c = await d.connect("c")
    const ids = new Set([hello["clientId"], b.hello!["clientId"], c.hello!["clientId"]])
    expect(ids.size).toBe(3)
    expect(b.hello!["supervisorGeneration"]).toBe(hello["supervisorGeneration"])
    // status agrees with the hello.
    const status = await b.ok({ type: "status" })
    expect(status["supervisorGeneration"]).toBe(hello["supervisorGeneration"])
    expect(status["pid"]).toBe(d.pid)
  })

  it("creates the state dir 0700 and the socket 0600", async () => {
    const d = shared()
    expect(fs.statSync(d.stateDir).isDirectory()).toBe(true)
    expect(modeOf(d.stateDir).toString(8)).toBe("700")
    expect(fs.statSync(d.socketPath).isSocket()).toBe(true)
    expect(modeOf(d.socketPath).toString(8)).toBe("600")
  })

  it("health-probe connections that close at once are harmless", async () => {
    const d = shared()
    for (let i = 0; i < 20; i++) {
      const c = await d.connect(`probe${i}`, { awaitHello: false })
      c.close()
    }
    const c = await d.connect("after")
    expect(await c.ok({ type: "ping" })).toEqual({ pong: true })
    expect(d.running).toBe(true)
  })
})

// ---------------------------------------------------------------------------------------------

describe("commands: success shapes", () => {
  it("ping in envelope form and bare form, with and without id", async () => {
    const d = shared()
    const c = await d.connect()
    const r = await c.request({ type: "ping" })
    expect(r).toEqual({ type: "response", id: r["id"], command: "ping", success: true, data: { pong: true } })
    c.send({ type: "ping", id: "bare-1" })
    expect(await c.response("bare-1")).toEqual({ type: "response", id: "bare-1", command: "ping", success: true, data: { pong: true } })
    c.send({ type: "ping" })
    expect(await c.response(null)).toEqual({ type: "response", id: null, command: "ping", success: true, data: { pong: true } })
    // Envelope with a clientId and unknown extra fields (ignored: forward compatibility).
    c.send({ type: "command", id: "env-x", protocol: PROTOCOL, clientId: c.hello!["clientId"], extra: 1, command: { type: "ping", future: true } })
    expect((await c.response("env-x"))["data"]).toEqual({ pong: true })
  })

  it("create, list, status, get_state, prompt, get_messages, checkpoint, abort, retry_worker, detach, kill", async () => {
    const d = shared()
    const c = await d.connect()

    // create
    const created = await c.request({ type: "create", name: "alpha" })
    expect(created["success"], JSON.stringify(created)).toBe(true)
    expect(created["command"]).toBe("create")
    const id = created["data"]["activeSessionId"] as string
    expect(typeof id).toBe("string")
    const st0 = created["data"]["state"] as Msg
    expect(summaryProblems(st0, "create.state")).toEqual([])
    expect(st0["activeSessionId"]).toBe(id)
    expect(st0["name"]).toBe("alpha")
    expect(st0["engine"]).toBe("echo")
    expect(st0["busy"]).toBe(false)
    expect(st0["telemetry"]).toBe(false)
    expect(st0["messageCount"]).toBe(0)
    expect(st0["restarts"]).toBe(0)
    d.recordWorkers(st0)
    const other = await createSession(c, { telemetry: true, config: { tokenDelayMs: 0 } })
    expect(other.data["state"]["telemetry"]).toBe(true)
    expect("name" in other.data["state"]).toBe(false)

    // list
    const list = await c.ok({ type: "list" })
    expect(Array.isArray(list["sessions"])).toBe(true)
    const listed = (list["sessions"] as Array<Msg>).map((s) => s["activeSessionId"])
    expect(listed).toContain(id)
    expect(listed).toContain(other.id)
    expect(new Set(listed).size).toBe(listed.length)
    for (const s of list["sessions"] as Array<Msg>) expect(summaryProblems(s, "list")).toEqual([])

    // prompt before attaching: accepted, the turn runs (create does not attach).
    const p = await c.request({ type: "prompt", activeSessionId: id, message: "hello world" })
    expect(p).toMatchObject({ command: "prompt", success: true, data: { accepted: true } })
    expect(c.received((m) => m["type"] === "session_event")).toEqual([])

    // get_state until idle, then the transcript holds the user and assistant messages.
    let st: Msg = {}
    for (let i = 0; i < 200; i++) {
      st = await c.ok({ type: "get_state", activeSessionId: id })
      if (st["busy"] === false && st["messageCount"] === 2) break
      await sleep(25)
    }
    expect(summaryProblems(st, "get_state")).toEqual([])
    expect(st).toMatchObject({ activeSessionId: id, busy: false, messageCount: 2, worker: "ready" })
    expect(Number.isInteger(st["workerPid"])).toBe(true)
    expect(isAlive(st["workerPid"])).toBe(true)
    expect(st["lastEventCursor"]).toBeDefined()
    d.recordWorkers(st)

    // status
    const status = await c.ok({ type: "status" })
    d.recordWorkers(status)
    expect(Number.isInteger(status["supervisorGeneration"])).toBe(true)
    expect(status["pid"]).toBe(d.pid)
    expect(Number.isInteger(status["uptimeMs"])).toBe(true)
    expect(status["uptimeMs"]).toBeGreaterThanOrEqual(0)
    expect(status["sessions"]).toBe((await c.ok({ type: "list" }))["sessions"].length)
    expect(status["sessions"]).toBeGreaterThanOrEqual(2)
    expect(Array.isArray(status["workers"])).toBe(true)
    for (const w of status["workers"] as Array<Msg>) {
      expect(Number.isInteger(w["pid"])).toBe(true)
      expect(typeof w["activeSessionId"]).toBe("string")
      expect(typeof w["state"]).toBe("string")
      expect(Number.isInteger(w["restarts"])).toBe(true)
    }
    const mine = (status["workers"] as Array<Msg>).find((w) => w["activeSessionId"] === id)
    expect(mine, JSON.stringify(status["workers"])).toBeDefined()
    expect(mine!["pid"]).toBe(st["workerPid"])

    // get_messages: whole, then a page.
    const msgs = await c.ok({ type: "get_messages", activeSessionId: id })
    expect(msgs["total"]).toBe(2)
    expect((msgs["messages"] as Array<Msg>).map((m) => [m["role"], m["content"]])).toEqual([
      ["user", "hello world"],
      ["assistant", "echo: hello world"]
    ])
    for (const m of msgs["messages"] as Array<Msg>) expect(agentMessageProblems(m)).toEqual([])
    const page = await c.ok({ type: "get_messages", activeSessionId: id, offset: 1, limit: 1 })
    expect(page["total"]).toBe(2)
    expect(page["messages"]).toEqual([msgs["messages"][1]])
    const empty = await c.ok({ type: "get_messages", activeSessionId: id, offset: 5, limit: 1000 })
    expect(empty).toEqual({ messages: [], total: 2 })

    // checkpoint: generation 2 (generation 1 is the session's first).
    const cp = await c.ok({ type: "checkpoint", activeSessionId: id }, 20_000)
    expect(cp["generation"]).toBe(2)
    expect(typeof cp["snapshotId"]).toBe("string")
    const cp2 = await c.ok({ type: "checkpoint", activeSessionId: id }, 20_000)
    expect(cp2["generation"]).toBe(3)
    expect(cp2["snapshotId"]).not.toBe(cp["snapshotId"])

    // abort while idle
    expect(await c.ok({ type: "abort", activeSessionId: id })).toEqual({ aborted: false })

    // retry_worker on a healthy session returns its summary
    const rw = await c.ok({ type: "retry_worker", activeSessionId: id }, 20_000)
    expect(summaryProblems(rw, "retry_worker")).toEqual([])
    expect(rw["activeSessionId"]).toBe(id)
    d.recordWorkers(rw)

    // attach, then detach: events stop flowing to this connection.
    const att = await c.ok({ type: "attach", activeSessionId: id })
    expect(att["activeSessionId"]).toBe(id)
    await c.waitFor((m) => m["type"] === "session_attached" && m["activeSessionId"] === id)
    expect(await c.ok({ type: "detach", activeSessionId: id })).toEqual({})
    const watcher = await d.connect("watcher")
    await watcher.ok({ type: "attach", activeSessionId: id })
    const before = c.all.length
    await c.ok({ type: "prompt", activeSessionId: id, message: "after detach" })
    await collectTurn(watcher, id)
    await sleep(200)
    const leaked = c.all.slice(before).filter((m) => m["activeSessionId"] === id && m["type"] !== "response")
    expect(leaked.map(describeMsg), "events after detach").toEqual([])

    // kill
    const k = await c.request({ type: "kill", activeSessionId: other.id })
    expect(k, JSON.stringify(k)).toMatchObject({ command: "kill", success: true, data: {} })
    expect(k["data"]).toEqual({})
    const list2 = ((await c.ok({ type: "list" }))["sessions"] as Array<Msg>).map((s) => s["activeSessionId"])
    expect(list2).toContain(id)
    expect(list2).not.toContain(other.id)
    expect(list2.length).toBe(listed.length - 1)
  }, 45_000)

  it("abort during a /sleep turn interrupts it with reason aborted", async () => {
    const d = shared()
    const c = await d.connect()
    const { id } = await createSession(c)
    await c.ok({ type: "attach", activeSessionId: id })
    await c.ok({ type: "prompt", activeSessionId: id, message: "/sleep 5000" })
    await c.waitFor(isEvent("tool_execution_start"), 10_000)
    const t0 = Date.now()
    expect(await c.ok({ type: "abort", activeSessionId: id })).toEqual({ aborted: true })
    const rest = await collectTurn(c, id, 4_000)
    expect(Date.now() - t0).toBeLessThan(4_000)
    const types = rest.filter((m) => m["type"] === "session_event").map((m) => m["event"].type)
    expect(types).toContain("turn_interrupted")
    expect(types).not.toContain("agent_end")
    const ti = rest.find(isEvent("turn_interrupted"))!
    expect(ti["event"]).toEqual({ type: "turn_interrupted", reason: "aborted" })
    // After turn_interrupted: exactly the busy:false status closes the turn.
    const after = rest.slice(rest.indexOf(ti) + 1)
    expect(after.length).toBeGreaterThanOrEqual(1)
    expect(isIdleStatus(after[after.length - 1]!)).toBe(true)
    expect(cursorGap(c.sequenced(id))).toBeUndefined()
    // The session works afterwards.
    await c.ok({ type: "prompt", activeSessionId: id, message: "again" })
    const turn = await collectTurn(c, id)
    expect(turn.some(isEvent("agent_end"))).toBe(true)
  }, 30_000)

})

// ---------------------------------------------------------------------------------------------

describe("error codes", () => {
  it("parse_error: not JSON, truncated JSON (id salvaged), invalid UTF-8", async () => {
    const d = shared()
    const c = await d.connect()
    expectError(await rawRequest(c, `{"type":"ping","id":"p1"`, "p1"), "parse_error", "p1", "parse")
    expectError(await rawRequest(c, `{"id":"p2", "type": "get_state", "activeSessionId": `, "p2"), "parse_error", "p2", "parse")
    expectError(await rawRequest(c, `hello daemon`, null), "parse_error", null, "parse")
    // The id is salvaged only from the first 4 KiB of the line (section 9).
    expectError(await rawRequest(c, `{"pad":"${"x".repeat(5000)}","id":"late","type":"ping"`, null), "parse_error", null, "parse")
    await c.sendRaw(Buffer.concat([Buffer.from([0xff, 0xfe, 0x80]), Buffer.from("{\"id\":\"p3\"\n")]))
    expectError(await c.response("p3"), "parse_error", "p3", "parse")
    // Still usable.
    expect(await c.ok({ type: "ping" })).toEqual({ pong: true })
  })

  it("line_too_long: a line just over 16 MiB is refused with its id and the connection stays usable", async () => {
    const d = shared()
    const c = await d.connect()
    const head = `{"type":"ping","id":"huge","pad":"`
    const tail = `"}`
    const over = Buffer.alloc(MAX_LINE_BYTES + 1, 0x61)
    over.write(head, 0)
    over.write(tail, over.length - tail.length)
    await c.sendRaw(over)
    await c.sendRaw(`\n{"type":"ping","id":"after-huge"}\n`)
    const err = await c.waitFor((m) => m["type"] === "response" && m["error"]?.code === "line_too_long", 30_000)
    // docs/protocol.md section 9: the id and the type are read from the line's head.
    expectError(err, "line_too_long", "huge", "ping")
    const after = await c.response("after-huge", 30_000)
    expect(after).toMatchObject({ success: true, data: { pong: true } })
    expect(c.all.indexOf(err)).toBeLessThan(c.all.indexOf(after))
    // Exactly one response for the long line.
    expect(c.received((m) => m["type"] === "response" && m["id"] !== "after-huge").length).toBe(1)

    // A line of exactly maxLineBytes bytes is accepted (section 9), with \r\n too.
    const exact = Buffer.alloc(MAX_LINE_BYTES, 0x20)
    const cmd = Buffer.from(`{"type":"ping","id":"exact"}`)
    cmd.copy(exact, 0)
    await c.sendRaw(Buffer.concat([exact, Buffer.from("\n")]))
    expect(await c.response("exact", 30_000)).toMatchObject({ success: true, data: { pong: true } })
    expect(d.running).toBe(true)
  }, 60_000)

  it("invalid_command: envelope without protocol/command/id, non-objects, bad field types", async () => {
    const d = shared()
    const c = await d.connect()
    const P = JSON.stringify(PROTOCOL)
    expectError(await rawRequest(c, `{"type":"command","id":"e1","command":{"type":"ping"}}`, "e1"), "invalid_command", "e1")
    expectError(await rawRequest(c, `{"type":"command","id":"e2","protocol":${P}}`, "e2"), "invalid_command", "e2")
    expectError(await rawRequest(c, `{"type":"command","id":"e2b","protocol":${P},"command":"ping"}`, "e2b"), "invalid_command", "e2b")
    for (const v of [`[1,2,3]`, `42`, `"ping"`, `null`, `true`]) {
      expectError(await rawRequest(c, v, null), "invalid_command", null, "parse")
    }
    expectError(await rawRequest(c, `{"id":"e3"}`, "e3"), "invalid_command", "e3", "parse")
    expectError(await rawRequest(c, `{"type":5,"id":"e4"}`, "e4"), "invalid_command", "e4", "parse")
    const e5 = await rawRequest(c, `{"type":"prompt","id":"e5","activeSessionId":"nope","message":5}`, "e5")
    expectError(e5, "invalid_command", "e5", "prompt")
    expect(e5["error"].message).toContain("message")
    const e6 = await rawRequest(c, `{"type":"get_messages","id":"e6","activeSessionId":"x","limit":1001}`, "e6")
    expectError(e6, "invalid_command", "e6", "get_messages")
    expect(e6["error"].message).toContain("limit")
    const e7 = await rawRequest(c, `{"type":"get_messages","id":"e7","activeSessionId":"x","offset":-1}`, "e7")
    expectError(e7, "invalid_command", "e7", "get_messages")
    expect(e7["error"].message).toContain("offset")
    const e8 = await rawRequest(c, `{"type":"create","id":"e8","name":null}`, "e8")
    expectError(e8, "invalid_command", "e8", "create")
    expect(e8["error"].message).toContain("name")
    // An engine or engine config the workers would refuse is refused at create: no session is
    // made (a worker could never load it; it used to crash-loop until `failed`).
    const before = ((await c.ok({ type: "list" }))["sessions"] as Array<unknown>).length
    const e8b = await rawRequest(c, `{"type":"create","id":"e8b","config":{"tokenDelayMs":-1}}`, "e8b")
    expectError(e8b, "invalid_command", "e8b", "create")
    expect(e8b["error"].message).toContain("tokenDelayMs")
    // A misspelt option is refused, not ignored.
    const e8t = await rawRequest(c, `{"type":"create","id":"e8t","config":{"tokenDelay":10}}`, "e8t")
    expectError(e8t, "invalid_command", "e8t", "create")
    expect(e8t["error"].message).toContain("unknown option config.tokenDelay ")
    const e8c = await rawRequest(c, `{"type":"create","id":"e8c","engine":"gpt"}`, "e8c")
    expectError(e8c, "invalid_command", "e8c", "create")
    expect(e8c["error"].message).toContain("unknown engine")
    expect(((await c.ok({ type: "list" }))["sessions"] as Array<unknown>).length).toBe(before)
    const e9 = await rawRequest(c, `{"type":"prompt","id":"e9","activeSessionId":"x"}`, "e9")
    expectError(e9, "invalid_command", "e9", "prompt")
    expect(e9["error"].message).toContain("message")
    const e10 = await rawRequest(c, `{"type":"command","id":"e10","protocol":${P},"command":{"type":"attach","activeSessionId":7}}`, "e10")
    expectError(e10, "invalid_command", "e10", "attach")
    expect(e10["error"].message).toContain("activeSessionId")
    // id of the wrong type: invalid_command naming `id` (section 9); the id cannot be echoed.
    const e11 = await rawRequest(c, `{"type":"ping","id":7}`, null)
    expectError(e11, "invalid_command", null)
    expect(e11["error"].message).toContain("id")
    const e12 = await rawRequest(c, `{"type":"command","protocol":${P},"command":{"type":"ping"}}`, null)
    expectError(e12, "invalid_command", null)
    // Cursor shape invalid → invalid_command, not an attach.
    const { id: sid } = await createSession(c)
    for (const [i, cur] of [
      { generation: 0, sequence: 0 },
      { generation: 1, sequence: -1 },
      { generation: 1.5, sequence: 0 },
      { generation: "1", sequence: 0 },
      { generation: 1 },
      "1:0"
    ].entries()) {
      const rid = `cur${i}`
      c.send({ type: "attach", id: rid, activeSessionId: sid, resumeCursor: cur })
      const r = await c.response(rid)
      expectError(r, "invalid_command", rid, "attach")
      expect(r["error"].message).toContain("resumeCursor")
    }
    await sleep(100)
    expect(c.received((m) => m["type"] === "session_attached")).toEqual([])
    expect(await c.ok({ type: "ping" })).toEqual({ pong: true })
  })

  it("unknown_command and unsupported_protocol echo the id", async () => {
    const d = shared()
    const c = await d.connect()
    expectError(await rawRequest(c, `{"type":"frobnicate","id":"u1"}`, "u1"), "unknown_command", "u1", "frobnicate")
    expectError(
      await rawRequest(c, `{"type":"command","id":"u2","protocol":${JSON.stringify(PROTOCOL)},"command":{"type":"frobnicate"}}`, "u2"),
      "unknown_command",
      "u2",
      "frobnicate"
    )
    // The envelope type itself as a bare command type is not a command.
    for (const [i, protocol] of [{ name: "agentd", version: 2 }, { name: "other", version: 1 }, { name: "agentd", version: "1" }].entries()) {
      const rid = `v${i}`
      const r = await rawRequest(c, JSON.stringify({ type: "command", id: rid, protocol, command: { type: "ping" } }), rid)
      expectError(r, "unsupported_protocol", rid)
      expect(r["error"].details?.supported, JSON.stringify(r)).toBeDefined()
    }
  })

  it("session_not_found for every command naming an unknown session", async () => {
    const d = shared()
    const c = await d.connect()
    const cmds: Array<Msg> = [
      { type: "attach" },
      { type: "prompt", message: "hi" },
      { type: "abort" },
      { type: "get_state" },
      { type: "get_messages" },
      { type: "checkpoint" },
      { type: "retry_worker" },
      { type: "kill" }
    ]
    for (const cmd of cmds) {
      const r = await c.request({ ...cmd, activeSessionId: "no-such-session" })
      expectError(r, "session_not_found", r["id"], cmd["type"])
    }
  })

  it("session_busy: a prompt during a /sleep 2000 turn", async () => {
    const d = shared()
    const c = await d.connect()
    const { id } = await createSession(c)
    await c.ok({ type: "attach", activeSessionId: id })
    await c.ok({ type: "prompt", activeSessionId: id, message: "/sleep 2000" })
    await c.waitFor(isEvent("tool_execution_start"))
    const r = await c.request({ type: "prompt", activeSessionId: id, message: "too soon" })
    expectError(r, "session_busy", r["id"], "prompt")
    // The first turn is undisturbed and completes.
    const turn = await collectTurn(c, id, 10_000)
    expect(turn.some(isEvent("agent_end"))).toBe(true)
    const msgs = await c.ok({ type: "get_messages", activeSessionId: id })
    expect((msgs["messages"] as Array<Msg>).some((m) => m["content"] === "too soon")).toBe(false)
  }, 20_000)

  it("telemetry_policy_violation: telemetryDisabled against a telemetry session", async () => {
    const d = shared()
    const c = await d.connect()
    const { id } = await createSession(c, { telemetry: true })
    const r = await c.request({ type: "attach", activeSessionId: id, telemetryDisabled: true })
    expectError(r, "telemetry_policy_violation", r["id"], "attach")
    await sleep(100)
    expect(c.received((m) => m["type"] === "session_attached")).toEqual([])
    // Not a violation: telemetryDisabled false, or a session without telemetry.
    await c.ok({ type: "attach", activeSessionId: id, telemetryDisabled: false })
    const { id: plain } = await createSession(c)
    await c.ok({ type: "attach", activeSessionId: plain, telemetryDisabled: true })
  })
})

// ---------------------------------------------------------------------------------------------

describe("framing", () => {
  it("CRLF, blank and whitespace-only lines, several commands per write, byte-by-byte writes; responses in order", async () => {
    const d = shared()
    const c = await d.connect()
    await c.sendRaw(`{"type":"ping","id":"f1"}\r\n\n   \n\t \r\n{"type":"ping","id":"f2"}\n{"type":"list","id":"f3"}\n`)
    const bytes = Buffer.from(`{"type":"ping","id":"f4"}\n{"type":"status","id":"f5"}\r\n`)
    for (const b of bytes) {
      await c.sendRaw(Buffer.from([b]))
    }
    await c.response("f5")
    const responses = c.received((m) => m["type"] === "response")
    expect(responses.map((r) => r["id"])).toEqual(["f1", "f2", "f3", "f4", "f5"])
    expect(responses.every((r) => r["success"] === true)).toBe(true)
    // A multi-byte UTF-8 character split across writes.
    const { id } = await createSession(c)
    const line = Buffer.from(JSON.stringify({ type: "prompt", id: "utf", activeSessionId: id, message: "héllo wörld ✓" }) + "\n")
    const cut = line.indexOf(Buffer.from("✓")) + 1
    await c.sendRaw(line.subarray(0, cut))
    await sleep(30)
    await c.sendRaw(line.subarray(cut))
    expect((await c.response("utf"))["success"]).toBe(true)
    let msgs: Msg = {}
    for (let i = 0; i < 100; i++) {
      msgs = await c.ok({ type: "get_messages", activeSessionId: id })
      if (msgs["total"] === 2) break
      await sleep(30)
    }
    expect(msgs["messages"][0].content).toBe("héllo wörld ✓")
    expect(msgs["messages"][1].content).toBe("echo: héllo wörld ✓")
  })

  it("half-close: responses owed are delivered, including a final line without newline; then the daemon ends the connection", async () => {
    const d = shared()
    const c = await d.connect()
    await c.sendRaw(`{"type":"ping","id":"h1"}\n{"type":"list","id":"h2"}\n{"type":"ping","id":"h3"}`)
    c.end()
    expect((await c.response("h1"))["success"]).toBe(true)
    expect((await c.response("h2"))["success"]).toBe(true)
    expect((await c.response("h3"))["success"]).toBe(true)
    expect(await c.waitClosed(5_000), "daemon should end a half-closed, unattached connection").toBe(true)
    expect(d.running).toBe(true)
  })

  it("half-close while attached: events keep flowing until the session closes", async () => {
    const d = shared()
    const ctl = await d.connect("ctl")
    const { id } = await createSession(ctl)
    const h = await d.connect("half")
    const aid = h.sendCommand({ type: "attach", activeSessionId: id })
    h.end()
    expect((await h.response(aid))["success"]).toBe(true)
    await h.waitFor((m) => m["type"] === "session_attached")
    await ctl.ok({ type: "prompt", activeSessionId: id, message: "still there" })
    const turn = await collectTurn(h, id)
    expect(turn.some(isEvent("agent_end"))).toBe(true)
    expect(h.closed).toBe(false)
    await ctl.ok({ type: "kill", activeSessionId: id })
    const closed = await h.waitFor((m) => m["type"] === "session_closed")
    expect(closed["reason"]).toBe("killed")
    expect(await h.waitClosed(5_000), "connection should end once nothing is owed").toBe(true)
  })

  it("a barrage of bad input never closes the connection or the daemon; one response per line", async () => {
    const d = shared()
    const c = await d.connect()
    let seed = 12345
    const rand = (): number => {
      seed = (seed * 1103515245 + 12345) & 0x7fffffff
      return seed / 0x7fffffff
    }
    const P = PROTOCOL
    const valid = [
      { type: "ping", id: "v" },
      { type: "command", id: "v", protocol: P, command: { type: "list" } },
      { type: "get_state", id: "v", activeSessionId: "zzz" },
      { type: "attach", id: "v", activeSessionId: "zzz", resumeCursor: { generation: 1, sequence: 3 } }
    ]
    const lines: Array<{ text: string | Buffer; id: string | null }> = []
    for (let i = 0; i < 300; i++) {
      const kind = i % 6
      if (kind === 0) {
        // Random bytes without a newline, starting with a non-space so the line is not blank.
        const n = 1 + Math.floor(rand() * 300)
        const b = Buffer.alloc(n + 1)
        b[0] = 0x23 // '#'
        for (let j = 1; j <= n; j++) {
          let x = Math.floor(rand() * 256)
          if (x === 0x0a) x = 0x0b
          b[j] = x
        }
        lines.push({ text: b, id: null })
      } else if (kind === 1) {
        const base = JSON.stringify({ ...valid[i % valid.length]!, id: `t${i}` })
        const cut = 1 + Math.floor(rand() * (base.length - 2))
        const text = base.slice(0, cut)
        // The id is salvaged only if the whole `"id":"t<i>"` pair made it into the line.
        lines.push({ text, id: text.includes(`"id":"t${i}"`) ? `t${i}` : null })
      } else if (kind === 2) {
        lines.push({ text: JSON.stringify({ type: "command", id: `w${i}`, protocol: { name: "agentd", version: 1 + (i % 5) + 1 }, command: { type: "ping" } }), id: `w${i}` })
      } else if (kind === 3) {
        lines.push({ text: JSON.stringify({ type: `nope_${i}`, id: `u${i}` }), id: `u${i}` })
      } else if (kind === 4) {
        const wrong = [
          { type: "prompt", id: `x${i}`, activeSessionId: 1, message: "m" },
          { type: "get_messages", id: `x${i}`, activeSessionId: "s", limit: "10" },
          { type: "attach", id: `x${i}`, activeSessionId: "s", capabilities: "chunked_snapshot" },
          { type: "create", id: `x${i}`, telemetry: "yes" },
          { type: "create", id: `x${i}`, env: { TERM: 5 } },
          { type: "command", id: `x${i}`, protocol: P, command: { type: "prompt", activeSessionId: "s", message: null } }
        ]
        lines.push({ text: JSON.stringify(wrong[i % wrong.length]), id: `x${i}` })
      } else {
        const junk = [`{}`, `[]`, `{"type":null,"id":"j${i}"}`, `{"id":"j${i}","type":"ping","id":5}`, `{"a":`, `\u0000\u0001`]
        const text = junk[i % junk.length]!
        lines.push({ text, id: text.startsWith(`{"type":null`) ? `j${i}` : null })
      }
    }
    const payload = Buffer.concat(lines.flatMap((l) => [Buffer.isBuffer(l.text) ? l.text : Buffer.from(l.text), Buffer.from("\n")]))
    // Send in odd-sized pieces.
    for (let off = 0; off < payload.length; ) {
      const n = 1 + Math.floor(rand() * 4096)
      await c.sendRaw(payload.subarray(off, off + n))
      off += n
    }
    await c.sendRaw(`{"type":"ping","id":"after-barrage"}\n`)
    const last = await c.response("after-barrage", 20_000)
    expect(last["data"]).toEqual({ pong: true })
    const responses = c.received((m) => m["type"] === "response")
    expect(responses.length, "exactly one response per non-blank line").toBe(lines.length + 1)
    const errs = responses.slice(0, -1)
    expect(errs.filter((r) => r["success"] !== false).map((r) => JSON.stringify(r))).toEqual([])
    // Ids that can be recovered are echoed, in order.
    const expectedIds = lines.map((l) => l.id)
    const gotIds = errs.map((r) => r["id"])
    const mismatches = expectedIds.flatMap((id, i) => (id !== null && gotIds[i] !== id ? [`line ${i}: expected id ${id}, got ${gotIds[i]}`] : []))
    expect(mismatches).toEqual([])
    const codes = new Set(errs.map((r) => r["error"].code))
    for (const code of ["parse_error", "invalid_command", "unknown_command", "unsupported_protocol"]) expect(codes).toContain(code)
    expect(c.badLines).toEqual([])
    expect(c.closed).toBe(false)
    // A fresh connection works too.
    const c2 = await d.connect("fresh")
    expect(await c2.ok({ type: "ping" })).toEqual({ pong: true })
    expect(await c.ok({ type: "ping" })).toEqual({ pong: true })
    expect(d.running).toBe(true)
  }, 30_000)
  // Section 8: `serve` "logs to stderr" (Effect's default logger writes to stdout).
  it("logs to stderr, never to stdout (section 8): the shared daemon after all the traffic above", async () => {
    const d = shared()
    const c = await d.connect()
    const { id } = await createSession(c)
    await c.ok({ type: "attach", activeSessionId: id })
    await c.ok({ type: "prompt", activeSessionId: id, message: "some log lines" })
    await collectTurn(c, id)
    await c.ok({ type: "kill", activeSessionId: id })
    await sleep(200)
    expect(d.stderr.length, `the daemon logged nothing on stderr; stdout has: ${d.stdout.slice(0, 300)}`).toBeGreaterThan(0)
    expect(d.stdout, "daemon output on stdout").toBe("")
  })
})

// ---------------------------------------------------------------------------------------------

describe("stale and live sockets", () => {
  it("refuses to start when another daemon listens on the socket", async () => {
    const d = shared()
    let second: Daemon | undefined
    let err: unknown
    try {
      second = await startDaemon({ stateDir: d.stateDir })
    } catch (e) {
      err = e
    }
    if (second !== undefined) await second.cleanup()
    expect(second, "a second daemon must not start on the same socket").toBeUndefined()
    // The state dir's lock refuses it first (one daemon per state dir), naming the first.
    expect(String(err)).toContain(`another daemon (pid ${d.pid}, socket ${d.socketPath}) holds ${d.stateDir}`)
    expect(String(err)).not.toMatch(/code 0,/)
    const c = await d.connect()
    expect(await c.ok({ type: "ping" })).toEqual({ pong: true })
  }, 30_000)
})

// Keep the Client import used for typing in helpers above.
export type { Client }
