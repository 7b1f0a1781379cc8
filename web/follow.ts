/**
 * Follows one session over HTTP with the SDK's own fold (src/SessionFold.ts): the session's
 * snapshot (`/v1/sessions/:id/snapshot`, the socket's snapshot frames) gives the baseline and
 * the offset after it; an `EventSource` on `/events?live=sse` from that offset gives the events.
 * The browser's EventSource reconnects by itself with `Last-Event-ID` (a lost network, a daemon
 * restart), and the fold drops whatever it already has, so nothing is shown twice or missed.
 * A pruned offset (410), a `lost: "resync"` or a history rewrite start over from a new snapshot.
 * Only the snapshot's last chunks are read, and its last WINDOW messages kept: the fold holds
 * the end of the transcript, and earlier messages are read (`/messages`) as the reader asks.
 */
import * as Either from "effect/Either"
import type * as Cursor from "../src/Cursor.js"
import type * as Protocol from "../src/Protocol.js"
import { SessionFold } from "../src/SessionFold.js"
import { api, ApiError } from "./api.js"

/** A line of the page's own, between messages: what happened to the session or the connection. */
export interface Notice {
  readonly kind: "info" | "warn" | "error"
  readonly text: string
  /** Shown after this many messages of the fold (moved on when earlier ones are put in front). */
  at: number
}

/** The offset of a cursor, as the HTTP front writes it (`GGGG…_SSSS…`). */
export const offsetOf = (c: Cursor.Cursor | undefined): string =>
  c === undefined ? "-1" : `${String(c.generation).padStart(16, "0")}_${String(c.sequence).padStart(16, "0")}`

const INTERRUPTS: Record<string, string> = {
  worker_crashed: "The worker crashed: this turn was interrupted.",
  aborted: "Aborted: this turn was interrupted.",
  daemon_restarted: "The daemon restarted: this turn was interrupted.",
  daemon_shutdown: "The daemon shut down: this turn was interrupted.",
  storage_failed: "Storage failed: this turn was interrupted."
}

/** The snapshot's bytes read at a start: its last chunks making at least this much. */
const TAIL_BYTES = 1024 * 1024
/** The snapshot's messages kept at a start (at most): the rest are read as the reader scrolls up. */
const WINDOW = 100

export class Follower {
  /** The transcript's end: `earlier` messages come before its first one. */
  fold: SessionFold
  /** Messages of the transcript before the fold's first one, not read (yet). */
  earlier = 0
  readonly notices: Array<Notice> = []
  /** What the connection is doing, for the status line. */
  connection: "connecting" | "live" | "reconnecting" | "stopped" = "connecting"
  /** Bumped whenever a baseline replaces the transcript (the view renders it again). */
  epoch = 0
  private source: EventSource | undefined
  private stopped = false
  private starting = false
  private retryTimer: ReturnType<typeof setTimeout> | undefined
  private lastWorker: Protocol.WorkerState | undefined
  /** The snapshot the transcript was last built from. */
  private snapshotId: string | undefined

  constructor(readonly id: string, private readonly changed: () => void) {
    this.fold = new SessionFold(id)
  }

  notice(kind: Notice["kind"], text: string): void {
    this.notices.push({ kind, text, at: this.fold.messages.length })
  }

  /** Loads the snapshot and follows the events after it. */
  async start(reason?: string): Promise<void> {
    if (this.stopped || this.starting) return
    this.starting = true
    this.source?.close()
    this.source = undefined
    clearTimeout(this.retryTimer)
    try {
      const summary = await api<Protocol.SessionSummary>("GET", `/v1/sessions/${encodeURIComponent(this.id)}`)
      const offset = await this.loadSnapshot(summary, reason)
      if (this.stopped) return
      this.follow(offset)
    } catch (e) {
      if (e instanceof ApiError && (e.status === 404 || e.status === 401)) {
        this.connection = "stopped"
        this.notice("error", e.status === 404 ? "This session does not exist (any more)." : "Not logged in: open the login link again (`agentd web`).")
        this.changed()
        return
      }
      this.connection = "reconnecting"
      this.changed()
      this.retryTimer = setTimeout(() => void this.start(), 1000)
    } finally {
      this.starting = false
    }
  }

  stop(): void {
    this.stopped = true
    this.connection = "stopped"
    clearTimeout(this.retryTimer)
    this.source?.close()
  }

  /**
   * Reads the end of the snapshot (JSON lines of the socket's snapshot frames; `tailBytes`: only
   * its last chunks) into the fold, as a snapshot of its last messages: `earlier` says how many
   * came before them.
   */
  private async loadSnapshot(summary: Protocol.SessionSummary, reason: string | undefined): Promise<string> {
    const res = await fetch(`/v1/sessions/${encodeURIComponent(this.id)}/snapshot?tailBytes=${TAIL_BYTES}`, { credentials: "same-origin" })
    if (!res.ok) throw await ApiError.of(res)
    const text = await res.text()
    // A fresh fold: a baseline replaces everything, and the fold's checks start over with it.
    const fold = new SessionFold(this.id)
    fold.attaching()
    let offset: string | undefined
    let begin: Protocol.PushMessage & { readonly type: "session_snapshot_begin" } | undefined
    let end: Protocol.PushMessage & { readonly type: "session_snapshot_end" } | undefined
    const chunks: Array<ReadonlyArray<Protocol.AgentMessage>> = []
    for (const line of text.split("\n")) {
      if (line === "") continue
      const m = JSON.parse(line) as Protocol.PushMessage | { readonly type: "snapshot_offset"; readonly offset: string }
      if (m.type === "snapshot_offset") offset = m.offset
      else if (m.type === "session_snapshot_begin") begin = m
      else if (m.type === "session_snapshot_chunk") chunks.push(m.messages)
      else if (m.type === "session_snapshot_end") end = m
      else if (m.type === "session_snapshot_failed") throw new Error(`the snapshot failed: ${m.error.message}`)
    }
    if (offset === undefined || begin === undefined || end === undefined) throw new Error("the snapshot ended early")
    const received = chunks.flat()
    const kept = received.slice(Math.max(0, received.length - WINDOW))
    const earlier = begin.messageCount - kept.length
    if (earlier < 0 || (chunks.length === end.chunkCount && received.length !== begin.messageCount)) {
      throw new Error(`${begin.snapshotId} announced ${begin.messageCount} messages, ${received.length} came`)
    }
    // The fold takes the window as a whole snapshot of its own (its checks hold for it).
    for (const m of [
      { ...begin, messageCount: kept.length },
      { type: "session_snapshot_chunk", activeSessionId: this.id, snapshotId: begin.snapshotId, index: 0, messages: kept },
      { ...end, chunkCount: 1 }
    ] as const) {
      const out = fold.receive(m)
      if (Either.isLeft(out)) throw new Error(out.left.message)
    }
    const snapshotId = begin.snapshotId
    // What `session_attached` says on the socket: the session's state; events may flow.
    const attached = fold.receive({ type: "session_attached", activeSessionId: this.id, state: summary, replay: { status: "unavailable" } })
    if (Either.isLeft(attached)) throw new Error(attached.left.message)
    this.fold = fold
    this.earlier = earlier
    this.snapshotId = snapshotId
    // The notices were about the transcript just replaced; the reason for replacing it stays.
    this.notices.length = 0
    if (reason !== undefined) this.notice("warn", reason)
    this.lastWorker = summary.worker
    this.epoch++
    this.changed()
    return offset
  }

  /**
   * Reads up to `n` of the messages before the fold's first one (`/messages`, by their index in
   * the transcript: the history before the window does not change but by a rewrite, which
   * starts over) and puts them in front. How many it put there (0 if a new baseline came meanwhile).
   */
  async loadEarlier(n: number): Promise<number> {
    if (this.earlier === 0) return 0
    const epoch = this.epoch
    const from = Math.max(0, this.earlier - n)
    const page = await api<Protocol.GetMessagesResult>(
      "GET",
      `/v1/sessions/${encodeURIComponent(this.id)}/messages?offset=${from}&limit=${this.earlier - from}`
    )
    if (epoch !== this.epoch || this.earlier - from !== page.messages.length) return 0
    this.fold.messages.unshift(...page.messages)
    for (const notice of this.notices) notice.at += page.messages.length
    this.earlier = from
    return page.messages.length
  }

  private follow(offset: string): void {
    const source = new EventSource(`/v1/sessions/${encodeURIComponent(this.id)}/events?offset=${offset}&live=sse`)
    this.source = source
    source.onopen = () => {
      this.connection = "live"
      this.changed()
    }
    source.addEventListener("data", (ev) => {
      if (source !== this.source) return
      const batch = JSON.parse((ev as MessageEvent<string>).data) as Array<Protocol.SessionEvent | Protocol.SessionStatus | Protocol.SessionClosed>
      for (const m of batch) {
        const before = this.fold.lastCursor
        const out = this.fold.receive(m)
        if (Either.isLeft(out)) {
          void this.start(`Resynchronising (${out.left.message}).`)
          return
        }
        if (out.right.length > 0 || before !== this.fold.lastCursor) this.noticeFor(m)
      }
      this.changed()
    })
    source.addEventListener("control", (ev) => {
      if (source !== this.source) return
      const c = JSON.parse((ev as MessageEvent<string>).data) as { readonly rewrite?: { readonly snapshotId: string }; readonly lost?: string }
      // A rewrite whose snapshot the transcript was built from: an offset after a rewrite is
      // also one of the history before it, so the stream names the snapshot, and this one is had.
      if (c.rewrite !== undefined && c.rewrite.snapshotId !== this.snapshotId) {
        void this.start("The history was rewritten: the transcript was replaced.")
      }
      else if (c.lost !== undefined) void this.start("This page fell behind and resynchronised from a snapshot.")
    })
    source.onerror = () => {
      if (source !== this.source) return
      this.connection = "reconnecting"
      this.changed()
      // CONNECTING: the browser retries by itself with Last-Event-ID. CLOSED: the server
      // refused (a pruned offset, the login gone, the session gone): find out which.
      if (source.readyState === EventSource.CLOSED) void this.refused()
    }
  }

  private async refused(): Promise<void> {
    const res = await fetch(`/v1/sessions/${encodeURIComponent(this.id)}/events?offset=${offsetOf(this.fold.lastCursor)}`, { method: "HEAD", credentials: "same-origin" })
      .catch(() => undefined)
    if (res?.status === 410) return this.start("Events this page lacked were pruned: it resynchronised from a snapshot.")
    this.retryTimer = setTimeout(() => void this.start(), 1000)
  }

  private noticeFor(m: Protocol.SessionEvent | Protocol.SessionStatus | Protocol.SessionClosed): void {
    if (m.type === "session_closed") {
      this.notice("error", `The session was closed (${m.reason}).`)
      this.source?.close()
      this.connection = "stopped"
    } else if (m.type === "session_status") {
      const w = m.state.worker
      if (w !== this.lastWorker) {
        if (w === "recovering") this.notice("warn", "The worker is recovering…")
        else if (w === "ready" && this.lastWorker === "recovering") this.notice("info", "The worker is ready again.")
        else if (w === "failed") this.notice("error", "The worker failed: Retry restarts it.")
        else if (w === "damaged") this.notice("error", `The session is damaged${m.state.damage === undefined ? "" : `: ${m.state.damage.reason}`}.`)
      }
      this.lastWorker = w
    } else if (m.event.type === "turn_interrupted") {
      this.notice("warn", INTERRUPTS[m.event.reason] ?? `This turn was interrupted (${m.event.reason}).`)
    } else if (m.event.type === "agent_end" && m.event.error !== undefined) {
      this.notice("error", `The turn failed: ${m.event.error.message}`)
    }
  }
}
