/**
 * A chaos client: one logical client of the daemon that may drop its socket, reconnect, pause
 * its reading, attach and detach. Independent of the project's own client code: it checks the
 * wire contract from outside.
 *
 * Every command it sends is tracked until its response: the run's watchdog fails the run when
 * the oldest unanswered command of a connection has waited longer than its bound (commands
 * run one at a time per connection, so the bound counts from the previous answer). Every
 * message of a session goes to that session's {@link SessionStream}, which checks it.
 */
import { randomUUID } from "node:crypto"
import * as net from "node:net"
import { describeMsg, type Msg, SessionStream, type Truth, Violation } from "./streamCheck.js"

export const PROTOCOL = { name: "agentd", version: 1 } as const

/** How long the daemon may take to answer a command once it is at the head of its connection. */
export const boundOf = (type: string): number => {
  switch (type) {
    case "prompt":
    case "checkpoint":
    case "retry_worker":
    case "kill":
    case "create":
      return 30_000
    case "attach":
    case "get_messages":
      return 20_000
    default:
      // ping, get_state, list, status, abort, detach
      return 5_000
  }
}

/** A command waiting for its response. */
interface Pending {
  readonly id: string
  readonly type: string
  readonly activeSessionId: string | undefined
  readonly sentAt: number
  readonly resolve: (r: Msg | undefined) => void
}

/** The answer to a command: the response, or undefined when the connection went away first. */
export type Answer = Msg | undefined

export class ChaosClient {
  private socket: net.Socket | undefined
  private parts: Array<Buffer> = []
  private pending: Array<Pending> = []
  private answeredIds = new Set<string>()
  /** When the last response arrived on the current connection (the head command's bound starts there). */
  private lastAnswerAt = 0
  private connectWaiters: Array<() => void> = []
  paused = false
  /** Set by the run: a violation found while reading. */
  onViolation: (v: Violation) => void = () => {}
  readonly streams = new Map<string, SessionStream>()
  connected = false
  connections = 0
  clientId: string | undefined

  constructor(
    readonly label: string,
    private readonly socketPath: () => string,
    private readonly truthOf: (activeSessionId: string) => Truth
  ) {}

  /** This client's stream of a session (made on first use). */
  stream(activeSessionId: string): SessionStream {
    let s = this.streams.get(activeSessionId)
    if (s === undefined) {
      s = new SessionStream(activeSessionId, this.label, this.truthOf(activeSessionId))
      this.streams.set(activeSessionId, s)
    }
    return s
  }

  /** Connects and waits for `daemon_hello`. Rejects when nothing listens. */
  connect(timeoutMs = 10_000): Promise<void> {
    return new Promise((resolve, reject) => {
      const socket = net.createConnection({ path: this.socketPath() })
      let settled = false
      const timer = setTimeout(() => {
        if (settled) return
        settled = true
        socket.destroy()
        reject(new Error(`[${this.label}] no daemon_hello within ${timeoutMs} ms`))
      }, timeoutMs)
      socket.once("error", (e) => {
        if (settled) return
        settled = true
        clearTimeout(timer)
        reject(e)
      })
      this.socket = socket
      this.parts = []
      this.paused = false
      this.connectWaiters.push(() => {
        if (settled) return
        settled = true
        clearTimeout(timer)
        resolve()
      })
      socket.on("data", (d: Buffer) => {
        if (this.socket === socket) this.onData(d)
      })
      socket.on("error", () => {})
      socket.on("close", () => {
        if (this.socket === socket) this.onClose()
      })
    })
  }

  private onClose(): void {
    this.socket = undefined
    this.connected = false
    this.paused = false
    for (const s of this.streams.values()) s.connectionLost()
    // The connection is gone: its commands will never be answered (not a violation).
    for (const p of this.pending.splice(0)) p.resolve(undefined)
  }

  /** Drops the connection at once (the commands in flight are answered `undefined`). */
  drop(): void {
    const s = this.socket
    if (s === undefined) return
    this.onClose()
    s.destroy()
  }

  /** Stops reading: the daemon's outbound buffer for this client fills up. */
  pause(): void {
    if (this.socket === undefined || this.paused) return
    this.paused = true
    this.socket.pause()
  }

  resume(): void {
    if (this.socket === undefined || !this.paused) return
    this.paused = false
    // The head command's bound starts again: nothing could be read while paused.
    this.lastAnswerAt = Date.now()
    this.socket.resume()
  }

  private onData(data: Buffer): void {
    let start = 0
    for (;;) {
      const nl = data.indexOf(0x0a, start)
      if (nl < 0) break
      const piece = data.subarray(start, nl)
      const line = this.parts.length === 0 ? piece : Buffer.concat([...this.parts, piece])
      this.parts = []
      start = nl + 1
      if (line.length === 0) continue
      let m: Msg
      try {
        m = JSON.parse(line.toString("utf8")) as Msg
      } catch {
        this.violation(new Violation("valid JSON lines", `[${this.label}] a line that is not JSON: ${line.toString("utf8").slice(0, 200)}`))
        return
      }
      try {
        this.onMessage(m)
      } catch (e) {
        if (e instanceof Violation) return this.violation(e)
        throw e
      }
    }
    if (start < data.length) this.parts.push(Buffer.from(data.subarray(start)))
  }

  private violation(v: Violation): void {
    this.onViolation(v)
  }

  private onMessage(m: Msg): void {
    const type = m["type"] as string
    if (type === "daemon_hello") {
      this.connected = true
      this.connections++
      this.clientId = m["clientId"]
      this.lastAnswerAt = Date.now()
      for (const w of this.connectWaiters.splice(0)) w()
      return
    }
    if (type === "response") {
      const id = m["id"] as string
      const i = this.pending.findIndex((p) => p.id === id)
      if (i < 0) {
        throw new Violation(
          "one response per command",
          `[${this.label}] ${this.answeredIds.has(id) ? "a second" : "an unexpected"} response ${describeMsg(m)} id ${id}`
        )
      }
      if (i > 0) {
        throw new Violation(
          "responses in order",
          `[${this.label}] ${describeMsg(m)} (${this.pending[i]!.type}) answered before the earlier ${this.pending[0]!.type} (id ${this.pending[0]!.id})`
        )
      }
      const [p] = this.pending.splice(i, 1)
      this.answeredIds.add(id)
      this.lastAnswerAt = Date.now()
      if (p!.type === "attach" && p!.activeSessionId !== undefined) this.stream(p!.activeSessionId).attachResponse(m)
      if (p!.type === "detach" && p!.activeSessionId !== undefined && m["success"] === true) this.stream(p!.activeSessionId).detached()
      p!.resolve(m)
      return
    }
    if (type === "daemon_closing") return
    const sid = m["activeSessionId"]
    if (typeof sid !== "string") throw new Violation("message shape", `[${this.label}] ${describeMsg(m)} without activeSessionId`)
    this.stream(sid).receive(m)
  }

  /**
   * Sends a command (envelope form) and resolves with its response, or undefined when the
   * connection is lost before it (or was not there).
   */
  send(command: Msg): Promise<Answer> {
    const socket = this.socket
    if (socket === undefined || !this.connected) return Promise.resolve(undefined)
    const id = `${this.label}-${randomUUID().slice(0, 8)}`
    const type = command["type"] as string
    const activeSessionId = command["activeSessionId"] as string | undefined
    if (type === "attach" && activeSessionId !== undefined) this.stream(activeSessionId).attachSent(command["resumeCursor"])
    return new Promise((resolve) => {
      if (this.pending.length === 0) this.lastAnswerAt = Date.now()
      this.pending.push({ id, type, activeSessionId, sentAt: Date.now(), resolve })
      socket.write(JSON.stringify({ type: "command", id, protocol: PROTOCOL, command }) + "\n")
    })
  }

  /** The oldest command that has waited past its bound, if any (never while paused). */
  overdue(now: number): { readonly type: string; readonly id: string; readonly waitedMs: number; readonly activeSessionId: string | undefined } | undefined {
    if (this.paused) return undefined
    const head = this.pending[0]
    if (head === undefined) return undefined
    const since = Math.max(head.sentAt, this.lastAnswerAt)
    const waited = now - since
    return waited > boundOf(head.type) ? { type: head.type, id: head.id, waitedMs: waited, activeSessionId: head.activeSessionId } : undefined
  }

  /** What is waiting, for failure output. */
  describePending(): string {
    return this.pending.map((p) => `${p.type}${p.activeSessionId ? `(${p.activeSessionId.slice(0, 8)})` : ""} for ${Date.now() - p.sentAt} ms`).join(", ")
  }

  get pendingCount(): number {
    return this.pending.length
  }
}
