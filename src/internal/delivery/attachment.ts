/** One client's subscription to one session, as publishing and the catch-up fiber share it. */
import type * as Cursor from "../../Cursor.js"
import * as Metrics from "../../Metrics.js"
import type { ConnectionPort } from "../../SessionManager.js"
import type { Session } from "../session/session.js"
import { WARM_UP_SESSION_PREFIX } from "./warmUp.js"

/** One connection's subscription to one session. */
export class Attachment {
  /** `live`: published events are written directly; otherwise the catch-up fiber reads the log. */
  mode: "catchup" | "live" | "paused" = "catchup"
  /** The last cursor written to the client (undefined: nothing of the session yet). */
  delivered: Cursor.Cursor | undefined
  /** Set after a backpressure pause: re-sent events are flagged replayed. */
  resumed = false
  /** The session's latest history rewrite that the client's state includes. */
  knownRewrite: number | undefined
  wake: (() => void) | undefined
  detached = false
  /** `session_attached` was sent: from here on the client reads the session's stream. */
  streaming = false
  /**
   * Its session was killed before `session_attached` was sent: the `session_closed` line that
   * follows it (and ends the attachment). See the entity's `PublishClosed`.
   */
  closedLine: string | undefined
  /** Counted as delivered here for socket clients; an HTTP read counts what it sends itself; the start's warm-up is not counted. */
  readonly metered: boolean

  constructor(
    readonly session: Session,
    readonly outbox: ConnectionPort,
    readonly connectionId: string,
    readonly limit: number,
    /** Events up to this cursor existed at attach time: they are flagged replayed. */
    readonly attachCursor: Cursor.Cursor | undefined
  ) {
    this.knownRewrite = session.rewriteGeneration
    // The warm-up's outbox is the socket server's class (the same code warmed), not counted.
    this.metered = (outbox as { readonly transport?: string }).transport !== "http" &&
      !session.meta.activeSessionId.startsWith(WARM_UP_SESSION_PREFIX)
  }

  /**
   * Called by publish, synchronously, for every batch of new events (`lines`, the last one at
   * `last`). A client over its limit is paused before the batch and later resumed from the log.
   */
  onLive(last: Cursor.Cursor, lines: Uint8Array) {
    if (this.mode !== "live" || this.detached) return
    if (this.outbox.queuedBytes > this.limit) {
      this.mode = "paused"
      Metrics.count(Metrics.slowClientPauses)
      this.signal()
      return
    }
    this.outbox.offer(lines)
    if (this.metered) Metrics.delivered("socket", Metrics.lineCount(lines), lines.byteLength)
    this.delivered = last
  }

  /**
   * The session's history was rewritten: the catch-up fiber sends the new snapshot before any
   * later event (a live attachment stops taking events directly until then).
   */
  replaceState() {
    if (this.mode === "live") this.mode = "catchup"
    this.signal()
  }

  signal() {
    const wake = this.wake
    this.wake = undefined
    wake?.()
  }
}
