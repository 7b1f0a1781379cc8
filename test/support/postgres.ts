/**
 * PostgreSQL for the tests: the server's URL (`AGENTD_TEST_PG_URL`, set by `.ci/run`, or the
 * private server vitest's global setup starts, test/support/pgGlobalSetup.ts), a fresh schema per
 * test, and the store's layers over it.
 *
 * Without a server the PostgreSQL suites are skipped with a message saying why, except under
 * `CI=true`, where they fail: CI must never pass by skipping them.
 */
import * as SqlClient from "@effect/sql/SqlClient"
import * as PgClient from "@effect/sql-pg/PgClient"
import { describe, inject, it } from "vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Redacted from "effect/Redacted"
import * as Scope from "effect/Scope"
import * as PostgresStore from "../../src/PostgresStore.js"

declare module "vitest" {
  export interface ProvidedContext {
    agentdTestPgUrl: string | undefined
    agentdTestPgWhy: string | undefined
  }
}

/** The test server's URL, if there is one. */
export const pgUrl = (): string | undefined => {
  const fromEnv = process.env["AGENTD_TEST_PG_URL"]
  if (fromEnv !== undefined && fromEnv !== "") return fromEnv
  try {
    return inject("agentdTestPgUrl")
  } catch {
    return undefined
  }
}

const whyNone = (): string => {
  let why: string | undefined
  try {
    why = inject("agentdTestPgWhy")
  } catch {
    why = undefined
  }
  return why ?? "AGENTD_TEST_PG_URL is not set"
}

let warned = false

/**
 * `describe`, when PostgreSQL is there; otherwise one skipped test (or, under CI=true, one
 * failing test) saying why.
 */
export const describePg = (name: string, body: () => void): void => {
  if (pgUrl() !== undefined) {
    describe(name, body)
    return
  }
  const why = `no PostgreSQL for the tests: ${whyNone()}`
  if (process.env["CI"] === "true") {
    describe(name, () => {
      it("needs PostgreSQL (CI=true: never skipped)", () => {
        throw new Error(`${why}; .ci/run starts one (scripts/pg-test-server.sh)`)
      })
    })
    return
  }
  if (!warned) {
    warned = true
    process.stderr.write(`[agentd tests] skipping the PostgreSQL suites: ${why}\n`)
  }
  describe.skip(`${name} (skipped: ${why})`, body)
}

const adminClient = (url: string) => PgClient.layer({ url: Redacted.make(url), maxConnections: 1 })

/** `url` with its connections' `search_path` set to `schema`. */
export const withSchema = (url: string, schema: string): string => {
  const parsed = new URL(url)
  parsed.searchParams.set("options", `-c search_path=${schema}`)
  return parsed.toString()
}

/**
 * A fresh schema for one test (one store: its own tables and its own lock), dropped when the
 * scope closes; the URL that uses it.
 */
export const freshSchema: Effect.Effect<string, never, Scope.Scope> = Effect.gen(function*() {
  const url = pgUrl()
  if (url === undefined) return yield* Effect.die(new Error("no PostgreSQL for the tests"))
  const schema = `t_${process.pid}_${Date.now().toString(36)}_${Math.random().toString(36).slice(2, 8)}`
  const admin = (statement: string) =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      yield* sql.unsafe(statement)
    }).pipe(Effect.provide(adminClient(url)), Effect.orDie)
  yield* Effect.acquireRelease(admin(`CREATE SCHEMA ${schema}`), () => admin(`DROP SCHEMA ${schema} CASCADE`))
  return withSchema(url, schema)
})

/** The store's connection, schema and lock over a fresh schema. */
export const storeLayer = (options: { readonly socketPath?: string } = {}) =>
  Layer.unwrapScoped(Effect.map(freshSchema, (url) => PostgresStore.layer({ url, ...options }))).pipe(Layer.orDie)

/**
 * {@link freshSchema} for tests outside Effect (the e2e tests): the URL of a new schema and a
 * function that drops it.
 */
export const freshSchemaUrl = async (): Promise<{ readonly url: string; readonly drop: () => Promise<void> }> => {
  const scope = await Effect.runPromise(Scope.make())
  const url = await Effect.runPromise(Scope.extend(freshSchema, scope))
  return { url, drop: () => Effect.runPromise(Scope.close(scope, Exit.void)) }
}

/**
 * A fresh database for a cluster of runners (the e2e cluster tests): @effect/cluster's shard
 * locks are advisory locks of the whole database, so two clusters (two test files running at
 * once) must not share one. Its URL and a function that drops it (and the connections left to it).
 */
export const freshDatabaseUrl = async (): Promise<{ readonly url: string; readonly drop: () => Promise<void> }> => {
  const url = pgUrl()
  if (url === undefined) throw new Error("no PostgreSQL for the tests")
  const name = `t_${process.pid}_${Date.now().toString(36)}_${Math.random().toString(36).slice(2, 8)}`
  const admin = (statement: string) =>
    Effect.runPromise(Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      yield* sql.unsafe(statement)
    }).pipe(Effect.provide(adminClient(url)), Effect.orDie))
  await admin(`CREATE DATABASE ${name}`)
  const parsed = new URL(url)
  parsed.pathname = `/${name}`
  return { url: parsed.toString(), drop: () => admin(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`) }
}
