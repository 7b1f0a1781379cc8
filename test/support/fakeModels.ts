/**
 * Fake model servers for tests: a real HTTP server on 127.0.0.1 that answers each request with
 * the next scripted reply, in the streaming wire format of a provider:
 * - OpenAI's Responses API (`POST /responses`, SSE `event:`/`data:` pairs, `response.created`
 *   ... `response.completed`),
 * - chat completions (`POST /chat/completions`, `data:` chunks then `data: [DONE]`),
 * - Anthropic's messages API (`POST /v1/messages`, `message_start`, `content_block_*`,
 *   `message_delta`, `message_stop`).
 * It records every request (headers and body) and whether the client closed it before the
 * reply was complete (an abort). Failure modes: an error status, a stream cut mid-way (`cut`),
 * a stream that stops writing and stays open (`hang`: a stall after a few bytes), a request
 * never answered at all, not even its headers (`silent`), malformed events (`raw`, `sse`).
 */
import * as http from "node:http"
import type { AddressInfo } from "node:net"

/** One step of a streamed reply. */
export type Step =
  | { readonly sse: string; readonly event?: string }
  | { readonly raw: string }
  | { readonly delayMs: number }
  /** Destroys the connection (a stream cut mid-way). */
  | { readonly cut: true }
  /** Stops writing and keeps the connection open (until the client gives up). */
  | { readonly hang: true }

/** A scripted reply: an error answer, a stream of steps, or nothing at all (no headers, ever). */
export type Reply =
  | { readonly status: number; readonly headers?: Readonly<Record<string, string>>; readonly body?: unknown }
  | { readonly steps: ReadonlyArray<Step> }
  | { readonly silent: true }

export interface RecordedRequest {
  readonly method: string
  readonly path: string
  readonly headers: http.IncomingHttpHeaders
  readonly body: any
  /** True once the client closed the connection before the reply was complete. */
  closedEarly: boolean
  /** Resolves when the reply is over (complete, or closed by the client). */
  readonly done: Promise<void>
}

export interface FakeModel {
  readonly url: string
  readonly port: number
  readonly requests: Array<RecordedRequest>
  /** Queues replies, answered in order, one per request. */
  readonly reply: (...replies: ReadonlyArray<Reply>) => void
  /** Resolves when `n` requests have arrived. */
  readonly waitForRequests: (n: number, timeoutMs?: number) => Promise<void>
  readonly close: () => Promise<void>
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms))

/** Starts a fake server on 127.0.0.1 (a free port). */
export const startFakeModel = async (): Promise<FakeModel> => {
  const queue: Array<Reply> = []
  const requests: Array<RecordedRequest> = []
  const waiters: Array<() => void> = []
  const sockets = new Set<import("node:net").Socket>()
  const server = http.createServer((req, res) => {
    const chunks: Array<Buffer> = []
    req.on("data", (c: Buffer) => chunks.push(c))
    req.on("end", async () => {
      let finish!: () => void
      const done = new Promise<void>((resolve) => (finish = resolve))
      const text = Buffer.concat(chunks).toString("utf8")
      let body: unknown = text
      try {
        body = JSON.parse(text)
      } catch {
        // kept as text
      }
      const record: RecordedRequest = { method: req.method ?? "", path: req.url ?? "", headers: req.headers, body, closedEarly: false, done }
      requests.push(record)
      res.on("close", () => {
        if (!res.writableFinished) record.closedEarly = true
        finish()
      })
      for (const w of waiters.splice(0)) w()
      const reply = queue.shift() ?? { status: 500, body: { error: { message: "the fake server has no reply scripted" } } }
      if ("silent" in reply) return
      if ("status" in reply) {
        res.writeHead(reply.status, { "content-type": "application/json", ...reply.headers })
        res.end(reply.body === undefined ? "" : JSON.stringify(reply.body))
        return
      }
      res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache", connection: "keep-alive" })
      res.flushHeaders()
      for (const step of reply.steps) {
        if (res.destroyed) return
        if ("delayMs" in step) await sleep(step.delayMs)
        else if ("cut" in step) {
          res.socket?.destroy()
          return
        } else if ("hang" in step) return
        else if ("raw" in step) res.write(step.raw)
        else res.write(`${step.event !== undefined ? `event: ${step.event}\n` : ""}data: ${step.sse}\n\n`)
      }
      res.end()
    })
  })
  server.on("connection", (s) => {
    sockets.add(s)
    s.on("close", () => sockets.delete(s))
  })
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve))
  const port = (server.address() as AddressInfo).port
  return {
    url: `http://127.0.0.1:${port}`,
    port,
    requests,
    reply: (...replies) => {
      queue.push(...replies)
    },
    waitForRequests: (n, timeoutMs = 10_000) =>
      new Promise<void>((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error(`fake model: ${requests.length} of ${n} requests after ${timeoutMs} ms`)), timeoutMs)
        const check = () => {
          if (requests.length >= n) {
            clearTimeout(timer)
            resolve()
          } else waiters.push(check)
        }
        check()
      }),
    close: () =>
      new Promise<void>((resolve) => {
        for (const s of sockets) s.destroy()
        server.close(() => resolve())
      })
  }
}

// ---------------------------------------------------------------------------------------------
// Chat completions
// ---------------------------------------------------------------------------------------------

const chunk = (delta: unknown, finish: string | null = null) =>
  JSON.stringify({
    id: "chatcmpl-1",
    object: "chat.completion.chunk",
    created: 1_700_000_000,
    model: "fake-model",
    choices: [{ index: 0, delta, finish_reason: finish }]
  })

/** Chat-completions streams. */
export const chat = {
  /** A text answer in the given deltas. */
  text: (deltas: ReadonlyArray<string>, options: { readonly delayMs?: number } = {}): Array<Step> => [
    { sse: chunk({ role: "assistant", content: "" }) },
    ...deltas.flatMap((d): Array<Step> => [...(options.delayMs ? [{ delayMs: options.delayMs }] : []), { sse: chunk({ content: d }) }]),
    { sse: chunk({}, "stop") },
    { sse: "[DONE]" }
  ],
  /** A tool call (its arguments in two pieces), optionally after some text. */
  toolCall: (id: string, name: string, args: unknown, text?: string): Array<Step> => {
    const json = JSON.stringify(args)
    const half = Math.floor(json.length / 2)
    return [
      { sse: chunk({ role: "assistant", content: text ?? null }) },
      { sse: chunk({ tool_calls: [{ index: 0, id, type: "function", function: { name, arguments: "" } }] }) },
      { sse: chunk({ tool_calls: [{ index: 0, function: { arguments: json.slice(0, half) } }] }) },
      { sse: chunk({ tool_calls: [{ index: 0, function: { arguments: json.slice(half) } }] }) },
      { sse: chunk({}, "tool_calls") },
      { sse: "[DONE]" }
    ]
  },
  /** The first chunks of a text answer, then the connection is cut. */
  cut: (deltas: ReadonlyArray<string>): Array<Step> => [
    { sse: chunk({ role: "assistant", content: "" }) },
    ...deltas.map((d): Step => ({ sse: chunk({ content: d }) })),
    { delayMs: 20 },
    { cut: true }
  ],
  /** A text answer that stops after its first deltas and never ends (for aborts). */
  hang: (deltas: ReadonlyArray<string>): Array<Step> => [
    { sse: chunk({ role: "assistant", content: "" }) },
    ...deltas.map((d): Step => ({ sse: chunk({ content: d }) })),
    { hang: true }
  ],
  /** The first deltas, then the first bytes of the next event, then nothing (the connection stays open). */
  stall: (deltas: ReadonlyArray<string>): Array<Step> => [
    { sse: chunk({ role: "assistant", content: "" }) },
    ...deltas.map((d): Step => ({ sse: chunk({ content: d }) })),
    { raw: "data: {\"id\":" },
    { hang: true }
  ]
}

// ---------------------------------------------------------------------------------------------
// OpenAI Responses API
// ---------------------------------------------------------------------------------------------

const response = (status: string, output: ReadonlyArray<unknown>) => ({
  id: "resp_1",
  object: "response",
  created_at: 1_700_000_000,
  status,
  model: "gpt-fake",
  output,
  parallel_tool_calls: true,
  tool_choice: "auto",
  tools: [],
  temperature: 1,
  top_p: 1,
  metadata: {},
  incomplete_details: null,
  error: null,
  instructions: null,
  usage: status === "completed"
    ? { input_tokens: 10, input_tokens_details: { cached_tokens: 0 }, output_tokens: 5, output_tokens_details: { reasoning_tokens: 0 }, total_tokens: 15 }
    : null
})

class Sequencer {
  n = 0
  event(type: string, fields: Record<string, unknown>): Step {
    return { event: type, sse: JSON.stringify({ type, sequence_number: this.n++, ...fields }) }
  }
}

const messageItem = (text: string, status: string) => ({
  id: "msg_1",
  type: "message",
  status,
  role: "assistant",
  content: status === "completed" ? [{ type: "output_text", text, annotations: [] }] : []
})

/** Responses API streams. */
export const responses = {
  text: (deltas: ReadonlyArray<string>, options: { readonly delayMs?: number; readonly end?: "complete" | "cut" | "hang" } = {}): Array<Step> => {
    const s = new Sequencer()
    const text = deltas.join("")
    const head: Array<Step> = [
      s.event("response.created", { response: response("in_progress", []) }),
      s.event("response.in_progress", { response: response("in_progress", []) }),
      s.event("response.output_item.added", { output_index: 0, item: messageItem("", "in_progress") }),
      s.event("response.content_part.added", { item_id: "msg_1", output_index: 0, content_index: 0, part: { type: "output_text", text: "", annotations: [] } }),
      ...deltas.flatMap((delta): Array<Step> => [
        ...(options.delayMs ? [{ delayMs: options.delayMs }] : []),
        s.event("response.output_text.delta", { item_id: "msg_1", output_index: 0, content_index: 0, delta, logprobs: [] })
      ])
    ]
    if (options.end === "cut") return [...head, { delayMs: 20 }, { cut: true }]
    if (options.end === "hang") return [...head, { hang: true }]
    return [
      ...head,
      s.event("response.output_text.done", { item_id: "msg_1", output_index: 0, content_index: 0, text, logprobs: [] }),
      s.event("response.content_part.done", { item_id: "msg_1", output_index: 0, content_index: 0, part: { type: "output_text", text, annotations: [] } }),
      s.event("response.output_item.done", { output_index: 0, item: messageItem(text, "completed") }),
      s.event("response.completed", { response: response("completed", [messageItem(text, "completed")]) })
    ]
  },
  toolCall: (callId: string, name: string, args: unknown): Array<Step> => {
    const s = new Sequencer()
    const json = JSON.stringify(args)
    const item = (status: string, a: string) => ({ id: "fc_1", type: "function_call", status, call_id: callId, name, arguments: a })
    return [
      s.event("response.created", { response: response("in_progress", []) }),
      s.event("response.output_item.added", { output_index: 0, item: item("in_progress", "") }),
      s.event("response.function_call_arguments.delta", { item_id: "fc_1", output_index: 0, delta: json }),
      s.event("response.function_call_arguments.done", { item_id: "fc_1", output_index: 0, arguments: json }),
      s.event("response.output_item.done", { output_index: 0, item: item("completed", json) }),
      s.event("response.completed", { response: response("completed", [item("completed", json)]) })
    ]
  }
}

// ---------------------------------------------------------------------------------------------
// Anthropic messages API
// ---------------------------------------------------------------------------------------------

const ev = (type: string, fields: Record<string, unknown> = {}): Step => ({ event: type, sse: JSON.stringify({ type, ...fields }) })

const messageStart = ev("message_start", {
  message: {
    id: "msg_01",
    type: "message",
    role: "assistant",
    content: [],
    model: "claude-fake",
    stop_reason: null,
    stop_sequence: null,
    usage: { input_tokens: 10, output_tokens: 1 }
  }
})

/** Anthropic messages streams. */
export const anthropic = {
  text: (deltas: ReadonlyArray<string>, options: { readonly delayMs?: number; readonly end?: "complete" | "cut" | "hang" } = {}): Array<Step> => {
    const head: Array<Step> = [
      messageStart,
      ev("content_block_start", { index: 0, content_block: { type: "text", text: "" } }),
      ev("ping"),
      ...deltas.flatMap((text): Array<Step> => [
        ...(options.delayMs ? [{ delayMs: options.delayMs }] : []),
        ev("content_block_delta", { index: 0, delta: { type: "text_delta", text } })
      ])
    ]
    if (options.end === "cut") return [...head, { delayMs: 20 }, { cut: true }]
    if (options.end === "hang") return [...head, { hang: true }]
    return [
      ...head,
      ev("content_block_stop", { index: 0 }),
      ev("message_delta", { delta: { stop_reason: "end_turn", stop_sequence: null }, usage: { output_tokens: 15 } }),
      ev("message_stop")
    ]
  },
  toolCall: (id: string, name: string, args: unknown, text?: string): Array<Step> => {
    const json = JSON.stringify(args)
    const half = Math.floor(json.length / 2)
    const index = text === undefined ? 0 : 1
    return [
      messageStart,
      ...(text === undefined ? [] : [
        ev("content_block_start", { index: 0, content_block: { type: "text", text: "" } }),
        ev("content_block_delta", { index: 0, delta: { type: "text_delta", text } }),
        ev("content_block_stop", { index: 0 })
      ]),
      ev("content_block_start", { index, content_block: { type: "tool_use", id, name, input: {} } }),
      ev("content_block_delta", { index, delta: { type: "input_json_delta", partial_json: json.slice(0, half) } }),
      ev("content_block_delta", { index, delta: { type: "input_json_delta", partial_json: json.slice(half) } }),
      ev("content_block_stop", { index }),
      ev("message_delta", { delta: { stop_reason: "tool_use", stop_sequence: null }, usage: { output_tokens: 20 } }),
      ev("message_stop")
    ]
  }
}
