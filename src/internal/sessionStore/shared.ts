/**
 * What every session store shares: metadata and header validation, message encoding, the
 * framing of a transcript written whole, and the checks of one read back (JSON lines, count).
 */
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as ParseResult from "effect/ParseResult"
import * as Predicate from "effect/Predicate"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"
import {
  SessionMeta,
  type SessionNotFound,
  SessionStoreError,
  SnapshotHeader,
  type SnapshotHeaderInput
} from "../../SessionStore.js"
import * as StateLayout from "../../StateLayout.js"

export const byCreation = (a: SessionMeta, b: SessionMeta) =>
  a.createdAt < b.createdAt ? -1 : a.createdAt > b.createdAt ? 1 : a.activeSessionId < b.activeSessionId ? -1 : 1

/** The error of a generation without a transcript. */
export const snapshotNotFound = (activeSessionId: string, generation: number, path: string) =>
  new SessionStoreError({
    reason: "SnapshotNotFound",
    detail: `no transcript for generation ${generation}`,
    activeSessionId,
    path
  })

/** Paths of a store rooted at `root` (named once, in StateLayout). */
export const pathsOf = (root: string) => StateLayout.sessionStorePaths(root)

// Functions, not constants: this module is loaded while the public module, which defines the
// schemas, is still being evaluated (it imports the implementations).
export const encodeMeta = (meta: SessionMeta) => Schema.encode(SessionMeta)(meta)
export const decodeMetaJson = (text: unknown) => Schema.decodeUnknownEither(Schema.parseJson(SessionMeta))(text)
export const validateHeader = (header: unknown) => Schema.validate(SnapshotHeader)(header)
export const decodeHeaderJson = (text: unknown) => Schema.decodeUnknownEither(Schema.parseJson(SnapshotHeader))(text)

export const invalidInput = (activeSessionId: string, detail: string) =>
  new SessionStoreError({ reason: "InvalidInput", detail, activeSessionId })

/** Validates and strips a meta (drops `env`/`launchEnv` or anything else unknown). */
export const cleanMeta = (meta: SessionMeta): Effect.Effect<SessionMeta, SessionStoreError> =>
  encodeMeta(meta).pipe(
    Effect.mapError((e) => invalidInput(meta.activeSessionId, ParseResult.TreeFormatter.formatErrorSync(e)))
  )

export const makeHeader = (
  activeSessionId: string,
  input: SnapshotHeaderInput
): Effect.Effect<SnapshotHeader, SessionStoreError> =>
  validateHeader({
    type: "snapshot_header",
    snapshotId: input.snapshotId,
    generation: input.generation,
    ...(input.cursor !== undefined ? { cursor: input.cursor } : {}),
    messageCount: input.messageCount,
    ...(input.rewrittenAt !== undefined ? { rewrittenAt: input.rewrittenAt } : {})
  }).pipe(
    Effect.mapError((e) => invalidInput(activeSessionId, ParseResult.TreeFormatter.formatErrorSync(e)))
  )

/**
 * What an ordinary checkpoint (`appendSnapshot`) of `input.generation` extends: the previous
 * generation (`base`, as the store's `headerOf` gives it; none for the first two, whose base is
 * empty), the append-only transcript it goes on (`epoch`), and whether the base's messages must
 * first be copied there (`copied`: a base written whole, by a rewrite or an older layout, starts
 * a new append-only transcript, once).
 */
export const appendBase = <B, E, R>(
  activeSessionId: string,
  input: SnapshotHeaderInput,
  requireSession: (activeSessionId: string) => Effect.Effect<void, SessionNotFound | SessionStoreError>,
  headerOf: (activeSessionId: string, generation: number) => Effect.Effect<B, E, R>,
  headerIn: (base: B) => SnapshotHeader
): Effect.Effect<
  { readonly requested: SnapshotHeader; readonly baseGeneration: number; readonly base: B | undefined; readonly copied: boolean; readonly epoch: number },
  SessionNotFound | SessionStoreError | E,
  R
> =>
  Effect.gen(function*() {
    const requested = yield* makeHeader(activeSessionId, input)
    yield* requireSession(activeSessionId)
    const baseGeneration = requested.generation - 1
    const base = baseGeneration <= 1 ? undefined : yield* headerOf(activeSessionId, baseGeneration)
    const header = base === undefined ? undefined : headerIn(base)
    return {
      requested,
      baseGeneration,
      base,
      copied: header !== undefined && header.transcript === undefined,
      epoch: header?.transcript?.epoch ?? requested.generation
    }
  })

export const isStream = (u: unknown): u is Stream.Stream<unknown, unknown, unknown> =>
  Predicate.hasProperty(u, Stream.StreamTypeId)

/** Messages -> their JSON lines (without `\n`); a message JSON cannot encode is `InvalidInput`. */
export const messageLines = <E, R>(
  activeSessionId: string,
  messages: Stream.Stream<unknown, E, R> | Iterable<unknown>
): Stream.Stream<string, E | SessionStoreError, R> =>
  (isStream(messages) ? (messages as Stream.Stream<unknown, E, R>) : Stream.fromIterable(messages)).pipe(
    Stream.mapChunksEffect((chunk) =>
      Effect.try({
        try: () =>
          Chunk.map(chunk, (message) => {
            const line = JSON.stringify(message) as string | undefined
            if (line === undefined) throw new Error(`a message is not JSON: ${String(message)}`)
            return line
          }),
        catch: (cause) => invalidInput(activeSessionId, cause instanceof Error ? cause.message : "a message cannot be encoded")
      })
    )
  )

/** Messages -> one string of JSON lines per chunk (one write per chunk, not per message). */
export const encodeMessages = <E, R>(
  activeSessionId: string,
  messages: Stream.Stream<unknown, E, R> | Iterable<unknown>
): Stream.Stream<string, E | SessionStoreError, R> =>
  Stream.mapChunks(messageLines(activeSessionId, messages), (lines) => {
    let text = ""
    for (const line of lines) text += line + "\n"
    return Chunk.of(text)
  })

/**
 * The bytes of a transcript: header line, then the body with every line `\n`-terminated and
 * empty lines dropped, then a check that the body held exactly `header.messageCount` lines.
 * The check fails the stream, which makes the atomic writer discard the temp file.
 */
export const frame = <E, R>(
  activeSessionId: string,
  header: SnapshotHeader,
  body: Stream.Stream<string | Uint8Array, E, R>
): Stream.Stream<Uint8Array, E | SessionStoreError, R> =>
  Stream.suspend(() => {
    let count = 0
    let atLineStart = true
    const normalize = (input: string | Uint8Array): Uint8Array => {
      const bytes = typeof input === "string" ? Buffer.from(input, "utf8") : Buffer.from(input.buffer, input.byteOffset, input.byteLength)
      // Count non-empty lines; drop empty ones so that the count and the reader agree.
      let out: Array<Uint8Array> | undefined
      let start = 0
      let newline = bytes.indexOf(0x0a, start)
      while (newline !== -1) {
        if (newline === start && atLineStart) {
          out ??= [bytes.subarray(0, start)]
        } else {
          count++
          out?.push(bytes.subarray(start, newline + 1))
        }
        atLineStart = true
        start = newline + 1
        newline = bytes.indexOf(0x0a, start)
      }
      if (start < bytes.length) {
        atLineStart = false
        out?.push(bytes.subarray(start))
      }
      return out === undefined ? bytes : Buffer.concat(out)
    }
    const trailer = Stream.suspend(() => {
      const tail: Array<Uint8Array> = []
      if (!atLineStart) {
        count++
        tail.push(Buffer.from("\n"))
      }
      return count === header.messageCount
        ? Stream.fromIterable(tail)
        : Stream.fail(
          new SessionStoreError({
            reason: "InvalidInput",
            detail: `snapshot ${header.snapshotId} declares ${header.messageCount} messages but has ${count}`,
            activeSessionId
          })
        )
    })
    return Stream.succeed<Uint8Array>(Buffer.from(JSON.stringify(header) + "\n")).pipe(
      Stream.concat(Stream.map(body, normalize)),
      Stream.concat(trailer)
    )
  })

/** Decodes JSON lines; a line that is not JSON means the file is damaged. */
export const parseLines = <E>(
  activeSessionId: string,
  path: string,
  lines: Stream.Stream<string, E>
): Stream.Stream<unknown, E | SessionStoreError> =>
  Stream.mapChunksEffect(lines, (chunk) =>
    Effect.try({
      try: () => Chunk.map(chunk, (line): unknown => JSON.parse(line)),
      catch: (cause) =>
        new SessionStoreError({
          reason: "Corrupt",
          detail: `invalid message line in ${path}`,
          activeSessionId,
          path,
          cause
        })
    }))

/** Counts the messages going by and fails at the end if the header promised another count. */
export const checkCount = <E>(
  activeSessionId: string,
  path: string,
  header: SnapshotHeader,
  lines: Stream.Stream<string, E>
): Stream.Stream<string, E | SessionStoreError> =>
  Stream.suspend(() => {
    let count = 0
    return lines.pipe(
      Stream.mapChunks((chunk) => {
        count += chunk.length
        return chunk
      }),
      Stream.concat(Stream.suspend(() =>
        count === header.messageCount ? Stream.empty : Stream.fail(
          new SessionStoreError({
            reason: "Corrupt",
            detail: `${path} holds ${count} messages, its header says ${header.messageCount}`,
            activeSessionId,
            path
          })
        )
      ))
    )
  })

/** Counts the `\n`-terminated lines of encoded messages. */
export const countLines = (text: string): number => {
  let count = 0
  for (let i = text.indexOf("\n"); i !== -1; i = text.indexOf("\n", i + 1)) count++
  return count
}

export const countMismatch = (activeSessionId: string, header: SnapshotHeader, count: number) =>
  new SessionStoreError({
    reason: "InvalidInput",
    detail: `snapshot ${header.snapshotId} declares ${header.messageCount} messages but has ${count}`,
    activeSessionId
  })

export const GENERATION_FILE = /^([1-9][0-9]*)\.jsonl$/
export const TEMP_GENERATION = /^\.([1-9][0-9]*)\.jsonl\..*\.tmp$/

/** `20261129T220114404Z`: sortable, no `:` (awkward in paths). */
export const compactTimestamp = (millis: number): string => new Date(millis).toISOString().replace(/[-:.]/g, "")
