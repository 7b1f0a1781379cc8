/**
 * SessionClient and `session.follow()` against the real daemon: a follower that sees every
 * event once, in cursor order, across a worker SIGKILL and a daemon SIGKILL + restart, whose
 * folded transcript equals `get_messages`; a follower that stops reading while its events are
 * pruned (a resync snapshot) and a second instance resumed from its persisted cursor; a
 * persisted-cursor resume that goes on exactly after the last event the first instance gave.
 *
 * Needs `npm run build` first.
 */
import * as Schedule from "effect/Schedule"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { describe, expect, it } from "vitest"
import * as Client from "../../src/client.js"
import { cleanUpAfterTests, compareCursor, type Cursor, fmtCursor, PROJECT_ROOT, sleep, useDaemon } from "./harness.js"

cleanUpAfterTests()

const fast = Schedule.spaced("50 millis")

/** Runs a follow loop in the background, collecting what it yields. */
const collect = (iterable: AsyncIterable<Client.FollowEvent>) => {
  const events: Array<Client.FollowEvent> = []
  let error: unknown
  let done = false
  const iterator = iterable[Symbol.asyncIterator]()
  const loop = (async () => {
    try {
      for (;;) {
        const r = await iterator.next()
        if (r.done === true) break
        events.push(r.value)
      }
    } catch (e) {
      error = e
    } finally {
      done = true
    }
  })()
  return {
    events,
    get error() {
      return error
    },
    get done() {
      return done
    },
    /** Stops the loop while a `next()` waits: its connection closes, the waiting `next()` ends. */
    stop: async () => {
      await iterator.return?.()
      await loop
    },
    waitFor: async (pred: (e: Client.FollowEvent) => boolean, what: string, timeoutMs = 15_000) => {
      const deadline = Date.now() + timeoutMs
      while (!events.some(pred)) {
        if (error !== undefined) throw new Error(`the follower failed while waiting for ${what}: ${String(error)}`)
        if (Date.now() > deadline) throw new Error(`no ${what} within ${timeoutMs} ms; last: ${events.slice(-8).map(describe_).join(", ")}`)
        await sleep(20)
      }
    }
  }
}

const describe_ = (e: Client.FollowEvent): string =>
  e.type === "baseline"
    ? `baseline(${e.purpose},${fmtCursor(e.cursor)},${e.skipped ? "skipped" : "-"})`
    : `${e.type === "session_event" ? e.event.type : e.type}@${fmtCursor(e.meta.cursor)}`

const sequenced = (events: ReadonlyArray<Client.FollowEvent>) =>
  events.flatMap((e) => (e.type === "baseline" ? [] : [e]))

/** Problems with a cursor sequence: each must follow the previous (same generation + 1, or 0 of a later one). */
const orderProblems = (cursors: ReadonlyArray<Cursor>, after?: Cursor): Array<string> => {
  const out: Array<string> = []
  let prev = after
  for (const c of cursors) {
    if (prev !== undefined) {
      const ok = (c.generation === prev.generation && c.sequence === prev.sequence + 1) || (c.generation > prev.generation && c.sequence === 0)
      if (!ok) out.push(`${fmtCursor(c)} after ${fmtCursor(prev)}`)
    } else if (c.sequence !== 0) out.push(`first ${fmtCursor(c)}`)
    prev = c
  }
  return out
}

const isEnd = (text: string) => (e: Client.FollowEvent) =>
  e.type === "session_event" && e.event.type === "message_end" && e.event.message.content === text
const isIdleAfter = (events: ReadonlyArray<Client.FollowEvent>, text: string) => () => {
  const i = events.findIndex(isEnd(text))
  return i >= 0 && events.slice(i).some((e) => e.type === "session_status" && !e.state.busy)
}

const drain = async (it: AsyncIterable<unknown>) => {
  for await (const _ of it) {
    // the turn's events
  }
}

const transcript = (ms: ReadonlyArray<Client.Protocol.AgentMessage>) => ms.map((m) => ({ id: m.id, role: m.role, content: m.content }))

describe("SessionClient against the daemon", () => {
  it("follow() sees every event once, in order, across a worker SIGKILL and a daemon SIGKILL + restart; its transcript equals get_messages", async () => {
    const first = await useDaemon()
    const driver = await Client.connect({ socketPath: first.socketPath })
    const handle = await driver.create({ name: "follow", config: { tokenDelayMs: 1 } })
    const id = handle.activeSessionId
    await drain(handle.prompt("before the follower"))
    const follower = collect(handle.follow({ reconnect: fast }))
    await drain(handle.prompt("one two three"))
    const f = follower
    await f.waitFor(() => isIdleAfter(f.events, "echo: one two three")(), "the first turn")

    // A worker SIGKILL in the middle of a turn.
    const sleeping = (async () => {
      try {
        await drain(handle.prompt("/sleep 3000"))
        return "ended"
      } catch (e) {
        return (e as { _tag?: string; reason?: string })._tag === "TurnInterrupted" ? (e as { reason: string }).reason : String(e)
      }
    })()
    await f.waitFor((e) => e.type === "session_event" && e.event.type === "tool_execution_start", "the sleep tool call")
    const state = await handle.getState()
    first.recordWorkers(state)
    expect(state.workerPid).toBeTypeOf("number")
    process.kill(state.workerPid!, "SIGKILL")
    expect(await sleeping).toBe("worker_crashed")
    await f.waitFor((e) => e.type === "session_status" && e.state.worker === "ready" && e.state.restarts > 0, "the restored worker")
    await drain(handle.prompt("after the crash"))
    await f.waitFor(() => isIdleAfter(f.events, "echo: after the crash")(), "the turn after the crash")
    await driver.close()

    // The daemon SIGKILLed, then a new one on the same state dir.
    first.recordWorkers(await (async () => {
      const c = await Client.connect({ socketPath: first.socketPath })
      try {
        return await c.status()
      } finally {
        await c.close()
      }
    })())
    await first.sigkill()
    await sleep(300)
    const second = await useDaemon({ stateDir: first.stateDir })
    const driver2 = await Client.connect({ socketPath: second.socketPath })
    const handle2 = driver2.session(id)
    await drain(handle2.prompt("after the restart"))
    second.recordWorkers(await handle2.getState())
    await f.waitFor(() => isIdleAfter(f.events, "echo: after the restart")(), "the turn after the restart")

    expect(f.error).toBeUndefined()
    const seen = sequenced(f.events)
    const cursors = seen.map((e) => e.meta.cursor)
    expect(orderProblems(cursors), f.events.map(describe_).join(", ")).toEqual([])
    const keys = cursors.map(fmtCursor)
    expect(new Set(keys).size).toBe(keys.length)
    // One baseline (the first attach): every reconnect resumed.
    expect(f.events.filter((e) => e.type === "baseline").map((e) => e.type === "baseline" && e.purpose)).toEqual(["attach"])
    expect(seen.some((e) => e.type === "session_event" && e.event.type === "turn_interrupted" && e.event.reason === "worker_crashed")).toBe(true)
    // The folded transcript is the daemon's.
    const page = await handle2.getMessages({ limit: 1000 })
    expect(transcript(handle.messages)).toEqual(transcript(page.messages))
    expect(handle.messages.map((m) => m.content)).toContain("echo: after the restart")
    const st = handle.state!
    expect(st.busy).toBe(false)
    expect(st.worker).toBe("ready")
    expect(compareCursor(st.lastCursor!, (await handle2.getState()).lastEventCursor!)).toBe(0)
    await f.stop()
    await driver2.close()
  }, 40_000)

  it("a follower that stops reading while its events are pruned gets a resync; a second instance resumed from the persisted cursor folds what get_messages returns", async () => {
    const d = await useDaemon({
      env: { AGENTD_OUTBOX_BYTES: "16384", AGENTD_RETAIN_GENERATIONS: "1", AGENTD_CHECKPOINT_EVENTS: "1" }
    })
    const cursorFile = path.join(path.dirname(d.stateDir), "follower.json")
    const driver = await Client.connect({ socketPath: d.socketPath })
    const handle = await driver.create({ name: "resync" })
    const id = handle.activeSessionId
    await drain(handle.prompt("warm up"))
    const f = collect(handle.follow({ reconnect: fast, persistPath: cursorFile }))
    // The warm-up turn is in the baseline's snapshot or among its events (its checkpoint may
    // or may not be done when the follower attaches).
    await f.waitFor((e) => e.type === "baseline", "the baseline")
    for (let i = 0; i < 500 && !handle.messages.some((m) => m.content === "echo: warm up"); i++) await sleep(20)
    expect(handle.messages.map((m) => m.content)).toContain("echo: warm up")

    // This process stops reading (its event loop blocked) while another process runs turns
    // far larger than the socket buffers and the 16 KiB outbox; every turn ends with a
    // checkpoint and only the newest generation is kept.
    const script = `
      const { connect } = await import(process.env.CLIENT_JS)
      const client = await connect({ socketPath: process.env.SOCKET })
      const session = client.session(process.env.ID)
      for (const text of JSON.parse(process.env.TURNS)) for await (const _ of session.prompt(text)) {}
      await client.close()
    `
    const blocked = spawnSync(process.execPath, ["--input-type=module", "-e", script], {
      env: {
        ...process.env,
        CLIENT_JS: path.join(PROJECT_ROOT, "dist", "src", "client.js"),
        SOCKET: d.socketPath,
        ID: id,
        TURNS: JSON.stringify(["/bulk 400000", "/bulk 400000", "plain words", "/bulk 400000", "more words"])
      },
      encoding: "utf8",
      timeout: 20_000
    })
    expect(blocked.status, blocked.stderr).toBe(0)
    // This process reads again: the follower catches up (through resyncs) before the live turn,
    // which would otherwise be pruned too (one generation kept, a checkpoint after every turn)
    // before the follower got there, and reach it inside a resync like the others.
    const caughtUpTo = (await handle.getState()).lastEventCursor!
    await f.waitFor(() => handle.state?.lastCursor !== undefined && compareCursor(handle.state.lastCursor, caughtUpTo) >= 0, "the follower caught up", 15_000)
    // The session is idle, and so is the follower's state, though a resync may have swallowed
    // the idle status (it reads the state after a resync).
    await f.waitFor(() => handle.state?.busy === false, "the idle state after the resyncs", 5_000)
    await drain(handle.prompt("live again"))
    await f.waitFor(() => isIdleAfter(f.events, "echo: live again")(), "the live turn", 15_000)
    const baselines = f.events.filter((e): e is Client.Baseline => e.type === "baseline")
    expect(baselines.map((b) => b.purpose)).toContain("resync")
    const resync = baselines.find((b) => b.purpose === "resync")!
    expect(resync.skipped).toBe(true)
    // In order and once between baselines; nothing at or before a resync's cursor after it.
    const seen = sequenced(f.events)
    const keys = seen.map((e) => fmtCursor(e.meta.cursor))
    expect(new Set(keys).size).toBe(keys.length)
    let after: Cursor | undefined
    for (const e of f.events) {
      if (e.type === "baseline") {
        after = e.cursor
        continue
      }
      if (after !== undefined) expect(orderProblems([e.meta.cursor], after), f.events.map(describe_).join(", ")).toEqual([])
      after = e.meta.cursor
    }
    let page = await handle.getMessages({ limit: 1000 })
    expect(transcript(handle.messages)).toEqual(transcript(page.messages))
    expect(page.messages.length).toBe(14)
    await f.stop()
    const persisted = JSON.parse(fs.readFileSync(cursorFile, "utf8")) as { cursor: Cursor }
    expect(persisted.cursor).toEqual(handle.state!.emittedCursor)
    expect(fs.statSync(cursorFile).mode & 0o777).toBe(0o600)

    // More turns (and pruned generations) while nobody follows; a second instance resumes
    // from the persisted cursor: its state is rebuilt, the events it missed are inside the
    // baseline's snapshot (skipped), and it goes on from there.
    await drain(handle.prompt("while away"))
    await drain(handle.prompt("still away"))
    const handle2 = driver.session(id)
    const g = collect(handle2.follow({ reconnect: fast, persistPath: cursorFile }))
    await g.waitFor((e) => e.type === "baseline", "the baseline")
    const base = g.events.find((e): e is Client.Baseline => e.type === "baseline")!
    expect(base.skipped).toBe(true)
    await drain(handle.prompt("back again"))
    // Live, or inside a resync: with one generation kept and a checkpoint after every turn, a
    // follower that falls a little behind (a loaded machine) is resynced past the turn's events.
    await g.waitFor(() => handle2.messages.some((m) => m.content === "echo: back again"), "the turn after the resume")
    page = await handle.getMessages({ limit: 1000 })
    expect(transcript(handle2.messages)).toEqual(transcript(page.messages))
    for (const e of sequenced(g.events)) expect(compareCursor(e.meta.cursor, persisted.cursor)).toBeGreaterThan(0)
    await g.stop()
    await driver.close()
  }, 40_000)

  it("a second SessionClient instance started from the persisted cursor yields exactly the events after it", async () => {
    const d = await useDaemon()
    const cursorFile = path.join(path.dirname(d.stateDir), "cursor.json")
    const driver = await Client.connect({ socketPath: d.socketPath })
    const handle = await driver.create({ name: "persist" })
    const id = handle.activeSessionId
    const f = collect(driver.session(id).follow({ reconnect: fast, persistPath: cursorFile }))
    await drain(handle.prompt("first"))
    await f.waitFor(() => isIdleAfter(f.events, "echo: first")(), "the first turn")
    await f.stop()
    const last = sequenced(f.events).at(-1)!.meta.cursor
    expect((JSON.parse(fs.readFileSync(cursorFile, "utf8")) as { cursor: Cursor }).cursor).toEqual(last)

    await drain(handle.prompt("second turn"))
    const second = driver.session(id)
    const g = collect(second.follow({ reconnect: fast, persistPath: cursorFile }))
    await drain(handle.prompt("third turn"))
    await g.waitFor(() => isIdleAfter(g.events, "echo: third turn")(), "the third turn")
    const seen = sequenced(g.events)
    expect(orderProblems(seen.map((e) => e.meta.cursor), last), g.events.map(describe_).join(", ")).toEqual([])
    expect(seen.some(isEnd("echo: second turn"))).toBe(true)
    const base = g.events.find((e): e is Client.Baseline => e.type === "baseline")!
    expect(base.skipped).toBe(false)
    const page = await handle.getMessages({ limit: 1000 })
    expect(transcript(second.messages)).toEqual(transcript(page.messages))
    await g.stop()
    await driver.close()
  }, 30_000)
})
