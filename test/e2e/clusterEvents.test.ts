/**
 * Events through a runner that does not own the session (docs/cluster.md section 4): two real
 * runners over one PostgreSQL store, both with `--http`.
 *
 * 1. A client attached through the owner and one attached through the other runner see the
 *    same events, cursor for cursor, across turns, a checkpoint, a history rewrite (`/compact`:
 *    both get the replacement snapshot, then the same events), the LISTEN connection of the
 *    non-owner cut (pg_terminate_backend) and a kill (the same `session_closed`). A third client
 *    resumes through the non-owner from a cursor of an older generation; an SSE read through
 *    the non-owner's HTTP sees the same cursors.
 * 2. The owner SIGKILLed mid-turn with clients attached through both runners: the one attached
 *    through the survivor keeps going without re-attaching (the session moves to its runner:
 *    its tail reads what the new owner writes), the owner's client resumes through the
 *    survivor with its cursor; both end with the same events, no gap, no duplicate.
 * 3. A third runner joins and takes shards from the one running: clients attached to the old
 *    owner of a moved session keep receiving its turns (its log tail takes them over from their
 *    last cursor), no gap, no duplicate. An attach's `launchEnv` through the non-owner reaches
 *    the owner's next worker. The new runner SIGKILLed: the sessions come back to the runner
 *    that wrote them before (which must read their logs again) and take turns, contiguous.
 *    Then that runner stops at a SIGTERM (its clients still on the tails its hand-over opened).
 *
 * One cluster for the file. Needs `npm run build` first, and PostgreSQL (test/support/postgres.ts).
 */
import * as fs from "node:fs"
import { createRequire } from "node:module"
import * as path from "node:path"
import { afterAll, beforeAll, expect, it } from "vitest"
import { describePg, freshDatabaseUrl } from "../support/postgres.js"
import { attachAndReplay } from "./attach.js"
import {
  cleanUpAfterTests,
  collectTurn,
  collectUntil,
  compareCursor,
  createSession,
  cursorGap,
  cursorOf,
  type Daemon,
  isEvent,
  isIdleStatus,
  type Msg,
  sleep,
  startDaemon
} from "./harness.js"
import { freePort, httpPortOf, request, SseFollower } from "./httpHarness.js"

cleanUpAfterTests()

const LEASE_MS = Number(process.env["AGENTD_TEST_CLUSTER_LEASE_MS"] ?? 6000)

type Client = Awaited<ReturnType<Daemon["connect"]>>

/** A sequenced message as compared between clients: its cursor and body (not `replayed`). */
const key = (m: Msg): string => {
  const { meta, ...body } = m
  return JSON.stringify({ cursor: meta.cursor, emittedAt: meta.emittedAt, body })
}

describePg("serve --cluster: attach and event reads through a runner that does not own the session", () => {
  let a: Daemon
  let b: Daemon
  let url: string
  let httpA: { port: number; token: string }
  let httpB: { port: number; token: string }
  let addressOf: Map<Daemon, string>
  let drop: (() => Promise<void>) | undefined

  const startRunner = async (storeUrl: string, http: boolean): Promise<{ daemon: Daemon; address: string }> => {
    const address = `127.0.0.1:${await freePort()}`
    const daemon = await startDaemon({
      shared: true,
      extraArgs: ["--store", storeUrl, "--cluster", "--runner-address", address, ...(http ? ["--http", "127.0.0.1:0"] : [])],
      env: { AGENTD_CLUSTER_LEASE_MS: String(LEASE_MS), AGENTD_WARM_SPARE: "0" }
    })
    return { daemon, address }
  }

  beforeAll(async () => {
    const store = await freshDatabaseUrl()
    drop = store.drop
    url = store.url
    const ra = await startRunner(store.url, true)
    const rb = await startRunner(store.url, true)
    a = ra.daemon
    b = rb.daemon
    addressOf = new Map([[a, ra.address], [b, rb.address]])
    const httpOf = async (d: Daemon) => ({ port: await httpPortOf(d), token: fs.readFileSync(path.join(d.stateDir, "http-token"), "utf8").trim() })
    httpA = await httpOf(a)
    httpB = await httpOf(b)
  }, 60_000)

  let c: Daemon | undefined

  afterAll(async () => {
    await c?.cleanup()
    await a?.cleanup()
    await b?.cleanup()
    await drop?.()
  }, 30_000)

  const settled = async (client: Client, runners = 2): Promise<void> => {
    const deadline = Date.now() + 60_000
    for (;;) {
      const listed = ((await client.ok({ type: "status" }))["runners"] ?? []) as Array<Msg>
      const total = listed.reduce((n, r) => n + (r["shards"] as number), 0)
      if (listed.length === runners && total === 300 && listed.every((r) => r["shards"] > 0 && r["healthy"] === true)) return
      if (Date.now() > deadline) throw new Error(`runners not settled: ${JSON.stringify(listed)}`)
      await sleep(100)
    }
  }

  /** A new session owned by `owner` (made through it until the hash puts one there). */
  const sessionOwnedBy = async (client: Client, owner: Daemon): Promise<string> => {
    for (let i = 0; i < 40; i++) {
      const { id, data } = await createSession(client)
      if (data["state"]["runner"] === addressOf.get(owner)) return id
    }
    throw new Error("no session landed on the runner wanted")
  }

  /** Cuts the non-owner's LISTEN connection (it reconnects; a notification sent meanwhile is lost). */
  const cutListen = async () => {
    const Pg = createRequire(import.meta.url)("pg") as {
      Client: new(o: { connectionString: string }) => { connect(): Promise<void>; query(q: string): Promise<{ rows: Array<Msg> }>; end(): Promise<void> }
    }
    const admin = new Pg.Client({ connectionString: url })
    await admin.connect()
    try {
      const r = await admin.query("SELECT pg_terminate_backend(pid) AS cut FROM pg_stat_activity WHERE application_name = 'agentd-log-tail'")
      return r.rows.length
    } finally {
      await admin.end()
    }
  }

  it("each runner's /metrics counts the sessions it runs: over the runners' scrapes, every session once", async () => {
    const ca = await a.connect("metrics")
    await settled(ca)
    await sessionOwnedBy(ca, a)
    await sessionOwnedBy(ca, b)
    const sessionsIn = (text: string) =>
      text.split("\n").filter((l) => l.startsWith("agentd_sessions{")).reduce((n, l) => n + Number(l.slice(l.lastIndexOf(" ") + 1)), 0)
    const listed = (await ca.ok({ type: "list" }))["sessions"] as Array<Msg>
    for (const [runner, h] of [[a, httpA], [b, httpB]] as const) {
      const scraped = await request(h, "GET", "/metrics")
      expect(scraped.status).toBe(200)
      const own = listed.filter((s) => s["runner"] === addressOf.get(runner)).length
      expect(own).toBeGreaterThan(0)
      expect(sessionsIn(scraped.text), scraped.text).toBe(own)
    }
  }, 60_000)

  it("the same events through the owner and through the other runner: turns, a checkpoint, /compact, a cut LISTEN, a kill; resume and SSE through the other", async () => {
    const ca = await a.connect("A")
    await settled(ca)
    const id = await sessionOwnedBy(ca, a)
    const owner = await a.connect("owner")
    const other = await b.connect("other")
    const onOwner = await attachAndReplay(owner, { activeSessionId: id })
    const onOther = await attachAndReplay(other, { activeSessionId: id })
    // The response says the same of the session whichever runner answered it.
    expect(onOther.data["lastEventCursor"]).toEqual(onOwner.data["lastEventCursor"])
    expect(onOther.data["state"]).toMatchObject({ activeSessionId: id, busy: false, messageCount: 0 })
    const sse = new SseFollower(() => httpB, `/v1/sessions/${id}/events?offset=-1&live=sse`)
    try {
      const same = () => {
        const x = owner.sequenced(id).map(key)
        const y = other.sequenced(id).map(key)
        expect(y).toEqual(x)
        expect(cursorGap(other.sequenced(id))).toBeUndefined()
      }
      const turn = async (message: string, through: Client) => {
        await through.ok({ type: "prompt", activeSessionId: id, message })
        await collectTurn(owner, id, 20_000)
        await collectTurn(other, id, 20_000)
      }
      await turn("one", other)
      same()
      const afterOne = cursorOf(owner.sequenced(id).at(-1)!)
      await turn("two", ca)
      // A checkpoint: the next turn's events are in the next generation.
      const cp = await other.ok({ type: "checkpoint", activeSessionId: id })
      expect(cp["generation"]).toBe(2)
      await turn("three", other)
      same()
      expect(cursorOf(other.sequenced(id).at(-1)!).generation).toBe(2)

      // The non-owner's LISTEN connection cut: the next turn reaches its client all the same.
      expect(await cutListen()).toBeGreaterThan(0)
      await turn("four", other)
      same()

      // Resume through the non-owner from a cursor of generation 1: complete, the same events.
      const late = await b.connect("late")
      const resumed = await attachAndReplay(late, { activeSessionId: id, resumeCursor: afterOne })
      expect(resumed.data["replay"]["status"]).toBe("complete")
      const expected = owner.sequenced(id).filter((m) => compareCursor(cursorOf(m), afterOne) > 0).map(key)
      expect(late.sequenced(id).map(key)).toEqual(expected)
      expect(late.sequenced(id).every((m) => m["meta"]["replayed"] === true)).toBe(true)

      // A history rewrite: both get the replacement snapshot (the same cursor), then the same events.
      const mark = owner.sequenced(id).length
      expect(other.sequenced(id).length).toBe(mark)
      await turn("/compact", other)
      const replacement = (c: Client) =>
        c.received((m) => m["type"] === "session_snapshot_begin" && m["activeSessionId"] === id && m["purpose"] === "replacement")
      const [ro] = replacement(owner)
      const [rn] = replacement(other)
      expect(ro, "owner: replacement snapshot").toBeDefined()
      expect(rn, "other: replacement snapshot").toBeDefined()
      expect(rn!["cursor"]).toEqual(ro!["cursor"])
      const after = (c: Client) => c.sequenced(id).slice(mark).filter((m) => compareCursor(cursorOf(m), ro!["cursor"]) > 0)
      expect(after(other).map(key)).toEqual(after(owner).map(key))
      expect(cursorGap(after(other), ro!["cursor"])).toBeUndefined()
      await turn("five", other)
      expect(after(other).map(key)).toEqual(after(owner).map(key))
      const messages = await other.ok({ type: "get_messages", activeSessionId: id })
      expect(messages["messages"].at(-1)["content"]).toBe("echo: five")

      // SSE through the non-owner: up to the same last cursor, in order, no duplicate.
      const last = cursorOf(owner.sequenced(id).at(-1)!)
      await sse.waitFor((f) => f.messages.some((m) => m["meta"] !== undefined && compareCursor(cursorOf(m), last) === 0), 20_000, "SSE up to the last event")
      const sseCursors = sse.messages.filter((m) => m["meta"] !== undefined).map(cursorOf)
      for (let i = 1; i < sseCursors.length; i++) expect(compareCursor(sseCursors[i - 1]!, sseCursors[i]!)).toBeLessThan(0)

      // A kill through the non-owner: both clients get the same `session_closed`. Its LISTEN
      // cut first: its tail then reads after the kill moved the log to the archive.
      expect(await cutListen()).toBeGreaterThan(0)
      await other.ok({ type: "kill", activeSessionId: id })
      const closedOwner = await owner.waitFor((m) => m["type"] === "session_closed" && m["activeSessionId"] === id, 20_000)
      const closedOther = await other.waitFor((m) => m["type"] === "session_closed" && m["activeSessionId"] === id, 20_000)
      expect(key(closedOther)).toEqual(key(closedOwner))
      const gone = await other.request({ type: "attach", activeSessionId: id })
      expect(gone["error"]?.["code"]).toBe("session_not_found")
    } finally {
      sse.stop()
    }
  }, 120_000)

  it("the owner SIGKILLed mid-turn, clients on both runners: the survivor's keeps going, the owner's resumes there; same events", async () => {
    const victim = a
    const survivor = b
    const cs = await survivor.connect("survivor")
    await settled(cs)
    const id = await sessionOwnedBy(cs, victim)
    const onVictim = await victim.connect("on-victim")
    const onSurvivor = await survivor.connect("on-survivor")
    await attachAndReplay(onVictim, { activeSessionId: id })
    await attachAndReplay(onSurvivor, { activeSessionId: id })
    await cs.ok({ type: "prompt", activeSessionId: id, message: "before" })
    await collectTurn(onVictim, id, 20_000)
    await collectTurn(onSurvivor, id, 20_000)
    // A turn still running when its runner dies (a tool call that sleeps).
    await cs.ok({ type: "prompt", activeSessionId: id, message: "/sleep 60000" })
    await collectUntil(onVictim, id, isEvent("tool_execution_start"), 20_000)
    await collectUntil(onSurvivor, id, isEvent("tool_execution_start"), 20_000)
    const seen = onVictim.sequenced(id)
    const lastSeen = cursorOf(seen.at(-1)!)
    await victim.sigkill()

    // The survivor's client, not re-attached: the cut turn's end, written by its new owner.
    await collectUntil(onSurvivor, id, isIdleStatus, 60_000)
    expect(onSurvivor.sequenced(id).find(isEvent("turn_interrupted"))?.["event"]).toEqual({ type: "turn_interrupted", reason: "daemon_restarted" })
    expect(cursorGap(onSurvivor.sequenced(id))).toBeUndefined()
    await cs.ok({ type: "prompt", activeSessionId: id, message: "after" })
    await collectTurn(onSurvivor, id, 20_000)

    // The victim's client resumes through the survivor with its cursor.
    const back = await survivor.connect("back")
    const resumed = await attachAndReplay(back, { activeSessionId: id, resumeCursor: lastSeen })
    expect(resumed.data["replay"]["status"]).toBe("complete")
    const all = [...seen, ...back.sequenced(id)]
    expect(cursorGap(all)).toBeUndefined()
    expect(all.map(key)).toEqual(onSurvivor.sequenced(id).map(key))
    expect((await cs.ok({ type: "get_state", activeSessionId: id }))["runner"]).toBe(addressOf.get(survivor))
  }, 120_000)

  it("a runner joins and takes shards: clients attached to the old owner go on without re-attaching (its log tail takes them over)", async () => {
    // After the previous test only B runs: it owns every session made now.
    const cb = await b.connect("before-join")
    await settled(cb, 1)
    const ids: Array<string> = []
    for (let i = 0; i < 8; i++) ids.push((await createSession(cb)).id)
    const watch = await b.connect("watch")
    for (const id of ids) {
      await attachAndReplay(watch, { activeSessionId: id })
      await cb.ok({ type: "prompt", activeSessionId: id, message: `before ${id}` })
      await collectTurn(watch, id, 20_000)
    }
    const rc = await startRunner(url, false)
    c = rc.daemon
    addressOf.set(c, rc.address)
    await settled(cb, 2)
    const moved: Array<string> = []
    for (const id of ids) {
      // The entity of a moved session is built on its new owner by its first message.
      const state = await cb.ok({ type: "get_state", activeSessionId: id })
      if (state["runner"] === rc.address) moved.push(id)
    }
    expect(moved.length, "sessions moved to the new runner").toBeGreaterThan(0)
    const cc = await c.connect("on-C")
    for (const id of ids) {
      await cc.ok({ type: "prompt", activeSessionId: id, message: `after ${id}` })
      const turn = await collectTurn(watch, id, 20_000)
      expect(turn.filter(isEvent("message_end")).map((m) => m["event"]["message"]["content"])).toEqual([`after ${id}`, `echo: after ${id}`])
      expect(cursorGap(watch.sequenced(id)), id).toBeUndefined()
    }
    // An attach's launch environment through a runner that does not own the session reaches
    // the owner's next worker (a bad NODE_OPTIONS: its workers cannot start, the session fails).
    const onB = ids.find((id) => !moved.includes(id))!
    const poison = await cc.request({ type: "attach", activeSessionId: onB, launchEnv: { NODE_OPTIONS: "--no-such-option" } })
    expect(poison["success"], JSON.stringify(poison)).toBe(true)
    const state = await cc.ok({ type: "get_state", activeSessionId: onB })
    expect(state["runner"]).toBe(addressOf.get(b))
    process.kill(state["workerPid"] as number, "SIGKILL")
    const deadline = Date.now() + 60_000
    while ((await cc.ok({ type: "get_state", activeSessionId: onB }))["worker"] !== "failed") {
      if (Date.now() > deadline) throw new Error("the session's workers started with the launch env of an attach through another runner")
      await sleep(200)
    }

    // The new runner SIGKILLed: the moved sessions come back to B, which wrote their logs before
    // C did (what B kept in memory of them is stale: it must read them again; before, its first
    // append reused cursors C had written and failed, storage_unavailable). Their clients on B
    // see the next turns, contiguous.
    await c.sigkill()
    await settled(cb, 1)
    for (const id of moved) {
      const back = Date.now() + 60_000
      for (;;) {
        const state = (await cb.request({ type: "get_state", activeSessionId: id }, 30_000))["data"] ?? {}
        if (state["runner"] === addressOf.get(b) && state["busy"] === false && state["worker"] !== "starting") break
        if (Date.now() > back) throw new Error(`session ${id} did not come back to B: ${JSON.stringify(state)}`)
        await sleep(200)
      }
      await cb.ok({ type: "prompt", activeSessionId: id, message: `back ${id}` })
      const turn = await collectTurn(watch, id, 20_000)
      expect(turn.filter(isEvent("message_end")).map((m) => m["event"]["message"]["content"])).toEqual([`back ${id}`, `echo: back ${id}`])
      expect(cursorGap(watch.sequenced(id)), id).toBeUndefined()
    }

    // B stops at a SIGTERM, its clients still following the moved sessions through the log
    // tails its hand-over opened when C joined. Before, those tails, started in the entity's
    // finalizer, could not be interrupted, and B's stop never ended (docs/cluster.md section 9).
    const t0 = Date.now()
    const stopped = await b.stop("SIGTERM", 30_000)
    expect(stopped.code, b.output).toBe(0)
    process.stderr.write(`[clusterEvents] SIGTERM of a runner with clients on its log tails: exited after ${Date.now() - t0} ms\n`)
  }, 200_000)
})
