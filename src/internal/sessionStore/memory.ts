/**
 * The session store in memory, for tests of the modules that use one.
 */
import * as Chunk from "effect/Chunk"
import * as Clock from "effect/Clock"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Ref from "effect/Ref"
import * as Stream from "effect/Stream"
import {
  type SessionListing,
  SessionMeta,
  SessionNotFound,
  SessionStore,
  SessionStoreError,
  type SessionStoreService,
  SnapshotHeader,
  type SnapshotHeaderInput,
  type SnapshotInfo
} from "../../SessionStore.js"
import {
  byCreation, cleanMeta, compactTimestamp, encodeMessages, frame, makeHeader, parseLines, pathsOf, snapshotNotFound
} from "./shared.js"

interface MemorySession {
  readonly meta: SessionMeta
  readonly snapshots: ReadonlyMap<number, { readonly header: SnapshotHeader; readonly lines: ReadonlyArray<string> }>
}

/**
 * A store in memory with the same semantics (validation, exclusivity, atomic transcripts,
 * archive); paths are reported under `memory:/`.
 */
export const make: Effect.Effect<SessionStoreService> = Effect.gen(function*() {
  const paths = pathsOf("memory:/")
  const sessions = yield* Ref.make<ReadonlyMap<string, MemorySession>>(new Map())
  const archived = yield* Ref.make<ReadonlyArray<{ readonly path: string; readonly session: MemorySession }>>([])

  const getSession = (id: string): Effect.Effect<MemorySession, SessionNotFound> =>
    Effect.flatMap(Ref.get(sessions), (all) => {
      const found = all.get(id)
      return found === undefined ? Effect.fail(new SessionNotFound({ activeSessionId: id })) : Effect.succeed(found)
    })

  const update = (id: string, f: (session: MemorySession) => MemorySession) =>
    Ref.modify(sessions, (all): [boolean, ReadonlyMap<string, MemorySession>] => {
      const found = all.get(id)
      return found === undefined ? [false, all] : [true, new Map(all).set(id, f(found))]
    }).pipe(Effect.flatMap((ok) => (ok ? Effect.void : Effect.fail(new SessionNotFound({ activeSessionId: id })))))

  const create = Effect.fn("SessionStore.create")(function*(meta: SessionMeta) {
    const clean = yield* cleanMeta(meta)
    const created = yield* Ref.modify(sessions, (all): [boolean, ReadonlyMap<string, MemorySession>] =>
      all.has(clean.activeSessionId)
        ? [false, all]
        : [true, new Map(all).set(clean.activeSessionId, { meta: clean, snapshots: new Map() })]
    )
    if (!created) {
      return yield* new SessionStoreError({
        reason: "AlreadyExists",
        detail: "session id already in use",
        activeSessionId: meta.activeSessionId
      })
    }
  })

  const saveMeta = Effect.fn("SessionStore.saveMeta")(function*(meta: SessionMeta) {
    const clean = yield* cleanMeta(meta)
    yield* update(clean.activeSessionId, (s) => ({ ...s, meta: clean }))
  })

  const writeSnapshotLines = <E = never, R = never>(
    id: string,
    input: SnapshotHeaderInput,
    body: Stream.Stream<string | Uint8Array, E, R>
  ): Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R> =>
    Effect.gen(function*() {
      const header = yield* makeHeader(id, input)
      yield* getSession(id)
      const bytes = yield* Stream.runCollect(frame(id, header, body))
      const lines = Buffer.concat(Chunk.toArray(bytes)).toString("utf8").split("\n").slice(1, -1)
      yield* update(id, (s) => ({ ...s, snapshots: new Map(s.snapshots).set(header.generation, { header, lines }) }))
      return { header, path: paths.snapshotFile(id, header.generation) }
    })

  const appendSnapshot = <E = never, R = never>(
    id: string,
    input: SnapshotHeaderInput,
    messages: Stream.Stream<unknown, E, R> | Iterable<unknown>
  ): Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R> =>
    Effect.suspend(() => {
      const base = input.generation - 1
      return writeSnapshotLines(id, input, Stream.concat(
        base <= 1 ? Stream.empty : Stream.map(readSnapshotLines(id, base), (line) => line + "\n"),
        encodeMessages(id, messages)
      ))
    })

  function readSnapshotLines(id: string, generation: number): Stream.Stream<string, SessionNotFound | SessionStoreError> {
    return Stream.unwrap(Effect.gen(function*() {
      const session = yield* getSession(id)
      const snapshot = session.snapshots.get(generation)
      if (snapshot === undefined) {
        return yield* snapshotNotFound(id, generation, paths.snapshotFile(id, generation))
      }
      return Stream.fromIterable(snapshot.lines)
    }))
  }

  return SessionStore.of({
    create,
    saveMeta,
    loadMeta: Effect.fn("SessionStore.loadMeta")(function*(id: string) {
      return (yield* getSession(id)).meta
    }),
    list: Effect.fn("SessionStore.list")(function*() {
      const all = yield* Ref.get(sessions)
      return Array.from(all.values(), (s) => s.meta).sort(byCreation).map((meta): SessionListing => ({ _tag: "Loaded", meta }))
    }),
    writeSnapshot: (id, header, messages) => writeSnapshotLines(id, header, encodeMessages(id, messages)),
    writeSnapshotLines,
    appendSnapshot,
    latestSnapshot: Effect.fn("SessionStore.latestSnapshot")(function*(id: string) {
      const session = yield* getSession(id)
      const generations = Array.from(session.snapshots.keys()).sort((a, b) => b - a)
      const latest = generations[0] === undefined ? undefined : session.snapshots.get(generations[0])
      return latest === undefined
        ? Option.none<SnapshotInfo>()
        : Option.some<SnapshotInfo>({ header: latest.header, path: paths.snapshotFile(id, latest.header.generation) })
    }),
    readSnapshot: (id, generation) =>
      parseLines(id, paths.snapshotFile(id, generation), readSnapshotLines(id, generation)),
    readSnapshotLines,
    transcriptSource: () => Effect.succeed(Option.none()),
    checkTranscript: () => Effect.void,
    snapshotPath: paths.snapshotFile,
    pruneSnapshots: Effect.fn("SessionStore.pruneSnapshots")(function*(id: string, keepFromGeneration: number) {
      const session = yield* getSession(id)
      const removed = Array.from(session.snapshots.keys()).filter((g) => g < keepFromGeneration).sort((a, b) => a - b)
      yield* update(id, (s) => {
        const snapshots = new Map(s.snapshots)
        for (const g of removed) snapshots.delete(g)
        return { ...s, snapshots }
      })
      return removed
    }),
    archive: Effect.fn("SessionStore.archive")(function*(id: string) {
      const now = yield* Clock.currentTimeMillis
      const session = yield* Ref.modify(sessions, (all): [MemorySession | undefined, ReadonlyMap<string, MemorySession>] => {
        const found = all.get(id)
        if (found === undefined) return [undefined, all]
        const rest = new Map(all)
        rest.delete(id)
        return [found, rest]
      })
      if (session === undefined) return yield* new SessionNotFound({ activeSessionId: id })
      const base = paths.archiveDir(id, compactTimestamp(now))
      return yield* Ref.modify(archived, (list): [string, ReadonlyArray<{ readonly path: string; readonly session: MemorySession }>] => {
        const taken = new Set(list.map((a) => a.path))
        let path = base
        for (let n = 1; taken.has(path); n++) path = `${base}-${n}`
        return [path, [...list, { path, session }]]
      })
    })
  })
})

/** The in-memory store, for tests. */
