/**
 * Event append throughput on both stores, in one run: 64 fibers append to one session of the
 * file event log and of the PostgreSQL one, as fast as their acknowledgements come back (every
 * acknowledged append durable: fdatasync'd, or committed), in alternating rounds (disk latency
 * on a shared machine drifts within seconds). Prints both rates and PostgreSQL / files
 * (the storage issue's goal: >= 0.5x).
 *
 * PostgreSQL: `AGENTD_BENCH_PG_URL` (else `AGENTD_TEST_PG_URL`), in a schema of its own dropped
 * afterwards; without either, a private server is started for the run
 * (scripts/pg-test-server.sh) and stopped after it.
 */
import * as SqlClient from "@effect/sql/SqlClient"
import * as PgClient from "@effect/sql-pg/PgClient"
import * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Redacted from "effect/Redacted"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import * as EventLog from "../src/EventLog.js"
import * as PostgresStore from "../src/PostgresStore.js"

const APPENDERS = 64
const ROUNDS = 4
const ROUND_MS = 1_200

const event = (w: number, i: number) => ({ type: "message_update", messageId: `m-${w}`, delta: ` word${i}`, appender: w, index: i })

interface Tally {
  events: number
  ms: number
}

const rate = (t: Tally) => t.events / (t.ms / 1000)
const fmt = (n: number) => Math.round(n).toLocaleString("en-US")

/** `sessions` sessions, APPENDERS fibers spread over them, until `ms` elapse. */
const round = (log: EventLog.EventLogService, sessions: number, ms: number, tally: Tally) =>
  Effect.gen(function*() {
    let acknowledged = 0
    const start = performance.now()
    const deadline = start + ms
    yield* Effect.forEach(
      Array.from({ length: APPENDERS }, (_, w) => w),
      (w) =>
        Effect.gen(function*() {
          for (let i = 0; performance.now() < deadline; i++) {
            yield* log.append(`bench-${w % sessions}`, event(w, i))
            acknowledged++
          }
        }),
      { concurrency: "unbounded", discard: true }
    )
    tally.events += acknowledged
    tally.ms += performance.now() - start
  })

const script = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..", "scripts", "pg-test-server.sh")

/** A PostgreSQL server's URL for the run, and how to let go of it. */
const server = (): { readonly url: string; readonly stop: () => void } => {
  const given = process.env["AGENTD_BENCH_PG_URL"] ?? process.env["AGENTD_TEST_PG_URL"]
  if (given !== undefined && given !== "") return { url: given, stop: () => {} }
  const base = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-bench-pg-"))
  const dir = path.join(base, "pg")
  const started = spawnSync("bash", [script, "start", dir], { encoding: "utf8" })
  if (started.status !== 0) throw new Error(`cannot start PostgreSQL for the benchmark: ${started.stderr.trim()}`)
  return {
    url: started.stdout.trim(),
    stop: () => {
      spawnSync("bash", [script, "stop", dir])
      fs.rmSync(base, { recursive: true, force: true })
    }
  }
}

const admin = (url: string, statement: string) =>
  Effect.gen(function*() {
    const sql = yield* SqlClient.SqlClient
    yield* sql.unsafe(statement)
  }).pipe(Effect.provide(PgClient.layer({ url: Redacted.make(url), maxConnections: 1 })))

/**
 * A PostgreSQL store for a benchmark: a schema of its own on the server of {@link server}; `close`
 * drops it (and stops a server started for it).
 */
export const benchStore = async (name: string): Promise<{ readonly url: string; readonly close: () => Promise<void> }> => {
  const pg = server()
  const schema = `bench_${name}_${process.pid}`
  const withSchema = new URL(pg.url)
  withSchema.searchParams.set("options", `-c search_path=${schema}`)
  await Effect.runPromise(admin(pg.url, `CREATE SCHEMA ${schema}`))
  return {
    url: withSchema.toString(),
    close: async () => {
      await Effect.runPromise(Effect.ignore(admin(pg.url, `DROP SCHEMA IF EXISTS ${schema} CASCADE`)))
      pg.stop()
    }
  }
}

export default async function storeAppend(): Promise<void> {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-bench-store-"))
  const store = await benchStore("append")
  try {
    for (const sessions of [1, 8]) {
      const files: Tally = { events: 0, ms: 0 }
      const postgres: Tally = { events: 0, ms: 0 }
      await Effect.runPromise(Effect.gen(function*() {
        const fileLog = Context.get(
          yield* Layer.build(Layer.orDie(EventLog.layer({ root: path.join(dir, `files-${sessions}`) }))),
          EventLog.EventLog
        )
        const pgLog = Context.get(
          yield* Layer.build(
            PostgresStore.eventLog.pipe(Layer.provide(PostgresStore.layer({ url: store.url, maxConnections: 16 })), Layer.orDie)
          ),
          EventLog.EventLog
        )
        // Sessions opened outside the measured windows.
        for (let s = 0; s < sessions; s++) {
          yield* fileLog.append(`bench-${s}`, event(-1, -1))
          yield* pgLog.append(`bench-${s}`, event(-1, -1))
        }
        for (let r = 0; r < ROUNDS; r++) {
          yield* round(fileLog, sessions, ROUND_MS, files)
          yield* round(pgLog, sessions, ROUND_MS, postgres)
        }
      }).pipe(Effect.scoped))
      const label = sessions === 1 ? "one session" : `${sessions} sessions`
      console.log(`EventLog.append, ${APPENDERS} appenders on ${label}, files (durable):      ${fmt(rate(files))} events/s`)
      console.log(`EventLog.append, ${APPENDERS} appenders on ${label}, PostgreSQL (durable): ${fmt(rate(postgres))} events/s`)
      console.log(`ratio PostgreSQL / files (${label}): ${(rate(postgres) / rate(files)).toFixed(2)}x (goal >= 0.5x)`)
    }
    console.log(
      `(${ROUNDS} alternating rounds of ${ROUND_MS} ms each; load average ${os.loadavg().map((l) => l.toFixed(1)).join(" ")} on ${os.cpus().length} cpus)`
    )
  } finally {
    await store.close()
    fs.rmSync(dir, { recursive: true, force: true })
  }
}
