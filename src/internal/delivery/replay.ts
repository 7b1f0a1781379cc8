/**
 * The replay decision of an attach (docs/protocol.md section 5), as a pure function of what the
 * session and its event log hold: replay the events after the client's cursor (`complete`), or
 * send a baseline (the current generation's snapshot and events) with the reason. A cursor from
 * before a history rewrite always gets the baseline (`transcript_replaced`).
 */
import * as Cursor from "../../Cursor.js"
import type * as Protocol from "../../Protocol.js"

export type Decision =
  | { readonly kind: "complete"; readonly after: Cursor.Cursor }
  | { readonly kind: "baseline"; readonly replay: Protocol.Replay }

/** What the decision looks at. */
export interface ReplayView {
  /** The client's resume cursor, if it gave one. */
  readonly resume: Cursor.Cursor | undefined
  /** The session's last cursor. */
  readonly last: Cursor.Cursor | undefined
  /** The session's current generation. */
  readonly generation: number
  /** The oldest generation the log still holds. */
  readonly oldestGeneration: number
  /**
   * Where the oldest retained generation began: the last event before it (its snapshot's
   * cursor), if any. Only looked at for a cursor in a pruned generation.
   */
  readonly oldestGenerationStart: Cursor.Cursor | undefined
  /**
   * The last sequence of the resume cursor's generation when it is an older generation the log
   * still holds (-1 when empty); undefined otherwise.
   */
  readonly lastSequenceOfResumeGeneration: number | undefined
  /** The latest generation whose snapshot rewrote history, if any. */
  readonly rewriteGeneration?: number | undefined
}

/** Whether the decision needs {@link ReplayView.lastSequenceOfResumeGeneration}. */
export const needsLastSequence = (resume: Cursor.Cursor, last: Cursor.Cursor, oldestGeneration: number): boolean =>
  resume.generation >= oldestGeneration && resume.generation < last.generation

export const decideReplay = (view: ReplayView): Decision => {
  const { resume, last } = view
  if (resume === undefined) return { kind: "baseline", replay: { status: "unavailable", reason: "no_cursor" } }
  if (last === undefined || Cursor.isAfter(resume, last)) {
    return { kind: "baseline", replay: { status: "unavailable", reason: "cursor_ahead" } }
  }
  if (view.rewriteGeneration !== undefined && resume.generation < view.rewriteGeneration) {
    // Replay never crosses a rewrite: what the client holds is not what the session extends.
    return { kind: "baseline", replay: { status: "partial", reason: "transcript_replaced" } }
  }
  if (resume.generation < view.oldestGeneration) {
    // The cursor's generation was pruned. Where the oldest retained generation began says where
    // the pruned ones ended: the very last event before it leaves nothing missing; a cursor
    // after that event and before the oldest retained generation names no event.
    const start = view.oldestGenerationStart
    if (start !== undefined && Cursor.equals(resume, start)) return { kind: "complete", after: resume }
    if (start !== undefined && Cursor.isAfter(resume, start)) {
      return { kind: "baseline", replay: { status: "unavailable", reason: "cursor_unknown" } }
    }
    return { kind: "baseline", replay: { status: "partial", reason: "cursor_expired" } }
  }
  if (resume.generation < last.generation && resume.sequence > (view.lastSequenceOfResumeGeneration ?? -1)) {
    return { kind: "baseline", replay: { status: "unavailable", reason: "cursor_unknown" } }
  }
  return { kind: "complete", after: resume }
}
