/**
 * The model engines against real HTTP servers on 127.0.0.1 speaking each provider's streaming
 * format (test/support/fakeModels.ts): text, a tool-call round trip, retries, errors, a cut
 * stream, an abort. The same suite runs against `openai`, `openai-compat` and `anthropic`.
 */
import * as AnthropicClient from "@effect/ai-anthropic/AnthropicClient"
import * as OpenAiClient from "@effect/ai-openai/OpenAiClient"
import { assert, describe, it } from "@effect/vitest"
import * as Cause from "effect/Cause"
import * as Chunk from "effect/Chunk"
import * as ConfigProvider from "effect/ConfigProvider"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Schedule from "effect/Schedule"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import * as HttpClient from "@effect/platform/HttpClient"
import * as HttpClientResponse from "@effect/platform/HttpClientResponse"
import * as TestClock from "effect/TestClock"
import { type EngineSession, TranscriptReplaced } from "../src/Engine.js"
import { compactionCut, ModelTimeout, retryAfterMs, timeoutOf, toPrompt, withRetries, withTimeouts } from "../src/engines/modelEngine.js"
import * as ModelEngines from "../src/engines/ModelEngines.js"
import type { AgentEvent, AgentMessage } from "../src/Protocol.js"
import { anthropic, chat, type FakeModel, responses, startFakeModel, type Step } from "./support/fakeModels.js"

const KEY = "sk-test-0123456789-secret"

interface Provider {
  readonly engine: "openai" | "openai-compat" | "anthropic"
  readonly keyEnv: string
  readonly path: string
  readonly baseUrl: (fake: FakeModel) => string
  readonly text: (deltas: ReadonlyArray<string>, options?: { delayMs?: number; end?: "complete" | "cut" | "hang" }) => Array<Step>
  readonly toolCall: (id: string, name: string, args: unknown) => Array<Step>
  /** The first deltas, then the first bytes of the next event, then silence (the connection open). */
  readonly stall: (deltas: ReadonlyArray<string>) => Array<Step>
  /** The key as the request carried it. */
  readonly sentKey: (headers: Record<string, unknown>) => unknown
  /** The tool results in a request body, as [call id, output text]. */
  readonly toolResults: (body: any) => Array<[string, string]>
}

const providers: ReadonlyArray<Provider> = [
  {
    engine: "openai-compat",
    keyEnv: "OPENAI_API_KEY",
    path: "/v1/chat/completions",
    baseUrl: (f) => `${f.url}/v1`,
    text: (deltas, o = {}) => (o.end === "cut" ? chat.cut(deltas) : o.end === "hang" ? chat.hang(deltas) : chat.text(deltas, o)),
    toolCall: (id, name, args) => chat.toolCall(id, name, args),
    stall: (deltas) => chat.stall(deltas),
    sentKey: (h) => h["authorization"],
    toolResults: (body) => body.messages.filter((m: any) => m.role === "tool").map((m: any) => [m.tool_call_id, m.content])
  },
  {
    engine: "openai",
    keyEnv: "OPENAI_API_KEY",
    path: "/v1/responses",
    baseUrl: (f) => `${f.url}/v1`,
    text: (deltas, o) => responses.text(deltas, o),
    toolCall: (id, name, args) => responses.toolCall(id, name, args),
    stall: (deltas) => [...responses.text(deltas, { end: "hang" }).slice(0, -1), { raw: "event: response.output_te" }, { hang: true }],
    sentKey: (h) => h["authorization"],
    toolResults: (body) =>
      body.input.filter((m: any) => m.type === "function_call_output").map((m: any) => [m.call_id, JSON.parse(m.output)])
  },
  {
    engine: "anthropic",
    keyEnv: "ANTHROPIC_API_KEY",
    path: "/v1/messages",
    baseUrl: (f) => f.url,
    text: (deltas, o) => anthropic.text(deltas, o),
    toolCall: (id, name, args) => anthropic.toolCall(id, name, args),
    stall: (deltas) => [...anthropic.text(deltas, { end: "hang" }).slice(0, -1), { raw: "event: content_blo" }, { hang: true }],
    sentKey: (h) => h["x-api-key"],
    toolResults: (body) =>
      body.messages.flatMap((m: any) =>
        Array.isArray(m.content)
          ? m.content.filter((c: any) => c.type === "tool_result").map((c: any) => [
            c.tool_use_id,
            // The provider sends a result as JSON text.
            JSON.parse(typeof c.content === "string" ? c.content : c.content.map((x: any) => x.text).join(""))
          ])
          : []
      )
  }
]

const withFake = <A, E>(f: (fake: FakeModel, cwd: string) => Effect.Effect<A, E>) =>
  Effect.acquireUseRelease(
    Effect.promise(async () => ({ fake: await startFakeModel(), cwd: fs.mkdtempSync(path.join(os.tmpdir(), "agentd-model-")) })),
    ({ cwd, fake }) => f(fake, cwd),
    ({ cwd, fake }) => Effect.promise(() => fake.close()).pipe(Effect.zipRight(Effect.sync(() => fs.rmSync(cwd, { recursive: true, force: true }))))
  )

const start = (p: Provider, fake: FakeModel, cwd: string, config: Record<string, unknown> = {}) =>
  ModelEngines.engines()[p.engine]!.make({ model: "m-test", baseUrl: p.baseUrl(fake), cwd, retryBaseDelayMs: 10, ...config }).pipe(
    Effect.withConfigProvider(ConfigProvider.fromMap(new Map([[p.keyEnv, KEY]])))
  )

/** A turn's events (a transcript replacement is not an event). */
const turn = (session: EngineSession, message: string, history: ReadonlyArray<AgentMessage> = [], turnId = "t1") =>
  Effect.map(
    Stream.runCollect(session.runTurn({ turnId, message, history })),
    (outputs) => Chunk.toArray(outputs).filter((o): o is AgentEvent => !(o instanceof TranscriptReplaced))
  )

const transcriptOf = (events: ReadonlyArray<AgentEvent>): Array<AgentMessage> =>
  events.flatMap((e) => (e.type === "message_end" ? [e.message] : []))

const types = (events: ReadonlyArray<AgentEvent>) => events.map((e) => e.type)

/** The `error` of a turn's `agent_end` (undefined: the turn succeeded). */
const endError = (events: ReadonlyArray<AgentEvent>) => {
  const end = events.at(-1)
  assert.strictEqual(end?.type, "agent_end")
  return (end as Extract<AgentEvent, { type: "agent_end" }>).error
}

describe("model engines: the fakes speak the providers' formats", () => {
  it.effect("Responses API events decode with @effect/ai-openai's own schema", () =>
    Effect.gen(function*() {
      const decode = Schema.decodeUnknownEither(Schema.parseJson(OpenAiClient.ResponseStreamEvent))
      for (const step of [...responses.text(["a", "b"]), ...responses.toolCall("call_1", "read_file", { path: "x" })]) {
        if ("sse" in step) {
          const decoded = decode(step.sse)
          assert.isTrue(Either.isRight(decoded), `${step.event}: ${Either.isLeft(decoded) ? decoded.left.message : ""}`)
        }
      }
    }))

  it.effect("Anthropic events decode with @effect/ai-anthropic's own schema", () =>
    Effect.gen(function*() {
      const decode = Schema.decodeUnknownEither(Schema.parseJson(AnthropicClient.MessageStreamEvent))
      for (const step of [...anthropic.text(["a", "b"]), ...anthropic.toolCall("toolu_1", "read_file", { path: "x" }, "hm")]) {
        if ("sse" in step) {
          const decoded = decode(step.sse)
          assert.isTrue(Either.isRight(decoded), `${step.event}: ${Either.isLeft(decoded) ? decoded.left.message : ""}`)
        }
      }
    }))
})

for (const p of providers) {
  describe(`model engine ${p.engine} (fake server)`, () => {
    it.live("streams a text answer as message_update deltas; sends the model, system prompt and key", () =>
      withFake((fake, cwd) =>
        Effect.gen(function*() {
          fake.reply({ steps: p.text(["Hel", "lo ", "world"]) })
          const session = yield* start(p, fake, cwd, { system: "be brief", temperature: 0.5, maxTokens: 100 })
          const events = yield* turn(session, "hi")
          assert.deepStrictEqual(types(events), [
            "agent_start",
            "turn_start",
            "message_start",
            "message_end",
            "message_start",
            "message_update",
            "message_update",
            "message_update",
            "message_end",
            "turn_end",
            "agent_end"
          ])
          const deltas = events.flatMap((e) => (e.type === "message_update" ? [e.delta] : []))
          assert.deepStrictEqual(deltas, ["Hel", "lo ", "world"])
          assert.deepStrictEqual(transcriptOf(events).map((m) => [m.role, m.content]), [["user", "hi"], ["assistant", "Hello world"]])
          assert.strictEqual(fake.requests.length, 1)
          const req = fake.requests[0]!
          assert.strictEqual(req.path, p.path)
          assert.strictEqual(req.body.model, "m-test")
          assert.include(String(p.sentKey(req.headers)), KEY)
          assert.include(JSON.stringify(req.body), "be brief")
          assert.include(JSON.stringify(req.body), "hi")
        })))

    it.live("a tool-call round trip: read_file runs in cwd, its result goes back, the model answers", () =>
      withFake((fake, cwd) =>
        Effect.gen(function*() {
          fs.writeFileSync(path.join(cwd, "notes.txt"), "the secret word is kumquat")
          fake.reply({ steps: p.toolCall("call_1", "read_file", { path: "notes.txt" }) }, { steps: p.text(["It is ", "kumquat."]) })
          const session = yield* start(p, fake, cwd)
          const events = yield* turn(session, "what is the word?")
          const start_ = events.find((e) => e.type === "tool_execution_start")
          const end = events.find((e) => e.type === "tool_execution_end")
          assert.deepStrictEqual(start_, { type: "tool_execution_start", toolCallId: "call_1", name: "read_file", args: { path: "notes.txt" } })
          assert.deepStrictEqual(end, { type: "tool_execution_end", toolCallId: "call_1", result: "the secret word is kumquat", isError: false })
          const transcript = transcriptOf(events)
          assert.deepStrictEqual(transcript.map((m) => m.role), ["user", "tool", "assistant"])
          assert.strictEqual(transcript[1]!.toolCallId, "call_1")
          assert.strictEqual(transcript[1]!.toolName, "read_file")
          assert.deepStrictEqual(transcript[1]!.toolArgs, { path: "notes.txt" })
          assert.strictEqual(transcript[2]!.content, "It is kumquat.")
          assert.strictEqual(fake.requests.length, 2)
          assert.deepStrictEqual(p.toolResults(fake.requests[1]!.body), [["call_1", "the secret word is kumquat"]])
          // The next turn sends the whole conversation, the tool call and its result included.
          fake.reply({ steps: p.text(["ok"]) })
          yield* turn(session, "thanks", transcript, "t2")
          const third = fake.requests[2]!.body
          assert.deepStrictEqual(p.toolResults(third), [["call_1", "the secret word is kumquat"]])
          assert.include(JSON.stringify(third), "It is kumquat.")
          assert.include(JSON.stringify(third), "thanks")
        })))

    it.live("a 429 with retry-after, then success: retried, the turn answers", () =>
      withFake((fake, cwd) =>
        Effect.gen(function*() {
          fake.reply({ status: 429, headers: { "retry-after": "0" }, body: { error: { message: "slow down" } } }, { steps: p.text(["fine"]) })
          const session = yield* start(p, fake, cwd)
          const events = yield* turn(session, "hi")
          assert.strictEqual(fake.requests.length, 2)
          assert.deepStrictEqual(transcriptOf(events).map((m) => m.content), ["hi", "fine"])
        })))

    it.live("5xx until the retries run out: the turn ends with a clear error message, and the session still works", () =>
      withFake((fake, cwd) =>
        Effect.gen(function*() {
          const boom = { status: 503, body: { error: { message: "overloaded" } } }
          fake.reply(boom, boom, boom)
          const session = yield* start(p, fake, cwd, { maxRetries: 2 })
          const events = yield* turn(session, "hi")
          assert.strictEqual(fake.requests.length, 3)
          assert.deepStrictEqual(types(events).slice(-2), ["turn_end", "agent_end"])
          const last = transcriptOf(events).at(-1)!
          assert.strictEqual(last.role, "assistant")
          assert.isTrue(last.isError)
          assert.include(last.content, "503")
          assert.include(last.content, "overloaded")
          assert.include(last.content, "gave up after 2 retries")
          const error = endError(events)!
          assert.deepStrictEqual([error.code, error.status], ["http_status", 503])
          assert.strictEqual(`Error: ${error.message}`, last.content)
          fake.reply({ steps: p.text(["back"]) })
          const again = yield* turn(session, "again", transcriptOf(events), "t2")
          assert.strictEqual(transcriptOf(again).at(-1)!.content, "back")
          assert.isUndefined(endError(again), "a turn that succeeds has no error")
          // The error message is not sent to the model as if it had said it.
          assert.notInclude(JSON.stringify(fake.requests[3]!.body), "overloaded")
        })))

    it.live("401: the error names the key's variable, never the key", () =>
      withFake((fake, cwd) =>
        Effect.gen(function*() {
          fake.reply({ status: 401, body: { error: { message: `Incorrect API key provided: ${KEY}` } } })
          const session = yield* start(p, fake, cwd)
          const events = yield* turn(session, "hi")
          assert.strictEqual(fake.requests.length, 1, "a 401 is not retried")
          const last = transcriptOf(events).at(-1)!
          assert.isTrue(last.isError)
          assert.include(last.content, "401")
          assert.include(last.content, p.keyEnv)
          assert.notInclude(JSON.stringify(events), KEY)
          assert.deepStrictEqual([endError(events)?.code, endError(events)?.status], ["auth", 401])
          // The error message says it is one from its start (before its text streams).
          const opened = events.find((e) => e.type === "message_start" && e.message.id === last.id)
          assert.isTrue(opened?.type === "message_start" && opened.message.isError === true)
        })))

    it.live("a stream cut mid-way: the partial text stays, an error says so", () =>
      withFake((fake, cwd) =>
        Effect.gen(function*() {
          fake.reply({ steps: p.text(["partial ", "answ"], { end: "cut" }) })
          const session = yield* start(p, fake, cwd, { maxRetries: 0 })
          const events = yield* turn(session, "hi")
          const transcript = transcriptOf(events)
          assert.deepStrictEqual(transcript.map((m) => m.role), ["user", "assistant", "assistant"])
          assert.strictEqual(transcript[1]!.content, "partial answ")
          assert.isTrue(transcript[2]!.isError)
          assert.include(transcript[2]!.content, "cut mid-stream")
          assert.deepStrictEqual(types(events).slice(-2), ["turn_end", "agent_end"])
          assert.strictEqual(endError(events)?.code, "stream_cut")
        })))

    it.live("a stream that stalls after a few bytes: idleTimeoutMs fails the turn (code timeout), the partial text stays, the request is closed", () =>
      withFake((fake, cwd) =>
        Effect.gen(function*() {
          fake.reply({ steps: p.stall(["partial ", "answ"]) })
          const session = yield* start(p, fake, cwd, { idleTimeoutMs: 300 })
          const events = yield* turn(session, "hi")
          assert.strictEqual(fake.requests.length, 1, "a stall in the middle of the body is not retried")
          const error = endError(events)!
          assert.strictEqual(error.code, "timeout")
          assert.include(error.message, "idleTimeoutMs")
          const transcript = transcriptOf(events)
          assert.deepStrictEqual(transcript.map((m) => [m.role, m.content.slice(0, 12), m.isError]), [
            ["user", "hi", undefined],
            ["assistant", "partial answ", undefined],
            ["assistant", "Error: " + transcript[2]!.content.slice(7, 12), true]
          ])
          yield* Effect.promise(() => fake.requests[0]!.done)
          assert.isTrue(fake.requests[0]!.closedEarly, "the server saw the request closed")
          // The session goes on.
          fake.reply({ steps: p.text(["awake"]) })
          const again = yield* turn(session, "again", transcript, "t2")
          assert.strictEqual(transcriptOf(again).at(-1)!.content, "awake")
          assert.isUndefined(endError(again))
        })))

    it.live("an abort mid-stream closes the HTTP request at once", () =>
      withFake((fake, cwd) =>
        Effect.gen(function*() {
          fake.reply({ steps: p.text(["first "], { end: "hang" }) })
          const session = yield* start(p, fake, cwd)
          const seen: Array<unknown> = []
          const fiber = yield* session.runTurn({ turnId: "t1", message: "hi", history: [] }).pipe(
            Stream.runForEach((e) => Effect.sync(() => seen.push(e))),
            Effect.fork
          )
          while (!seen.some((e) => (e as AgentEvent).type === "message_update")) yield* Effect.sleep("5 millis")
          assert.isFalse(fake.requests[0]!.closedEarly)
          const t0 = Date.now()
          yield* Fiber.interrupt(fiber)
          yield* Effect.promise(() => fake.requests[0]!.done)
          assert.isTrue(fake.requests[0]!.closedEarly, "the server saw the request closed")
          assert.isBelow(Date.now() - t0, 1000)
        })))
  })
}

describe("model engine openai-compat: failures of the endpoint", () => {
  const p = providers[0]!
  it.live("connection refused ends the turn with a clear message", () =>
    Effect.gen(function*() {
      const fake = yield* Effect.promise(() => startFakeModel())
      yield* Effect.promise(() => fake.close())
      const cwd = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-model-"))
      const session = yield* start(p, fake, cwd)
      const events = yield* turn(session, "hi")
      const last = transcriptOf(events).at(-1)!
      assert.isTrue(last.isError)
      assert.include(last.content, "connection refused")
      assert.strictEqual(endError(events)?.code, "connect_failed")
      fs.rmSync(cwd, { recursive: true, force: true })
    }))

  it.live("a malformed stream ends the turn with a clear message", () =>
    withFake((fake, cwd) =>
      Effect.gen(function*() {
        fake.reply({ steps: [{ sse: "{not json" }] })
        const session = yield* start(p, fake, cwd)
        const events = yield* turn(session, "hi")
        const last = transcriptOf(events).at(-1)!
        assert.isTrue(last.isError)
        assert.include(last.content, "malformed")
        assert.strictEqual(endError(events)?.code, "malformed_response")
      })))

  it.live("a server that never answers (no headers): idleTimeoutMs, retried like a 5xx, then code timeout", () =>
    withFake((fake, cwd) =>
      Effect.gen(function*() {
        fake.reply({ silent: true }, { silent: true })
        const session = yield* start(p, fake, cwd, { idleTimeoutMs: 200, maxRetries: 1 })
        const events = yield* turn(session, "hi")
        assert.strictEqual(fake.requests.length, 2)
        assert.strictEqual(endError(events)?.code, "timeout")
        assert.isTrue(transcriptOf(events).at(-1)!.isError)
        for (const r of fake.requests) {
          yield* Effect.promise(() => r.done)
          assert.isTrue(r.closedEarly)
        }
      })))

  it.live("a stream that trickles past requestTimeoutMs: code timeout, naming requestTimeoutMs", () =>
    withFake((fake, cwd) =>
      Effect.gen(function*() {
        // Each piece comes well within idleTimeoutMs; the whole takes at least 600 ms.
        fake.reply({ steps: chat.text(["a", "b", "c", "d", "e", "f"], { delayMs: 100 }) })
        const session = yield* start(p, fake, cwd, { requestTimeoutMs: 250, idleTimeoutMs: 60_000 })
        const events = yield* turn(session, "hi")
        const error = endError(events)!
        assert.strictEqual(error.code, "timeout")
        assert.include(error.message, "requestTimeoutMs")
      })))

  it.live("404 (unknown model) names the model and the baseUrl", () =>
    withFake((fake, cwd) =>
      Effect.gen(function*() {
        fake.reply({ status: 404, body: { error: { message: "model 'm-test' not found" } } })
        const session = yield* start(p, fake, cwd)
        const events = yield* turn(session, "hi")
        const last = transcriptOf(events).at(-1)!
        assert.include(last.content, "404")
        assert.include(last.content, "m-test")
        assert.deepStrictEqual([endError(events)?.code, endError(events)?.status], ["http_status", 404])
      })))

  it.live("maxToolRounds bounds the loop: after that many rounds the request offers no tools", () =>
    withFake((fake, cwd) =>
      Effect.gen(function*() {
        fs.writeFileSync(path.join(cwd, "a.txt"), "A")
        fake.reply(
          { steps: chat.toolCall("c1", "read_file", { path: "a.txt" }) },
          { steps: chat.toolCall("c2", "read_file", { path: "a.txt" }) },
          { steps: chat.text(["done"]) }
        )
        const session = yield* start(p, fake, cwd, { maxToolRounds: 2 })
        const events = yield* turn(session, "loop")
        assert.strictEqual(fake.requests.length, 3)
        assert.isDefined(fake.requests[0]!.body.tools)
        assert.isDefined(fake.requests[1]!.body.tools)
        assert.strictEqual(fake.requests[0]!.body.tool_choice, "auto")
        assert.strictEqual(fake.requests[2]!.body.tool_choice, "none")
        assert.strictEqual(events.filter((e) => e.type === "tool_execution_end").length, 2)
        assert.strictEqual(transcriptOf(events).at(-1)!.content, "done")
        // A model that calls a tool anyway ends the turn with an error, running nothing.
        fake.reply({ steps: chat.toolCall("c3", "read_file", { path: "a.txt" }) }, { steps: chat.toolCall("c4", "read_file", { path: "a.txt" }) })
        const stubborn = yield* start(p, fake, cwd, { maxToolRounds: 1 })
        const events2 = yield* turn(stubborn, "loop", [], "t2")
        assert.strictEqual(events2.filter((e) => e.type === "tool_execution_end").length, 1)
        const last = transcriptOf(events2).at(-1)!
        assert.isTrue(last.isError)
        assert.include(last.content, "maxToolRounds")
        assert.strictEqual(endError(events2)?.code, "tool_rounds_exceeded")
      })))

  it.live("maxToolRounds 0: no tools are offered", () =>
    withFake((fake, cwd) =>
      Effect.gen(function*() {
        fake.reply({ steps: chat.text(["plain"]) })
        const session = yield* start(p, fake, cwd, { maxToolRounds: 0 })
        yield* turn(session, "hi")
        assert.isUndefined(fake.requests[0]!.body.tools)
      })))
})

describe("model engines: config", () => {
  const validate = (engine: string, config: Record<string, unknown>) =>
    Effect.flip(ModelEngines.engines()[engine]!.validate(config).pipe(Effect.withConfigProvider(ConfigProvider.fromMap(new Map()))))

  it.effect("bad configs are refused with a message naming the field", () =>
    Effect.gen(function*() {
      assert.include((yield* validate("openai-compat", { baseUrl: "http://x/v1" })).message, "config.model is required")
      assert.include((yield* validate("openai-compat", { model: "m" })).message, "config.baseUrl is required")
      assert.include((yield* validate("openai", { model: "m", temperature: 3 })).message, "config.temperature")
      assert.include((yield* validate("openai", { model: "m", maxToolRounds: -1 })).message, "config.maxToolRounds")
      assert.include((yield* validate("openai", { model: "m", cwd: "relative" })).message, "config.cwd must be an absolute path")
      assert.include((yield* validate("anthropic", { model: "m", modle: "x" })).message, "unknown option config.modle")
      assert.include((yield* validate("openai", { model: "m", baseUrl: "ftp://x" })).message, "http or https")
      assert.include((yield* validate("openai", { model: "m", baseUrl: "http://u:p@x" })).message, "credentials")
      assert.include((yield* validate("openai", { model: "m", requestTimeoutMs: 0 })).message, "config.requestTimeoutMs must be an integer from 1")
      assert.include((yield* validate("openai", { model: "m", idleTimeoutMs: "5" })).message, "config.idleTimeoutMs")
      assert.include((yield* validate("openai", { model: "m", idleTimeoutMs: 1.5 })).message, "config.idleTimeoutMs")
      yield* ModelEngines.engines()["openai"]!.validate({ model: "m", requestTimeoutMs: 1, idleTimeoutMs: 86_400_000 }).pipe(
        Effect.withConfigProvider(ConfigProvider.fromMap(new Map()))
      )
      const e = yield* validate("openai", { model: 3 })
      assert.strictEqual(e.reason, "invalid_config")
    }))

  it.effect("defaults come from the configuration provider", () =>
    Effect.gen(function*() {
      const provider = ConfigProvider.fromMap(new Map([["AGENTD_OPENAI_COMPAT_MODEL", "llama"], ["AGENTD_OPENAI_COMPAT_BASE_URL", "http://127.0.0.1:1/v1"]]))
      yield* ModelEngines.engines()["openai-compat"]!.validate({}).pipe(Effect.withConfigProvider(provider))
      // An embedder's defaults.
      yield* ModelEngines.engines({ anthropic: { model: "claude-x" } })["anthropic"]!.validate({}).pipe(
        Effect.withConfigProvider(ConfigProvider.fromMap(new Map()))
      )
    }))
})

describe("model engines: retries on the Clock", () => {
  /** A client answering with the given statuses in turn (then 200), counting the requests. */
  const scripted = (answers: ReadonlyArray<{ status: number; headers?: Record<string, string> }>) => {
    const calls: Array<number> = []
    const client = HttpClient.make((request) =>
      Effect.sync(() => {
        const answer = answers[calls.length] ?? { status: 200 }
        calls.push(Date.now())
        return HttpClientResponse.fromWeb(request, new Response(`{"n":${calls.length}}`, { status: answer.status, headers: answer.headers ?? {} }))
      })
    )
    return { calls, client: withRetries(3, 100)(client) }
  }

  it.effect("a 429 waits its retry-after; 5xx back off exponentially from the base delay", () =>
    Effect.gen(function*() {
      const a = scripted([{ status: 429, headers: { "retry-after": "5" } }])
      const first = yield* Effect.fork(a.client.get("http://model.test/x"))
      yield* TestClock.adjust("4999 millis")
      assert.strictEqual(a.calls.length, 1)
      yield* TestClock.adjust("1 millis")
      assert.strictEqual((yield* first).status, 200)
      assert.strictEqual(a.calls.length, 2)

      const b = scripted([{ status: 500 }, { status: 502 }, { status: 503 }])
      const second = yield* Effect.fork(b.client.get("http://model.test/x"))
      yield* TestClock.adjust("100 millis")
      assert.strictEqual(b.calls.length, 2)
      yield* TestClock.adjust("200 millis")
      assert.strictEqual(b.calls.length, 3)
      yield* TestClock.adjust("400 millis")
      assert.strictEqual((yield* second).status, 200)
    }))

  it.effect("retries run out: the last answer is passed on whole, its body readable", () =>
    Effect.gen(function*() {
      const c = scripted([{ status: 503 }, { status: 503 }, { status: 503 }, { status: 503 }, { status: 503 }])
      const fiber = yield* Effect.fork(c.client.get("http://model.test/x"))
      yield* TestClock.adjust("10 seconds")
      const response = yield* fiber
      assert.strictEqual(response.status, 503)
      assert.strictEqual(c.calls.length, 4)
      assert.strictEqual(yield* response.text, `{"n":4}`)
    }))

  it.effect("a retry-after over 60 s is not waited for; 4xx other than 429 are not retried", () =>
    Effect.gen(function*() {
      const d = scripted([{ status: 429, headers: { "retry-after": "3600" } }])
      assert.strictEqual((yield* d.client.get("http://model.test/x")).status, 429)
      assert.strictEqual(d.calls.length, 1)
      const e = scripted([{ status: 401 }, { status: 404 }])
      assert.strictEqual((yield* e.client.get("http://model.test/x")).status, 401)
      assert.strictEqual(e.calls.length, 1)
    }))

  it("retry-after: seconds, an HTTP date, retry-after-ms", () => {
    assert.strictEqual(retryAfterMs({ "retry-after": "2" }), 2000)
    assert.strictEqual(retryAfterMs({ "retry-after": "0.5" }), 500)
    assert.strictEqual(retryAfterMs({ "retry-after-ms": "250", "retry-after": "9" }), 250)
    assert.strictEqual(retryAfterMs({ "retry-after": new Date(10_000).toUTCString() }, 7_000), 3000)
    assert.isUndefined(retryAfterMs({ "retry-after": "soon" }))
    assert.isUndefined(retryAfterMs({}))
  })
})

describe("model engines: timeouts on the Clock", () => {
  const bytes = new TextEncoder().encode("data: {}\n\n")
  /** A client answering 200 with `body` as its response's stream, counting the requests. */
  const streaming = (body: Stream.Stream<Uint8Array>) => {
    let calls = 0
    const client = HttpClient.make((request) =>
      Effect.sync(() => {
        calls++
        const base = HttpClientResponse.fromWeb(request, new Response(null, { status: 200, headers: { "content-type": "text/event-stream" } }))
        return Object.defineProperty(Object.create(base), "stream", { value: body }) as HttpClientResponse.HttpClientResponse
      })
    )
    return { client, calls: () => calls }
  }
  const failureOf = <A, E>(exit: Exit.Exit<A, E>): E => {
    assert.isTrue(Exit.isFailure(exit))
    const failure = Exit.isFailure(exit) ? Option.getOrUndefined(Cause.failureOption(exit.cause)) : undefined
    assert.isDefined(failure)
    return failure!
  }

  it.effect("a body that goes silent fails after idleTimeoutMs of silence, not before", () =>
    Effect.gen(function*() {
      const { client } = streaming(Stream.concat(Stream.make(bytes), Stream.never))
      const response = yield* withTimeouts(600_000, 1000)(client).get("http://model.test/x")
      const reading = yield* Effect.fork(Stream.runCollect(response.stream))
      yield* TestClock.adjust("999 millis")
      assert.isTrue(Option.isNone(yield* Fiber.poll(reading)))
      yield* TestClock.adjust("1 millis")
      const error = failureOf(yield* Fiber.await(reading))
      assert.strictEqual(error._tag, "ResponseError")
      const timeout = timeoutOf(error)
      assert.instanceOf(timeout, ModelTimeout)
      assert.strictEqual((timeout as ModelTimeout).which, "idle")
      assert.include(error.description, "idleTimeoutMs")
    }))

  it.effect("a body that trickles within idleTimeoutMs still ends at requestTimeoutMs from the request's start", () =>
    Effect.gen(function*() {
      const { client } = streaming(Stream.map(Stream.fromSchedule(Schedule.spaced("600 millis")), () => bytes))
      const response = yield* withTimeouts(2000, 1000)(client).get("http://model.test/x")
      const reading = yield* Effect.fork(Stream.runCollect(response.stream))
      yield* TestClock.adjust("1999 millis")
      assert.isTrue(Option.isNone(yield* Fiber.poll(reading)))
      yield* TestClock.adjust("1 millis")
      const timeout = timeoutOf(failureOf(yield* Fiber.await(reading)))
      assert.strictEqual((timeout as ModelTimeout).which, "request")
      assert.strictEqual((timeout as ModelTimeout).ms, 2000)
    }))

  it.effect("no headers within idleTimeoutMs: a RequestError, retried like a 5xx, then given up", () =>
    Effect.gen(function*() {
      let calls = 0
      const silent = HttpClient.make(() => Effect.zipRight(Effect.sync(() => calls++), Effect.never))
      const client = withRetries(2, 100)(withTimeouts(600_000, 1000)(silent))
      const fiber = yield* Effect.fork(client.get("http://model.test/x"))
      yield* TestClock.adjust("999 millis")
      assert.strictEqual(calls, 1)
      yield* TestClock.adjust("1 millis")
      yield* TestClock.adjust("100 millis")
      assert.strictEqual(calls, 2, "retried after the base delay")
      yield* TestClock.adjust("1 minute")
      const error = failureOf(yield* Fiber.await(fiber))
      assert.strictEqual(calls, 3)
      assert.strictEqual(error._tag, "RequestError")
      assert.instanceOf(timeoutOf(error), ModelTimeout)
    }))

  it.effect("a whole answer in time is untouched", () =>
    Effect.gen(function*() {
      const { client } = streaming(Stream.make(bytes, bytes))
      const response = yield* withTimeouts(1000, 100)(client).get("http://model.test/x")
      assert.strictEqual(Chunk.size(yield* Stream.runCollect(response.stream)), 2)
    }))
})

describe("model engine anthropic: an error event mid-stream", () => {
  it.live("ends the turn with the endpoint's message", () =>
    withFake((fake, cwd) =>
      Effect.gen(function*() {
        fake.reply({
          steps: [...anthropic.text(["x"]).slice(0, 2), { event: "error", sse: JSON.stringify({ type: "error", error: { type: "overloaded_error", message: "Overloaded" } }) }]
        })
        const session = yield* start(providers[2]!, fake, cwd)
        const events = yield* turn(session, "hi")
        const last = transcriptOf(events).at(-1)!
        assert.isTrue(last.isError)
        assert.include(last.content, "Overloaded")
        assert.strictEqual(endError(events)?.code, "endpoint_error")
      })))
})

describe("model engines: the transcript as a prompt", () => {
  const m = (id: string, role: AgentMessage["role"], content: string, extra: Partial<AgentMessage> = {}): AgentMessage => ({
    id,
    role,
    content,
    timestamp: 0,
    ...extra
  })
  const tool = (id: string, callId: string, content: string, extra: Partial<AgentMessage> = {}) =>
    m(id, "tool", content, { toolCallId: callId, toolName: "read_file", toolArgs: { path: callId }, ...extra })

  it("rounds become assistant messages with their calls, then the results; error messages are left out", () => {
    const prompt = toPrompt("sys", [
      m("t1-u", "user", "q"),
      tool("t1-t0-0", "c1", "r1"),
      tool("t1-t0-1", "c2", "r2", { isError: true }),
      m("t1-a1", "assistant", "thinking"),
      tool("t1-t1-0", "c3", "r3"),
      m("t1-a2", "assistant", "answer"),
      m("t2-u", "user", "q2"),
      m("t2-e", "assistant", "Error: boom", { isError: true }),
      m("t3-u", "user", "q3")
    ])
    assert.deepStrictEqual(prompt, [
      { role: "system", content: "sys" },
      { role: "user", content: "q" },
      {
        role: "assistant",
        content: [
          { type: "tool-call", id: "c1", name: "read_file", params: { path: "c1" }, providerExecuted: false },
          { type: "tool-call", id: "c2", name: "read_file", params: { path: "c2" }, providerExecuted: false }
        ]
      },
      {
        role: "tool",
        content: [
          { type: "tool-result", id: "c1", name: "read_file", result: "r1", isFailure: false, providerExecuted: false },
          { type: "tool-result", id: "c2", name: "read_file", result: "r2", isFailure: true, providerExecuted: false }
        ]
      },
      {
        role: "assistant",
        content: [
          { type: "text", text: "thinking" },
          { type: "tool-call", id: "c3", name: "read_file", params: { path: "c3" }, providerExecuted: false }
        ]
      },
      { role: "tool", content: [{ type: "tool-result", id: "c3", name: "read_file", result: "r3", isFailure: false, providerExecuted: false }] },
      { role: "assistant", content: [{ type: "text", text: "answer" }] },
      { role: "user", content: "q2" },
      { role: "user", content: "q3" }
    ] as any)
  })
})

describe("model engines: context compaction", () => {
  const p = providers[0]!
  const long = (id: string, role: AgentMessage["role"], word: string): AgentMessage => ({
    id,
    role,
    content: `${word} `.repeat(80),
    timestamp: 0
  })

  it.live("past maxContextTokens the older messages are replaced by the model's summary (a transcript replacement)", () =>
    withFake((fake, cwd) =>
      Effect.gen(function*() {
        const history = [
          long("h1-u", "user", "alpha"),
          long("h1-a0", "assistant", "bravo"),
          long("h2-u", "user", "charlie"),
          long("h2-a0", "assistant", "delta")
        ]
        fake.reply({ steps: chat.text(["The user said alpha ", "and charlie."]) }, { steps: chat.text(["fine"]) })
        const session = yield* start(p, fake, cwd, { maxContextTokens: 300 })
        const outputs = Chunk.toArray(yield* Stream.runCollect(session.runTurn({ turnId: "t3", message: "and now?", history })))
        // The summary request: the older messages, no tools.
        assert.strictEqual(fake.requests.length, 2)
        const summaryRequest = JSON.stringify(fake.requests[0]!.body)
        assert.include(summaryRequest, "summarize")
        assert.include(summaryRequest, "alpha")
        assert.isUndefined(fake.requests[0]!.body.tools)
        // The transcript is replaced by [summary, kept messages..., this turn's user message].
        const replaced = outputs.filter((o): o is TranscriptReplaced => o instanceof TranscriptReplaced)
        assert.strictEqual(replaced.length, 1)
        const messages = replaced[0]!.messages
        assert.strictEqual(messages[0]!.role, "assistant")
        assert.include(messages[0]!.content, "The user said alpha and charlie.")
        assert.strictEqual(messages.at(-1)!.content, "and now?")
        assert.isBelow(messages.length, history.length + 1)
        // The turn's request carries the summary, not the summarized messages.
        const turnRequest = fake.requests[1]!.body
        assert.strictEqual(turnRequest.messages[0].role, "user", "a user message first")
        assert.include(JSON.stringify(turnRequest), "The user said alpha and charlie.")
        assert.notInclude(JSON.stringify(turnRequest), "alpha alpha")
        const events = outputs.filter((o): o is AgentEvent => !(o instanceof TranscriptReplaced))
        assert.strictEqual(transcriptOf(events).at(-1)!.content, "fine")
        assert.deepStrictEqual(types(events).slice(-2), ["turn_end", "agent_end"])
      })))

  it.live("under the limit nothing is compacted", () =>
    withFake((fake, cwd) =>
      Effect.gen(function*() {
        fake.reply({ steps: chat.text(["short"]) })
        const session = yield* start(p, fake, cwd, { maxContextTokens: 100_000 })
        const outputs = Chunk.toArray(yield* Stream.runCollect(session.runTurn({ turnId: "t1", message: "hi", history: [long("h-u", "user", "x")] })))
        assert.isFalse(outputs.some((o) => o instanceof TranscriptReplaced))
        assert.strictEqual(fake.requests.length, 1)
      })))

  it("the cut keeps the newest messages that fit, from a user message on", () => {
    const ms = [long("1-u", "user", "a"), long("1-a0", "assistant", "b"), long("2-u", "user", "c"), long("2-a0", "assistant", "d")]
    // Each message is ~44 tokens: two fit in 100, from the user message "2-u".
    assert.strictEqual(compactionCut(ms, 100), 2)
    // Nothing fits: the last user message is kept anyway.
    assert.strictEqual(compactionCut(ms, 10), 2)
    assert.strictEqual(compactionCut(ms, 10_000), 0)
  })
})
