/**
 * The PostgreSQL store's own promises (its storage layers run the shared suites of
 * EventLog/SessionStore/RecoveryJournal): one writer per store through an advisory lock (a second
 * daemon is refused naming the first, a SIGKILLed one frees it at once), the schema made by the
 * Migrator once, and everything acknowledged still there when the store is opened again.
 */
import { assert, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import { spawn, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import * as SqlClient from "@effect/sql/SqlClient"
import * as PgClient from "@effect/sql-pg/PgClient"
import * as Redacted from "effect/Redacted"
import * as Cursor from "../src/Cursor.js"
import * as EventLog from "../src/EventLog.js"
import * as PostgresStore from "../src/PostgresStore.js"
import { isSchemaRace } from "../src/internal/postgres/store.js"
import * as RecoveryJournal from "../src/RecoveryJournal.js"
import * as SessionStore from "../src/SessionStore.js"
import { describePg, freshSchema } from "./support/postgres.js"
import { childProgram } from "./support/fixtures.js"

// Bundled once for the run (test/support/fixturesGlobalSetup.ts): a start costs ~plain node's.
const childPath = childProgram("lockChild")

/** A lockChild holding the store at `url` (it prints `locked <pid>`); SIGKILLed at scope end. */
const holderProcess = (url: string, socketPath: string) =>
  Effect.acquireRelease(
    Effect.async<{ readonly pid: number; readonly exited: Promise<void> }, Error>((resume) => {
      const proc = spawn(process.execPath, [childPath, url, socketPath], { stdio: ["pipe", "pipe", "inherit"] })
      const exited = new Promise<void>((resolve) => proc.once("exit", () => resolve()))
      let text = ""
      proc.stdout.setEncoding("utf8")
      proc.stdout.on("data", (chunk: string) => {
        text += chunk
        if (text.includes("loaded\n") && !text.includes("go-sent")) {
          text += "go-sent"
          proc.stdin.write("go\n")
        }
        const locked = /locked (\d+)\n/.exec(text)
        if (locked !== null) resume(Effect.succeed({ pid: Number(locked[1]), exited }))
        const refused = /refused (.*)\n/.exec(text)
        if (refused !== null) resume(Effect.fail(new Error(`the child was refused: ${refused[1]}`)))
      })
      proc.once("exit", (code) => resume(Effect.fail(new Error(`the child exited (${code}): ${text}`))))
    }),
    (child) =>
      Effect.promise(async () => {
        try {
          process.kill(child.pid, "SIGKILL")
        } catch {
          // gone already
        }
        await child.exited
      })
  )

const storage = (url: string, socketPath = "/run/test.sock") => PostgresStore.layerStorage({ url, socketPath })

const serverScript = fileURLToPath(new URL("../scripts/pg-test-server.sh", import.meta.url))

/** A private server of the test's own (it is restarted: the shared one must not be). */
const privateServer = Effect.acquireRelease(
  Effect.sync(() => {
    const base = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-pg-restart-"))
    const dir = path.join(base, "pg")
    const started = spawnSync("bash", [serverScript, "start", dir], { encoding: "utf8" })
    if (started.status !== 0) throw new Error(`cannot start a private PostgreSQL: ${started.stderr}`)
    return { base, dir, url: started.stdout.trim() }
  }),
  (server) =>
    Effect.sync(() => {
      spawnSync("bash", [serverScript, "stop", server.dir])
      fs.rmSync(server.base, { recursive: true, force: true })
    })
)

describePg("PostgresStore", () => {
  it.scopedLive("one writer per store: a second one is refused naming the first's pid and socket, until the first is closed", () =>
    Effect.gen(function*() {
      const url = yield* freshSchema
      const first = yield* Effect.exit(Layer.build(PostgresStore.layer({ url, socketPath: "/run/first.sock" })).pipe(Effect.scoped, Effect.as(true)))
      assert.isTrue(Exit.isSuccess(first))
      yield* Effect.scoped(Effect.gen(function*() {
        yield* Layer.build(PostgresStore.layer({ url, socketPath: "/run/first.sock" }))
        const refused = yield* Effect.flip(Layer.build(PostgresStore.layer({ url, socketPath: "/run/second.sock" })))
        assert.strictEqual(refused._tag, "PostgresStoreLocked")
        assert.include(refused.message, `pid ${process.pid}`)
        assert.include(refused.message, "socket /run/first.sock")
        // Another schema is another store, with its own lock.
        const other = yield* freshSchema
        yield* Layer.build(PostgresStore.layer({ url: other }))
      }))
      // Released with its scope: the next one takes it.
      yield* Effect.scoped(Layer.build(PostgresStore.layer({ url, socketPath: "/run/third.sock" })))
    }))

  it.scopedLive("cluster runners hold the store together (lock shared); a single daemon and runners refuse each other, naming the holder", () =>
    Effect.gen(function*() {
      const url = yield* freshSchema
      yield* Effect.scoped(Effect.gen(function*() {
        yield* Layer.build(PostgresStore.layer({ url, lock: "shared" }))
        yield* Layer.build(PostgresStore.layer({ url, lock: "shared" }))
        const single = yield* Effect.flip(Layer.build(PostgresStore.layer({ url, socketPath: "/run/single.sock" })))
        assert.strictEqual(single._tag, "PostgresStoreLocked")
        assert.include(single.message, "2 cluster runners (serve --cluster) hold the store")
      }))
      yield* Effect.scoped(Effect.gen(function*() {
        yield* Layer.build(PostgresStore.layer({ url, socketPath: "/run/single.sock" }))
        const runner = yield* Effect.flip(Layer.build(PostgresStore.layer({ url, lock: "shared" })))
        assert.strictEqual(runner._tag, "PostgresStoreLocked")
        assert.include(runner.message, `pid ${process.pid}`)
        assert.include(runner.message, "socket /run/single.sock")
      }))
    }))

  it.scopedLive("names are unique across every daemon of the store: two runners racing for a name, one wins; a rename moves the claim, an archive frees it; migration 3 keeps an older store's names", () =>
    Effect.gen(function*() {
      const url = yield* freshSchema
      const meta = (id: string, name?: string): SessionStore.SessionMeta => ({
        activeSessionId: id,
        sessionId: id,
        engine: "echo",
        telemetry: false,
        createdAt: "2026-01-01T00:00:00.000Z",
        ...(name === undefined ? {} : { name })
      })
      const runner = (n: number) =>
        Effect.map(
          Layer.build(PostgresStore.layerStorage({ url, socketPath: `/run/r${n}.sock`, lock: "shared" })),
          (ctx) => Context.get(ctx, SessionStore.SessionStore)
        )
      const nameTaken = (e: unknown) => (e as { reason?: string }).reason === "NameTaken"
      yield* Effect.scoped(Effect.gen(function*() {
        const [a, b] = [yield* runner(1), yield* runner(2)]
        // 20 races of two creates with one name, one on each runner, at once: exactly one wins.
        for (let i = 0; i < 20; i++) {
          const [x, y] = yield* Effect.all([
            Effect.either(a.create(meta(`s-a${i}`, `race ${i}`))),
            Effect.either(b.create(meta(`s-b${i}`, `race ${i}`)))
          ], { concurrency: 2 })
          assert.strictEqual([x, y].filter(Either.isRight).length, 1, `race ${i}`)
          const lost = [x, y].find(Either.isLeft)!.left
          assert.isTrue(nameTaken(lost), String(lost))
          assert.match(lost.message, new RegExp(`The name "race ${i}" is in use by session \`s-[ab]${i}\``))
        }
        // The loser's session was not registered either (one transaction).
        const ids = (yield* a.list()).map(SessionStore.listingId)
        assert.strictEqual(ids.length, 20)
        const holder = (i: number) => ids.includes(`s-a${i}`) ? { store: a, id: `s-a${i}` } : { store: b, id: `s-b${i}` }
        // A rename on the other runner to a held name: refused; the session keeps its own.
        const h0 = holder(0)
        const h1 = holder(1)
        const renamed = yield* Effect.flip(b.saveMeta(meta(h1.id, "race 0")))
        assert.isTrue(nameTaken(renamed), String(renamed))
        assert.strictEqual((yield* a.loadMeta(h1.id)).name, "race 1")
        // Saving a meta with its name unchanged claims nothing new.
        yield* b.saveMeta({ ...meta(h1.id, "race 1"), config: { x: 1 } })
        // A rename moves the claim: the old name is free, the new one held.
        yield* a.saveMeta(meta(h0.id, "renamed 0"))
        yield* b.create(meta("s-c0", "race 0"))
        assert.isTrue(nameTaken(yield* Effect.flip(b.create(meta("s-c1", "renamed 0")))))
        // Dropping the name frees it.
        yield* a.saveMeta(meta(h0.id))
        yield* b.create(meta("s-c2", "renamed 0"))
        // An archived session's name is free again.
        yield* a.archive(h1.id)
        yield* b.create(meta("s-c3", "race 1"))
      }))
      // An older store (before migration 3) whose live sessions share a name: they load, the
      // oldest holds the claim, and each still saves its meta.
      const raw = <A>(body: (sql: SqlClient.SqlClient) => Effect.Effect<A, unknown>) =>
        Effect.flatMap(SqlClient.SqlClient, body).pipe(
          Effect.provide(PgClient.layer({ url: Redacted.make(url), maxConnections: 1 })),
          Effect.orDie,
          Effect.scoped
        )
      yield* raw((sql) =>
        Effect.gen(function*() {
          yield* sql`DROP TABLE agentd_session_names`
          yield* sql`DELETE FROM agentd_migrations WHERE migration_id = 3`
          yield* sql`DELETE FROM agentd_sessions`
          for (const [id, at] of [["s-new", "2026-02-01"], ["s-old", "2026-01-01"]] as const) {
            yield* sql`INSERT INTO agentd_sessions VALUES (${id}, ${JSON.stringify({ ...meta(id, "twin"), createdAt: at })}, ${at})`
          }
          yield* sql`INSERT INTO agentd_sessions VALUES ('s-bad', '{not json', '2026-01-01')`
        })
      )
      yield* Effect.scoped(Effect.gen(function*() {
        const store = yield* runner(3)
        yield* store.saveMeta({ ...meta("s-new", "twin"), createdAt: "2026-02-01", config: { y: 2 } })
        yield* store.saveMeta({ ...meta("s-old", "twin"), config: { y: 3 } })
        const taken = yield* Effect.flip(store.create(meta("s-third", "twin")))
        assert.include(taken.message, "session `s-old`")
      }))
    }), { timeout: 60_000 })

  it.scopedLive("a holder killed with SIGKILL leaves no lock behind: the store is taken again at once", () =>
    Effect.gen(function*() {
      const url = yield* freshSchema
      yield* Effect.scoped(Effect.gen(function*() {
        const child = yield* holderProcess(url, "/run/child.sock")
        const refused = yield* Effect.flip(Effect.scoped(Layer.build(PostgresStore.layer({ url }))))
        assert.strictEqual(refused._tag, "PostgresStoreLocked")
        assert.include(refused.message, `pid ${child.pid}`)
        assert.include(refused.message, "socket /run/child.sock")
        process.kill(child.pid, "SIGKILL")
        yield* Effect.promise(() => child.exited)
        yield* Effect.scoped(Layer.build(PostgresStore.layer({ url })))
      }))
    }), { timeout: 30_000 })

  it.scopedLive("reopened, the store has everything acknowledged: events, generations, transcripts, registry, journal", () =>
    Effect.gen(function*() {
      const url = yield* freshSchema
      const meta: SessionStore.SessionMeta = {
        activeSessionId: "s\u0000é",
        sessionId: "engine-s",
        engine: "echo",
        telemetry: false,
        createdAt: "2026-01-01T00:00:00.000Z"
      }
      yield* Effect.gen(function*() {
        const log = yield* EventLog.EventLog
        const store = yield* SessionStore.SessionStore
        const journal = yield* RecoveryJournal.RecoveryJournal
        yield* store.create(meta)
        yield* log.appendAll(meta.activeSessionId, [{ n: 0 }, { n: 1 }])
        yield* log.startGeneration(meta.activeSessionId)
        yield* log.append(meta.activeSessionId, { n: 2 })
        yield* store.appendSnapshot(meta.activeSessionId, { snapshotId: "s2", generation: 2, messageCount: 2 }, [{ m: 0 }, { m: 1 }])
        yield* journal.record({ activeSessionId: meta.activeSessionId, sessionId: "engine-s", busy: true, operation: "prompt" })
      }).pipe(Effect.provide(storage(url)))
      yield* Effect.gen(function*() {
        const log = yield* EventLog.EventLog
        const store = yield* SessionStore.SessionStore
        const journal = yield* RecoveryJournal.RecoveryJournal
        const sid = meta.activeSessionId
        assert.deepStrictEqual(yield* store.loadMeta(sid), meta)
        assert.deepStrictEqual((yield* store.list()).map(SessionStore.listingId), [sid])
        assert.strictEqual(yield* log.currentGeneration(sid), 2)
        assert.deepStrictEqual(yield* log.lastCursor(sid), Option.some(Cursor.make(2, 0)))
        const records = Chunk.toReadonlyArray(yield* Stream.runCollect(log.read(sid)))
        assert.deepStrictEqual(records.map((r) => r.event), [{ n: 0 }, { n: 1 }, { n: 2 }])
        assert.deepStrictEqual(yield* log.generationStart(sid, 2), Option.some(Cursor.make(1, 1)))
        // The same bytes as the file layer counts, so checkpoints come at the same points.
        const status = yield* log.status(sid)
        assert.strictEqual(status.generationEvents, 1)
        assert.strictEqual(status.generationBytes, `{"cursor":{"generation":2,"sequence":0},"event":{"n":2}}\n`.length)
        assert.deepStrictEqual(yield* log.append(sid, { n: 3 }), Cursor.make(2, 1))
        const latest = Option.getOrThrow(yield* store.latestSnapshot(sid))
        assert.strictEqual(latest.header.messageCount, 2)
        assert.deepStrictEqual(Chunk.toReadonlyArray(yield* Stream.runCollect(store.readSnapshot(sid, 2))), [{ m: 0 }, { m: 1 }])
        yield* store.checkTranscript(sid, 2)
        const record = Option.getOrThrow(yield* journal.get(sid))
        assert.strictEqual(record.operation, "prompt")
        assert.isTrue(record.busy)
        // Same state: still deduplicated against what was loaded.
        assert.isFalse(yield* journal.record({ activeSessionId: sid, sessionId: "engine-s", busy: true, operation: "prompt" }))
      }).pipe(Effect.provide(storage(url)))
    }))

  it.scopedLive("the first schema's events (a row each) read back the same after migration 2; a read resumes inside a group commit's row; a row that does not add up is Corrupt", () =>
    Effect.gen(function*() {
      const url = yield* freshSchema
      const raw = <A>(body: (sql: SqlClient.SqlClient) => Effect.Effect<A, unknown>) =>
        Effect.flatMap(SqlClient.SqlClient, body).pipe(
          Effect.provide(PgClient.layer({ url: Redacted.make(url), maxConnections: 1 })),
          Effect.orDie,
          Effect.scoped
        )
      const sid = "s-old"
      // A store of the first schema: made now, then migration 2 undone by hand, as it was.
      yield* Effect.scoped(Layer.build(storage(url)))
      const astral = { text: "a \ud83d\ude00 \"b\"" }
      yield* raw((sql) =>
        Effect.gen(function*() {
          yield* sql`DROP TABLE agentd_event_batches`
          yield* sql`DROP TABLE agentd_session_names`
          yield* sql`DELETE FROM agentd_migrations WHERE migration_id >= 2`
          yield* sql`CREATE TABLE agentd_events (session_id text NOT NULL, generation integer NOT NULL,
            sequence integer NOT NULL, event text NOT NULL, PRIMARY KEY (session_id, generation, sequence))`
          yield* sql`INSERT INTO agentd_generations VALUES (${sid}, 1, NULL, NULL)`
          for (const [i, event] of [{ n: 0 }, astral, { n: 2 }].entries()) {
            yield* sql`INSERT INTO agentd_events VALUES (${sid}, 1, ${i}, ${JSON.stringify(event)})`
          }
        })
      )
      yield* Effect.gen(function*() {
        const log = yield* EventLog.EventLog
        const all = (after?: Cursor.Cursor) =>
          Effect.map(Stream.runCollect(log.read(sid, after)), (c) => Chunk.toReadonlyArray(c).map((r) => [r.cursor.sequence, r.event]))
        assert.deepStrictEqual(yield* all(), [[0, { n: 0 }], [1, astral], [2, { n: 2 }]])
        const status = yield* log.status(sid)
        assert.strictEqual(status.generationEvents, 3)
        // The same bytes as the file layer counts (UTF-8 of the astral character included).
        const lines = [{ n: 0 }, astral, { n: 2 }].map((e, i) => `{"cursor":{"generation":1,"sequence":${i}},"event":${JSON.stringify(e)}}\n`)
        assert.strictEqual(status.generationBytes, Buffer.byteLength(lines.join(""), "utf8"))
        // One group commit of 12 events is one row: a read after any of them starts right after it.
        const more = Array.from({ length: 12 }, (_, i) => i % 3 === 1 ? { ...astral, i } : { n: 3 + i })
        yield* log.appendAll(sid, more)
        for (const after of [2, 3, 7, 13, 14]) {
          const got = yield* all(Cursor.make(1, after))
          assert.deepStrictEqual(got.map(([seq]) => seq), Array.from({ length: 14 - after }, (_, i) => after + 1 + i))
        }
        assert.deepStrictEqual((yield* all(Cursor.make(1, 2))).map(([, e]) => e), more)
        const generation = Chunk.toReadonlyArray(yield* Stream.runCollect(log.readGeneration(sid, 1)))
        assert.deepStrictEqual(generation.map((r) => r.event), [{ n: 0 }, astral, { n: 2 }, ...more])
      }).pipe(Effect.provide(storage(url)))
      const rows = yield* raw((sql) => sql<{ count: number }>`SELECT count FROM agentd_event_batches ORDER BY first_sequence`)
      assert.deepStrictEqual(rows.map((r) => r.count), [1, 1, 1, 12])
      // Damaged: the lengths say more than the text holds.
      yield* raw((sql) => sql`UPDATE agentd_event_batches SET lengths = array_append(lengths, 5), count = count + 1 WHERE count = 12`)
      yield* Effect.gen(function*() {
        const log = yield* EventLog.EventLog
        const error = yield* Effect.flip(Stream.runDrain(log.read(sid, Cursor.make(1, 5))))
        assert.strictEqual(error.reason, "Corrupt")
        assert.include(error.message, "1:3 to 1:15")
      }).pipe(Effect.provide(storage(url)))
    }))

  it.scopedLive("the schema is made once: a second open runs no migration, and a store's tables are its own schema's", () =>
    Effect.gen(function*() {
      const url = yield* freshSchema
      yield* Effect.scoped(Layer.build(storage(url)))
      yield* Effect.scoped(Layer.build(storage(url)))
      const other = yield* freshSchema
      yield* Effect.gen(function*() {
        const store = yield* SessionStore.SessionStore
        assert.deepStrictEqual(yield* store.list(), [])
      }).pipe(Effect.provide(storage(other)))
    }))

  it.scopedLive("two runners of one store: a session's log written by one, then the other, is read again after forget", () =>
    Effect.gen(function*() {
      const url = yield* freshSchema
      const shared = (socketPath: string) => PostgresStore.layerStorage({ url, socketPath, lock: "shared" })
      const a = Context.get(yield* Layer.build(shared("/run/a.sock")), EventLog.EventLog)
      const b = Context.get(yield* Layer.build(shared("/run/b.sock")), EventLog.EventLog)
      yield* a.appendAll("s", [{ n: 0 }, { n: 1 }])
      // The session moves to b, which writes on.
      yield* b.forget("s")
      assert.deepStrictEqual(yield* b.appendAll("s", [{ n: 2 }, { n: 3 }]), [Cursor.make(1, 2), Cursor.make(1, 3)])
      // a still has its own position (what made a session moved back resume at a stale cursor)...
      assert.deepStrictEqual(yield* a.lastCursor("s"), Option.some(Cursor.make(1, 1)))
      // ...until it forgets it, as a runner does when the session comes back to it.
      yield* a.forget("s")
      assert.deepStrictEqual(yield* a.lastCursor("s"), Option.some(Cursor.make(1, 3)))
      assert.deepStrictEqual(yield* a.append("s", { n: 4 }), Cursor.make(1, 4))
      const records = Chunk.toReadonlyArray(yield* Stream.runCollect(a.read("s")))
      assert.deepStrictEqual(records.map((r) => r.event["n"]), [0, 1, 2, 3, 4])
      assert.deepStrictEqual(records.map((r) => r.cursor), Array.from({ length: 5 }, (_, i) => Cursor.make(1, i)))
    }))

  it.scopedLive("an unreachable server is a clear error naming the store, without its password", () =>
    Effect.gen(function*() {
      const error = yield* Effect.flip(Effect.scoped(Layer.build(
        PostgresStore.layer({ url: "postgres://agentd:s3cret@127.0.0.1:1/nowhere?connect_timeout=2" })
      )))
      assert.strictEqual(error._tag, "PostgresStoreError")
      assert.include(error.message, "127.0.0.1:1/nowhere")
      assert.notInclude(error.message, "s3cret")
    }), { timeout: 30_000 })

  it.scopedLive("PostgreSQL restarted under a holder: it takes its lock again, and its log goes on without a gap", () =>
    Effect.gen(function*() {
      const server = yield* privateServer
      // One pooled connection besides the lock's: the lost lock connection must be given back
      // (held, it took the pool's last place once the lock was taken again, and the log waited
      // for ever).
      const ctx = yield* Layer.build(PostgresStore.layerStorage({ url: server.url, socketPath: "/run/holder.sock", maxConnections: 1 }))
      const log = Context.get(ctx, EventLog.EventLog)
      assert.deepStrictEqual(yield* log.append("s", { n: 0 }), Cursor.make(1, 0))
      const restarted = spawnSync("bash", [serverScript, "restart", server.dir], { encoding: "utf8" })
      assert.strictEqual(restarted.status, 0, restarted.stderr)
      // The first append after it may meet a dead pooled connection: a clear error, not a hang.
      const first = yield* Effect.either(log.append("s", { n: 1 }))
      if (first._tag === "Left") assert.strictEqual(first.left.reason, "Io")
      // Within a few checks the holder has its lock back: a second store is refused again, naming
      // it. (One of these stores may take the lock before the holder does, and leave its record:
      // a refusal read between the holder's lock and its record names that one; the next names
      // the holder.)
      let refused: string | undefined
      for (let i = 0; i < 40 && !refused?.includes("socket /run/holder.sock"); i++) {
        const other = yield* Effect.either(Effect.scoped(Layer.build(PostgresStore.layer({ url: server.url }))))
        if (other._tag === "Left" && other.left._tag === "PostgresStoreLocked") refused = other.left.message
        else yield* Effect.sleep("250 millis")
      }
      assert.isDefined(refused, "the lock was not taken again after the restart")
      assert.include(refused!, "socket /run/holder.sock")
      const next = yield* log.append("s", { n: 2 }).pipe(Effect.timeoutFail({ duration: "10 seconds", onTimeout: () => "the append after the lock was taken again did not answer in 10 s" }))
      const records = Chunk.toReadonlyArray(yield* Stream.runCollect(log.read("s")))
      assert.deepStrictEqual(records.map((r) => r.cursor), Array.from({ length: next.sequence + 1 }, (_, i) => Cursor.make(1, i)))
    }), { timeout: 60_000 })
})

it("a lost race to create a schema object is told from any other failure, at any depth of causes", () => {
  const pg = (code: string) => Object.assign(new Error("pg"), { code })
  const cases: Array<[unknown, boolean]> = [
    [pg("23505"), true], // the catalog's unique index (CREATE TABLE IF NOT EXISTS raced)
    [pg("42P07"), true], // duplicate_table
    [pg("42710"), true], // duplicate_object
    [{ _tag: "SqlError", cause: pg("42P07") }, true],
    [{ _tag: "MigrationError", cause: { _tag: "SqlError", cause: pg("23505") } }, true],
    [pg("42P01"), false], // undefined_table
    [pg("08006"), false], // connection failure
    [{ cause: { cause: { cause: { cause: pg("23505") } } } }, false], // deeper than any layer wraps it
    [new Error("no code"), false],
    [undefined, false],
    ["23505", false]
  ]
  for (const [error, expected] of cases) assert.strictEqual(isSchemaRace(error), expected, JSON.stringify(error))
})
