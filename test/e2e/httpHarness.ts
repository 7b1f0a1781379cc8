/**
 * HTTP helpers for the e2e tests of the HTTP front: a daemon started with `--http`, its URL
 * (read from its log) and token (read from the state dir, as `agentd http-token` does), a raw
 * request on `node:http` (fetch may not set `Host` or `Origin`, which the attack tests need),
 * an SSE follower that resumes with `Last-Event-ID` as a browser's EventSource does, and what
 * the event-stream tests share: waiting for a session to be idle, reading all its events page by
 * page, offsets and cursors.
 */
import * as fs from "node:fs"
import * as http from "node:http"
import * as net from "node:net"
import * as path from "node:path"
import { type Cursor, type Daemon, type Msg, sleep, type StartOptions, useDaemon } from "./harness.js"

export interface HttpDaemon {
  readonly daemon: Daemon
  readonly port: number
  readonly url: string
  readonly token: string
}

/** A TCP port free right now (bound, then released). */
export const freePort = (): Promise<number> =>
  new Promise((resolve, reject) => {
    const server = net.createServer()
    server.once("error", reject)
    server.listen(0, "127.0.0.1", () => {
      const port = (server.address() as net.AddressInfo).port
      server.close(() => resolve(port))
    })
  })

/** Waits for the daemon's `agentd HTTP at http://...` log line; its port. */
export const httpPortOf = async (daemon: Daemon, timeoutMs = 15_000): Promise<number> => {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const m = /agentd HTTP at http:\/\/[^\s]+:(\d+)/.exec(daemon.stderr)
    if (m !== null) return Number(m[1])
    if (!daemon.running) throw new Error(`daemon exited before serving HTTP;\n${daemon.output}`)
    if (Date.now() > deadline) throw new Error(`no HTTP log line within ${timeoutMs} ms;\n${daemon.output}`)
    await sleep(25)
  }
}

/** Starts a daemon with `--http 127.0.0.1:<port>` (0: any) for the current test. */
export const useHttpDaemon = async (options: StartOptions & { readonly port?: number } = {}): Promise<HttpDaemon> => {
  const daemon = await useDaemon({
    ...options,
    extraArgs: [...(options.extraArgs ?? []), "--http", `127.0.0.1:${options.port ?? 0}`]
  })
  const port = await httpPortOf(daemon)
  const token = fs.readFileSync(path.join(daemon.stateDir, "http-token"), "utf8").trim()
  return { daemon, port, url: `http://127.0.0.1:${port}`, token }
}

export interface HttpResult {
  readonly status: number
  readonly headers: http.IncomingHttpHeaders
  readonly text: string
  // eslint-disable-next-line @typescript-eslint/no-explicit-any
  readonly json: any
}

export interface RequestOptions {
  readonly headers?: Record<string, string>
  readonly body?: string | Buffer | undefined
  /** No `Authorization` header (default: the daemon's bearer token). */
  readonly noAuth?: boolean
  /** Send the body chunked (no Content-Length). */
  readonly chunked?: boolean
  readonly timeoutMs?: number
}

/** One request; resolves with status, headers and body (parsed as JSON when it is). */
export const request = (
  h: { readonly port: number; readonly token: string },
  method: string,
  target: string,
  options: RequestOptions = {}
): Promise<HttpResult> =>
  new Promise((resolve, reject) => {
    const headers: Record<string, string> = { host: `127.0.0.1:${h.port}`, ...options.headers }
    if (options.noAuth !== true && headers["authorization"] === undefined) headers["authorization"] = `Bearer ${h.token}`
    if (options.body !== undefined && options.chunked !== true) headers["content-length"] = String(Buffer.byteLength(options.body))
    if (options.chunked === true) headers["transfer-encoding"] = "chunked"
    const req = http.request({ host: "127.0.0.1", port: h.port, method, path: target, headers, setHost: false, agent: false })
    const timer = setTimeout(() => {
      req.destroy()
      reject(new Error(`${method} ${target}: no answer within ${options.timeoutMs ?? 15_000} ms`))
    }, options.timeoutMs ?? 15_000)
    req.on("error", (e) => {
      clearTimeout(timer)
      reject(e)
    })
    req.on("response", (res) => {
      const chunks: Array<Buffer> = []
      res.on("data", (c: Buffer) => chunks.push(c))
      res.on("end", () => {
        clearTimeout(timer)
        const text = Buffer.concat(chunks).toString("utf8")
        let json: unknown
        try {
          json = JSON.parse(text)
        } catch {
          json = undefined
        }
        resolve({ status: res.statusCode ?? 0, headers: res.headers, text, json })
      })
      res.on("error", (e) => {
        clearTimeout(timer)
        reject(e)
      })
    })
    if (options.body !== undefined) {
      if (options.chunked === true) {
        const body = Buffer.from(options.body)
        for (let i = 0; i < body.length; i += 65536) req.write(body.subarray(i, i + 65536))
      } else req.write(options.body)
    }
    req.end()
  })

/** One SSE event as parsed. */
export interface SseEvent {
  readonly event: string
  readonly id: string | undefined
  readonly data: string
}

/**
 * Follows an SSE URL as EventSource does: on any end or error it reconnects (every
 * `retryMs`) with `Last-Event-ID` set to the last id it saw. Every data event's messages are
 * kept in `messages`, in order.
 */
export class SseFollower {
  readonly events: Array<SseEvent> = []
  readonly messages: Array<Msg> = []
  readonly statuses: Array<number> = []
  lastEventId: string | undefined
  connections = 0
  private stopped = false
  private paused = false
  private current: http.ClientRequest | undefined
  private response: http.IncomingMessage | undefined
  private waiters: Array<() => void> = []

  constructor(
    private readonly target: () => { readonly port: number; readonly token: string },
    private readonly path: string,
    private readonly retryMs = 100,
    private readonly extraHeaders: Record<string, string> = {}
  ) {
    void this.loop()
  }

  private async loop(): Promise<void> {
    while (!this.stopped) {
      await new Promise<void>((resolve) => {
        const t = this.target()
        const headers: Record<string, string> = {
          host: `127.0.0.1:${t.port}`,
          authorization: `Bearer ${t.token}`,
          accept: "text/event-stream",
          ...this.extraHeaders
        }
        if (this.lastEventId !== undefined) headers["last-event-id"] = this.lastEventId
        const req = http.request({ host: "127.0.0.1", port: t.port, path: this.path, headers, setHost: false, agent: false })
        this.current = req
        req.on("error", () => resolve())
        req.on("response", (res) => {
          this.statuses.push(res.statusCode ?? 0)
          if (res.statusCode !== 200) {
            res.resume()
            res.on("end", () => resolve())
            return
          }
          this.connections++
          this.response = res
          if (this.paused) res.pause()
          res.setEncoding("utf8")
          let buffer = ""
          res.on("data", (text: string) => {
            buffer += text
            for (;;) {
              const end = buffer.indexOf("\n\n")
              if (end < 0) break
              this.onBlock(buffer.slice(0, end))
              buffer = buffer.slice(end + 2)
            }
          })
          res.on("end", () => resolve())
          res.on("error", () => resolve())
          res.on("close", () => resolve())
        })
        req.end()
      })
      if (!this.stopped) await sleep(this.retryMs)
    }
  }

  private onBlock(block: string): void {
    let event = "message"
    let id: string | undefined
    const data: Array<string> = []
    for (const line of block.split("\n")) {
      if (line.startsWith(":")) continue
      const colon = line.indexOf(":")
      const field = colon < 0 ? line : line.slice(0, colon)
      const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "")
      if (field === "event") event = value
      else if (field === "id") id = value
      else if (field === "data") data.push(value)
    }
    if (data.length === 0 && id === undefined) return
    if (id !== undefined) this.lastEventId = id
    const e = { event, id, data: data.join("\n") }
    this.events.push(e)
    if (event === "data") this.messages.push(...(JSON.parse(e.data) as Array<Msg>))
    for (const w of this.waiters.splice(0)) w()
  }

  /** Waits until `pred` holds of what was received. */
  async waitFor(pred: (f: SseFollower) => boolean, timeoutMs = 15_000, what = "condition"): Promise<void> {
    const deadline = Date.now() + timeoutMs
    while (!pred(this)) {
      if (Date.now() > deadline) {
        throw new Error(`SSE: ${what} not reached within ${timeoutMs} ms (${this.messages.length} messages, statuses ${this.statuses.join(",")})`)
      }
      await Promise.race([new Promise<void>((r) => this.waiters.push(r)), sleep(100)])
    }
  }

  /** Stops reading (a slow reader: the kernel's buffers fill, then the daemon's). */
  pause(): void {
    this.paused = true
    this.response?.pause()
  }

  resume(): void {
    this.paused = false
    this.response?.resume()
  }

  stop(): void {
    this.stopped = true
    this.current?.destroy()
  }
}

/** The HTTP offset of a cursor (`GGGG…_SSSS…`). */
export const offsetOf = (c: Cursor) => `${String(c.generation).padStart(16, "0")}_${String(c.sequence).padStart(16, "0")}`
/** Messages' cursors as `G:S`, for comparing streams. */
export const cursorsOf = (msgs: ReadonlyArray<Msg>) => msgs.map((m) => `${m["meta"].cursor.generation}:${m["meta"].cursor.sequence}`)
export const isEventOf = (type: string) => (m: Msg) => m["type"] === "session_event" && m["event"]?.type === type

/** Waits until the session's worker is ready and no turn runs (its summary). */
export const waitIdle = async (h: HttpDaemon, id: string, timeoutMs = 20_000) => {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const s = await request(h, "GET", `/v1/sessions/${id}`).catch(() => undefined)
    if (s?.json?.worker === "ready" && s.json.busy === false) {
      h.daemon.recordWorkers(s.json)
      return s.json
    }
    if (Date.now() > deadline) throw new Error(`session ${id} not idle: ${s?.text}`)
    await sleep(50)
  }
}

/** Every event of the session from `from` (default the start), read page by page; and the offset after them. */
export const readAll = async (h: HttpDaemon, id: string, from = "-1") => {
  const out: Array<Msg> = []
  let offset = from
  for (;;) {
    const res = await request(h, "GET", `/v1/sessions/${id}/events?offset=${offset}`)
    if (res.status !== 200) throw new Error(`events?offset=${offset}: ${res.status} ${res.text}`)
    out.push(...res.json)
    offset = String(res.headers["stream-next-offset"])
    if (res.headers["stream-up-to-date"] === "true") return { messages: out, next: offset }
  }
}
