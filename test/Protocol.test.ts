import { assert, describe, it } from "@effect/vitest"
import * as Arbitrary from "effect/Arbitrary"
import * as Either from "effect/Either"
import * as FastCheck from "effect/FastCheck"
import * as Schema from "effect/Schema"
import * as Protocol from "../src/Protocol.js"
import { isUtf8 } from "node:buffer"
import * as WorkerProtocol from "../src/WorkerProtocol.js"

const envelope = (command: unknown, extra: Record<string, unknown> = {}) =>
  JSON.stringify({ type: "command", id: "c1", protocol: { name: "agentd", version: 1 }, command, ...extra })

const decodeOk = (line: string) => {
  const result = Protocol.decodeCommandLine(line)
  if (Either.isLeft(result)) assert.fail(`expected a command, got ${result.left.code}: ${result.left.message}`)
  return result.right
}

const decodeErr = (line: string) => {
  const result = Protocol.decodeCommandLine(line)
  if (Either.isRight(result)) assert.fail(`expected an error, got ${JSON.stringify(result.right)}`)
  return result.left
}

describe("Protocol.decodeCommandLine", () => {
  it("decodes the envelope form", () => {
    const decoded = decodeOk(envelope({ type: "prompt", activeSessionId: "s1", message: "hi" }, { clientId: "k" }))
    assert.deepStrictEqual(decoded, {
      id: "c1",
      clientId: "k",
      command: { type: "prompt", activeSessionId: "s1", message: "hi" }
    })
  })

  it("decodes the bare form, with or without id", () => {
    assert.deepStrictEqual(decodeOk(`{"type":"ping","id":"p"}`), { id: "p", command: { type: "ping" } })
    assert.deepStrictEqual(decodeOk(`{"type":"list"}`), { id: null, command: { type: "list" } })
    const attach = decodeOk(
      `{"type":"attach","activeSessionId":"s","resumeCursor":{"generation":2,"sequence":5},"capabilities":["slim_attach","future_cap"]}`
    )
    assert.deepStrictEqual(attach.command, {
      type: "attach",
      activeSessionId: "s",
      resumeCursor: { generation: 2, sequence: 5 },
      capabilities: ["slim_attach", "future_cap"]
    })
  })

  it("decodes every command type", () => {
    const samples: Record<Protocol.CommandType, Record<string, unknown>> = {
      ping: {},
      create: { name: "n", engine: "echo", config: { tokenDelayMs: 1 }, telemetry: true, env: { TERM: "x" }, launchEnv: { A: "b" } },
      list: {},
      status: {},
      attach: { activeSessionId: "s" },
      detach: { activeSessionId: "s" },
      prompt: { activeSessionId: "s", message: "m" },
      abort: { activeSessionId: "s" },
      get_state: { activeSessionId: "s" },
      get_messages: { activeSessionId: "s", offset: 0, limit: 1000 },
      checkpoint: { activeSessionId: "s" },
      retry_worker: { activeSessionId: "s" },
      kill: { activeSessionId: "s" },
      rename: { activeSessionId: "s", name: "n" },
      shutdown: {}
    }
    for (const [type, fields] of Object.entries(samples)) {
      const decoded = decodeOk(envelope({ type, ...fields }))
      assert.deepStrictEqual(decoded.command, { type, ...fields } as unknown as Protocol.Command)
    }
  })

  it("parse_error: not JSON, id salvaged when the line shows one", () => {
    const err = decodeErr(`{"type":"ping","id":"abc", oops}`)
    assert.strictEqual(err.code, "parse_error")
    assert.strictEqual(err.id, "abc")
    assert.strictEqual(err.command, "parse")
    const noId = decodeErr(`{"type":"ping"`)
    assert.strictEqual(noId.code, "parse_error")
    assert.strictEqual(noId.id, null)
    assert.strictEqual(decodeErr("\uFFFD\uFFFD").code, "parse_error")
  })

  it("invalid_command: not an object, missing envelope fields, wrong field types (message names the field)", () => {
    for (const line of ["[1,2]", "42", "null", "\"ping\""]) {
      const err = decodeErr(line)
      assert.strictEqual(err.code, "invalid_command")
      assert.strictEqual(err.command, "parse")
    }
    const noProtocol = decodeErr(JSON.stringify({ type: "command", id: "x1", command: { type: "ping" } }))
    assert.strictEqual(noProtocol.code, "invalid_command")
    assert.strictEqual(noProtocol.id, "x1")
    assert.match(noProtocol.message, /protocol/)
    const noCommand = decodeErr(JSON.stringify({ type: "command", id: "x2", protocol: Protocol.PROTOCOL }))
    assert.strictEqual(noCommand.code, "invalid_command")
    assert.strictEqual(noCommand.id, "x2")
    assert.match(noCommand.message, /command/)
    const wrongType = decodeErr(envelope({ type: "prompt", activeSessionId: "s", message: 42 }))
    assert.strictEqual(wrongType.code, "invalid_command")
    assert.strictEqual(wrongType.id, "c1")
    assert.strictEqual(wrongType.command, "prompt")
    assert.match(wrongType.message, /`message`/)
    const missing = decodeErr(`{"type":"attach","id":"a9"}`)
    assert.strictEqual(missing.id, "a9")
    assert.match(missing.message, /`activeSessionId`/)
    const badCursor = decodeErr(`{"type":"attach","id":"a","activeSessionId":"s","resumeCursor":{"generation":0,"sequence":-1}}`)
    assert.strictEqual(badCursor.code, "invalid_command")
    assert.match(badCursor.message, /resumeCursor/)
    // A `__proto__` key is dropped, never assigned as a prototype.
    const proto = decodeOk(`{"type":"create","id":"e","env":{"__proto__":"x","TERM":"t"}}`)
    assert.deepStrictEqual(proto.command, { type: "create", env: { TERM: "t" } })
    assert.strictEqual(Object.getPrototypeOf((proto.command as { env: object }).env), Object.prototype)
    const badLimit = decodeErr(`{"type":"get_messages","activeSessionId":"s","limit":1001}`)
    assert.match(badLimit.message, /`limit`/)
    const noType = decodeErr(`{"id":"q"}`)
    assert.strictEqual(noType.code, "invalid_command")
    assert.strictEqual(noType.id, "q")
    assert.strictEqual(noType.command, "parse")
    const numericId = decodeErr(`{"type":"ping","id":7}`)
    assert.strictEqual(numericId.code, "invalid_command")
    assert.match(numericId.message, /`id`/)
  })

  it("unknown_command: the type is echoed as the command", () => {
    const err = decodeErr(envelope({ type: "fly" }))
    assert.strictEqual(err.code, "unknown_command")
    assert.strictEqual(err.id, "c1")
    assert.strictEqual(err.command, "fly")
    const bare = decodeErr(`{"type":"toString","id":"t"}`)
    assert.strictEqual(bare.code, "unknown_command")
    assert.strictEqual(bare.id, "t")
  })

  it("unsupported_protocol: another name or version", () => {
    for (const protocol of [{ name: "agentd", version: 2 }, { name: "prime", version: 1 }, "agentd"]) {
      const err = decodeErr(envelope({ type: "ping" }, { protocol }))
      assert.strictEqual(err.code, "unsupported_protocol")
      assert.strictEqual(err.id, "c1")
      assert.strictEqual(err.command, "ping")
    }
  })

  it("line_too_long has a code and a response shape", () => {
    const response = Protocol.failure(null, "parse", { code: "line_too_long", message: "too long" })
    assert.deepStrictEqual(JSON.parse(Protocol.encode(response)), {
      type: "response",
      id: null,
      command: "parse",
      success: false,
      error: { code: "line_too_long", message: "too long" }
    })
  })

  it("failureOf turns a ProtocolError into the documented response", () => {
    const err = decodeErr(envelope({ type: "fly" }))
    const wire = JSON.parse(Protocol.encode(Protocol.failureOf(err)))
    assert.deepStrictEqual(wire, {
      type: "response",
      id: "c1",
      command: "fly",
      success: false,
      error: { code: "unknown_command", message: "Unknown command `fly`." }
    })
  })

  it("encodeCommand produces an envelope that decodes back", () => {
    const command: Protocol.Command = { type: "get_messages", activeSessionId: "s", offset: 3 }
    const decoded = decodeOk(Protocol.encodeCommand("z", command))
    assert.deepStrictEqual(decoded, { id: "z", command })
  })
})

/** encode -> JSON text -> decode -> encode gives the same JSON text. */
const roundTrips = <A, I>(name: string, schema: Schema.Schema<A, I>) =>
  it.prop(name, [Arbitrary.make(schema)], ([value]) => {
    const wire = JSON.stringify(Schema.encodeSync(schema)(value))
    const decoded = Schema.decodeUnknownSync(schema)(JSON.parse(wire))
    assert.strictEqual(JSON.stringify(Schema.encodeSync(schema)(decoded)), wire)
  }, { fastCheck: { numRuns: 50 } })

describe("Protocol schemas round-trip", () => {
  const schemas: Record<string, Schema.Schema<any, any>> = {
    Command: Protocol.Command,
    CommandEnvelope: Protocol.CommandEnvelope,
    ServerMessage: Protocol.ServerMessage,
    DaemonAttachResult: Protocol.DaemonAttachResult,
    SessionSummary: Protocol.SessionSummary,
    AgentEvent: Protocol.AgentEvent,
    AgentMessage: Protocol.AgentMessage,
    WorkerFrame: WorkerProtocol.WorkerFrame,
    SupervisorFrame: WorkerProtocol.SupervisorFrame
  }
  for (const [name, schema] of Object.entries(schemas)) roundTrips(name, schema)

  it.prop("every generated command decodes through decodeCommandLine, in both forms", [Arbitrary.make(Protocol.Command), FastCheck.string()], ([command, id]) => {
    const bare = JSON.stringify({ ...command, id })
    assert.deepStrictEqual(decodeOk(bare), { id, command })
    assert.deepStrictEqual(decodeOk(Protocol.encodeCommand(id, command)), { id, command })
  }, { fastCheck: { numRuns: 200 } })

  it.prop("every generated server message decodes through decodeServerLine", [Arbitrary.make(Protocol.ServerMessage)], ([message]) => {
    const decoded = Protocol.decodeServerLine(Protocol.encode(message))
    assert.isTrue(Either.isRight(decoded))
    assert.strictEqual(Protocol.encode(Either.getOrThrow(decoded)), Protocol.encode(message))
  }, { fastCheck: { numRuns: 200 } })
})

describe("WorkerProtocol", () => {
  it("decodes frames and reports readable errors", () => {
    const ok = WorkerProtocol.decodeWorkerFrame(WorkerProtocol.encodeFrame({ type: "worker_ready", pid: 12, messageCount: 0 }))
    assert.isTrue(Either.isRight(ok))
    const bad = WorkerProtocol.decodeWorkerFrame(`{"type":"worker_ready","pid":"x","messageCount":0}`)
    assert.isTrue(Either.isLeft(bad))
    assert.match(Either.isLeft(bad) ? bad.left : "", /pid/)
    assert.isTrue(Either.isLeft(WorkerProtocol.decodeSupervisorFrame("not json")))
  })

  it("an event frame carries the event's type first and is read without parsing its event", () => {
    // Built with `type` last: the encoder still puts it first.
    const event = { messageId: "m", delta: "a \"b\"\n", type: "message_update" } as unknown as Protocol.AgentEvent
    const line = WorkerProtocol.encodeFrame({ type: "worker_event", event })
    assert.isTrue(line.startsWith(`{"type":"worker_event","event":{"type":"message_update",`))
    const read = WorkerProtocol.readWorkerLine(line.slice(0, -1)) as WorkerProtocol.EventFrame
    assert.strictEqual(read.eventType, "message_update")
    assert.deepStrictEqual(JSON.parse(WorkerProtocol.eventTextOf(read)), event)
    assert.strictEqual(WorkerProtocol.eventTextOf(read), JSON.stringify(JSON.parse(line).event))
    // Still a plain JSON line that the schema decodes.
    assert.isTrue(Either.isRight(WorkerProtocol.decodeWorkerFrame(line)))
  })

  it.prop("readWorkerLine gives every event frame's type and exact event", [Arbitrary.make(WorkerProtocol.WorkerEvent)], ([frame]) => {
    const read = WorkerProtocol.readWorkerLine(WorkerProtocol.encodeFrame(frame).slice(0, -1)) as WorkerProtocol.EventFrame
    assert.strictEqual(read.type, "worker_event")
    assert.strictEqual(read.eventType, frame.event.type)
    assert.deepStrictEqual(JSON.parse(WorkerProtocol.eventTextOf(read)), JSON.parse(JSON.stringify(frame.event)))
  }, { fastCheck: { numRuns: 200 } })

  it.prop("readWorkerBytes reads a line inside a larger buffer (lines and quotes after it)", [Arbitrary.make(WorkerProtocol.WorkerEvent), Arbitrary.make(WorkerProtocol.WorkerEvent)], ([a, b]) => {
    const lines = [WorkerProtocol.encodeFrame(a), WorkerProtocol.encodeFrame(b)]
    const buf = Buffer.from(`junk"${lines.join("")}"tail`, "utf8")
    let start = buf.indexOf("{")
    for (const [k, frame] of [a, b].entries()) {
      const end = buf.indexOf(10, start)
      const read = WorkerProtocol.readWorkerBytes(buf, start, end) as WorkerProtocol.EventFrame
      assert.strictEqual(read.eventType, frame.event.type, `line ${k}`)
      assert.strictEqual(WorkerProtocol.eventTextOf(read), JSON.stringify(JSON.parse(lines[k]!).event))
      start = end + 1
    }
  }, { fastCheck: { numRuns: 100 } })

  it("an event line whose type does not close within it is never read past its end", () => {
    // The quote that would close the type is in the next line of the same chunk.
    const buf = Buffer.from(`{"type":"worker_event","event":{"type":"message_update}}\n{"type":"worker_event","event":{"type":"x"}}\n`)
    const end = buf.indexOf(10)
    assert.throws(() => WorkerProtocol.readWorkerBytes(buf, 0, end))
  })

  it("an event that is not valid UTF-8 is read as a decoder reads it (U+FFFD), never passed on as it came", () => {
    const head = Buffer.from(`{"type":"worker_event","event":{"type":"message_update","delta":"a`)
    const buf = Buffer.concat([head, Buffer.from([0xff, 0xc3]), Buffer.from(`b"}}`)])
    const read = WorkerProtocol.readWorkerBytes(buf, 0, buf.length) as WorkerProtocol.EventFrame
    assert.strictEqual(read.eventType, "message_update")
    assert.isTrue(isUtf8(read.eventBytes))
    assert.deepStrictEqual(JSON.parse(WorkerProtocol.eventTextOf(read)), { type: "message_update", delta: "a\ufffd\ufffdb" })
  })

  it("lines off the fast path are parsed: other key orders, escaped types, other frames", () => {
    const reordered = WorkerProtocol.readWorkerLine(`{"event":{"delta":"x","type":"message_update"},"type":"worker_event"}`)
    const textOf = (f: WorkerProtocol.ReceivedFrame) => ({ ...f, eventBytes: WorkerProtocol.eventTextOf(f as WorkerProtocol.EventFrame) })
    assert.deepStrictEqual(textOf(reordered), { type: "worker_event", eventType: "message_update", eventBytes: `{"delta":"x","type":"message_update"}` })
    const escaped = WorkerProtocol.readWorkerLine(`{"type":"worker_event","event":{"type":"agent\\u005fend"}}`)
    assert.deepStrictEqual(textOf(escaped), { type: "worker_event", eventType: "agent_end", eventBytes: `{"type":"agent_end"}` })
    assert.deepStrictEqual(WorkerProtocol.readWorkerLine(`{"type":"worker_ready","pid":3,"messageCount":0}`), {
      type: "worker_ready",
      pid: 3,
      messageCount: 0
    })
    assert.throws(() => WorkerProtocol.readWorkerLine(`{"type":"worker_event","event":{"type":"x"`))
    // An event frame without an event object with a string type is refused, never passed on.
    for (const bad of [`{"type":"worker_event"}`, `{"type":"worker_event","event":{"type":7}}`, `{"type":"worker_event","event":[1]}`]) {
      assert.throws(() => WorkerProtocol.readWorkerLine(bad), /worker_event/)
    }
  })
})
