/**
 * The session store in PostgreSQL (tables in ./store.ts): the registry, snapshot headers and
 * transcripts, with the file store's semantics. A transcript is published by one transaction
 * (its lines and its header together), so a reader sees the previous latest one until the new
 * one is complete and committed; an ordinary checkpoint (`appendSnapshot`) inserts only the new
 * messages, so it costs what changed, not the size of the transcript.
 *
 * Paths are reported under `postgres:/` (`sessions/<escaped id>/snapshots/<g>.jsonl`): they name
 * a transcript for the recovery journal and for logs; no file is behind them.
 */
import * as SqlClient from "@effect/sql/SqlClient"
import type { SqlError } from "@effect/sql/SqlError"
import * as Chunk from "effect/Chunk"
import * as Clock from "effect/Clock"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Option from "effect/Option"
import * as ParseResult from "effect/ParseResult"
import * as Predicate from "effect/Predicate"
import * as Stream from "effect/Stream"
import * as nodePath from "node:path"
import {
  SessionMeta,
  type SessionListing,
  SessionNotFound,
  SessionStore,
  SessionStoreError,
  type SessionStoreService,
  SnapshotHeader,
  type SnapshotHeaderInput,
  type SnapshotInfo
} from "../../SessionStore.js"
import * as StateLayout from "../../StateLayout.js"
import {
  appendBase,
  byCreation,
  cleanMeta,
  compactTimestamp,
  countMismatch,
  decodeHeaderJson,
  decodeMetaJson,
  makeHeader,
  messageLines,
  parseLines,
  snapshotNotFound
} from "../sessionStore/shared.js"

/** What the store's paths start with (an archived session's log is keyed `archive:` + its archive's path + `/events`). */
export const BASE = "postgres:/"

const ioError = (activeSessionId: string | undefined) => (cause: SqlError) =>
  new SessionStoreError({
    reason: "Io",
    detail: cause.message,
    ...(activeSessionId !== undefined ? { activeSessionId } : {}),
    cause
  })

const isSqlError = (u: unknown): u is SqlError => Predicate.isTagged(u, "SqlError")

/** SQL failures of `effect` become `Io` errors of the session; the caller's own errors pass. */
/** The `name` of a stored meta, if it has one (a meta that does not parse has none here). */
export const nameOfMetaText = (text: string): string | undefined => {
  try {
    const name = (JSON.parse(text) as { name?: unknown }).name
    return typeof name === "string" ? name : undefined
  } catch {
    return undefined
  }
}

const io = (activeSessionId: string | undefined) => <A, E, R>(effect: Effect.Effect<A, E, R>) =>
  Effect.catchIf(effect, isSqlError, (e) => Effect.fail(ioError(activeSessionId)(e))) as Effect.Effect<
    A,
    Exclude<E, SqlError> | SessionStoreError,
    R
  >

/**
 * Chunks of encoded JSON lines (split anywhere, even inside a character) -> the lines, without
 * `\n`, empty ones dropped; a last line without `\n` counts.
 */
const splitLines = <E, R>(chunks: Stream.Stream<string | Uint8Array, E, R>): Stream.Stream<string, E, R> =>
  Stream.suspend(() => {
    let pending: Array<Buffer> = []
    const lines = Stream.mapChunks(chunks, (chunk) => {
      const out: Array<string> = []
      for (const input of chunk) {
        const bytes = typeof input === "string" ? Buffer.from(input, "utf8") : Buffer.from(input.buffer, input.byteOffset, input.byteLength)
        let start = 0
        for (let nl = bytes.indexOf(0x0a, start); nl !== -1; nl = bytes.indexOf(0x0a, start)) {
          const piece = bytes.subarray(start, nl)
          const line = pending.length === 0 ? piece.toString("utf8") : Buffer.concat([...pending, piece]).toString("utf8")
          pending = []
          if (line.length > 0) out.push(line)
          start = nl + 1
        }
        if (start < bytes.length) pending.push(Buffer.from(bytes.subarray(start)))
      }
      return Chunk.unsafeFromArray(out)
    })
    return Stream.concat(lines, Stream.suspend(() => {
      const rest = Buffer.concat(pending).toString("utf8")
      pending = []
      return rest.length > 0 ? Stream.make(rest) : Stream.empty
    }))
  })

/** Lines inserted per statement when a transcript is written. */
const BATCH_LINES = 1000
const BATCH_BYTES = 1024 * 1024
/** Lines fetched per query when a transcript is read. */
const PAGE = 2000

/** Builds the PostgreSQL session store over the store's SqlClient (./store.ts). */
export const make: Effect.Effect<SessionStoreService, never, SqlClient.SqlClient> = Effect.gen(function*() {
  const sql = yield* SqlClient.SqlClient
  const key = (id: string) => StateLayout.safeSegment(id)
  const snapshotPath = (id: string, generation: number) =>
    nodePath.join(BASE, "sessions", key(id), "snapshots", `${generation}.jsonl`)

  const exists = (id: string) =>
    Effect.map(sql`SELECT 1 AS one FROM agentd_sessions WHERE active_session_id = ${key(id)}`, (rows) => rows.length > 0)

  const requireSession = (id: string): Effect.Effect<void, SessionNotFound | SessionStoreError> =>
    exists(id).pipe(
      io(id),
      Effect.flatMap((found) => (found ? Effect.void : Effect.fail(new SessionNotFound({ activeSessionId: id }))))
    )

  /**
   * Claims `name` for the session (within the caller's transaction): `NameTaken` when another
   * session holds it. Every daemon of the store (the runners of a cluster) sees the same claims,
   * where each daemon's own check sees only its sessions.
   */
  const claimName = (id: string, name: string) =>
    Effect.gen(function*() {
      const k = key(id)
      const claimed = yield* sql`INSERT INTO agentd_session_names (name, active_session_id) VALUES (${name}, ${k})
        ON CONFLICT DO NOTHING RETURNING 1 AS one`
      if (claimed.length > 0) return
      const holder = yield* sql<{ active_session_id: string }>`SELECT active_session_id FROM agentd_session_names WHERE name = ${name}`
      if (holder[0]?.active_session_id === k) return
      return yield* new SessionStoreError({
        reason: "NameTaken",
        detail: `The name ${JSON.stringify(name)} is in use by ${holder[0] === undefined ? "another session" : `session \`${holder[0].active_session_id}\``}.`,
        activeSessionId: id
      })
    })

  const create = Effect.fn("SessionStore.create")(function*(meta: SessionMeta) {
    const clean = yield* cleanMeta(meta)
    yield* sql.withTransaction(Effect.gen(function*() {
      const inserted = yield* sql`INSERT INTO agentd_sessions (active_session_id, meta, created_at)
        VALUES (${key(clean.activeSessionId)}, ${JSON.stringify(clean)}, ${clean.createdAt})
        ON CONFLICT (active_session_id) DO NOTHING RETURNING 1 AS one`
      if (inserted.length === 0) {
        return yield* new SessionStoreError({ reason: "AlreadyExists", detail: "session id already in use", activeSessionId: meta.activeSessionId })
      }
      if (clean.name !== undefined) yield* claimName(clean.activeSessionId, clean.name)
    })).pipe(io(meta.activeSessionId))
  })

  const saveMeta = Effect.fn("SessionStore.saveMeta")(function*(meta: SessionMeta) {
    const clean = yield* cleanMeta(meta)
    const k = key(clean.activeSessionId)
    yield* sql.withTransaction(Effect.gen(function*() {
      const stored = yield* sql<{ meta: string }>`SELECT meta FROM agentd_sessions WHERE active_session_id = ${k} FOR UPDATE`
      if (stored.length === 0) return yield* new SessionNotFound({ activeSessionId: meta.activeSessionId })
      // A new name moves the session's claim (a meta saved with its name unchanged claims nothing:
      // sessions of an older store that share a name keep saving theirs).
      if (nameOfMetaText(stored[0]!.meta) !== clean.name) {
        yield* sql`DELETE FROM agentd_session_names WHERE active_session_id = ${k}`
        if (clean.name !== undefined) yield* claimName(clean.activeSessionId, clean.name)
      }
      yield* sql`UPDATE agentd_sessions SET meta = ${JSON.stringify(clean)}, created_at = ${clean.createdAt}
        WHERE active_session_id = ${k}`
    })).pipe(io(meta.activeSessionId))
  })

  const decodeMeta = (id: string, text: string): Either.Either<SessionMeta, SessionStoreError> =>
    Either.mapLeft(decodeMetaJson(text), (e) =>
      new SessionStoreError({
        reason: "Corrupt",
        detail: `invalid metadata of ${JSON.stringify(id)}: ${ParseResult.TreeFormatter.formatErrorSync(e)}`,
        activeSessionId: id
      }))

  const loadMeta = Effect.fn("SessionStore.loadMeta")(function*(id: string) {
    const rows = yield* sql<{ meta: string }>`SELECT meta FROM agentd_sessions WHERE active_session_id = ${key(id)}`.pipe(io(id))
    if (rows[0] === undefined) return yield* new SessionNotFound({ activeSessionId: id })
    return yield* decodeMeta(id, rows[0].meta)
  })

  const list = Effect.fn("SessionStore.list")(function*() {
    // Archived sessions are keyed `archive/...`; an escaped id never holds a `/`.
    const rows = yield* sql<{ active_session_id: string; meta: string }>`
      SELECT active_session_id, meta FROM agentd_sessions WHERE strpos(active_session_id, '/') = 0`.pipe(io(undefined))
    const metas: Array<SessionMeta> = []
    const unreadable: Array<SessionListing> = []
    for (const row of rows) {
      const id = StateLayout.segmentId(row.active_session_id) ?? row.active_session_id
      const decoded = decodeMeta(id, row.meta)
      if (Either.isRight(decoded)) metas.push(decoded.right)
      else unreadable.push({ _tag: "Unreadable", activeSessionId: id, reason: decoded.left.detail })
    }
    return [...metas.sort(byCreation).map((meta): SessionListing => ({ _tag: "Loaded", meta })), ...unreadable]
  })

  /** The header of a generation's transcript and its body's bytes; `SnapshotNotFound` when none. */
  const headerOf = (id: string, generation: number) =>
    Effect.gen(function*() {
      const rows = yield* sql<{ header: string; body_bytes: string }>`SELECT header, body_bytes FROM agentd_snapshots
        WHERE active_session_id = ${key(id)} AND generation = ${generation}`.pipe(io(id))
      const row = rows[0]
      if (row === undefined) {
        return yield* snapshotNotFound(id, generation, snapshotPath(id, generation))
      }
      const header = decodeHeaderJson(row.header)
      if (Either.isLeft(header)) {
        return yield* new SessionStoreError({
          reason: "Corrupt",
          detail: `invalid header of generation ${generation}`,
          activeSessionId: id,
          path: snapshotPath(id, generation)
        })
      }
      return { header: header.right, bodyBytes: Number(row.body_bytes) }
    })

  /**
   * Inserts lines into a table from `firstLine` on, in batches; returns how many and their
   * bytes (each counted with its `\n`, as in a file).
   */
  const insertLines = <E, R>(
    table: "agentd_snapshot_lines" | "agentd_transcript_lines",
    column: "generation" | "epoch",
    id: string,
    owner: number,
    firstLine: number,
    lines: Stream.Stream<string, E, R>
  ) =>
    Effect.gen(function*() {
      let next = firstLine
      let bytes = 0
      let batch: Array<string> = []
      let batchBytes = 0
      const flush = Effect.suspend(() => {
        if (batch.length === 0) return Effect.void
        const rows = batch
        const from = next - rows.length
        batch = []
        batchBytes = 0
        return sql.unsafe(
          `INSERT INTO ${table} (active_session_id, ${column}, line_no, line)
           SELECT $1, $2, $3 + n - 1, l FROM unnest($4::text[]) WITH ORDINALITY AS t(l, n)`,
          [key(id), owner, from, rows]
        )
      })
      yield* Stream.runForEach(lines, (line) => {
        batch.push(line)
        next++
        const size = Buffer.byteLength(line, "utf8") + 1
        bytes += size
        batchBytes += size
        return batch.length >= BATCH_LINES || batchBytes >= BATCH_BYTES ? flush : Effect.void
      })
      yield* flush
      return { count: next - firstLine, bytes }
    })

  const publish = (id: string, header: SnapshotHeader, bodyBytes: number) =>
    sql`INSERT INTO agentd_snapshots (active_session_id, generation, header, body_bytes)
      VALUES (${key(id)}, ${header.generation}, ${JSON.stringify(header)}, ${bodyBytes})
      ON CONFLICT (active_session_id, generation) DO UPDATE SET header = EXCLUDED.header, body_bytes = EXCLUDED.body_bytes`

  const writeSnapshotLines = <E = never, R = never>(
    id: string,
    input: SnapshotHeaderInput,
    lines: Stream.Stream<string | Uint8Array, E, R>
  ): Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R> =>
    Effect.gen(function*() {
      const header = yield* makeHeader(id, input)
      yield* requireSession(id)
      // One transaction: an interrupted or failed write leaves nothing, the previous latest stands.
      yield* sql.withTransaction(Effect.gen(function*() {
        yield* sql`DELETE FROM agentd_snapshot_lines WHERE active_session_id = ${key(id)} AND generation = ${header.generation}`
        const written = yield* insertLines("agentd_snapshot_lines", "generation", id, header.generation, 0, splitLines(lines))
        if (written.count !== header.messageCount) return yield* countMismatch(id, header, written.count)
        yield* publish(id, header, written.bytes)
      })).pipe(io(id))
      return { header, path: snapshotPath(id, header.generation) }
    }).pipe(Effect.withSpan("SessionStore.writeSnapshot", { attributes: { activeSessionId: id } }))

  const appendSnapshot = <E = never, R = never>(
    id: string,
    input: SnapshotHeaderInput,
    messages: Stream.Stream<unknown, E, R> | Iterable<unknown>
  ): Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R> =>
    Effect.gen(function*() {
      // A copied base's lines are copied inside the database, under their own line numbers.
      const { base, baseGeneration, copied, epoch, requested } = yield* appendBase(id, input, requireSession, headerOf, (b) => b.header)
      const startCount = base === undefined ? 0 : base.header.messageCount
      const startBytes = base === undefined ? 0 : base.header.transcript?.bytes ?? base.bodyBytes
      const header = yield* sql.withTransaction(Effect.gen(function*() {
        // Lines past the base belong to no published header (or to one this write replaces).
        yield* sql`DELETE FROM agentd_transcript_lines WHERE active_session_id = ${key(id)} AND epoch = ${epoch}
          AND line_no >= ${copied ? 0 : startCount}`
        if (copied) {
          yield* sql`INSERT INTO agentd_transcript_lines (active_session_id, epoch, line_no, line)
            SELECT active_session_id, ${epoch}, line_no, line FROM agentd_snapshot_lines
            WHERE active_session_id = ${key(id)} AND generation = ${baseGeneration}`
        }
        const written = yield* insertLines("agentd_transcript_lines", "epoch", id, epoch, startCount, messageLines(id, messages))
        const total = startCount + written.count
        if (total !== requested.messageCount) return yield* countMismatch(id, requested, total)
        const header: SnapshotHeader = { ...requested, transcript: { epoch, bytes: startBytes + written.bytes } }
        yield* publish(id, header, header.transcript!.bytes)
        return header
      })).pipe(io(id))
      return { header, path: snapshotPath(id, header.generation) }
    }).pipe(Effect.withSpan("SessionStore.appendSnapshot", { attributes: { activeSessionId: id } }))

  const latestSnapshot = Effect.fn("SessionStore.latestSnapshot")(function*(id: string) {
    yield* requireSession(id)
    const rows = yield* sql<{ generation: number; header: string }>`SELECT generation, header FROM agentd_snapshots
      WHERE active_session_id = ${key(id)} ORDER BY generation DESC`.pipe(io(id))
    for (const row of rows) {
      const header = decodeHeaderJson(row.header)
      if (Either.isRight(header) && header.right.generation === row.generation) {
        return Option.some<SnapshotInfo>({ header: header.right, path: snapshotPath(id, row.generation) })
      }
      yield* Effect.logWarning(`session store: ignoring the unreadable header of ${snapshotPath(id, row.generation)}`)
    }
    return Option.none<SnapshotInfo>()
  })

  function readSnapshotLines(id: string, generation: number): Stream.Stream<string, SessionNotFound | SessionStoreError> {
    return Stream.unwrap(Effect.gen(function*() {
      yield* requireSession(id)
      const { header } = yield* headerOf(id, generation)
      const path = snapshotPath(id, generation)
      const [table, column, owner] = header.transcript === undefined
        ? ["agentd_snapshot_lines", "generation", generation] as const
        : ["agentd_transcript_lines", "epoch", header.transcript.epoch] as const
      let next = 0
      let done = false
      const pull: Effect.Effect<Chunk.Chunk<string>, Option.Option<SessionStoreError>> = Effect.suspend(() => {
        if (done) return Effect.fail(Option.none())
        // Lines beyond this generation's count belong to later generations of its epoch.
        return sql.unsafe<{ line_no: number; line: string }>(
          `SELECT line_no, line FROM ${table} WHERE active_session_id = $1 AND ${column} = $2
           AND line_no >= $3 AND line_no < $4 ORDER BY line_no LIMIT $5`,
          [key(id), owner, next, header.messageCount, PAGE]
        ).pipe(
          Effect.mapError((e) => Option.some(ioError(id)(e))),
          Effect.flatMap((rows) => {
            const out: Array<string> = []
            for (const row of rows) {
              if (row.line_no !== next) break
              out.push(row.line)
              next++
            }
            if (out.length < PAGE || next >= header.messageCount) done = true
            if (done && next !== header.messageCount) {
              return Effect.fail(Option.some(
                new SessionStoreError({
                  reason: "Corrupt",
                  detail: `${path} holds ${next} messages, its header says ${header.messageCount}`,
                  activeSessionId: id,
                  path
                })
              ))
            }
            return out.length === 0 ? Effect.fail(Option.none()) : Effect.succeed(Chunk.unsafeFromArray(out))
          })
        )
      })
      return Stream.repeatEffectChunkOption(pull)
    }))
  }

  const readSnapshot = (id: string, generation: number): Stream.Stream<unknown, SessionNotFound | SessionStoreError> =>
    parseLines(id, snapshotPath(id, generation), readSnapshotLines(id, generation))

  const checkTranscript = Effect.fn("SessionStore.checkTranscript")(function*(id: string, generation: number) {
    yield* requireSession(id)
    const { header } = yield* headerOf(id, generation)
    if (header.messageCount === 0) return
    const [table, column, owner] = header.transcript === undefined
      ? ["agentd_snapshot_lines", "generation", generation] as const
      : ["agentd_transcript_lines", "epoch", header.transcript.epoch] as const
    // Lines are inserted in order in one transaction: the last one there means all are.
    const rows = yield* sql.unsafe(
      `SELECT 1 AS one FROM ${table} WHERE active_session_id = $1 AND ${column} = $2 AND line_no = $3`,
      [key(id), owner, header.messageCount - 1]
    ).pipe(io(id))
    if (rows.length === 0) {
      const path = snapshotPath(id, generation)
      return yield* new SessionStoreError({
        reason: "Corrupt",
        detail: `${path}: generation ${generation}'s transcript lacks messages its header counts (${header.messageCount})`,
        activeSessionId: id,
        path
      })
    }
  })

  const pruneSnapshots = Effect.fn("SessionStore.pruneSnapshots")(function*(id: string, keepFromGeneration: number) {
    yield* requireSession(id)
    const k = key(id)
    return yield* sql.withTransaction(Effect.gen(function*() {
      const removed = yield* sql<{ generation: number }>`DELETE FROM agentd_snapshots
        WHERE active_session_id = ${k} AND generation < ${keepFromGeneration} RETURNING generation`
      yield* sql`DELETE FROM agentd_snapshot_lines WHERE active_session_id = ${k} AND generation < ${keepFromGeneration}`
      // An append-only transcript goes with the last generation that reads it.
      const kept = yield* sql<{ header: string }>`SELECT header FROM agentd_snapshots WHERE active_session_id = ${k}`
      const referenced = kept.flatMap((row) => {
        const header = decodeHeaderJson(row.header)
        return Either.isRight(header) && header.right.transcript !== undefined ? [header.right.transcript.epoch] : []
      })
      yield* sql.unsafe(
        `DELETE FROM agentd_transcript_lines WHERE active_session_id = $1 AND epoch < $2 AND NOT (epoch = ANY($3::integer[]))`,
        [k, keepFromGeneration, referenced]
      )
      return removed.map((row) => row.generation).sort((a, b) => a - b)
    })).pipe(io(id))
  })

  const archive = Effect.fn("SessionStore.archive")(function*(id: string) {
    const now = yield* Clock.currentTimeMillis
    const k = key(id)
    const base = `archive/${k}-${compactTimestamp(now)}`
    return yield* sql.withTransaction(Effect.gen(function*() {
      const found = yield* sql`SELECT 1 AS one FROM agentd_sessions WHERE active_session_id = ${k} FOR UPDATE`
      if (found.length === 0) return yield* new SessionNotFound({ activeSessionId: id })
      // The same id can be created and archived twice within one millisecond.
      let target = base
      for (let n = 1; (yield* sql`SELECT 1 AS one FROM agentd_sessions WHERE active_session_id = ${target}`).length > 0; n++) {
        target = `${base}-${n}`
      }
      // An archived session's name is free again.
      yield* sql`DELETE FROM agentd_session_names WHERE active_session_id = ${k}`
      for (const table of ["agentd_sessions", "agentd_snapshots", "agentd_snapshot_lines", "agentd_transcript_lines"]) {
        yield* sql.unsafe(`UPDATE ${table} SET active_session_id = $2 WHERE active_session_id = $1`, [k, target])
      }
      return nodePath.join(BASE, target)
    })).pipe(io(id))
  })

  return SessionStore.of({
    create,
    saveMeta,
    loadMeta,
    list,
    writeSnapshot: (id, header, messages) => writeSnapshotLines(id, header, Stream.map(messageLines(id, messages), (line) => line + "\n")),
    writeSnapshotLines,
    appendSnapshot,
    latestSnapshot,
    readSnapshot,
    readSnapshotLines,
    // No file holds the messages: readers take them through readSnapshotLines.
    transcriptSource: (id) => Effect.as(requireSession(id), Option.none()),
    checkTranscript,
    snapshotPath,
    pruneSnapshots,
    archive
  })
})
