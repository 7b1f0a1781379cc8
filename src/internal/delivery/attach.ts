/**
 * Delivery to attached clients (docs/protocol.md section 5). An attachment that is not live (streaming
 * its baseline, catching up, or paused because its client does not read) reads the events it
 * lacks from the EventLog and turns live in the same synchronous step in which it finds itself
 * caught up, so nothing is lost or sent twice. A client paused while the events it lacks were
 * pruned gets a `resync`: the current generation's snapshot, then that generation's events.
 */
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import * as Cursor from "../../Cursor.js"
import * as Metrics from "../../Metrics.js"
import type { EventRecord } from "../../EventLog.js"
import * as Protocol from "../../Protocol.js"
import type { AgentMessage, CommandOf } from "../../Protocol.js"
import type { ConnectionPort, HandedOver } from "../../SessionManager.js"
import { type CoreError, TelemetryPolicyViolation, unreadable } from "../session/errors.js"
import { type Core, type Session, snapshotIdOf } from "../session/session.js"
import type { Checkpoints } from "../session/checkpoint.js"
import { Attachment } from "./attachment.js"
import { type Decision, decideReplay, needsLastSequence } from "./replay.js"
import { wireLineOfRecord } from "./wireLines.js"

/**
 * Room left in an attach's response line for what surrounds its data (`type`, `id`, `command`,
 * `success`): the data itself is measured.
 */
const ENVELOPE_BYTES = 1024

/** The seam of delivery: a client's attachments to a session. */
export interface Delivery {
  /** Attaches a connection to a session: the replay decision, the response, then its delivery. */
  readonly attach: (
    connectionId: string,
    outbox: ConnectionPort,
    cmd: CommandOf<"attach">
  ) => Effect.Effect<{ data: Protocol.DaemonAttachResult; deliver: Effect.Effect<void> }, CoreError>
  /** Ends an attachment (synchronously: nothing more is delivered to it). */
  readonly detachAttachment: (a: Attachment) => void
  /**
   * Continues a client's stream that another delivery of the session ended (a cluster runner's
   * session moved: its log tail takes the clients over): registered at once; its delivery, the
   * catch-up from `from.delivered`, is the effect returned.
   */
  readonly continueAttachment: (session: Session, from: HandedOver) => Effect.Effect<void>
}

/** Attachments: attach (replay decision, baseline), catch-up from the log, resync, detach. */
export const makeDelivery = (core: Core, checkpoints: Checkpoints): Delivery => {
  const { cache, config, connections, log, get, filterEnv, post, publishedState } = core
  const { currentSnapshotEntry, snapshotLines } = checkpoints

  /** The last sequence of a generation, read from the log (only for cursor_unknown checks). */
  const lastSequenceOf = (s: Session, generation: number) =>
    log.readGeneration(s.meta.activeSessionId, generation).pipe(
      Stream.runFold(-1, (_, r: EventRecord) => r.cursor.sequence),
      Effect.orElseSucceed(() => -1)
    )

  const decide = (s: Session, resume: Cursor.Cursor | undefined) =>
    Effect.gen(function*(): Effect.fn.Return<Decision, CoreError> {
      const last = s.lastCursor
      const view = { resume, last, generation: s.generation, rewriteGeneration: s.rewriteGeneration }
      if (resume === undefined || last === undefined) {
        return decideReplay({
          ...view,
          oldestGeneration: s.generation,
          oldestGenerationStart: undefined,
          lastSequenceOfResumeGeneration: undefined
        })
      }
      const id = s.meta.activeSessionId
      const generations = yield* log.generations(id).pipe(Effect.mapError(unreadable("the event log")))
      const oldestGeneration = generations[0] ?? s.generation
      const lastSequenceOfResumeGeneration = needsLastSequence(resume, last, oldestGeneration)
        ? yield* lastSequenceOf(s, resume.generation)
        : undefined
      // Pruned meanwhile (or unreadable): then where the pruned generations ended is unknown.
      const oldestGenerationStart = resume.generation < oldestGeneration
        ? Option.getOrUndefined(yield* log.generationStart(id, oldestGeneration).pipe(Effect.orElseSucceed(() => Option.none())))
        : undefined
      return decideReplay({ ...view, oldestGeneration, oldestGenerationStart, lastSequenceOfResumeGeneration })
    })

  /**
   * Replaces a client's state with the current generation's snapshot: a `resync` (the events it
   * lacked were pruned) or a `replacement` (history was rewritten). False when it must re-attach.
   */
  const resync = (a: Attachment, purpose: "resync" | "replacement") =>
    Effect.gen(function*() {
      const s = a.session
      const chosen = yield* Effect.either(s.readGate.withPermits(1)(
        Effect.map(currentSnapshotEntry(s), (entry) => ({ entry, cursor: s.snapshotCursor, rewrite: s.rewriteGeneration }))
      ))
      // Detached while it waited for the read gate: nothing more goes to the client for it.
      if (a.detached || a.outbox.isClosed) return false
      if (Either.isLeft(chosen)) {
        // The client must hear that its state is gone: it attaches again.
        yield* Effect.logWarning(`resync of ${s.meta.activeSessionId} failed: ${chosen.left.message}`)
        a.outbox.offer(Protocol.encode({
          type: "session_snapshot_failed",
          activeSessionId: s.meta.activeSessionId,
          snapshotId: checkpoints.snapshotEntryOf(s) ?? snapshotIdOf(s, s.generation),
          error: { code: "storage_unavailable", message: chosen.left.message }
        }))
        return false
      }
      a.knownRewrite = chosen.right.rewrite
      if (!(yield* streamSnapshot(a, chosen.right.entry, purpose))) return false
      a.delivered = chosen.right.cursor
      // Events re-sent after a resync existed already; after a replacement they are new.
      if (purpose === "resync") a.resumed = true
      return true
    })

  /** Reads the events after `a.delivered` up to the session's last, then turns live. */
  const catchUp = (a: Attachment) =>
    Effect.gen(function*() {
      const s = a.session
      const id = s.meta.activeSessionId
      const sessionJson = JSON.stringify(id)
      /** History was rewritten since the client's state was made: it needs the new snapshot. */
      const stale = () => a.knownRewrite !== s.rewriteGeneration
      while (!a.detached && !a.outbox.isClosed) {
        if (stale()) {
          if (!(yield* resync(a, "replacement"))) return detachAttachment(a)
          continue
        }
        const target = s.lastCursor
        if (target === undefined || (a.delivered !== undefined && !Cursor.isBefore(a.delivered, target))) {
          // Caught up: from now on publish writes to this client directly.
          a.mode = "live"
          yield* Effect.async<void>((resume) => {
            if (a.mode !== "live" || a.detached) return resume(Effect.void)
            a.wake = () => resume(Effect.void)
          })
          if (a.detached || a.outbox.isClosed) return
          if (stale()) continue
          // Paused: wait for the client to drain, then re-send what it missed from the log.
          yield* a.outbox.awaitBelow(Math.max(1, a.limit / 2))
          a.resumed = true
          a.mode = "catchup"
          continue
        }
        const pruned = yield* log.read(id, a.delivered).pipe(
          // Never into a rewritten history the client has not been sent the snapshot of.
          Stream.takeWhile((r) => !Cursor.isAfter(r.cursor, target) && !(stale() && r.cursor.generation >= s.rewriteGeneration!)),
          Stream.runForEach((r) =>
            Effect.gen(function*() {
              if (a.detached) return yield* Effect.interrupt
              if (a.outbox.queuedBytes >= a.limit) {
                yield* a.outbox.awaitBelow(a.limit)
                // Detached while it waited: its detach is answered, nothing may follow.
                if (a.detached) return yield* Effect.interrupt
              }
              const replayed = a.resumed || (a.attachCursor !== undefined && !Cursor.isAfter(r.cursor, a.attachCursor))
              const line = wireLineOfRecord(sessionJson, r, replayed)
              a.outbox.offer(line)
              if (a.metered) Metrics.delivered("socket", 1, Buffer.byteLength(line))
              a.delivered = r.cursor
            })
          ),
          Effect.as(false),
          Effect.catchAll((e) => Effect.succeed(e.reason === "GenerationNotFound")),
          Effect.catchAllCause((cause) => Effect.as(Effect.logDebug("catch-up stopped", cause), false))
        )
        // The events after what the client has were pruned while it was paused: it gets the
        // current generation's snapshot (a resync), then that generation's events.
        if (pruned && !stale()) Metrics.count(Metrics.slowClientResyncs)
        if (pruned && !stale() && !(yield* resync(a, "resync"))) return detachAttachment(a)
      }
    })

  const detachAttachment = (a: Attachment) => {
    a.detached = true
    a.session.attachments.delete(a)
    a.signal()
    const byConn = connections.get(a.connectionId)
    if (byConn?.get(a.session.meta.activeSessionId) === a) byConn.delete(a.session.meta.activeSessionId)
    if (byConn?.size === 0) connections.delete(a.connectionId)
  }

  // A baseline (snapshot, its messages, its generation's events) is read under the session's
  // read gate, which a checkpoint's completion takes whole: a baseline never mixes generations.
  const attach = (connectionId: string, outbox: ConnectionPort, cmd: CommandOf<"attach">) =>
    Effect.flatMap(get(cmd.activeSessionId), (s) => s.readGate.withPermits(1)(Effect.gen(function*() {
      if (cmd.telemetryDisabled === true && s.meta.telemetry) {
        return yield* new TelemetryPolicyViolation({
          message: `Session \`${s.meta.activeSessionId}\` was created with telemetry on; it cannot be attached with telemetryDisabled.`
        })
      }
      // The environment of the session's next worker: the entity's to change (posted now, so
      // that it comes before any command this client sends after the attach).
      if (cmd.launchEnv !== undefined || cmd.env !== undefined) {
        yield* post(s, {
          _tag: "SetEnv",
          ...(cmd.launchEnv === undefined ? {} : { launchEnv: { ...cmd.launchEnv } }),
          ...(cmd.env === undefined ? {} : { clientEnv: filterEnv(cmd.env) ?? {} })
        })
      }
      const capabilities = cmd.capabilities ?? Protocol.DEFAULT_CLIENT_CAPABILITIES
      const chunked = capabilities.includes("chunked_snapshot")
      const slim = capabilities.includes("slim_attach")
      const decision = yield* decide(s, cmd.resumeCursor)
      // The state and the last event at one moment, as logged (a change of phase is read only
      // with the status that says it). Events after `lastCursor` reach the attachment from the
      // log: it starts in catch-up and turns live only once it has read up to the last one.
      const { state, lastCursor } = yield* publishedState(s)
      const previous = connections.get(connectionId)?.get(s.meta.activeSessionId)
      if (previous !== undefined) detachAttachment(previous)
      const attachment = new Attachment(s, outbox, connectionId, config.outboxBytes, lastCursor)
      let snapshotId = `${snapshotIdOf(s, s.generation)}`
      let snapshotMessages: ReadonlyArray<AgentMessage> = []
      let snapshotCursor = s.snapshotCursor
      let snapshotMessageCount = s.baseMessageCount
      let stream: string | undefined
      let fromChunk = 0
      let replay: Protocol.Replay = { status: "complete", eventCount: 0 }
      /** The response's data as things stand. */
      const responseData = () => {
        const data: { -readonly [K in keyof Protocol.DaemonAttachResult]: Protocol.DaemonAttachResult[K] } = {
          protocol: Protocol.PROTOCOL,
          activeSessionId: s.meta.activeSessionId,
          snapshot: {
            snapshotId,
            ...(snapshotCursor === undefined ? {} : { cursor: snapshotCursor }),
            messageCount: decision.kind === "complete" ? 0 : snapshotMessageCount,
            messages: snapshotMessages
          },
          replay,
          lastEventSequence: lastCursor?.sequence ?? -1,
          client: { id: connectionId, capabilities }
        }
        if (!slim) {
          data.state = state
          data.messages = snapshotMessages
        }
        if (lastCursor !== undefined) data.lastEventCursor = lastCursor
        if (stream !== undefined) {
          data.snapshotStream = { id: stream, messageCount: snapshotMessageCount, targetChunkBytes: config.targetChunkBytes }
        }
        return data
      }
      if (decision.kind === "complete") {
        attachment.delivered = decision.after
        const count = lastCursor === undefined ? 0 : yield* countEvents(s, decision.after, lastCursor)
        replay = count === 0
          ? { status: "complete", eventCount: 0 }
          : { status: "complete", fromCursor: yield* firstAfter(s, decision.after), toCursor: lastCursor!, eventCount: count }
      } else {
        const resumed = cmd.snapshotResume === undefined ? undefined : yield* resumable(s, cmd.snapshotResume.snapshotId)
        if (resumed !== undefined) {
          // The snapshot a cut-off attach was streaming, still retained: the same frames from
          // the chunk where it stopped, then the events after it.
          stream = resumed.snapshotId
          snapshotId = stream
          fromChunk = cmd.snapshotResume!.fromChunk
          snapshotCursor = resumed.cursor
          snapshotMessageCount = resumed.messageCount
        }
        attachment.delivered = snapshotCursor
        // The events after the snapshot, up to the last one: the current generation's, or for a
        // resumed older snapshot, everything after its cursor.
        const count = resumed === undefined
          ? s.generationEvents
          : lastCursor === undefined
          ? 0
          : yield* countEvents(s, snapshotCursor, lastCursor)
        replay = { ...decision.replay, eventCount: count }
        if (count > 0 && lastCursor !== undefined) {
          const first = resumed === undefined
            ? Cursor.make(s.generation, 0)
            : snapshotCursor === undefined
            ? Cursor.make(1, 0)
            : yield* firstAfter(s, snapshotCursor)
          replay = { ...replay, fromCursor: first, toCursor: lastCursor }
        }
        // Inline unless the client takes frames, or the response line would pass the line limit
        // (the messages appear twice in it without slim_attach): then frames all the same.
        let inline: ReadonlyArray<AgentMessage> | undefined
        if (stream === undefined && !chunked) {
          const rest = Buffer.byteLength(JSON.stringify(responseData()))
          inline = yield* inlineSnapshot(s, (config.maxLineBytes - rest - ENVELOPE_BYTES) / (slim ? 1 : 2))
        }
        if (inline !== undefined) snapshotMessages = inline
        else if (stream === undefined) {
          stream = yield* currentSnapshotEntry(s)
          snapshotId = stream
        }
      }
      s.attachments.add(attachment)
      let byConn = connections.get(connectionId)
      if (byConn === undefined) connections.set(connectionId, byConn = new Map())
      byConn.set(s.meta.activeSessionId, attachment)
      const data = responseData()
      const purpose: Protocol.SnapshotPurpose = decision.kind !== "baseline"
        ? "attach"
        : decision.replay.reason === "transcript_replaced"
        ? "replacement"
        : decision.replay.status === "partial"
        ? "resync"
        : "attach"
      const deliver = Effect.gen(function*() {
        if (stream !== undefined) {
          const ok = yield* streamSnapshot(attachment, stream, purpose, fromChunk)
          if (!ok) {
            detachAttachment(attachment)
            return
          }
        }
        outbox.offer(Protocol.encode({
          type: "session_attached",
          activeSessionId: s.meta.activeSessionId,
          state,
          replay,
          ...(lastCursor === undefined ? {} : { lastEventCursor: lastCursor })
        }))
        attachment.streaming = true
        // Killed meanwhile: session_closed, and nothing more (the log is archived).
        if (attachment.closedLine !== undefined) return outbox.offer(attachment.closedLine)
        yield* catchUp(attachment)
      })
      return { data: data as Protocol.DaemonAttachResult, deliver }
    })))

  /** Sends begin, every chunk from `fromChunk` and end (or failed); false when the client must re-attach. */
  const streamSnapshot = (a: Attachment, snapshotId: string, purpose: Protocol.SnapshotPurpose, fromChunk = 0) =>
    Effect.scoped(Effect.gen(function*() {
      const s = a.session
      const base = { activeSessionId: s.meta.activeSessionId, snapshotId }
      const reader = yield* cache.retain(snapshotId)
      // Detached (or replaced by a new attach on its connection) while the snapshot was being
      // retained: that detach or attach is answered, and nothing of this attachment may follow
      // (a begin here reached the client in the middle of its new attachment's frames: chaos
      // seed 830).
      if (a.detached || a.outbox.isClosed) return false
      a.outbox.offer(Protocol.encode({
        type: "session_snapshot_begin",
        ...base,
        messageCount: reader.meta.messageCount,
        targetChunkBytes: reader.meta.targetChunkBytes,
        purpose,
        ...(reader.meta.cursor === undefined ? {} : { cursor: reader.meta.cursor })
      }))
      const window = Math.min(a.limit, 2 * reader.meta.targetChunkBytes)
      let index = fromChunk
      // The next chunk is read while the socket drains the ones queued: read after the drain, its
      // disk read, its buffer's fresh pages and its scan left the socket idle for as long (a 1-2 MB
      // chunk: ~1 ms of every ~2.5). One chunk ahead at most, per reader.
      let ahead = yield* Effect.forkScoped(reader.waitForChunk(index))
      while (true) {
        if (a.detached || a.outbox.isClosed) return false
        // A couple of chunks in flight keep the socket busy; more would only hold memory (each
        // reader of a 100 MB snapshot would otherwise queue up to its whole outbox limit).
        if (a.outbox.queuedBytes >= window) yield* a.outbox.awaitBelow(window)
        const next = yield* Fiber.join(ahead)
        if (next._tag === "Chunk") ahead = yield* Effect.forkScoped(reader.waitForChunk(index + 1))
        // Detached while it waited: its detach is answered, nothing may follow.
        if (a.detached || a.outbox.isClosed) {
          if (next._tag === "Chunk") next.release()
          return false
        }
        if (next._tag === "End") {
          a.outbox.offer(Protocol.encode({
            type: "session_snapshot_end",
            ...base,
            chunkCount: next.end.chunkCount,
            lastEventSequence: next.end.lastEventSequence,
            ...(next.end.lastEventCursor === undefined ? {} : { lastEventCursor: next.end.lastEventCursor })
          }))
          return true
        }
        // The port gives the chunk's buffer back to the cache once the socket took it.
        a.outbox.offer(next.bytes, next.release)
        index++
      }
    })).pipe(
      Effect.catchAll((e) =>
        Effect.sync(() => {
          a.outbox.offer(Protocol.encode({
            type: "session_snapshot_failed",
            activeSessionId: a.session.meta.activeSessionId,
            snapshotId,
            error: { code: "storage_unavailable", message: e.message }
          }))
          return false
        })
      )
    )

  /**
   * A snapshot of the session still in the cache and whole (complete, or being filled), that a
   * cut-off attach may continue; undefined otherwise.
   */
  const resumable = (s: Session, snapshotId: string) =>
    Effect.map(Effect.option(cache.info(snapshotId)), (found) => {
      if (Option.isNone(found)) return undefined
      const info = found.value
      if (info.disposed || info.status === "failed" || info.meta.activeSessionId !== s.meta.activeSessionId) return undefined
      return { snapshotId, cursor: info.meta.cursor, messageCount: info.meta.messageCount }
    })

  /** The current snapshot's messages if they fit in `budget` bytes (one line each); undefined if not. */
  const inlineSnapshot = (s: Session, budget: number) =>
    Effect.gen(function*() {
      let bytes = 0
      let fits = true
      const lines = yield* snapshotLines(s).pipe(
        Stream.takeWhile((line) => {
          bytes += Buffer.byteLength(line) + 1
          fits = bytes <= budget
          return fits
        }),
        Stream.runCollect
      )
      return fits ? Chunk.toReadonlyArray(Chunk.map(lines, (line) => JSON.parse(line) as AgentMessage)) : undefined
    })

  const countEvents = (s: Session, after: Cursor.Cursor | undefined, until: Cursor.Cursor) =>
    after !== undefined && after.generation === until.generation
      ? Effect.succeed(until.sequence - after.sequence)
      : log.read(s.meta.activeSessionId, after).pipe(
        Stream.takeWhile((r) => !Cursor.isAfter(r.cursor, until)),
        Stream.runCount,
        Effect.mapError(unreadable("the event log"))
      )

  const firstAfter = (s: Session, after: Cursor.Cursor) =>
    log.read(s.meta.activeSessionId, after).pipe(
      Stream.take(1),
      Stream.runHead,
      Effect.map(Option.match({ onNone: () => Cursor.next(after), onSome: (r) => r.cursor })),
      Effect.mapError(unreadable("the event log"))
    )

  const continueAttachment = (s: Session, from: HandedOver) => {
    const a = new Attachment(s, from.outbox, from.connectionId, config.outboxBytes, from.attachCursor)
    a.delivered = from.delivered
    a.knownRewrite = from.knownRewrite
    a.resumed = from.resumed
    a.streaming = true
    const previous = connections.get(from.connectionId)?.get(s.meta.activeSessionId)
    if (previous !== undefined) detachAttachment(previous)
    s.attachments.add(a)
    let byConn = connections.get(from.connectionId)
    if (byConn === undefined) connections.set(from.connectionId, byConn = new Map())
    byConn.set(s.meta.activeSessionId, a)
    return catchUp(a)
  }

  return { attach, detachAttachment, continueAttachment }
}
