/**
 * An `@effect/ai` `LanguageModel` for any OpenAI-compatible chat-completions endpoint
 * (`POST {baseUrl}/chat/completions` with `stream: true`): llama.cpp's server, vLLM, Ollama,
 * LM Studio, and the hosted services that copy OpenAI's older API.
 *
 * Why it exists: `@effect/ai-openai` 0.41 speaks only OpenAI's Responses API, which local
 * servers do not implement; `@effect/ai-openrouter` speaks chat completions but needs
 * `@effect/ai` 0.35, and `@effect/ai-openai-compat` exists only for Effect 4. So this is a
 * small provider built the way the official ones are (the platform's HttpClient, the SSE
 * parser of `@effect/experimental`, `LanguageModel.make`), so that it takes the same prompts
 * and toolkits as they do. Text and function tools only: no images, no structured output.
 */
import * as AiError from "@effect/ai/AiError"
import * as LanguageModel from "@effect/ai/LanguageModel"
import type * as Prompt from "@effect/ai/Prompt"
import type * as Response from "@effect/ai/Response"
import * as Tool from "@effect/ai/Tool"
import * as Sse from "@effect/experimental/Sse"
import * as HttpBody from "@effect/platform/HttpBody"
import * as HttpClient from "@effect/platform/HttpClient"
import * as HttpClientRequest from "@effect/platform/HttpClientRequest"
import * as Effect from "effect/Effect"
import { identity } from "effect/Function"
import * as Redacted from "effect/Redacted"
import * as Stream from "effect/Stream"

/** How to reach the endpoint, and the request's sampling settings. */
export interface Options {
  /** Up to and including the API version, e.g. `http://127.0.0.1:8080/v1`. */
  readonly baseUrl: string
  readonly model: string
  readonly apiKey?: Redacted.Redacted | undefined
  readonly temperature?: number | undefined
  readonly maxTokens?: number | undefined
  readonly transformClient?: ((client: HttpClient.HttpClient) => HttpClient.HttpClient) | undefined
}

const MODULE = "OpenAiCompat"

type ChatMessage =
  | { readonly role: "system" | "user"; readonly content: string }
  | {
    readonly role: "assistant"
    readonly content: string | null
    readonly tool_calls?: ReadonlyArray<{
      readonly id: string
      readonly type: "function"
      readonly function: { readonly name: string; readonly arguments: string }
    }>
  }
  | { readonly role: "tool"; readonly tool_call_id: string; readonly content: string }

/** One `data:` chunk of a chat-completions stream (the fields this provider reads). */
interface ChatChunk {
  readonly id?: string
  readonly model?: string
  readonly choices?: ReadonlyArray<{
    readonly delta?: {
      readonly content?: string | null
      readonly tool_calls?: ReadonlyArray<{
        readonly index?: number
        readonly id?: string
        readonly function?: { readonly name?: string; readonly arguments?: string }
      }>
    }
    readonly finish_reason?: string | null
  }>
  readonly usage?: { readonly prompt_tokens?: number; readonly completion_tokens?: number; readonly total_tokens?: number } | null
  readonly error?: unknown
}

const malformed = (method: string, description: string) => new AiError.MalformedOutput({ module: MODULE, method, description })

const resultText = (result: unknown): string => (typeof result === "string" ? result : JSON.stringify(result) ?? "null")

/** The prompt as chat-completions messages. */
export const toMessages = (prompt: Prompt.Prompt): Effect.Effect<Array<ChatMessage>, AiError.AiError> =>
  Effect.suspend(() => {
    const out: Array<ChatMessage> = []
    for (const message of prompt.content) {
      switch (message.role) {
        case "system":
          out.push({ role: "system", content: message.content })
          break
        case "user": {
          const texts: Array<string> = []
          for (const part of message.content) {
            if (part.type !== "text") {
              return Effect.fail(new AiError.MalformedInput({ module: MODULE, method: "toMessages", description: `unsupported ${part.type} part in a user message` }))
            }
            texts.push(part.text)
          }
          out.push({ role: "user", content: texts.join("\n") })
          break
        }
        case "assistant": {
          let text = ""
          const calls: Array<{ id: string; type: "function"; function: { name: string; arguments: string } }> = []
          for (const part of message.content) {
            if (part.type === "text") text += part.text
            else if (part.type === "tool-call" && !part.providerExecuted) {
              calls.push({ id: part.id, type: "function", function: { name: part.name, arguments: JSON.stringify(part.params ?? {}) } })
            }
          }
          out.push(calls.length > 0 ? { role: "assistant", content: text.length > 0 ? text : null, tool_calls: calls } : { role: "assistant", content: text })
          break
        }
        case "tool":
          for (const part of message.content) out.push({ role: "tool", tool_call_id: part.id, content: resultText(part.result) })
          break
      }
    }
    return Effect.succeed(out)
  })

const toolChoiceOf = (choice: LanguageModel.ProviderOptions["toolChoice"]): unknown => {
  if (typeof choice === "string") return choice
  if ("tool" in choice) return { type: "function", function: { name: choice.tool } }
  return choice.mode ?? "auto"
}

const finishReason = (reason: string | undefined): Response.FinishReason => {
  switch (reason) {
    case "stop":
      return "stop"
    case "length":
      return "length"
    case "tool_calls":
    case "function_call":
      return "tool-calls"
    case "content_filter":
      return "content-filter"
    case undefined:
      return "unknown"
    default:
      return "other"
  }
}

/** The request body (without `stream`). */
const makeBody = (options: Options, provider: LanguageModel.ProviderOptions) =>
  Effect.map(toMessages(provider.prompt), (messages) => {
    const tools = provider.tools.filter(Tool.isUserDefined).map((tool) => ({
      type: "function",
      function: { name: tool.name, description: Tool.getDescription(tool as any), parameters: Tool.getJsonSchema(tool as any) }
    }))
    return {
      model: options.model,
      messages,
      ...(options.temperature === undefined ? {} : { temperature: options.temperature }),
      ...(options.maxTokens === undefined ? {} : { max_tokens: options.maxTokens }),
      ...(tools.length > 0 ? { tools, tool_choice: toolChoiceOf(provider.toolChoice) } : {})
    }
  })

/**
 * Turns the SSE `data:` payloads of one response into response parts: text deltas as they
 * come; tool calls (their arguments arrive in pieces) and the finish once the stream says it
 * is done. A stream that ends before `[DONE]` and before any `finish_reason` was cut: it
 * fails, rather than passing off a partial answer as a whole one.
 */
const toParts = (events: Stream.Stream<Sse.Event, AiError.AiError>): Stream.Stream<Response.StreamPartEncoded, AiError.AiError> =>
  Stream.suspend(() => {
    let textOpen = false
    let metadataSent = false
    let reason: string | undefined
    let done = false
    let usage: ChatChunk["usage"] = undefined
    const calls = new Map<number, { id: string; name: string; args: string }>()

    const finish = (): Effect.Effect<Array<Response.StreamPartEncoded>, AiError.AiError> =>
      Effect.suspend(() => {
        const parts: Array<Response.StreamPartEncoded> = []
        if (textOpen) parts.push({ type: "text-end", id: "0" })
        textOpen = false
        for (const call of [...calls.entries()].sort(([a], [b]) => a - b).map(([, c]) => c)) {
          let params: unknown
          try {
            params = call.args.trim() === "" ? {} : Tool.unsafeSecureJsonParse(call.args)
          } catch {
            return Effect.fail(malformed("stream", `the arguments of the tool call ${call.name} are not JSON: ${call.args.slice(0, 200)}`))
          }
          parts.push({ type: "tool-params-end", id: call.id })
          parts.push({ type: "tool-call", id: call.id, name: call.name, params, providerExecuted: false })
        }
        parts.push({
          type: "finish",
          reason: calls.size > 0 && (reason === undefined || reason === "stop") ? "tool-calls" : finishReason(reason),
          usage: {
            inputTokens: usage?.prompt_tokens ?? undefined,
            outputTokens: usage?.completion_tokens ?? undefined,
            totalTokens: usage?.total_tokens ?? undefined
          }
        })
        return Effect.succeed(parts)
      })

    const onEvent = (event: Sse.Event): Effect.Effect<Array<Response.StreamPartEncoded>, AiError.AiError> =>
      Effect.suspend(() => {
        if (done) return Effect.succeed([])
        const data = event.data.trim()
        if (data === "[DONE]") {
          done = true
          return finish()
        }
        if (data === "") return Effect.succeed([])
        let chunk: ChatChunk
        try {
          chunk = JSON.parse(data) as ChatChunk
        } catch {
          return Effect.fail(malformed("stream", `a stream event is not JSON: ${data.slice(0, 200)}`))
        }
        if (typeof chunk !== "object" || chunk === null) return Effect.fail(malformed("stream", `a stream event is not an object: ${data.slice(0, 200)}`))
        const parts: Array<Response.StreamPartEncoded> = []
        if (chunk.error !== undefined) {
          parts.push({ type: "error", error: chunk.error })
          return Effect.succeed(parts)
        }
        if (!metadataSent) {
          metadataSent = true
          parts.push({
            type: "response-metadata",
            ...(typeof chunk.id === "string" ? { id: chunk.id } : {}),
            ...(typeof chunk.model === "string" ? { modelId: chunk.model } : {}),
            timestamp: new Date().toISOString()
          })
        }
        if (chunk.usage) usage = chunk.usage
        for (const choice of chunk.choices ?? []) {
          const delta = choice.delta
          if (typeof delta?.content === "string" && delta.content.length > 0) {
            if (!textOpen) {
              textOpen = true
              parts.push({ type: "text-start", id: "0" })
            }
            parts.push({ type: "text-delta", id: "0", delta: delta.content })
          }
          for (const [position, piece] of (delta?.tool_calls ?? []).entries()) {
            const index = piece.index ?? position
            let call = calls.get(index)
            if (call === undefined) {
              call = { id: piece.id ?? `call_${index}`, name: piece.function?.name ?? "", args: "" }
              calls.set(index, call)
              parts.push({ type: "tool-params-start", id: call.id, name: call.name })
            } else if (piece.function?.name !== undefined && call.name === "") {
              call.name = piece.function.name
            }
            if (piece.function?.arguments) {
              call.args += piece.function.arguments
              parts.push({ type: "tool-params-delta", id: call.id, delta: piece.function.arguments })
            }
          }
          if (typeof choice.finish_reason === "string") reason = choice.finish_reason
        }
        return Effect.succeed(parts)
      })

    const tail = Stream.suspend(() =>
      done
        ? Stream.empty
        : reason !== undefined
        // Some servers end after the finish reason without `[DONE]`: the answer is whole.
        ? Stream.fromIterableEffect(finish())
        : Stream.fail(malformed("stream", "the stream ended before [DONE] (cut mid-way?)"))
    )
    return events.pipe(Stream.mapConcatEffect(onEvent), Stream.concat(tail))
  })

/** The chat-completions model, as a `LanguageModel` service. */
export const make = (options: Options): Effect.Effect<LanguageModel.Service, never, HttpClient.HttpClient> =>
  Effect.gen(function*() {
    const client = (yield* HttpClient.HttpClient).pipe(
      HttpClient.mapRequest((request) =>
        request.pipe(
          HttpClientRequest.prependUrl(options.baseUrl),
          options.apiKey !== undefined ? HttpClientRequest.bearerToken(Redacted.value(options.apiKey)) : identity,
          HttpClientRequest.acceptJson
        )
      ),
      options.transformClient ?? identity,
      HttpClient.filterStatusOk
    )

    const streamText = (provider: LanguageModel.ProviderOptions): Stream.Stream<Response.StreamPartEncoded, AiError.AiError> =>
      Effect.map(makeBody(options, provider), (body) => {
        const request = HttpClientRequest.post("/chat/completions", {
          body: HttpBody.unsafeJson({ ...body, stream: true })
        }).pipe(HttpClientRequest.setHeader("accept", "text/event-stream"))
        const events = client.execute(request).pipe(
          Effect.map((response) => response.stream),
          Stream.unwrapScoped,
          Stream.decodeText(),
          Stream.pipeThroughChannel(Sse.makeChannel()),
          Stream.catchTags({
            RequestError: (error) => AiError.HttpRequestError.fromRequestError({ module: MODULE, method: "streamText", error }),
            ResponseError: (error) => AiError.HttpResponseError.fromResponseError({ module: MODULE, method: "streamText", error })
          })
        )
        return toParts(events)
      }).pipe(Stream.unwrap)

    return yield* LanguageModel.make({
      streamText,
      // The same request, its parts gathered: text deltas into one text part.
      generateText: (provider) =>
        Stream.runCollect(streamText(provider)).pipe(
          Effect.map((chunk) => {
            const parts: Array<Response.PartEncoded> = []
            let text = ""
            for (const part of chunk) {
              if (part.type === "text-delta") text += part.delta
              else if (part.type === "tool-call" || part.type === "finish" || part.type === "response-metadata") {
                if (text.length > 0) {
                  parts.push({ type: "text", text })
                  text = ""
                }
                parts.push(part)
              }
            }
            if (text.length > 0) parts.push({ type: "text", text })
            return parts
          })
        )
    })
  })
