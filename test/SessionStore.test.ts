import * as fsp from "node:fs/promises"
import * as os from "node:os"
import * as nodePath from "node:path"
import { assert, describe, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Context from "effect/Context"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import type * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as PostgresStore from "../src/PostgresStore.js"
import * as SessionStore from "../src/SessionStore.js"
import { describePg, storeLayer } from "./support/postgres.js"

// ---------------------------------------------------------------------------------------------
// Helpers

const tempDir = Effect.acquireRelease(
  Effect.promise(() => fsp.mkdtemp(nodePath.join(os.tmpdir(), "agentd-store-"))),
  (dir) => Effect.promise(() => fsp.rm(dir, { recursive: true, force: true }))
)

const mode = (path: string) => Effect.promise(() => fsp.stat(path)).pipe(Effect.map((s) => s.mode & 0o777))
const readdir = (path: string) => Effect.promise(() => fsp.readdir(path)).pipe(Effect.map((names) => names.sort()))

const meta = (activeSessionId: string, overrides: Partial<SessionStore.SessionMeta> = {}): SessionStore.SessionMeta => ({
  activeSessionId,
  sessionId: `engine-${activeSessionId}`,
  engine: "echo",
  telemetry: false,
  createdAt: "2026-01-01T00:00:00.000Z",
  ...overrides
})

const message = (n: number, content = `message ${n}`) => ({
  id: `m${n}`,
  role: n % 2 === 0 ? "user" : "assistant",
  content,
  timestamp: 1_700_000_000_000 + n
})

const collect = <A, E>(stream: Stream.Stream<A, E>) => Effect.map(Stream.runCollect(stream), Chunk.toArray)

interface Fixture {
  readonly store: SessionStore.SessionStoreService
  /** The store's root directory (file implementation only). */
  readonly root: Option.Option<string>
  /** What the paths it reports start with when it has no root (`memory:/`, `postgres:/`). */
  readonly pathBase?: string
}

const implementations: ReadonlyArray<{
  readonly name: string
  readonly make: Effect.Effect<Fixture, SessionStore.SessionStoreError, Scope.Scope>
}> = [
  {
    name: "file",
    make: Effect.gen(function*() {
      const dir = yield* tempDir
      const root = nodePath.join(dir, "state")
      const context = yield* Layer.build(SessionStore.layer({ root }))
      return { store: Context.get(context, SessionStore.SessionStore), root: Option.some(root) }
    })
  },
  {
    name: "memory",
    make: Effect.gen(function*() {
      const context = yield* Layer.build(SessionStore.layerMemory)
      return { store: Context.get(context, SessionStore.SessionStore), root: Option.none() }
    })
  },
  {
    // A fresh schema of the test server per test.
    name: "postgres",
    make: Effect.gen(function*() {
      const context = yield* Layer.build(PostgresStore.sessionStore.pipe(Layer.provide(storeLayer())))
      return { store: Context.get(context, SessionStore.SessionStore), root: Option.none(), pathBase: "postgres:/" }
    })
  }
]

// ---------------------------------------------------------------------------------------------
// The shared suite

for (const implementation of implementations) {
  ;(implementation.name === "postgres" ? describePg : describe)(`SessionStore (${implementation.name})`, () => {
    it.scoped("round-trips metadata; create is exclusive; env and launchEnv are never stored", () =>
      Effect.gen(function*() {
        const { root, store } = yield* implementation.make
        const full = meta("a", { name: "demo", config: { tokenDelayMs: 5, nested: { x: [1, 2] } }, telemetry: true })
        // What a careless caller might hand over: the wire command, secrets included.
        const withSecrets = { ...full, env: { TERM: "xterm" }, launchEnv: { API_KEY: "secret" } }
        yield* store.create(withSecrets)
        const loaded = yield* store.loadMeta("a")
        assert.deepStrictEqual(loaded, full)
        assert.isFalse("env" in loaded)
        assert.isFalse("launchEnv" in loaded)
        if (Option.isSome(root)) {
          const text = yield* Effect.promise(() =>
            fsp.readFile(nodePath.join(root.value, "sessions", "a", "meta.json"), "utf8")
          )
          assert.notInclude(text, "secret")
          assert.notInclude(text, "launchEnv")
        }

        const again = yield* Effect.flip(store.create(meta("a")))
        assert.strictEqual(again._tag, "SessionStoreError")
        assert.strictEqual(again._tag === "SessionStoreError" ? again.reason : "", "AlreadyExists")

        yield* store.saveMeta({ ...full, name: "renamed" })
        assert.strictEqual((yield* store.loadMeta("a")).name, "renamed")

        const missing = yield* Effect.flip(store.loadMeta("nope"))
        assert.instanceOf(missing, SessionStore.SessionNotFound)
        assert.strictEqual(missing._tag === "SessionNotFound" ? missing.activeSessionId : "", "nope")
        assert.strictEqual(missing.message, `session "nope" not found`)
        assert.strictEqual((yield* Effect.flip(store.saveMeta(meta("nope"))))._tag, "SessionNotFound")

        // Invalid metadata is refused, not written.
        const invalid = yield* Effect.flip(store.create(meta("b", { createdAt: "yesterday" })))
        assert.strictEqual(invalid._tag === "SessionStoreError" ? invalid.reason : "", "InvalidInput")
        assert.strictEqual((yield* Effect.flip(store.loadMeta("b")))._tag, "SessionNotFound")
      }))

    it.scoped("lists live sessions oldest first", () =>
      Effect.gen(function*() {
        const { store } = yield* implementation.make
        assert.deepStrictEqual(yield* store.list(), [])
        yield* store.create(meta("late", { createdAt: "2026-03-01T00:00:00.000Z" }))
        yield* store.create(meta("early", { createdAt: "2026-01-01T00:00:00.000Z" }))
        yield* store.create(meta("middle", { createdAt: "2026-02-01T00:00:00.000Z" }))
        assert.deepStrictEqual((yield* store.list()).map(SessionStore.listingId), ["early", "middle", "late"])
        yield* store.archive("middle")
        assert.deepStrictEqual((yield* store.list()).map(SessionStore.listingId), ["early", "late"])
      }))

    it.scoped("writes transcripts from iterables, streams and encoded chunks; reads the latest back", () =>
      Effect.gen(function*() {
        const { store } = yield* implementation.make
        yield* store.create(meta("a"))
        assert.isTrue(Option.isNone(yield* store.latestSnapshot("a")))

        const first = [message(0), message(1), message(2)]
        const info1 = yield* store.writeSnapshot("a", { snapshotId: "snap-1", generation: 1, messageCount: 3 }, first)
        assert.deepStrictEqual(info1.header, {
          type: "snapshot_header",
          snapshotId: "snap-1",
          generation: 1,
          messageCount: 3
        })
        assert.strictEqual(info1.path, store.snapshotPath("a", 1))

        const second = Array.from({ length: 5 }, (_, n) => message(n, `line with "quotes", \n newline and é ${n}`))
        const info2 = yield* store.writeSnapshot(
          "a",
          { snapshotId: "snap-2", generation: 2, cursor: { generation: 1, sequence: 41 }, messageCount: 5 },
          Stream.fromIterable(second).pipe(Stream.rechunk(2))
        )
        const latest = yield* store.latestSnapshot("a")
        assert.deepStrictEqual(latest, Option.some(info2))
        assert.deepStrictEqual(info2.header.cursor, { generation: 1, sequence: 41 })

        assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 1)), first)
        assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 2)), second)
        assert.deepStrictEqual(yield* collect(store.readSnapshotLines("a", 1)), first.map((m) => JSON.stringify(m)))

        // Already-encoded lines, split at arbitrary places (mid-line, mid-character), with and
        // without a final newline and with stray empty lines.
        const encoded = [message(7), message(8, "ünïcödé ✓"), message(9)].map((m) => JSON.stringify(m)).join("\n")
        const bytes = Buffer.from(encoded + "\n\n", "utf8")
        const cut1 = 17
        const cut2 = bytes.indexOf("✓") + 1
        const chunks: Array<string | Uint8Array> = [
          bytes.subarray(0, cut1),
          bytes.subarray(cut1, cut2),
          new Uint8Array(bytes.subarray(cut2, bytes.length - 2)),
          "\n"
        ]
        yield* store.writeSnapshotLines("a", { snapshotId: "snap-3", generation: 3, messageCount: 3 }, Stream.fromIterable(chunks))
        assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 3)), [message(7), message(8, "ünïcödé ✓"), message(9)])

        // An empty transcript is a valid one.
        yield* store.writeSnapshot("a", { snapshotId: "snap-4", generation: 4, messageCount: 0 }, [])
        assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 4)), [])
        assert.strictEqual(Option.getOrThrow(yield* store.latestSnapshot("a")).header.snapshotId, "snap-4")
      }))

    it.scoped("refuses a transcript whose message count differs from its header, keeping the previous latest", () =>
      Effect.gen(function*() {
        const { root, store } = yield* implementation.make
        yield* store.create(meta("a"))
        yield* store.writeSnapshot("a", { snapshotId: "good", generation: 1, messageCount: 1 }, [message(0)])
        const tooFew = yield* Effect.flip(
          store.writeSnapshot("a", { snapshotId: "bad", generation: 2, messageCount: 3 }, [message(0), message(1)])
        )
        assert.strictEqual(tooFew._tag === "SessionStoreError" ? tooFew.reason : "", "InvalidInput")
        const tooMany = yield* Effect.flip(
          store.writeSnapshotLines("a", { snapshotId: "bad", generation: 2, messageCount: 1 }, Stream.make("{}\n{}\n"))
        )
        assert.strictEqual(tooMany._tag, "SessionStoreError")
        const notJson = yield* Effect.flip(
          store.writeSnapshot("a", { snapshotId: "bad", generation: 2, messageCount: 1 }, [() => 1])
        )
        assert.strictEqual(notJson._tag === "SessionStoreError" ? notJson.reason : "", "InvalidInput")
        const badHeader = yield* Effect.flip(store.writeSnapshot("a", { snapshotId: "bad", generation: 0, messageCount: 0 }, []))
        assert.strictEqual(badHeader._tag === "SessionStoreError" ? badHeader.reason : "", "InvalidInput")

        assert.strictEqual(Option.getOrThrow(yield* store.latestSnapshot("a")).header.snapshotId, "good")
        const missing = yield* Effect.flip(collect(store.readSnapshot("a", 2)))
        assert.strictEqual(missing._tag === "SessionStoreError" ? missing.reason : "", "SnapshotNotFound")
        if (Option.isSome(root)) {
          assert.deepStrictEqual(yield* readdir(nodePath.join(root.value, "sessions", "a", "snapshots")), ["1.jsonl"])
        }
      }))

    it.scoped("a failing or interrupted writer leaves the previous latest transcript and no partial file", () =>
      Effect.gen(function*() {
        const { root, store } = yield* implementation.make
        yield* store.create(meta("a"))
        yield* store.writeSnapshot("a", { snapshotId: "s1", generation: 1, messageCount: 2 }, [message(0), message(1)])

        class Boom {
          readonly _tag = "Boom"
        }
        const failing = Stream.fromIterable([message(0), message(1)]).pipe(Stream.concat(Stream.fail(new Boom())))
        const error = yield* Effect.flip(store.writeSnapshot("a", { snapshotId: "s2", generation: 2, messageCount: 5 }, failing))
        assert.instanceOf(error, Boom)

        // Interrupted mid-stream: the messages stop coming and the writer is cancelled.
        const started = yield* Deferred.make<void>()
        const hanging = Stream.fromIterable([message(0)]).pipe(
          Stream.concat(Stream.drain(Stream.fromEffect(Deferred.succeed(started, undefined)))),
          Stream.concat(Stream.never)
        )
        const fiber = yield* Effect.fork(store.writeSnapshot("a", { snapshotId: "s3", generation: 3, messageCount: 5 }, hanging))
        yield* Deferred.await(started)
        const exit = yield* Fiber.interrupt(fiber)
        assert.isTrue(Exit.isInterrupted(exit))

        assert.strictEqual(Option.getOrThrow(yield* store.latestSnapshot("a")).header.snapshotId, "s1")
        assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 1)), [message(0), message(1)])
        if (Option.isSome(root)) {
          assert.deepStrictEqual(yield* readdir(nodePath.join(root.value, "sessions", "a", "snapshots")), ["1.jsonl"])
        }
      }))

    it.scoped("prunes old generations", () =>
      Effect.gen(function*() {
        const { store } = yield* implementation.make
        yield* store.create(meta("a"))
        for (const generation of [1, 2, 3, 4]) {
          yield* store.writeSnapshot("a", { snapshotId: `s${generation}`, generation, messageCount: 1 }, [message(generation)])
        }
        assert.deepStrictEqual(yield* store.pruneSnapshots("a", 3), [1, 2])
        assert.deepStrictEqual(yield* store.pruneSnapshots("a", 3), [])
        const gone = yield* Effect.flip(collect(store.readSnapshot("a", 2)))
        assert.strictEqual(gone._tag === "SessionStoreError" ? gone.reason : "", "SnapshotNotFound")
        assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 3)), [message(3)])
        assert.strictEqual(Option.getOrThrow(yield* store.latestSnapshot("a")).header.generation, 4)
        assert.strictEqual((yield* Effect.flip(store.pruneSnapshots("nope", 1)))._tag, "SessionNotFound")
      }))

    it.scoped("appendSnapshot: each generation is the previous one plus its messages, also across a whole (rewritten) one", () =>
      Effect.gen(function*() {
        const { store } = yield* implementation.make
        yield* store.create(meta("a"))
        const all = Array.from({ length: 10 }, (_, n) => message(n, n === 4 ? "ünïcödé ✓\nnewline" : undefined))
        // Generation 2 extends generation 1's empty transcript.
        yield* store.appendSnapshot("a", { snapshotId: "s2", generation: 2, messageCount: 3, cursor: { generation: 1, sequence: 9 } }, all.slice(0, 3))
        yield* store.appendSnapshot("a", { snapshotId: "s3", generation: 3, messageCount: 5 }, Stream.fromIterable(all.slice(3, 5)))
        yield* store.appendSnapshot("a", { snapshotId: "s4", generation: 4, messageCount: 5 }, [])
        assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 2)), all.slice(0, 3))
        assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 3)), all.slice(0, 5))
        assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 4)), all.slice(0, 5))
        const latest = Option.getOrThrow(yield* store.latestSnapshot("a")).header
        assert.strictEqual(latest.snapshotId, "s4")
        assert.strictEqual(latest.messageCount, 5)
        // A rewrite is written whole; the next generation extends it.
        yield* store.writeSnapshot("a", { snapshotId: "s5", generation: 5, messageCount: 1, rewrittenAt: 5 }, [all[5]])
        yield* store.appendSnapshot("a", { snapshotId: "s6", generation: 6, messageCount: 3, rewrittenAt: 5 }, all.slice(6, 8))
        assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 6)), all.slice(5, 8))
        assert.strictEqual(Option.getOrThrow(yield* store.latestSnapshot("a")).header.rewrittenAt, 5)
        // Old generations go; the ones kept still read whole.
        assert.deepStrictEqual(yield* store.pruneSnapshots("a", 4), [2, 3])
        assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 4)), all.slice(0, 5))
        assert.deepStrictEqual(yield* store.pruneSnapshots("a", 6), [4, 5])
        assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 6)), all.slice(5, 8))
        // A count that does not add up publishes nothing; the same generation can then be written.
        const wrong = yield* Effect.flip(store.appendSnapshot("a", { snapshotId: "s7", generation: 7, messageCount: 9 }, [all[8]]))
        assert.strictEqual(wrong._tag === "SessionStoreError" ? wrong.reason : "", "InvalidInput")
        assert.strictEqual(Option.getOrThrow(yield* store.latestSnapshot("a")).header.generation, 6)
        yield* store.appendSnapshot("a", { snapshotId: "s7", generation: 7, messageCount: 4 }, [all[9]])
        assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 7)), [...all.slice(5, 8), all[9]])
        // The generation before must exist (generation 1 excepted).
        const orphan = yield* Effect.flip(store.appendSnapshot("a", { snapshotId: "s9", generation: 9, messageCount: 0 }, []))
        assert.strictEqual(orphan._tag === "SessionStoreError" ? orphan.reason : "", "SnapshotNotFound")
      }))

    it.scoped("archive moves a session away: afterwards it is not found, and its id can be reused", () =>
      Effect.gen(function*() {
        const { root, store } = yield* implementation.make
        yield* store.create(meta("a", { name: "first life" }))
        yield* store.writeSnapshot("a", { snapshotId: "s1", generation: 1, messageCount: 1 }, [message(1)])
        const archived = yield* store.archive("a")
        assert.include(archived, nodePath.join("archive", "a-"))

        assert.strictEqual((yield* Effect.flip(store.loadMeta("a")))._tag, "SessionNotFound")
        assert.strictEqual((yield* Effect.flip(store.latestSnapshot("a")))._tag, "SessionNotFound")
        assert.strictEqual((yield* Effect.flip(collect(store.readSnapshot("a", 1))))._tag, "SessionNotFound")
        assert.strictEqual((yield* Effect.flip(store.archive("a")))._tag, "SessionNotFound")
        assert.strictEqual(
          (yield* Effect.flip(store.writeSnapshot("a", { snapshotId: "s2", generation: 2, messageCount: 0 }, [])))._tag,
          "SessionNotFound"
        )

        // Same id, same millisecond (TestClock): a second archive does not overwrite the first.
        yield* store.create(meta("a", { name: "second life" }))
        const archivedAgain = yield* store.archive("a")
        assert.notStrictEqual(archivedAgain, archived)

        if (Option.isSome(root)) {
          const kept = yield* Effect.promise(() => fsp.readFile(nodePath.join(archived, "meta.json"), "utf8"))
          assert.include(kept, "first life")
          assert.deepStrictEqual(yield* readdir(nodePath.join(archived, "snapshots")), ["1.jsonl"])
          assert.deepStrictEqual(yield* readdir(nodePath.join(root.value, "sessions")), [])
        }
      }))

    it.scoped("sanitizes ids from the wire: nothing escapes the root, distinct ids stay distinct", () =>
      Effect.gen(function*() {
        const { pathBase, root, store } = yield* implementation.make
        const ids = ["../../x", "..", ".", "a/b", "a%2Fb", "a_2Fb", "", "x\u0000y", "é", "../sessions/../../x", "z".repeat(400)]
        for (const [n, id] of ids.entries()) {
          yield* store.create(meta(id, { name: `n${n}` }))
          yield* store.writeSnapshot(id, { snapshotId: `s${n}`, generation: 1, messageCount: 1 }, [message(n)])
        }
        for (const [n, id] of ids.entries()) {
          assert.strictEqual((yield* store.loadMeta(id)).name, `n${n}`)
          assert.deepStrictEqual(yield* collect(store.readSnapshot(id, 1)), [message(n)])
        }
        assert.strictEqual((yield* store.list()).length, ids.length)

        const base = Option.getOrElse(root, () => pathBase ?? "memory:/")
        const paths = new Set<string>()
        for (const id of ids) {
          const path = store.snapshotPath(id, 1)
          paths.add(path)
          const relative = nodePath.relative(nodePath.join(base, "sessions"), path)
          assert.isFalse(relative.startsWith(".."), `${JSON.stringify(id)} -> ${path}`)
          // sessions/<one segment>/snapshots/1.jsonl
          assert.strictEqual(relative.split(nodePath.sep).length, 3, path)
          assert.isTrue(Buffer.byteLength(relative.split(nodePath.sep)[0] ?? "") <= 255)
        }
        assert.strictEqual(paths.size, ids.length)

        if (Option.isSome(root)) {
          // Nothing was created beside the root.
          assert.deepStrictEqual(yield* readdir(nodePath.dirname(root.value)), ["state"])
          assert.deepStrictEqual(yield* readdir(root.value), ["sessions"])
          assert.strictEqual((yield* readdir(nodePath.join(root.value, "sessions"))).length, ids.length)
        }
        const archived = yield* store.archive("../../x")
        const relative = nodePath.relative(nodePath.join(base, "archive"), archived)
        assert.isFalse(relative.startsWith(".."))
        assert.strictEqual(relative.split(nodePath.sep).length, 1)
      }))
  })
}

// ---------------------------------------------------------------------------------------------
// File-specific behaviour

describe("SessionStore (file)", () => {
  const open = (root: string) =>
    Layer.build(SessionStore.layer({ root })).pipe(Effect.map((context) => Context.get(context, SessionStore.SessionStore)))

  it.scoped("creates directories 0700 and files 0600", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const root = nodePath.join(dir, "state")
      const store = yield* open(root)
      yield* store.create(meta("a"))
      const info = yield* store.writeSnapshot("a", { snapshotId: "s1", generation: 1, messageCount: 1 }, [message(1)])
      assert.strictEqual(yield* mode(root), 0o700)
      assert.strictEqual(yield* mode(nodePath.join(root, "sessions")), 0o700)
      assert.strictEqual(yield* mode(nodePath.join(root, "sessions", "a")), 0o700)
      assert.strictEqual(yield* mode(nodePath.join(root, "sessions", "a", "snapshots")), 0o700)
      assert.strictEqual(yield* mode(nodePath.join(root, "sessions", "a", "meta.json")), 0o600)
      assert.strictEqual(yield* mode(info.path), 0o600)
      const archived = yield* store.archive("a")
      assert.strictEqual(yield* mode(nodePath.join(root, "archive")), 0o700)
      assert.strictEqual(yield* mode(nodePath.join(archived, "meta.json")), 0o600)
    }))

  it.scoped("appendSnapshot writes only the new messages: one append-only file, header-only generations, pruned with the last reader", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const root = nodePath.join(dir, "state")
      const store = yield* open(root)
      yield* store.create(meta("a"))
      const big = (n: number) => message(n, "x".repeat(100_000))
      const size = (path: string) => Effect.promise(() => fsp.stat(path)).pipe(Effect.map((st) => st.size))
      const transcript = nodePath.join(root, "sessions", "a", "transcripts", "2.jsonl")
      let count = 0
      for (let generation = 2; generation <= 6; generation++) {
        count++
        const info = yield* store.appendSnapshot("a", { snapshotId: `s${generation}`, generation, messageCount: count }, [big(count)])
        // The generation's own file is its header: small whatever the transcript's size.
        assert.isBelow(yield* size(info.path), 400)
        assert.strictEqual(yield* mode(info.path), 0o600)
        assert.strictEqual(yield* size(transcript), info.header.transcript!.bytes)
      }
      assert.strictEqual(yield* mode(transcript), 0o600)
      assert.strictEqual(yield* mode(nodePath.dirname(transcript)), 0o700)
      assert.isAbove(yield* size(transcript), 5 * 100_000)
      // A write that never got its header leaves bytes past the last published length: they
      // are never read, and the next write of that generation replaces them.
      const failed = yield* Effect.flip(store.appendSnapshot("a", { snapshotId: "s7", generation: 7, messageCount: 99 }, [big(6), big(7)]))
      assert.strictEqual(failed._tag, "SessionStoreError")
      assert.strictEqual((yield* collect(store.readSnapshot("a", 6))).length, 5)
      yield* store.appendSnapshot("a", { snapshotId: "s7", generation: 7, messageCount: 6 }, [message(6)])
      assert.deepStrictEqual((yield* collect(store.readSnapshot("a", 7))).at(-1), message(6))
      // A rewrite starts over; once no kept generation reads the old file, it goes.
      yield* store.writeSnapshot("a", { snapshotId: "s8", generation: 8, messageCount: 1, rewrittenAt: 8 }, [message(0)])
      yield* store.appendSnapshot("a", { snapshotId: "s9", generation: 9, messageCount: 2 }, [message(1)])
      assert.deepStrictEqual(yield* readdir(nodePath.dirname(transcript)), ["2.jsonl", "9.jsonl"])
      yield* store.pruneSnapshots("a", 7)
      assert.deepStrictEqual(yield* readdir(nodePath.dirname(transcript)), ["2.jsonl", "9.jsonl"])
      yield* store.pruneSnapshots("a", 8)
      assert.deepStrictEqual(yield* readdir(nodePath.dirname(transcript)), ["9.jsonl"])
      assert.deepStrictEqual(yield* collect(store.readSnapshot("a", 9)), [message(0), message(1)])
      // A transcript shorter than a header says is damage, not zeros.
      yield* Effect.promise(() => fsp.truncate(nodePath.join(nodePath.dirname(transcript), "9.jsonl"), 3))
      const damaged = yield* Effect.flip(store.appendSnapshot("a", { snapshotId: "s10", generation: 10, messageCount: 2 }, []))
      assert.strictEqual(damaged._tag === "SessionStoreError" ? damaged.reason : "", "Corrupt")
    }))

  it.scoped("a writer that died before its rename leaves the previous latest transcript", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const root = nodePath.join(dir, "state")
      const store = yield* open(root)
      yield* store.create(meta("a"))
      yield* store.writeSnapshot("a", { snapshotId: "s1", generation: 1, messageCount: 1 }, [message(1)])
      const previous = yield* store.latestSnapshot("a")
      const snapshots = nodePath.join(root, "sessions", "a", "snapshots")
      // What a killed writer leaves: a temp file with a header and part of its body.
      const header = JSON.stringify({ type: "snapshot_header", snapshotId: "s2", generation: 2, messageCount: 2 })
      yield* Effect.promise(() => fsp.writeFile(nodePath.join(snapshots, ".2.jsonl.4242.deadbeef.tmp"), `${header}\n{"id":`))
      assert.deepStrictEqual(yield* store.latestSnapshot("a"), previous)

      // A final name with an unreadable header (disk damage) is skipped with a warning.
      yield* Effect.promise(() => fsp.writeFile(nodePath.join(snapshots, "3.jsonl"), "garbage\n"))
      assert.deepStrictEqual(yield* store.latestSnapshot("a"), previous)

      // A new generation replaces it; pruning clears the dead writer's leftovers of old generations.
      yield* store.writeSnapshot("a", { snapshotId: "s4", generation: 4, messageCount: 0 }, [])
      assert.strictEqual(Option.getOrThrow(yield* store.latestSnapshot("a")).header.generation, 4)
      assert.deepStrictEqual(yield* store.pruneSnapshots("a", 4), [1, 3])
      assert.deepStrictEqual(yield* readdir(snapshots), ["4.jsonl"])
    }))

  it.scoped("detects a damaged transcript while reading it", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const store = yield* open(dir)
      yield* store.create(meta("a"))
      const info = yield* store.writeSnapshot("a", { snapshotId: "s1", generation: 1, messageCount: 3 }, [
        message(0),
        message(1),
        message(2)
      ])
      const text = yield* Effect.promise(() => fsp.readFile(info.path, "utf8"))
      // Lost its last message.
      yield* Effect.promise(() => fsp.writeFile(info.path, text.split("\n").slice(0, 3).join("\n") + "\n"))
      const short = yield* Effect.flip(collect(store.readSnapshot("a", 1)))
      assert.strictEqual(short._tag === "SessionStoreError" ? short.reason : "", "Corrupt")
      // A torn line.
      yield* Effect.promise(() => fsp.writeFile(info.path, text.slice(0, text.length - 10)))
      const torn = yield* Effect.flip(collect(store.readSnapshot("a", 1)))
      assert.strictEqual(torn._tag === "SessionStoreError" ? torn.reason : "", "Corrupt")
    }))

  it.scoped("streams large transcripts both ways without holding them whole", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const store = yield* open(dir)
      yield* store.create(meta("big"))
      const count = 20_000
      const big = "x".repeat(200_000)
      // Generated lazily: the writer pulls messages as it writes them.
      const messages = Stream.range(0, count - 1).pipe(Stream.map((n) => (n === 777 ? message(n, big) : message(n))))
      const info = yield* store.writeSnapshot("big", { snapshotId: "big", generation: 1, messageCount: count }, messages)
      assert.isAbove((yield* Effect.promise(() => fsp.stat(info.path))).size, 1_500_000)

      let seen = 0
      let bigSeen = false
      yield* Stream.runForEach(store.readSnapshot("big", 1), (m) =>
        Effect.sync(() => {
          const msg = m as { id: string; content: string }
          assert.strictEqual(msg.id, `m${seen}`)
          if (msg.content === big) bigSeen = true
          seen++
        }))
      assert.strictEqual(seen, count)
      assert.isTrue(bigSeen)
      // Taking a prefix stops reading (and closes the file) early.
      assert.deepStrictEqual(yield* collect(Stream.take(store.readSnapshot("big", 1), 2)), [message(0), message(1)])
    }))

  it.scoped("a reopened store sees what was written before", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const first = yield* open(dir)
      yield* first.create(meta("a"))
      yield* first.writeSnapshot("a", { snapshotId: "s1", generation: 1, messageCount: 1 }, [message(1)])
      const second = yield* open(dir)
      assert.deepStrictEqual(yield* second.loadMeta("a"), meta("a"))
      assert.deepStrictEqual(yield* second.latestSnapshot("a"), yield* first.latestSnapshot("a"))
      // A broken meta.json hides neither the other sessions nor itself: it is listed unreadable,
      // and so is a session directory whose meta.json is gone.
      yield* first.create(meta("b"))
      yield* first.create(meta("c"))
      yield* Effect.promise(() => fsp.writeFile(nodePath.join(dir, "sessions", "b", "meta.json"), "{"))
      yield* Effect.promise(() => fsp.rm(nodePath.join(dir, "sessions", "c", "meta.json")))
      const listed = yield* second.list()
      assert.deepStrictEqual(listed.map(SessionStore.listingId).sort(), ["a", "b", "c"])
      assert.deepStrictEqual(listed[0], { _tag: "Loaded", meta: meta("a") })
      for (const entry of listed.slice(1)) {
        assert.strictEqual(entry._tag, "Unreadable")
        if (entry._tag === "Unreadable") assert.include(entry.reason, "meta.json")
      }
      assert.strictEqual((yield* Effect.flip(second.loadMeta("b")))._tag, "SessionStoreError")
    }))
})
