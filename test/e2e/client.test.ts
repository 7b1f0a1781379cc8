/**
 * The client (`agentd/client`, Effect service and Promise facade) against the real daemon:
 * typed results of every command, the daemon's errors as typed errors, server messages as a
 * decoded stream, a prompted turn followed to its `agent_end` or to `turn_interrupted`, and the
 * CLI over the client.
 *
 * Needs `npm run build` first.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Stream from "effect/Stream"
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import * as Client from "../../src/client.js"
import { DaemonClient } from "../../src/client.js"
import { cleanUpAfterTests, DAEMON_BIN, sharedDaemon } from "./harness.js"

cleanUpAfterTests()

const failureOf = <A, E>(exit: Exit.Exit<A, E>): E => {
  if (Exit.isSuccess(exit)) assert.fail(`expected a failure, got ${JSON.stringify(exit.value)}`)
  if (exit.cause._tag !== "Fail") assert.fail(`expected a typed failure, got ${String(exit.cause)}`)
  return exit.cause.error
}

/** Runs the CLI; resolves with its exit code and output. */
const cli = (args: ReadonlyArray<string>) =>
  new Promise<{ code: number | null; stdout: string; stderr: string }>((resolve, reject) => {
    const proc = spawn(process.execPath, [DAEMON_BIN, ...args], { stdio: ["ignore", "pipe", "pipe"] })
    let stdout = ""
    let stderr = ""
    proc.stdout.setEncoding("utf8").on("data", (d: string) => (stdout += d))
    proc.stderr.setEncoding("utf8").on("data", (d: string) => (stderr += d))
    proc.once("error", reject)
    proc.once("exit", (code) => resolve({ code, stdout, stderr }))
  })

describe("client against the daemon", () => {
  const daemon = sharedDaemon()

  it.scopedLive("every command's answer is decoded into its typed result", () =>
    Effect.gen(function*() {
      const d = daemon()
      const client = yield* DaemonClient.make({ socketPath: d.socketPath })
      assert.strictEqual(client.hello.supervisorPid, d.pid)
      assert.deepStrictEqual(yield* client.ping(), { pong: true })

      const created = yield* client.create({ name: "typed", config: { tokenDelayMs: 0 } })
      d.recordWorkers(created.state)
      const id = created.activeSessionId
      assert.match(id, /^s-/)
      assert.strictEqual(created.state.name, "typed")
      assert.strictEqual(created.state.engine, "echo")
      assert.isFalse(client.isAttached(id))

      const { sessions } = yield* client.list()
      assert.include(sessions.map((s) => s.activeSessionId), id)

      const messages = yield* client.subscribe
      const attached = yield* client.attach(id)
      assert.strictEqual(attached.activeSessionId, id)
      assert.deepStrictEqual(attached.replay.status, "unavailable")
      assert.deepStrictEqual(attached.replay.reason, "no_cursor")
      assert.deepStrictEqual(attached.protocol, { name: "agentd", version: 1 })
      assert.isTrue(client.isAttached(id))
      const first = yield* Stream.runHead(Stream.filter(messages, (m) => m.type === "session_attached"))
      assert.strictEqual(first._tag, "Some")

      const turn = yield* Stream.runCollect(client.promptTurn(id, "hello typed world"))
      const events = Chunk.toReadonlyArray(turn).map((m) => m.event)
      assert.strictEqual(events[0]!.type, "agent_start")
      assert.strictEqual(events[events.length - 1]!.type, "agent_end")
      const text = events.flatMap((e) => (e.type === "message_update" ? [e.delta] : [])).join("")
      assert.strictEqual(text, "echo: hello typed world")
      // Cursors strictly increase within the turn.
      const cursors = Chunk.toReadonlyArray(turn).map((m) => m.meta.cursor)
      for (let i = 1; i < cursors.length; i++) {
        assert.isTrue(cursors[i]!.sequence > cursors[i - 1]!.sequence || cursors[i]!.generation > cursors[i - 1]!.generation)
      }

      const state = yield* client.getState(id)
      d.recordWorkers(state)
      assert.strictEqual(state.messageCount, 2)
      const page = yield* client.getMessages(id, { offset: 1, limit: 10 })
      assert.strictEqual(page.total, 2)
      assert.deepStrictEqual(page.messages.map((m) => [m.role, m.content]), [["assistant", "echo: hello typed world"]])

      const checkpoint = yield* client.checkpoint(id)
      assert.strictEqual(checkpoint.generation, 2)
      assert.strictEqual(checkpoint.snapshotId, `${id}~g2`)
      assert.deepStrictEqual(yield* client.abort(id), { aborted: false })
      const retried = yield* client.retryWorker(id)
      assert.strictEqual(retried.activeSessionId, id)

      const status = yield* client.status()
      assert.strictEqual(status.pid, d.pid)
      assert.isAtLeast(status.sessions, 1)
      assert.include(status.workers.map((w) => w.activeSessionId), id)
      d.recordWorkers(status)

      yield* client.detach(id)
      assert.isFalse(client.isAttached(id))
      yield* client.kill(id)
      const gone = yield* Effect.flip(client.getState(id))
      assert.strictEqual(gone._tag, "DaemonError")
      if (gone._tag === "DaemonError") assert.strictEqual(gone.code, "session_not_found")
    }), 30_000)

  it.scopedLive("the daemon's errors are typed: session_not_found, invalid_command, session_busy", () =>
    Effect.gen(function*() {
      const d = daemon()
      const client = yield* DaemonClient.make({ socketPath: d.socketPath })

      // catchTag, then switch on the code.
      const outcome = yield* client.getState("s-00000000-0000-0000-0000-000000000000").pipe(
        Effect.as("found"),
        Effect.catchTag("DaemonError", (e) => e.code === "session_not_found" ? Effect.succeed(`not found: ${e.command}`) : Effect.fail(e))
      )
      assert.strictEqual(outcome, "not found: get_state")
      for (const command of [client.prompt("s-nope", "x"), client.kill("s-nope"), client.getMessages("s-nope")]) {
        const error = yield* Effect.flip(command)
        assert.strictEqual(error._tag, "DaemonError")
        if (error._tag === "DaemonError") assert.strictEqual(error.code, "session_not_found")
      }

      const unknownEngine = yield* Effect.flip(client.create({ engine: "no-such-engine" }))
      assert.strictEqual(unknownEngine._tag, "DaemonError")
      if (unknownEngine._tag === "DaemonError") {
        assert.strictEqual(unknownEngine.code, "invalid_command")
        assert.include(unknownEngine.message, "engine")
      }
      const badConfig = yield* Effect.flip(client.create({ config: { tokenDelayMs: -1 } }))
      assert.strictEqual(badConfig._tag === "DaemonError" && badConfig.code, "invalid_command")

      const { activeSessionId: id, state } = yield* client.create({})
      d.recordWorkers(state)
      // The schema of get_messages allows at most 1000: the daemon is the judge.
      const tooMany = yield* Effect.flip(client.getMessages(id, { limit: 5000 }))
      assert.strictEqual(tooMany._tag === "DaemonError" && tooMany.code, "invalid_command")
      assert.include(tooMany.message, "limit")

      yield* client.prompt(id, "/sleep 1000")
      const busy = yield* Effect.flip(client.prompt(id, "again"))
      assert.strictEqual(busy._tag === "DaemonError" && busy.code, "session_busy")
      const busyTurn = yield* Effect.flip(Stream.runDrain(client.promptTurn(id, "again")))
      assert.strictEqual(busyTurn._tag === "DaemonError" && busyTurn.code, "session_busy")
      assert.deepStrictEqual(yield* client.abort(id), { aborted: true })
      yield* client.kill(id)
    }), 30_000)

  it.live("Promise facade: create, then each prompt yields its turn and ends with agent_end", () =>
    Effect.promise(async () => {
      const d = daemon()
      const client = await Client.connect({ socketPath: d.socketPath })
      const other = await Client.connect({ socketPath: d.socketPath })
      try {
        const session = await client.create({ name: "facade", engine: "echo", config: { tokenDelayMs: 1 } })
        const collect = async (iterable: AsyncIterable<Client.Protocol.AgentEvent>) => {
          const events: Array<Client.Protocol.AgentEvent> = []
          for await (const event of iterable) events.push(event)
          return events
        }
        const first = await collect(session.prompt("one two"))
        assert.strictEqual(first[0]!.type, "agent_start")
        assert.strictEqual(first[first.length - 1]!.type, "agent_end")
        assert.strictEqual(first.filter((e) => e.type === "agent_end").length, 1)
        assert.deepStrictEqual(first.flatMap((e) => (e.type === "message_update" ? [e.delta] : [])), ["echo:", " one", " two"])

        // Already attached: the next turn alone, nothing of the first.
        const second = await collect(session.prompt("three"))
        assert.deepStrictEqual(second.flatMap((e) => (e.type === "message_end" ? [e.message.content] : [])), ["three", "echo: three"])

        // Another connection, by id: attaches (resuming after the last event, no history) and follows.
        const byId = other.session(session.activeSessionId)
        const third = await collect(byId.prompt("four"))
        assert.deepStrictEqual(third.flatMap((e) => (e.type === "message_end" ? [e.message.content] : [])), ["four", "echo: four"])
        assert.isTrue(other.core.isAttached(session.activeSessionId))

        const state = await byId.getState()
        d.recordWorkers(state)
        assert.strictEqual(state.messageCount, 6)
        assert.strictEqual((await session.getMessages({ limit: 1000 })).total, 6)
        assert.include((await client.list()).map((s) => s.activeSessionId), session.activeSessionId)

        const missing = await client.session("s-missing").getState().then(() => undefined, (e: unknown) => e)
        assert.instanceOf(missing, Client.DaemonError)
        assert.strictEqual((missing as Client.DaemonError).code, "session_not_found")
        await session.kill()
      } finally {
        await client.close()
        await other.close()
      }
    }), 30_000)

  it.live("Promise facade: follow with a cursor file keeps the last event the loop was given, not what was read ahead", () =>
    Effect.promise(async () => {
      const d = daemon()
      const client = await Client.connect({ socketPath: d.socketPath })
      const dir = fs.mkdtempSync(path.join(d.stateDir, "..", "cursor-"))
      const file = path.join(dir, "cursor.json")
      try {
        const session = await client.create({ engine: "echo" })
        for await (const _ of session.prompt("one two three four five")) void _
        const cursorOf = (e: Client.SessionClient.FollowEvent) => (e.type === "baseline" ? e.cursor : e.meta.cursor)
        // The whole turn is there to read; the loop stops at its fourth sequenced event.
        let seen: Client.Cursor.Cursor | undefined
        let count = 0
        for await (const e of session.follow({ persistPath: file })) {
          if (e.type === "baseline") continue
          seen = cursorOf(e)
          if (++count === 4) break
        }
        const saved = JSON.parse(fs.readFileSync(file, "utf8"))
        assert.deepStrictEqual(saved.cursor, seen)
        // The next follow goes on right after it: nothing skipped.
        for await (const e of session.follow({ persistPath: file })) {
          if (e.type === "baseline") continue
          assert.deepStrictEqual(cursorOf(e), { generation: seen!.generation, sequence: seen!.sequence + 1 })
          break
        }
        await session.kill()
      } finally {
        await client.close()
        fs.rmSync(dir, { recursive: true, force: true })
      }
    }), 30_000)

  it.live("Promise facade: a turn cut by abort throws TurnInterrupted with reason `aborted`", () =>
    Effect.promise(async () => {
      const d = daemon()
      const client = await Client.connect({ socketPath: d.socketPath })
      try {
        const session = await client.create({})
        const seen: Array<string> = []
        let aborted: boolean | undefined
        const started = Date.now()
        const error = await (async () => {
          for await (const event of session.prompt("/sleep 3000")) {
            seen.push(event.type)
            if (event.type === "tool_execution_start") aborted = await session.abort()
          }
        })().then(() => undefined, (e: unknown) => e)
        assert.instanceOf(error, Client.TurnInterrupted)
        const interrupted = error as Client.TurnInterrupted
        assert.strictEqual(interrupted._tag, "TurnInterrupted")
        assert.strictEqual(interrupted.reason, "aborted")
        assert.strictEqual(interrupted.activeSessionId, session.activeSessionId)
        assert.isTrue(aborted)
        assert.isBelow(Date.now() - started, 2500, "the abort cut the 3 s sleep")
        assert.deepStrictEqual(seen.slice(0, 2), ["agent_start", "turn_start"])
        assert.notInclude(seen, "agent_end")

        // The session takes the next prompt.
        const next: Array<string> = []
        for await (const event of session.prompt("after")) next.push(event.type)
        assert.strictEqual(next[next.length - 1], "agent_end")
        await session.kill()
      } finally {
        await client.close()
      }
    }), 30_000)

  it.live("the CLI over the client: create, prompt, sessions --json; exit 1 for a daemon error, 3 when unreachable", () =>
    Effect.promise(async () => {
      const d = daemon()
      const sock = ["--socket", d.socketPath]
      const created = await cli(["create", "--name", "cli", ...sock])
      assert.strictEqual(created.code, 0, created.stderr)
      const id = created.stdout.trim()
      assert.match(id, /^s-/)
      const prompted = await cli(["prompt", id, "hi there", ...sock])
      assert.strictEqual(prompted.code, 0, prompted.stderr)
      assert.strictEqual(prompted.stdout, "echo: hi there\n")
      const [listed, missing, unreachable] = await Promise.all([
        cli(["sessions", "--json", ...sock]),
        cli(["prompt", "s-missing", "x", ...sock]),
        cli(["status", "--socket", path.join(path.dirname(d.stateDir), "nobody.sock")])
      ])
      assert.strictEqual(listed.code, 0, listed.stderr)
      const sessions = (JSON.parse(listed.stdout) as { sessions: Array<{ activeSessionId: string; messageCount: number }> }).sessions
      assert.strictEqual(sessions.find((s) => s.activeSessionId === id)?.messageCount, 2)
      assert.strictEqual(missing.code, 1)
      assert.include(missing.stderr, "s-missing")
      assert.strictEqual(unreachable.code, 3)
      assert.include(unreachable.stderr, "nobody.sock")
    }), 40_000)

  // Last: it stops the shared daemon.
  it.scopedLive("shutdown answers, then the message stream fails with DaemonDisconnected after daemon_closing", () =>
    Effect.gen(function*() {
      const d = daemon()
      const client = yield* DaemonClient.make({ socketPath: d.socketPath })
      const messages = yield* client.subscribe
      yield* client.shutdown()
      const seen: Array<string> = []
      const error = failureOf(yield* Effect.exit(Stream.runForEach(messages, (m) => Effect.sync(() => seen.push(m.type)))))
      assert.deepStrictEqual(seen, ["daemon_closing"])
      assert.strictEqual(error._tag, "DaemonDisconnected")
      assert.include(error.message, "daemon_closing")
      const after = yield* Effect.flip(client.ping())
      assert.strictEqual(after._tag, "DaemonDisconnected")
      yield* Effect.promise(() => d.exited)
      assert.strictEqual(d.exitCode, 0)
      assert.isFalse(fs.existsSync(d.socketPath))
    }), 30_000)
})
