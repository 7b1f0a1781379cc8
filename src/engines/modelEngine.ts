/**
 * The running part of the model engines (`openai`, `openai-compat`, `anthropic`; their
 * configuration is modelConfig.ts): the agent loop of a turn over an `@effect/ai`
 * `LanguageModel`, the built-in tools, the transcript sent back to the model, retries of 429/5xx
 * answers, and error messages a person can act on. Loaded by a worker when such a session starts.
 *
 * A turn: the user message, then rounds of one streamed model response each; the tool calls of
 * a round run (events `tool_execution_start/end` and a `tool` message each) and the next round
 * sends their results, until a round calls no tool. After `maxToolRounds` rounds with tool calls
 * the request declares the tools with tool choice `none`, so the model has to answer. An
 * endpoint error ends the turn with an assistant message marked `isError` (the partial text
 * already streamed kept as its own message), then `turn_end` and `agent_end {error: {code,
 * message}}`: the turn failed, the session stays usable. Every HTTP request is bounded by
 * `requestTimeoutMs` (whole request) and `idleTimeoutMs` (no byte for that long): a timeout is
 * an endpoint error like the others (code `timeout`). With `maxContextTokens`, a turn over the
 * budget starts by replacing the older messages with a summary the model writes (a history
 * rewrite: `TranscriptReplaced`).
 *
 * Secrets: the API key is read from the worker's environment when the session starts, goes
 * only into the request's auth header, and is scrubbed from every message this module writes.
 */
import * as AiError from "@effect/ai/AiError"
import type * as LanguageModel from "@effect/ai/LanguageModel"
import type * as Prompt from "@effect/ai/Prompt"
import type * as Toolkit from "@effect/ai/Toolkit"
import * as HttpClient from "@effect/platform/HttpClient"
import * as HttpClientError from "@effect/platform/HttpClientError"
import type * as HttpClientRequest from "@effect/platform/HttpClientRequest"
import * as HttpClientResponse from "@effect/platform/HttpClientResponse"
import * as HttpIncomingMessage from "@effect/platform/HttpIncomingMessage"
import * as Chunk from "effect/Chunk"
import * as Clock from "effect/Clock"
import * as Config from "effect/Config"
import * as Data from "effect/Data"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Inspectable from "effect/Inspectable"
import * as Mailbox from "effect/Mailbox"
import * as Option from "effect/Option"
import * as Redacted from "effect/Redacted"
import * as Schedule from "effect/Schedule"
import * as Stream from "effect/Stream"
import * as FileIo from "../internal/fileIo.js"
import { agentMessage, EngineError, type EngineSession, TranscriptReplaced, type TurnInput, type TurnOutput } from "../Engine.js"
import type { AgentMessage, TurnFailure } from "../Protocol.js"
import { MAX_RETRY_AFTER_MS, type ModelConfig } from "./modelConfig.js"
import * as SessionWorkDir from "./SessionWorkDir.js"
import * as Tools from "./tools.js"

// ---------------------------------------------------------------------------------------------
// Retries
// ---------------------------------------------------------------------------------------------

class RetryableStatus extends Data.TaggedError("RetryableStatus")<{
  readonly response: HttpClientResponse.HttpClientResponse
  readonly body: string
  readonly retryAfterMs: number | undefined
}> {}

/** `retry-after-ms`, else `retry-after` in seconds or as an HTTP date. */
export const retryAfterMs = (headers: Readonly<Record<string, string>>, now = Date.now()): number | undefined => {
  const ms = headers["retry-after-ms"]
  if (ms !== undefined && /^\d+(\.\d+)?$/.test(ms.trim())) return Math.ceil(Number(ms))
  const value = headers["retry-after"]?.trim()
  if (value === undefined || value === "") return undefined
  if (/^\d+(\.\d+)?$/.test(value)) return Math.ceil(Number(value) * 1000)
  const date = Date.parse(value)
  return Number.isNaN(date) ? undefined : Math.max(0, date - now)
}

const isRetryable = (status: number) => status === 429 || status >= 500

/**
 * The retry schedule of 429 and 5xx answers: exponential from `baseDelayMs`, at most
 * `maxRetries` times; a `retry-after` header replaces the computed delay, and one longer than
 * MAX_RETRY_AFTER_MS stops the retries.
 */
const retrySchedule = (maxRetries: number, baseDelayMs: number) =>
  Schedule.exponential(Duration.millis(baseDelayMs), 2).pipe(
    Schedule.intersect(Schedule.recurs(maxRetries)),
    Schedule.intersect(Schedule.identity<unknown>()),
    // Only a retryable answer, or no answer at all in time (nothing of it streamed yet), is
    // retried; a transport error is reported at once.
    Schedule.whileInput((e: unknown) =>
      (e instanceof RetryableStatus && (e.retryAfterMs ?? 0) <= MAX_RETRY_AFTER_MS) || timeoutOf(e) !== undefined
    ),
    Schedule.modifyDelay(([, e], delay) =>
      e instanceof RetryableStatus && e.retryAfterMs !== undefined ? Duration.millis(e.retryAfterMs) : delay
    )
  )

/**
 * An HttpClient that retries 429 and 5xx answers, and requests timed out before their answer's
 * headers (see {@link withTimeouts}): before any of their body is streamed. The answer given up
 * on is passed on whole, with its body, so the provider reports it as usual.
 */
export const withRetries = (maxRetries: number, baseDelayMs: number) => (client: HttpClient.HttpClient): HttpClient.HttpClient =>
  HttpClient.transform(client, (effect, request) =>
    effect.pipe(
      Effect.flatMap((response) =>
        isRetryable(response.status)
          ? Effect.flatMap(
            // Read (and so release) the error body: a retry needs the connection, a final
            // answer needs the body.
            Effect.orElseSucceed(response.text, () => ""),
            (body) => Effect.fail(new RetryableStatus({ response, body, retryAfterMs: retryAfterMs(response.headers) }))
          )
          : Effect.succeed(response)
      ),
      Effect.retry(retrySchedule(maxRetries, baseDelayMs)),
      Effect.catchTag("RetryableStatus", (e) =>
        Effect.succeed(HttpClientResponse.fromWeb(
          request,
          new Response(e.body, { status: e.response.status, headers: new Headers(e.response.headers as Record<string, string>) })
        )))
    ))

// ---------------------------------------------------------------------------------------------
// Timeouts
// ---------------------------------------------------------------------------------------------

/** A request to the model took too long (`requestTimeoutMs`), or its endpoint went silent (`idleTimeoutMs`). */
export class ModelTimeout extends Data.TaggedError("ModelTimeout")<{
  readonly which: "request" | "idle"
  readonly ms: number
  readonly message: string
}> {}

const modelTimeout = (which: "request" | "idle", ms: number) =>
  new ModelTimeout({
    which,
    ms,
    message: which === "idle"
      ? `the endpoint sent nothing for ${ms} ms (idleTimeoutMs)`
      : `the request took longer than ${ms} ms (requestTimeoutMs)`
  })

/**
 * The providers turn a response's errors into `AiError.HttpResponseError`, which keeps the
 * platform error's description and drops its cause: a timeout in a response's body is known by
 * this prefix of its description.
 */
const TIMEOUT_DESCRIPTION = "timeout: "

/** The timeout behind an error (a platform or `@effect/ai` error, or the timeout itself), if any. */
export const timeoutOf = (error: unknown): ModelTimeout | string | undefined => {
  let described: string | undefined
  for (let c = error, depth = 0; c !== undefined && c !== null && depth < 6; depth++) {
    if (c instanceof ModelTimeout) return c
    const description = (c as { description?: unknown }).description
    if (described === undefined && typeof description === "string" && description.startsWith(TIMEOUT_DESCRIPTION)) {
      described = description.slice(TIMEOUT_DESCRIPTION.length)
    }
    c = (c as { cause?: unknown }).cause
  }
  return described
}

/**
 * A response whose body is read under the request's deadline and the idle timeout: each read
 * of the underlying body fails with a `ResponseError` (its description starting with
 * `timeout: `) when no byte comes for `idleMs`, or when the deadline passes. Ending the read
 * ends the underlying one, which aborts the HTTP request.
 */
class TimedResponse implements HttpClientResponse.HttpClientResponse {
  readonly [HttpClientResponse.TypeId]: HttpClientResponse.TypeId = HttpClientResponse.TypeId
  readonly [HttpIncomingMessage.TypeId]: HttpIncomingMessage.TypeId = HttpIncomingMessage.TypeId
  /** When the whole request must be over (Clock time). */
  readonly deadline: number
  constructor(
    readonly original: HttpClientResponse.HttpClientResponse,
    startedAt: number,
    readonly requestMs: number,
    readonly idleMs: number
  ) {
    this.deadline = startedAt + requestMs
  }
  get request() {
    return this.original.request
  }
  get status() {
    return this.original.status
  }
  get headers() {
    return this.original.headers
  }
  get cookies() {
    return this.original.cookies
  }
  get remoteAddress() {
    return this.original.remoteAddress
  }
  private timedOut(timeout: ModelTimeout) {
    // The error's response has no body: a provider reading the body of a failed response
    // (to report it) must not wait on the silent one.
    const { "content-type": _, ...headers } = this.original.headers
    const status = this.original.status >= 200 && this.original.status <= 599 ? this.original.status : 502
    return new HttpClientError.ResponseError({
      request: this.original.request,
      response: HttpClientResponse.fromWeb(this.original.request, new Response(null, { status, headers })),
      reason: "Decode",
      cause: timeout,
      description: `${TIMEOUT_DESCRIPTION}${timeout.message}`
    })
  }
  get stream(): Stream.Stream<Uint8Array, HttpClientError.ResponseError> {
    return Stream.unwrapScoped(Effect.map(Stream.toPull(this.original.stream), (pull) =>
      Stream.repeatEffectChunkOption(Effect.flatMap(Clock.currentTimeMillis, (now) => {
        const left = Math.max(0, this.deadline - now)
        const timeout = left < this.idleMs ? modelTimeout("request", this.requestMs) : modelTimeout("idle", this.idleMs)
        return Effect.timeoutFail(pull, {
          duration: Duration.millis(Math.min(left, this.idleMs)),
          onTimeout: () => Option.some(this.timedOut(timeout))
        })
      }))))
  }
  get text(): Effect.Effect<string, HttpClientError.ResponseError> {
    return Stream.mkString(Stream.decodeText(this.stream))
  }
  get arrayBuffer(): Effect.Effect<ArrayBuffer, HttpClientError.ResponseError> {
    return Effect.map(Stream.runCollect(this.stream), (chunks) => {
      const bytes = Buffer.concat(Chunk.toArray(chunks))
      return bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength) as ArrayBuffer
    })
  }
  get json(): Effect.Effect<unknown, HttpClientError.ResponseError> {
    return Effect.flatMap(this.text, (text) =>
      Effect.try({
        try: () => (text === "" ? null : JSON.parse(text)) as unknown,
        catch: (cause) => new HttpClientError.ResponseError({ request: this.request, response: this, reason: "Decode", cause })
      }))
  }
  get urlParamsBody() {
    return this.bounded(this.original.urlParamsBody)
  }
  get formData() {
    return this.bounded(this.original.formData)
  }
  /** A whole-body read the stream does not serve: bounded by the deadline only. */
  private bounded<A>(effect: Effect.Effect<A, HttpClientError.ResponseError>): Effect.Effect<A, HttpClientError.ResponseError> {
    return Effect.flatMap(Clock.currentTimeMillis, (now) =>
      Effect.timeoutFail(effect, {
        duration: Duration.millis(Math.max(0, this.deadline - now)),
        onTimeout: () => this.timedOut(modelTimeout("request", this.requestMs))
      }))
  }
  toJSON() {
    return this.original.toJSON()
  }
  toString() {
    return Inspectable.format(this.toJSON())
  }
  [Inspectable.NodeInspectSymbol]() {
    return this.toJSON()
  }
}

/**
 * An HttpClient whose requests time out: the response's headers must come within `idleMs`
 * (and the deadline), each piece of its body within `idleMs` of the previous one, and the
 * whole request, body included, within `requestMs` of its start. A request timed out before
 * its headers fails with a `RequestError` whose cause is the {@link ModelTimeout} (retried by
 * {@link withRetries}); one timed out in its body fails the body's stream with a
 * `ResponseError` (not retried: part of the answer was streamed). The request is aborted.
 */
export const withTimeouts = (requestMs: number, idleMs: number) => (client: HttpClient.HttpClient): HttpClient.HttpClient =>
  HttpClient.transform(client, (effect, request: HttpClientRequest.HttpClientRequest) =>
    Effect.gen(function*() {
      const startedAt = yield* Clock.currentTimeMillis
      const timeout = idleMs < requestMs ? modelTimeout("idle", idleMs) : modelTimeout("request", requestMs)
      const response = yield* Effect.timeoutFail(effect, {
        duration: Duration.millis(Math.min(idleMs, requestMs)),
        onTimeout: () =>
          new HttpClientError.RequestError({
            request,
            reason: "Transport",
            cause: timeout,
            description: `${TIMEOUT_DESCRIPTION}${timeout.message}`
          })
      })
      return new TimedResponse(response, startedAt, requestMs, idleMs)
    }))

// ---------------------------------------------------------------------------------------------
// Errors people can act on
// ---------------------------------------------------------------------------------------------

/** Replaces every occurrence of a secret. */
export const scrub = (text: string, secrets: ReadonlyArray<string>): string => {
  let out = text
  for (const secret of secrets) if (secret.length >= 4) out = out.split(secret).join("[redacted]")
  return out
}

const bodyMessage = (body: string | undefined): string | undefined => {
  if (body === undefined || body.trim() === "") return undefined
  try {
    const json = JSON.parse(body) as { error?: { message?: unknown } | string; message?: unknown } | string
    // A text body comes quoted (the provider formats it as a JSON string).
    if (typeof json === "string") return json === body ? json : bodyMessage(json)
    if (typeof json.error === "string") return json.error
    if (typeof json.error?.message === "string") return json.error.message
    if (typeof json.message === "string") return json.message
  } catch {
    // not JSON: the text itself
  }
  const text = body.replace(/\s+/g, " ").trim()
  return text.length > 300 ? `${text.slice(0, 300)}...` : text
}

const causeCode = (cause: unknown): string | undefined => {
  for (let c = cause, depth = 0; c !== undefined && c !== null && depth < 6; depth++) {
    const code = (c as { code?: unknown }).code
    if (typeof code === "string") return code
    c = (c as { cause?: unknown }).cause
  }
  return undefined
}

/** Context for error messages: which engine, which endpoint, where the key comes from. */
export interface ErrorContext {
  readonly engine: string
  readonly model: string
  readonly baseUrl: string
  readonly apiKeyEnv: string
  readonly maxRetries: number
}

/** A sentence saying what went wrong with the endpoint and what to check. */
export const describeError = (error: unknown, ctx: ErrorContext): string => {
  const prefix = `${ctx.engine} (${ctx.baseUrl})`
  if (error instanceof TurnError) return `${prefix}: ${error.message}`
  const timeout = timeoutOf(error)
  if (timeout !== undefined) return `${prefix}: timed out: ${typeof timeout === "string" ? timeout : timeout.message}`
  if (AiError.isAiError(error)) {
    switch (error._tag) {
      case "HttpResponseError": {
        const status = error.response.status
        const gaveUp = ctx.maxRetries > 0 ? `; gave up after ${ctx.maxRetries} retries` : ""
        if (error.reason === "StatusCode") {
          const detail = bodyMessage(error.body === undefined ? undefined : String(error.body))
          const hint = status === 401 || status === 403
            ? ` (check the API key in ${ctx.apiKeyEnv})`
            : status === 404
            ? ` (check the model \`${ctx.model}\` and the baseUrl)`
            : status === 429
            ? ` (rate limited${gaveUp})`
            : status >= 500
            ? ` (server error${gaveUp})`
            : ""
          return `${prefix}: the endpoint answered ${status}${hint}${detail === undefined ? "" : `: ${detail}`}`
        }
        return `${prefix}: the response broke off before its end, the connection cut mid-stream (${error.reason}${error.description ? `: ${error.description}` : ""})`
      }
      case "HttpRequestError": {
        const code = causeCode(error.cause)
        return code === "ECONNREFUSED"
          ? `${prefix}: connection refused (is the server running?)`
          : `${prefix}: the request failed (${error.reason}${code !== undefined ? ` ${code}` : ""}${error.description ? `: ${error.description}` : ""})`
      }
      case "MalformedOutput":
        return `${prefix}: the endpoint sent a malformed response: ${error.description ? firstLine(error.description) : "a stream event could not be decoded"}`
      case "MalformedInput":
        return `${prefix}: the request could not be built${error.description ? `: ${firstLine(error.description)}` : ""}`
      case "UnknownError":
        return `${prefix}: ${error.description ?? "an unknown error"}`
    }
  }
  const message = error instanceof Error ? error.message : String(error)
  return `${prefix}: ${firstLine(message)}`
}

const firstLine = (text: string) => {
  const line = text.split("\n")[0] ?? ""
  return line.length > 300 ? `${line.slice(0, 300)}...` : line
}

/** A turn went wrong in a way the model's answer shows (not a transport error). */
export class TurnError extends Data.TaggedError("TurnError")<{
  readonly code: "stream_cut" | "malformed_response" | "endpoint_error" | "tool_rounds_exceeded"
  readonly message: string
}> {}

/**
 * The stable codes of a failed turn (`agent_end.error.code`), documented in docs/protocol.md
 * section 7a.
 */
export type FailureCode =
  | "http_status"
  | "auth"
  | "connect_failed"
  | "timeout"
  | "stream_cut"
  | "malformed_response"
  | "endpoint_error"
  | "tool_rounds_exceeded"
  | "unknown"

/** What a turn's error was, by code (and HTTP status, when the endpoint answered one). */
export const failureCode = (error: unknown): { readonly code: FailureCode; readonly status?: number } => {
  if (error instanceof TurnError) return { code: error.code }
  if (timeoutOf(error) !== undefined) return { code: "timeout" }
  if (!AiError.isAiError(error)) return { code: "unknown" }
  switch (error._tag) {
    case "HttpResponseError": {
      if (error.reason !== "StatusCode") return { code: "stream_cut" }
      const status = error.response.status
      return { code: status === 401 || status === 403 ? "auth" : "http_status", status }
    }
    case "HttpRequestError":
      return { code: "connect_failed" }
    case "MalformedOutput":
      // OpenAiCompat's own check of a stream that ended before its end (no `[DONE]`).
      return { code: error.description?.startsWith("the stream ended before") ? "stream_cut" : "malformed_response" }
    default:
      return { code: "unknown" }
  }
}

/** A turn's error as `agent_end.error`: its code and a sentence (secrets scrubbed). */
export const turnFailure = (error: unknown, ctx: ErrorContext, secrets: ReadonlyArray<string>): TurnFailure => {
  const { code, status } = failureCode(error)
  return { code, message: scrub(describeError(error, ctx), secrets), ...(status === undefined ? {} : { status }) }
}

// ---------------------------------------------------------------------------------------------
// The transcript as a prompt
// ---------------------------------------------------------------------------------------------

/**
 * The conversation sent to the model: the system prompt, then the session's transcript. An
 * assistant message marked `isError` (an endpoint error this engine reported) is not the
 * model's and is left out; the `tool` messages after an assistant message carry its tool calls
 * (name and `toolArgs`) and their results.
 */
const roundOf = (id: string): string | undefined => {
  const m = /^(.*)-(?:a(\d+)|t(\d+)-\d+)$/.exec(id)
  return m === null ? undefined : `${m[1]}:${m[2] ?? m[3]}`
}

export const toPrompt = (system: string | undefined, messages: ReadonlyArray<AgentMessage>): Array<Prompt.MessageEncoded> => {
  const out: Array<Prompt.MessageEncoded> = []
  if (system !== undefined) out.push({ role: "system", content: system })
  let assistant: { role: "assistant"; content: Array<Prompt.AssistantMessagePartEncoded> } | undefined
  let results: { role: "tool"; content: Array<Prompt.ToolMessagePartEncoded> } | undefined
  // The round the open assistant message belongs to, from the ids this engine gives
  // (`<turnId>-a<round>`, `<turnId>-t<round>-<i>`): the calls of two rounds are two messages.
  let round: string | undefined
  const flush = () => {
    // An assistant message with neither text nor calls is refused by some APIs.
    if (assistant !== undefined && assistant.content.length > 0) out.push(assistant)
    if (results !== undefined) out.push(results)
    assistant = undefined
    results = undefined
    round = undefined
  }
  for (const m of messages) {
    switch (m.role) {
      case "user":
        flush()
        out.push({ role: "user", content: m.content })
        break
      case "assistant":
        if (m.isError === true) break
        flush()
        assistant = { role: "assistant", content: m.content.length > 0 ? [{ type: "text", text: m.content }] : [] }
        round = roundOf(m.id)
        break
      case "tool": {
        if (m.toolCallId === undefined || m.toolName === undefined) break
        const its = roundOf(m.id)
        if (assistant !== undefined && its !== undefined && round !== undefined && its !== round) flush()
        if (assistant === undefined) {
          assistant = { role: "assistant", content: [] }
          round = its
        }
        results ??= { role: "tool", content: [] }
        assistant.content.push({ type: "tool-call", id: m.toolCallId, name: m.toolName, params: m.toolArgs ?? {}, providerExecuted: false })
        results.content.push({
          type: "tool-result",
          id: m.toolCallId,
          name: m.toolName,
          result: m.content,
          isFailure: m.isError === true,
          providerExecuted: false
        })
        break
      }
    }
  }
  flush()
  // Some APIs want the user to speak first; a compacted transcript starts with its summary.
  const first = system === undefined ? 0 : 1
  if (out[first]?.role === "assistant") {
    out.splice(first, 0, { role: "user", content: "(The earlier conversation was replaced by the summary that follows.)" })
  }
  return out
}

// ---------------------------------------------------------------------------------------------
// The turn
// ---------------------------------------------------------------------------------------------

/** What a model engine needs to run turns: a model, and how to talk about errors. */
export interface ModelSession {
  readonly model: LanguageModel.Service
  readonly config: ModelConfig
  readonly engine: string
  /** Values to scrub from every message (the API key). */
  readonly secrets: ReadonlyArray<string>
  /** The tools' working directory. */
  readonly cwd: string
  readonly toolkit: Toolkit.WithHandler<typeof Tools.toolkit.tools>
}

interface ToolCall {
  readonly id: string
  readonly name: string
  readonly params: unknown
}

/**
 * One turn's events. Runs the loop in a fiber of the stream's scope: interrupting the stream
 * (an abort) interrupts the loop, which cancels the HTTP request in flight.
 */
export const runTurn = (session: ModelSession, input: TurnInput): Stream.Stream<TurnOutput, EngineError> =>
  Stream.unwrapScoped(Effect.gen(function*() {
    const mailbox = yield* Mailbox.make<TurnOutput, EngineError>({ capacity: 256 })
    yield* turnLoop(session, input, (event) => mailbox.offer(event)).pipe(
      Mailbox.into(mailbox),
      Effect.forkScoped
    )
    return Mailbox.toStream(mailbox)
  }))

const turnLoop = (session: ModelSession, input: TurnInput, emit: (event: TurnOutput) => Effect.Effect<unknown>) =>
  Effect.gen(function*() {
    const { config } = session
    const user = agentMessage(`${input.turnId}-u`, "user", input.message)
    yield* emit({ type: "agent_start" })
    yield* emit({ type: "turn_start" })
    yield* emit({ type: "message_start", message: user })
    yield* emit({ type: "message_end", message: user })
    let transcript: Array<AgentMessage> = [...input.history, user]
    // The assistant message being streamed, ended with its partial text if the round fails.
    let open: { id: string; text: string } | undefined
    const endOpen = Effect.suspend(() => {
      if (open === undefined) return Effect.void
      const done = agentMessage(open.id, "assistant", open.text)
      open = undefined
      transcript.push(done)
      return emit({ type: "message_end", message: done })
    })

    const round = (n: number, offerTools: boolean) =>
      Effect.gen(function*() {
        const calls: Array<ToolCall> = []
        let finished = false
        const parts = session.model.streamText({
          prompt: toPrompt(config.system, transcript),
          // Past the last round the tools stay declared (the transcript holds calls of them, and
          // a call must decode) but the model may not call one.
          ...(config.maxToolRounds > 0 ? { toolkit: session.toolkit, toolChoice: offerTools ? "auto" as const : "none" as const } : {}),
          disableToolCallResolution: true
        })
        yield* Stream.runForEach(parts, (part) =>
          Effect.gen(function*() {
            switch (part.type) {
              case "text-delta": {
                if (part.delta.length === 0) return
                if (open === undefined) {
                  open = { id: `${input.turnId}-a${n}`, text: "" }
                  yield* emit({ type: "message_start", message: agentMessage(open.id, "assistant", "") })
                }
                open.text += part.delta
                yield* emit({ type: "message_update", messageId: open.id, delta: part.delta })
                return
              }
              case "tool-call":
                if (!part.providerExecuted) calls.push({ id: part.id, name: part.name, params: part.params })
                return
              case "error":
                return yield* new TurnError({ code: "endpoint_error", message: `the endpoint reported an error: ${errorText(part.error)}` })
              case "finish":
                finished = true
                return
            }
          }))
        if (!finished) return yield* new TurnError({ code: "stream_cut", message: "the response stream ended before the response was complete" })
        yield* endOpen
        return calls
      })

    const outcome = yield* Effect.either(Effect.gen(function*() {
      const compacted = yield* compact(session, input.turnId, transcript)
      if (compacted !== undefined) {
        // A copy: the loop goes on appending to its own transcript.
        transcript = [...compacted]
        yield* emit(new TranscriptReplaced({ messages: compacted }))
      }
      for (let n = 0;; n++) {
        const offerTools = n < config.maxToolRounds
        const calls = yield* round(n, offerTools)
        if (calls.length === 0) return
        if (!offerTools) {
          return yield* new TurnError({
            code: "tool_rounds_exceeded",
            message: `the model still called tools after ${config.maxToolRounds} rounds of tool calls (maxToolRounds) with none offered`
          })
        }
        for (const [i, call] of calls.entries()) {
          yield* emit({ type: "tool_execution_start", toolCallId: call.id, name: call.name, args: call.params })
          const { isError, result } = yield* Tools.run(session.cwd, call.name, call.params)
          yield* emit({ type: "tool_execution_end", toolCallId: call.id, result, isError })
          const toolMessage = agentMessage(`${input.turnId}-t${n}-${i}`, "tool", result, {
            toolCallId: call.id,
            toolName: call.name,
            toolArgs: call.params,
            ...(isError ? { isError: true } : {})
          })
          transcript.push(toolMessage)
          yield* emit({ type: "message_start", message: toolMessage })
          yield* emit({ type: "message_end", message: toolMessage })
        }
      }
    }))
    if (outcome._tag === "Right") {
      yield* emit({ type: "turn_end" })
      yield* emit({ type: "agent_end" })
      return
    }
    yield* endOpen
    const error = turnFailure(outcome.left, { ...config, engine: session.engine }, session.secrets)
    yield* Effect.logWarning(`turn ${input.turnId}: ${error.code}: ${error.message}`)
    const failed = agentMessage(`${input.turnId}-e`, "assistant", `Error: ${error.message}`, { isError: true })
    // Streamed as one delta too, so that a client that prints deltas shows it; its start
    // already says `isError`, so that one that keeps errors apart (`agentd prompt` prints them
    // on stderr) can tell before the text comes.
    yield* emit({ type: "message_start", message: { ...failed, content: "" } })
    yield* emit({ type: "message_update", messageId: failed.id, delta: failed.content })
    yield* emit({ type: "message_end", message: failed })
    yield* emit({ type: "turn_end" })
    yield* emit({ type: "agent_end", error })
  })

// ---------------------------------------------------------------------------------------------
// Context compaction
// ---------------------------------------------------------------------------------------------

/** A message's tokens, estimated (characters / 4: no model's tokenizer is at hand). */
export const estimateTokens = (m: AgentMessage): number =>
  Math.ceil((m.content.length + (m.toolArgs === undefined ? 0 : JSON.stringify(m.toolArgs).length) + 16) / 4)

/**
 * Where the kept part of a transcript starts: the newest messages whose estimate fits in
 * `budget`, starting at a user message (a round's tool calls and results stay together); the
 * last user message is kept whatever its size.
 */
export const compactionCut = (messages: ReadonlyArray<AgentMessage>, budget: number): number => {
  let total = 0
  let cut = messages.length
  for (let i = messages.length - 1; i >= 0; i--) {
    total += estimateTokens(messages[i]!)
    if (total > budget) break
    if (messages[i]!.role === "user") cut = i
  }
  if (cut === messages.length) {
    let lastUser = messages.length
    for (let i = messages.length - 1; i >= 0; i--) {
      if (messages[i]!.role === "user") {
        lastUser = i
        break
      }
    }
    cut = lastUser
  }
  return cut
}

const SUMMARY_SYSTEM = "You summarize conversations between a user and an assistant that can read files. " +
  "Write a concise summary of the conversation you are given, keeping every fact, decision, file name, " +
  "result and open question needed to continue it. Answer with the summary only."

const clip = (text: string, max = 4000) => (text.length > max ? `${text.slice(0, max)} [...]` : text)

const render = (messages: ReadonlyArray<AgentMessage>): string =>
  messages
    .filter((m) => !(m.role === "assistant" && m.isError === true))
    .map((m) =>
      m.role === "tool"
        ? `TOOL ${m.toolName ?? "?"}(${JSON.stringify(m.toolArgs ?? {})}): ${clip(m.content)}`
        : `${m.role.toUpperCase()}: ${clip(m.content)}`
    )
    .join("\n\n")

/**
 * When the conversation passes `maxContextTokens` (estimated), the transcript that replaces it:
 * a summary the model writes of the older messages, then the newest ones (about half the
 * budget) as they are. Undefined when no compaction is due or nothing can be summarized.
 */
const compact = (session: ModelSession, turnId: string, transcript: ReadonlyArray<AgentMessage>) =>
  Effect.gen(function*() {
    const max = session.config.maxContextTokens
    if (max === undefined) return undefined
    const total = transcript.reduce((n, m) => n + estimateTokens(m), Math.ceil((session.config.system?.length ?? 0) / 4))
    if (total <= max) return undefined
    const cut = compactionCut(transcript, Math.floor(max / 2))
    if (cut === 0) return undefined
    const older = transcript.slice(0, cut)
    let finished = false
    const summary = yield* Stream.runFold(
      session.model.streamText({
        prompt: [{ role: "system", content: SUMMARY_SYSTEM }, { role: "user", content: render(older) }],
        disableToolCallResolution: true
      }),
      "",
      (text, part) => {
        if (part.type === "finish") finished = true
        return part.type === "text-delta" ? text + part.delta : text
      }
    )
    if (!finished) return yield* new TurnError({ code: "stream_cut", message: "the summary's stream ended before the response was complete" })
    if (summary.trim() === "") {
      return yield* new TurnError({ code: "malformed_response", message: "the model wrote an empty summary of the conversation" })
    }
    yield* Effect.logInfo(`turn ${turnId}: the conversation (~${total} tokens) was compacted: ${cut} messages summarized`)
    return [
      agentMessage(`${turnId}-s`, "assistant", `Summary of the earlier conversation (${cut} messages):\n${summary.trim()}`),
      ...transcript.slice(cut)
    ]
  })

const errorText = (error: unknown): string => {
  if (typeof error === "string") return error
  const e = error as { error?: { message?: unknown; type?: unknown }; message?: unknown }
  if (typeof e?.error?.message === "string") return e.error.message
  if (typeof e?.message === "string") return e.message
  try {
    return JSON.stringify(error)
  } catch {
    return String(error)
  }
}


// ---------------------------------------------------------------------------------------------
// Starting a session
// ---------------------------------------------------------------------------------------------

/** The API key from the environment variable `name`, if set and not empty. */
export const readApiKey = (name: string): Effect.Effect<Option.Option<Redacted.Redacted>> =>
  Config.option(Config.redacted(name)).pipe(
    Effect.map(Option.filter((key) => Redacted.value(key).length > 0)),
    Effect.orElseSucceed(() => Option.none())
  )

/** How an engine builds its model for a session. */
export interface ModelProvider {
  /**
   * The session's model, given its config, the API key (if set), and the HttpClient
   * transformation that adds the retries.
   */
  readonly make: (options: {
    readonly config: ModelConfig
    readonly apiKey: Option.Option<Redacted.Redacted>
    readonly transformClient: (client: HttpClient.HttpClient) => HttpClient.HttpClient
  }) => Effect.Effect<LanguageModel.Service>
}

/** The tools' handlers, for the toolkit the model is told about (the loop runs the calls). */
const toolHandlers = (cwd: string) => {
  const handler = (name: Tools.ToolName) => ({ path }: { readonly path: unknown }) =>
    Effect.flatMap(Tools.run(cwd, name, { path }), (o) => (o.isError ? Effect.fail(o.result) : Effect.succeed(o.result)))
  return Tools.toolkit.of({ read_file: handler("read_file"), list_dir: handler("list_dir") })
}

/**
 * A session of a model engine: its model, its tools' working directory (the config's `cwd`,
 * else the session's work dir, made on first use), the API key from the environment.
 */
export const start = (engine: string, config: ModelConfig, provider: ModelProvider): Effect.Effect<EngineSession, EngineError> =>
  Effect.gen(function*() {
    const workDir = Option.getOrUndefined(yield* Effect.serviceOption(SessionWorkDir.SessionWorkDir))
    const cwd = config.cwd ?? workDir ?? process.cwd()
    if (config.cwd === undefined && workDir !== undefined) {
      yield* FileIo.ensureDir(workDir).pipe(
        Effect.mapError(() => new EngineError({ reason: "invalid_config", message: `${engine}: the session's work dir ${workDir} cannot be made` }))
      )
    }
    const apiKey = yield* readApiKey(config.apiKeyEnv)
    // Timeouts inside the retries: each attempt has its own deadline, and one that got no
    // answer in time is retried like a 5xx.
    const retries = withRetries(config.maxRetries, config.retryBaseDelayMs)
    const timeouts = withTimeouts(config.requestTimeoutMs, config.idleTimeoutMs)
    const model = yield* provider.make({ config, apiKey, transformClient: (client) => retries(timeouts(client)) })
    const toolkit = yield* Effect.provide(Tools.toolkit, Tools.toolkit.toLayer(toolHandlers(cwd)))
    const session: ModelSession = {
      model,
      config,
      engine,
      secrets: Option.match(apiKey, { onNone: () => [], onSome: (k) => [Redacted.value(k)] }),
      cwd,
      toolkit
    }
    return { runTurn: (input) => runTurn(session, input), endsCutMessages: true }
  })
