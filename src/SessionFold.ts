/**
 * The fold of one session (docs/protocol.md sections 4-5), shared by the SDK's
 * `SessionClient` (Node, over the socket) and the web page (the browser, over HTTP): it takes
 * attach results, snapshot frames and sequenced events in wire order, reassembles chunked
 * snapshots, checks that cursors follow one another, and keeps the session's state (the
 * transcript, the message being streamed, busy, the worker's state, the last cursor).
 *
 * Pure and platform-free: no I/O and no Node module, so that the browser bundle holds this
 * very code (one fold for Node and the browser, not two that could drift apart).
 */
import * as Data from "effect/Data"
import * as Either from "effect/Either"
import * as Cursor from "./Cursor.js"
import type * as Protocol from "./Protocol.js"

// ---------------------------------------------------------------------------------------------
// What a follower emits
// ---------------------------------------------------------------------------------------------

/** Why a snapshot replaced the follower's state. */
export type BaselinePurpose = "attach" | "resync" | "replacement"

/**
 * A snapshot became the follower's state (the first attach, a resync after the events it
 * lacked were pruned, a history rewrite): `messages` is the transcript at `cursor` (absent: the
 * session's start); the events after it follow.
 */
export interface Baseline {
  readonly type: "baseline"
  readonly activeSessionId: string
  readonly purpose: BaselinePurpose
  readonly snapshotId: string
  readonly cursor?: Cursor.Cursor | undefined
  readonly messages: ReadonlyArray<Protocol.AgentMessage>
  /**
   * True when events after the consumer's last cursor and at or before `cursor` exist that
   * will not be emitted (they are inside the snapshot): a resync, a rewrite, or a start from a
   * cursor older than the current generation.
   */
  readonly skipped: boolean
}

/** What {@link SessionClientService.events} emits: every sequenced message once, and baselines. */
export type FollowEvent = Protocol.SessionEvent | Protocol.SessionStatus | Protocol.SessionClosed | Baseline

/** The folded state of a session, as its follower knows it. */
export interface SessionState {
  readonly activeSessionId: string
  /** The transcript: the baseline's messages, then each `message_end`'s message. A live view. */
  readonly messages: ReadonlyArray<Protocol.AgentMessage>
  /** The message being streamed (from `message_start`, its `message_update` deltas appended). */
  readonly streaming: Protocol.AgentMessage | undefined
  /** Whether a turn runs (from the latest `session_status` or `session_attached`). */
  readonly busy: boolean
  /** The worker's state (ditto); undefined before the first attach. */
  readonly worker: Protocol.WorkerState | undefined
  /** The latest summary the daemon sent. */
  readonly summary: Protocol.SessionSummary | undefined
  /** The fold's position: the last event folded, or the last baseline's snapshot cursor. */
  readonly lastCursor: Cursor.Cursor | undefined
  /** The last event emitted to the consumer (what is persisted). */
  readonly emittedCursor: Cursor.Cursor | undefined
  /** Whether a baseline has been received (before it, `messages` is empty and means nothing). */
  readonly hasBaseline: boolean
  /** The `session_closed` reason, once closed. */
  readonly closed: string | undefined
  /**
   * The error of the latest turn when it ended failed (its `agent_end` carried an `error`: the
   * model endpoint failed; its last assistant message has `isError`). Cleared when a turn
   * starts; undefined after a baseline (the transcript's `isError` messages still say it).
   */
  readonly turnError: Protocol.TurnFailure | undefined
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/** The daemon could not stream a snapshot (`session_snapshot_failed`): the follower attaches again. */
export class SnapshotFailed extends Data.TaggedError("SnapshotFailed")<{
  readonly activeSessionId: string
  readonly snapshotId: string
  readonly error: Protocol.ErrorBody
  readonly message: string
}> {}

/**
 * The daemon broke a promise of the protocol on this follower's stream (an event out of cursor
 * order or with a gap, a frame out of place, a snapshot whose chunks do not add up). Not
 * retried: the follower's state can no longer be trusted.
 */
export class SessionProtocolViolation extends Data.TaggedError("SessionProtocolViolation")<{
  readonly activeSessionId: string
  readonly message: string
}> {}

// ---------------------------------------------------------------------------------------------
// The fold (pure, no I/O)
// ---------------------------------------------------------------------------------------------

interface Assembling {
  readonly purpose: BaselinePurpose
  readonly snapshotId: string
  readonly cursor: Cursor.Cursor | undefined
  readonly messageCount: number
  readonly messages: Array<Protocol.AgentMessage>
  chunks: number
}

/**
 * One follower's view of one session across its connections: takes the attach results and the
 * daemon's pushed messages in wire order, and returns what to emit. Pure; exported for tests.
 */
export class SessionFold implements SessionState {
  messages: Array<Protocol.AgentMessage> = []
  streaming: Protocol.AgentMessage | undefined = undefined
  summary: Protocol.SessionSummary | undefined = undefined
  lastCursor: Cursor.Cursor | undefined = undefined
  emittedCursor: Cursor.Cursor | undefined
  hasBaseline = false
  closed: string | undefined = undefined
  turnError: Protocol.TurnFailure | undefined = undefined
  private assembling: Assembling | undefined = undefined
  /** A snapshot a dropped connection was in the middle of (its chunks so far), to resume. */
  private cutOff: Assembling | undefined = undefined
  /** Whether `session_attached` came on this connection (events may flow). */
  private flowing = false
  /** The cursor of the last status folded. */
  private statusCursor: Cursor.Cursor | undefined = undefined

  /** `from`: emit only events after it (the consumer has seen the rest). */
  constructor(readonly activeSessionId: string, from?: Cursor.Cursor) {
    this.emittedCursor = from
  }

  get busy(): boolean {
    return this.summary?.busy ?? false
  }

  get worker(): Protocol.WorkerState | undefined {
    return this.summary?.worker
  }

  /** A plain copy of the state (the transcript array is shared, not copied). */
  snapshot(): SessionState {
    return {
      activeSessionId: this.activeSessionId,
      messages: this.messages,
      streaming: this.streaming,
      busy: this.busy,
      worker: this.worker,
      summary: this.summary,
      lastCursor: this.lastCursor,
      emittedCursor: this.emittedCursor,
      hasBaseline: this.hasBaseline,
      closed: this.closed,
      turnError: this.turnError
    }
  }

  /**
   * A new connection is about to attach: the cursor to resume from (none: a baseline is needed),
   * and the snapshot the last connection was cut off in, to continue from its next chunk.
   */
  attaching(): { readonly resumeCursor?: Cursor.Cursor; readonly snapshotResume?: { readonly snapshotId: string; readonly fromChunk: number } } {
    const cut = this.assembling
    this.assembling = undefined
    this.cutOff = cut !== undefined && cut.chunks > 0 ? cut : undefined
    this.flowing = false
    return {
      ...(this.hasBaseline && this.lastCursor !== undefined ? { resumeCursor: this.lastCursor } : {}),
      ...(this.cutOff === undefined ? {} : { snapshotResume: { snapshotId: this.cutOff.snapshotId, fromChunk: this.cutOff.chunks } })
    }
  }

  /** The attach response: an inline baseline, if it carries one. */
  attached(result: Protocol.DaemonAttachResult): Either.Either<ReadonlyArray<FollowEvent>, SessionProtocolViolation> {
    // The daemon continues the cut-off snapshot only when it streams that one again.
    if (result.snapshotStream?.id !== this.cutOff?.snapshotId) this.cutOff = undefined
    if (result.replay.status === "complete") {
      if (!this.hasBaseline) return Either.left(this.violation("a complete replay for an attach without a resume cursor"))
      return Either.right([])
    }
    if (result.snapshotStream !== undefined) return Either.right([])
    const snapshot = result.snapshot
    if (snapshot.messages.length !== snapshot.messageCount) {
      return Either.left(this.violation(`an inline snapshot of ${snapshot.messageCount} messages carries ${snapshot.messages.length}`))
    }
    return Either.right([this.baseline(purposeOf(result.replay), snapshot.snapshotId, snapshot.cursor, snapshot.messages)])
  }

  /** Any pushed message (others' sessions are ignored). */
  receive(m: Protocol.PushMessage): Either.Either<ReadonlyArray<FollowEvent>, SessionProtocolViolation | SnapshotFailed> {
    if (m.type === "daemon_closing" || m.activeSessionId !== this.activeSessionId) return Either.right([])
    switch (m.type) {
      case "session_attached":
        if (this.assembling !== undefined) return Either.left(this.violation("session_attached inside a snapshot"))
        this.flowing = true
        this.summary = m.state
        return Either.right([])
      case "session_snapshot_begin": {
        if (this.assembling !== undefined) return Either.left(this.violation(`snapshot ${m.snapshotId} begins inside ${this.assembling.snapshotId}`))
        if (m.purpose === "checkpoint") return Either.left(this.violation("a snapshot with purpose checkpoint"))
        const cut = this.cutOff
        this.cutOff = undefined
        if (cut !== undefined && cut.snapshotId === m.snapshotId) {
          // Resumed: its chunks continue from the one after those already here.
          this.assembling = cut
          return Either.right([])
        }
        this.assembling = {
          purpose: m.purpose,
          snapshotId: m.snapshotId,
          cursor: m.cursor,
          messageCount: m.messageCount,
          messages: [],
          chunks: 0
        }
        return Either.right([])
      }
      case "session_snapshot_chunk": {
        const a = this.assembling
        if (a === undefined || a.snapshotId !== m.snapshotId) return Either.left(this.violation(`chunk of ${m.snapshotId} outside its snapshot`))
        if (m.index !== a.chunks) return Either.left(this.violation(`chunk ${m.index} of ${m.snapshotId}, expected ${a.chunks}`))
        a.chunks++
        for (const message of m.messages) a.messages.push(message)
        return Either.right([])
      }
      case "session_snapshot_end": {
        const a = this.assembling
        if (a === undefined || a.snapshotId !== m.snapshotId) return Either.left(this.violation(`end of ${m.snapshotId} outside its snapshot`))
        if (m.chunkCount !== a.chunks) return Either.left(this.violation(`${m.snapshotId} ends after ${m.chunkCount} chunks, ${a.chunks} came`))
        if (a.messages.length !== a.messageCount) {
          return Either.left(this.violation(`${m.snapshotId} announced ${a.messageCount} messages, ${a.messages.length} came`))
        }
        this.assembling = undefined
        return Either.right([this.baseline(a.purpose, a.snapshotId, a.cursor, a.messages)])
      }
      case "session_snapshot_failed":
        this.assembling = undefined
        return Either.left(
          new SnapshotFailed({
            activeSessionId: this.activeSessionId,
            snapshotId: m.snapshotId,
            error: m.error,
            message: `the daemon could not stream snapshot ${m.snapshotId} (${m.error.code}: ${m.error.message})`
          })
        )
      default:
        return this.sequenced(m)
    }
  }

  private sequenced(
    m: Protocol.SessionEvent | Protocol.SessionStatus | Protocol.SessionClosed
  ): Either.Either<ReadonlyArray<FollowEvent>, SessionProtocolViolation> {
    const c = m.meta.cursor
    if (this.assembling !== undefined) return Either.left(this.violation(`event ${Cursor.format(c)} inside snapshot ${this.assembling.snapshotId}`))
    if (!this.flowing) return Either.left(this.violation(`event ${Cursor.format(c)} before session_attached`))
    if (!this.hasBaseline) return Either.left(this.violation(`event ${Cursor.format(c)} before any baseline`))
    const last = this.lastCursor
    // At or before the fold's position: already folded (a replay that overlaps).
    if (last !== undefined && !Cursor.isAfter(c, last)) return Either.right([])
    const follows = last === undefined
      ? c.sequence === 0
      : (c.generation === last.generation && c.sequence === last.sequence + 1) || (c.generation > last.generation && c.sequence === 0)
    if (!follows) return Either.left(this.violation(`event ${Cursor.format(c)} does not follow ${last === undefined ? "the session's start" : Cursor.format(last)}`))
    this.fold(m)
    if (this.emittedCursor !== undefined && !Cursor.isAfter(c, this.emittedCursor)) return Either.right([])
    this.emittedCursor = c
    return Either.right([m])
  }

  /**
   * The session's summary as `get_state` read it after a `resync` or `replacement` that came in
   * the middle of the stream: its snapshot may hold the statuses since the last one folded (the
   * idle status of a turn, say), and no `session_attached` follows it to say the state. Taken
   * unless a status newer than it was folded meanwhile (like an attach's `state`, it may be
   * ahead of the events still to come, whose statuses are folded in their turn).
   */
  refreshed(summary: Protocol.SessionSummary): void {
    const at = summary.lastEventCursor
    if (this.statusCursor !== undefined && (at === undefined || Cursor.isAfter(this.statusCursor, at))) return
    this.summary = summary
  }

  private fold(m: Protocol.SessionEvent | Protocol.SessionStatus | Protocol.SessionClosed): void {
    this.lastCursor = m.meta.cursor
    if (m.type === "session_status") {
      this.summary = m.state
      this.statusCursor = m.meta.cursor
      return
    }
    if (m.type === "session_closed") {
      this.closed = m.reason
      return
    }
    const e = m.event
    switch (e.type) {
      case "message_start":
        this.streaming = e.message
        return
      case "message_update":
        if (this.streaming !== undefined && this.streaming.id === e.messageId) {
          this.streaming = { ...this.streaming, content: this.streaming.content + e.delta }
        }
        return
      case "message_end":
        this.messages.push(e.message)
        this.streaming = undefined
        return
      case "agent_start":
        this.turnError = undefined
        return
      case "turn_interrupted":
        this.streaming = undefined
        this.turnError = undefined
        return
      case "agent_end":
        this.streaming = undefined
        this.turnError = e.error
        return
      default:
        return
    }
  }

  private baseline(
    purpose: BaselinePurpose,
    snapshotId: string,
    cursor: Cursor.Cursor | undefined,
    messages: ReadonlyArray<Protocol.AgentMessage>
  ): Baseline {
    const emitted = this.emittedCursor
    // Events after what the consumer saw and inside the snapshot are not emitted one by one.
    const skipped = cursor !== undefined && (emitted === undefined ? this.hasBaseline : Cursor.isAfter(cursor, emitted))
    this.messages = [...messages]
    this.streaming = undefined
    this.turnError = undefined
    this.lastCursor = cursor
    this.hasBaseline = true
    if (cursor !== undefined && (emitted === undefined || Cursor.isAfter(cursor, emitted))) this.emittedCursor = cursor
    return { type: "baseline", activeSessionId: this.activeSessionId, purpose, snapshotId, cursor, messages, skipped }
  }

  private violation(what: string): SessionProtocolViolation {
    return new SessionProtocolViolation({ activeSessionId: this.activeSessionId, message: `session ${this.activeSessionId}: ${what}` })
  }
}

const purposeOf = (replay: Protocol.Replay): BaselinePurpose =>
  replay.reason === "transcript_replaced" ? "replacement" : replay.status === "partial" ? "resync" : "attach"
