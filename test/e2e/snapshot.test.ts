/**
 * Chunked snapshots, fan-out to many clients, and kill, against the real daemon (docs/protocol.md
 * sections 3 and 5).
 *
 * Needs `npm run build` first.
 */
import * as fs from "node:fs"
import * as path from "node:path"
import { describe, expect, it } from "vitest"
import { attachAndReplay, attachProblems, unflag } from "./attach.js"
import {
  e2eOnPostgres,
  allMessages,
  type Client,
  cleanUpAfterTests,
  compactedJournal,
  collectTurn,
  collectUntil,
  createSession,
  type Cursor,
  cursorGap,
  cursorOf,
  describeMsg,
  isAlive,
  isEvent,
  isIdleStatus,
  isSequenced,
  metaProblems,
  type Msg,
  sharedDaemon,
  sleep,
  waitGone
} from "./harness.js"

cleanUpAfterTests()

/** One daemon for the whole file: every test works on sessions of its own. */
const shared = sharedDaemon()

/**
 * A new session, attached on `client`, given a `/bulk N` turn for each size, then checkpointed:
 * its id and its transcript.
 */
const checkpointedSession = async (client: Client, bulkSizes: ReadonlyArray<number>) => {
  const { id } = await createSession(client)
  await attachAndReplay(client, { activeSessionId: id })
  for (const size of bulkSizes) {
    await client.ok({ type: "prompt", activeSessionId: id, message: `/bulk ${size}` })
    await collectTurn(client, id, 20_000)
  }
  await client.ok({ type: "checkpoint", activeSessionId: id }, 20_000)
  return { id, transcript: await allMessages(client, id) }
}

// ---------------------------------------------------------------------------------------------

describe("chunked snapshot", () => {
  it("streams a > 10 MB checkpointed transcript: response → begin → chunks → end → session_attached → replayed, live held", async () => {
    const d = shared()
    const a = await d.connect("a")
    const { id } = await createSession(a)
    await attachAndReplay(a, { activeSessionId: id })
    // Small and mid-sized messages around the 11 MB one, so chunks hold one or several messages.
    const prompts = ["hello world", "/bulk 200000", "/bulk 200000", "/bulk 11000000", "/bulk 300000", "bye"]
    for (const p of prompts) {
      await a.ok({ type: "prompt", activeSessionId: id, message: p })
      await collectTurn(a, id, 40_000)
    }
    const cp = await a.ok({ type: "checkpoint", activeSessionId: id }, 40_000)
    const lastGen1 = cursorOf(a.sequenced(id).filter((m) => cursorOf(m).generation < cp["generation"]).pop()!)
    await a.ok({ type: "prompt", activeSessionId: id, message: "after checkpoint" })
    await collectTurn(a, id)
    const transcript = await allMessages(a, id)
    const baseline = transcript.slice(0, prompts.length * 2)
    expect(baseline.reduce((n, m) => n + m["content"].length, 0)).toBeGreaterThan(10_000_000)
    const genEvents = a.sequenced(id).filter((m) => cursorOf(m).generation === cp["generation"]).map(unflag)
    a.drain()

    const b = await d.connect("b")
    const attachId = b.sendCommand({ type: "attach", activeSessionId: id, capabilities: ["chunked_snapshot", "event_sequence"] })
    // A live turn while the snapshot streams: held and delivered after it.
    await a.ok({ type: "prompt", activeSessionId: id, message: "during the stream" })
    const response = await b.response(attachId, 60_000)
    expect(response["success"], JSON.stringify(response["error"])).toBe(true)
    const data = response["data"] as Msg
    expect(attachProblems(data, { id, clientId: b.hello!["clientId"] })).toEqual([])
    expect(data["replay"]).toMatchObject({ status: "unavailable", reason: "no_cursor" })
    const stream = data["snapshotStream"]
    expect(stream).toBeDefined()
    expect(typeof stream["id"]).toBe("string")
    expect(stream["messageCount"]).toBe(baseline.length)
    expect(stream["targetChunkBytes"]).toBe(524288)
    expect(data["snapshot"]["messages"]).toEqual([])
    expect(data["snapshot"]["messageCount"]).toBe(baseline.length)
    expect(data["snapshot"]["cursor"]).toEqual(lastGen1)
    const target = stream["targetChunkBytes"] as number

    const attached = await b.waitFor((m) => m["type"] === "session_attached", 60_000)
    let sawLiveUser = false
    const rest = await collectUntil(b, id, (m) => {
      if (isEvent("message_end")(m) && m["event"]["message"]["content"] === "during the stream") sawLiveUser = true
      return sawLiveUser && isIdleStatus(m)
    }, 30_000)
    await collectTurn(a, id)

    const iResp = b.all.indexOf(response)
    const iAtt = b.all.indexOf(attached)
    expect(b.all.slice(0, iResp).filter(isSequenced).map(describeMsg), "events before the attach response").toEqual([])
    const between = b.all.slice(iResp + 1, iAtt)
    // Only snapshot frames between the response and session_attached.
    expect(between.filter((m) => !String(m["type"]).startsWith("session_snapshot_")).map(describeMsg)).toEqual([])
    const begin = between[0]!
    expect(begin).toMatchObject({
      type: "session_snapshot_begin",
      activeSessionId: id,
      snapshotId: stream["id"],
      messageCount: baseline.length,
      targetChunkBytes: target,
      purpose: "attach",
      cursor: lastGen1
    })
    const end = between[between.length - 1]!
    const chunks = between.slice(1, -1)
    expect(chunks.every((m) => m["type"] === "session_snapshot_chunk")).toBe(true)
    expect(chunks.map((m) => m["index"])).toEqual(chunks.map((_, i) => i))
    expect(chunks.length).toBeGreaterThan(1)
    const problems: Array<string> = []
    for (const ch of chunks) {
      if (ch["snapshotId"] !== stream["id"] || ch["activeSessionId"] !== id) problems.push(`chunk ${ch["index"]}: wrong ids`)
      const msgs = ch["messages"] as Array<Msg>
      if (msgs.length === 0) problems.push(`chunk ${ch["index"]}: empty`)
      const bytes = Buffer.byteLength(JSON.stringify(msgs))
      const line = b.lineBytes.get(ch)!
      if (msgs.length > 1 && bytes > target) problems.push(`chunk ${ch["index"]}: ${msgs.length} messages serialize to ${bytes} > ${target}`)
      if (msgs.length > 1 || bytes <= target) {
        if (line > target + 1024) problems.push(`chunk ${ch["index"]}: line of ${line} bytes > target + overhead`)
      }
    }
    expect(problems).toEqual([])
    expect(chunks.flatMap((m) => m["messages"])).toEqual(baseline)
    expect(end).toMatchObject({ type: "session_snapshot_end", activeSessionId: id, snapshotId: stream["id"], chunkCount: chunks.length })
    // docs/protocol.md does not say whether the end frame's lastEventCursor is the snapshot's own
    // cursor (what it covers) or the session's last event at attach time; accept either, but it
    // must be one of them and lastEventSequence must match it.
    const endCursor = end["lastEventCursor"] as Cursor | undefined
    expect([JSON.stringify(lastGen1), JSON.stringify(data["lastEventCursor"])]).toContain(JSON.stringify(endCursor))
    expect(end["lastEventSequence"]).toBe(endCursor?.sequence ?? -1)
    // After session_attached: the generation's events replayed, then the held live turn.
    const after = b.sequenced(id)
    expect(b.all.indexOf(after[0]!)).toBeGreaterThan(iAtt)
    const replayed = after.filter((m) => m["meta"]?.replayed === true)
    expect(replayed.map(unflag).slice(0, genEvents.length)).toEqual(genEvents)
    expect(cursorGap(after, lastGen1)).toBeUndefined()
    expect(after.slice(replayed.length).every((m) => !("replayed" in m["meta"]))).toBe(true)
    expect(rest.some(isEvent("agent_end"))).toBe(true)
    const keys = after.map((m) => `${cursorOf(m).generation}:${cursorOf(m).sequence}`)
    expect(new Set(keys).size).toBe(keys.length)

    // A plain attach: its response would carry the > 10 MB transcript twice (`messages` and
    // `snapshot.messages`), past the 16 MiB line limit, so it is streamed as frames all the same.
    const c = await d.connect("c")
    const plain = await c.ok({ type: "attach", activeSessionId: id }, 60_000)
    expect(plain["snapshotStream"]).toBeDefined()
    expect(plain["snapshot"]["messages"]).toEqual([])
    await c.waitFor((m) => m["type"] === "session_attached", 60_000)
    const plainChunks = c.received((m) => m["type"] === "session_snapshot_chunk")
    expect(plainChunks.flatMap((m) => m["messages"])).toEqual(baseline)
    expect(c.received((m) => m["type"] === "session_snapshot_begin").map((m) => m["purpose"])).toEqual(["attach"])
    // Under slim_attach it is there once, within the limit: inline.
    const slim = await d.connect("slim")
    const inline = await slim.ok({ type: "attach", activeSessionId: id, capabilities: ["attach_snapshot", "event_sequence", "slim_attach"] }, 60_000)
    expect(inline["snapshotStream"]).toBeUndefined()
    expect(inline["snapshot"]["messages"]).toEqual(baseline)
  }, 90_000)

  it("a reader that stops reading mid-snapshot gets the whole older snapshot and every later event once a newer checkpoint happened", async () => {
    const d = shared()
    const ctl = await d.connect("ctl")
    const { id, transcript: baseline } = await checkpointedSession(ctl, Array.from({ length: 6 }, () => 1_000_000))
    const slow = await d.connect("slow")
    const attachId = slow.sendCommand({ type: "attach", activeSessionId: id, capabilities: ["chunked_snapshot", "event_sequence"] })
    slow.socket.pause()
    // While it does not read: more turns (> its 8 MiB outbound limit) and a newer snapshot.
    for (let i = 0; i < 4; i++) {
      await ctl.ok({ type: "prompt", activeSessionId: id, message: "/bulk 1500000" })
      await collectTurn(ctl, id, 20_000)
    }
    await ctl.ok({ type: "checkpoint", activeSessionId: id }, 20_000)
    await ctl.ok({ type: "prompt", activeSessionId: id, message: "after the newer snapshot" })
    await collectTurn(ctl, id)
    const last = cursorOf(ctl.sequenced(id).pop()!)
    slow.socket.resume()
    const response = await slow.response(attachId, 30_000)
    expect(response["success"], JSON.stringify(response["error"])).toBe(true)
    const failed = slow.all.find((m) => m["type"] === "session_snapshot_failed")
    expect(failed, "a newer snapshot must not disturb a reader of an older one").toBeUndefined()
    await slow.waitFor((m) => isSequenced(m) && cursorOf(m).generation === last.generation && cursorOf(m).sequence === last.sequence, 60_000, "the last event")
    const chunks = slow.all.filter((m) => m["type"] === "session_snapshot_chunk")
    expect(chunks.flatMap((m) => m["messages"])).toEqual(baseline)
    const seq = slow.sequenced(id)
    const keys = seq.map((m) => `${cursorOf(m).generation}:${cursorOf(m).sequence}`)
    expect(new Set(keys).size, "duplicates").toBe(keys.length)
    expect(cursorGap(seq, response["data"]["snapshot"]["cursor"])).toBeUndefined()
    expect(seq.map(unflag)).toEqual(ctl.sequenced(id).map(unflag).slice(-seq.length))
    const transcript = await allMessages(ctl, id)
    const folded = [...baseline, ...seq.filter(isEvent("message_end")).map((m) => m["event"]["message"])]
    expect(folded.length).toBe(transcript.length)
    expect(folded.map((m) => m["id"])).toEqual(transcript.map((m) => m["id"]))
  }, 60_000)

  // Both read the state dir's files (their modes; the archive).
  it.skipIf(e2eOnPostgres)("state files: dirs 0700 and files 0600, nothing group/world accessible; idle journal compacted", async () => {
    // Runs after the > 10 MB checkpoint and the chunked attaches above. (A generation's snapshot
    // is read from its transcript file, never copied; only snapshots a worker streams, history
    // rewrites, spill to snapshot-cache/ past memoryCacheBytes.)
    const d = shared()
    const problems: Array<string> = []
    let spilled = 0
    const walk = (dir: string): void => {
      for (const e of fs.readdirSync(dir)) {
        const f = path.join(dir, e)
        const st = fs.lstatSync(f)
        const mode = st.mode & 0o777
        const rel = path.relative(d.stateDir, f)
        const inCache = rel.startsWith("snapshot-cache")
        if (st.isDirectory()) {
          if (mode !== 0o700) problems.push(`dir ${rel} is ${mode.toString(8)}`)
          walk(f)
        } else {
          if (inCache && rel.endsWith(".jsonl")) spilled++
          if (inCache && mode !== 0o600) problems.push(`cache file ${rel} is ${mode.toString(8)}`)
          if ((mode & 0o077) !== 0) problems.push(`${rel} is ${mode.toString(8)} (group/world bits)`)
        }
      }
    }
    walk(d.stateDir)
    expect(problems).toEqual([])
    expect(spilled, "a generation's snapshot is not copied to snapshot-cache/").toBe(0)

    // Every session idle: the journal is compacted to one line per session.
    const c = await d.connect()
    // One with a checkpoint, then a turn after it: its line still names the snapshot file.
    const { id: checkpointed } = await createSession(c)
    await c.ok({ type: "attach", activeSessionId: checkpointed, capabilities: ["event_sequence", "slim_attach"] })
    await c.ok({ type: "prompt", activeSessionId: checkpointed, message: "before" })
    await collectTurn(c, checkpointed)
    await c.ok({ type: "checkpoint", activeSessionId: checkpointed })
    await c.ok({ type: "prompt", activeSessionId: checkpointed, message: "after" })
    await collectTurn(c, checkpointed)
    const sessions = ((await c.ok({ type: "list" }))["sessions"] as Array<Msg>)
    expect(sessions.every((x) => x["busy"] === false)).toBe(true)
    const records: Array<Msg> = await compactedJournal(d.stateDir)
    const ids = records.map((r) => r["activeSessionId"] as string)
    expect(new Set(ids).size, `journal lines per session: ${ids.join(", ")}`).toBe(ids.length)
    for (const r of records) {
      expect(r).toMatchObject({ version: 1, busy: false })
      expect(typeof r["sessionId"]).toBe("string")
      expect(typeof r["operation"]).toBe("string")
      expect(typeof r["recordedAt"]).toBe("string")
    }
    for (const x of sessions) expect(ids).toContain(x["activeSessionId"])
    const line = records.find((r) => r["activeSessionId"] === checkpointed)!
    expect(line["operation"]).toBe("turn_end")
    expect(typeof line["sessionFile"], JSON.stringify(line)).toBe("string")
    expect(fs.existsSync(line["sessionFile"])).toBe(true)
  })
})

// ---------------------------------------------------------------------------------------------

describe("fan-out and kill", () => {
  it("50 clients attached to one session each receive every event once, in order", async () => {
    const d = shared()
    const ctl = await d.connect("ctl")
    const { id } = await createSession(ctl)
    await ctl.ok({ type: "prompt", activeSessionId: id, message: "before everyone" })
    for (let i = 0; i < 200; i++) {
      const st = await ctl.ok({ type: "get_state", activeSessionId: id })
      if (st["busy"] === false && st["messageCount"] === 2) break
      await sleep(25)
    }
    const clients = await Promise.all(Array.from({ length: 50 }, (_, i) => d.connect(`c${i}`)))
    const attaches = await Promise.all(clients.map((c) => attachAndReplay(c, { activeSessionId: id })))
    await attachAndReplay(ctl, { activeSessionId: id })
    await ctl.ok({ type: "prompt", activeSessionId: id, message: "one two three four five six seven eight" })
    const ref = (await collectTurn(ctl, id)).map(unflag)
    const results = await Promise.all(clients.map((c) => collectTurn(c, id, 20_000)))
    await sleep(200)
    for (const [i, c] of clients.entries()) {
      const all = c.sequenced(id)
      const base = attaches[i]!.data["lastEventCursor"] as Cursor | undefined
      const head = attaches[i]!.replayed
      expect(cursorGap(all), `client ${i}`).toBeUndefined()
      const keys = all.map((m) => `${cursorOf(m).generation}:${cursorOf(m).sequence}`)
      expect(new Set(keys).size, `client ${i} duplicates`).toBe(keys.length)
      // Live part equals the reference turn exactly.
      const liveAll = all.slice(head.length).map(unflag)
      expect(liveAll, `client ${i}`).toEqual(ref)
      expect(results[i]!.map(unflag)).toEqual(ref)
      if (base !== undefined) expect(cursorGap(ref, base)).toBeUndefined()
    }
  }, 60_000)

  it.skipIf(e2eOnPostgres)("kill: session_closed to attached clients, worker stops, files archived, then session_not_found", async () => {
    const d = shared()
    const a = await d.connect("a")
    const { id } = await createSession(a)
    await attachAndReplay(a, { activeSessionId: id })
    await a.ok({ type: "prompt", activeSessionId: id, message: "soon gone" })
    await collectTurn(a, id)
    const st = await a.ok({ type: "get_state", activeSessionId: id })
    d.recordWorkers(st)
    const pid = st["workerPid"] as number
    expect(isAlive(pid)).toBe(true)
    const archive = path.join(d.stateDir, "archive")
    const archivedBefore = fs.existsSync(archive) ? fs.readdirSync(archive, { recursive: true }).length : 0
    const b = await d.connect("b")
    expect(await b.ok({ type: "kill", activeSessionId: id })).toEqual({})
    const closed = await a.waitFor((m) => m["type"] === "session_closed", 10_000)
    expect(closed["activeSessionId"]).toBe(id)
    expect(closed["reason"]).toBe("killed")
    expect(metaProblems(closed, false)).toEqual([])
    expect(cursorGap(a.sequenced(id))).toBeUndefined()
    expect(await waitGone([pid], 5_000), "worker still alive after kill").toEqual([])
    expect(fs.existsSync(archive), "archive dir").toBe(true)
    const archived = fs.readdirSync(archive, { recursive: true }).map(String)
    expect(archived.length, "the killed session's files moved to archive/").toBeGreaterThan(archivedBefore)
    expect(archived.some((f) => f.includes(id)), `archive/ entries naming ${id}: ${archived.slice(0, 10).join(", ")}`).toBe(true)
    for (const cmd of [{ type: "get_state" }, { type: "prompt", message: "x" }, { type: "attach" }, { type: "get_messages" }, { type: "kill" }]) {
      const r = await b.request({ ...cmd, activeSessionId: id })
      expect(r["error"]?.code, JSON.stringify(r)).toBe("session_not_found")
    }
    const listed = ((await b.ok({ type: "list" }))["sessions"] as Array<Msg>).map((s) => s["activeSessionId"])
    expect(listed).not.toContain(id)
    const status = await b.ok({ type: "status" })
    expect(status["sessions"]).toBe(listed.length)
    expect((status["workers"] as Array<Msg>).filter((w) => w["activeSessionId"] === id)).toEqual([])
  }, 20_000)
})

// ---------------------------------------------------------------------------------------------

describe("races and isolation", () => {
  it("clients attaching (with and without a cursor) while a turn streams see every event once, with no gap", async () => {
    const d = shared()
    const ctl = await d.connect("ctl")
    const { id } = await createSession(ctl, { config: { tokenDelayMs: 3 } })
    await attachAndReplay(ctl, { activeSessionId: id })
    await ctl.ok({ type: "prompt", activeSessionId: id, message: "warm up" })
    await collectTurn(ctl, id)
    const words = Array.from({ length: 300 }, (_, i) => `w${i}`).join(" ")
    await ctl.ok({ type: "prompt", activeSessionId: id, message: words })
    // Attach 12 clients at staggered moments of the turn, half of them resuming from a cursor
    // ctl has already seen.
    const late: Array<{ c: Awaited<ReturnType<typeof d.connect>>; from: Cursor | undefined }> = []
    for (let i = 0; i < 12; i++) {
      await sleep(40)
      const c = await d.connect(`late${i}`)
      const seen = ctl.sequenced(id)
      const from = i % 2 === 0 && seen.length > 0 ? cursorOf(seen[Math.max(0, seen.length - 5)]!) : undefined
      c.sendCommand({ type: "attach", activeSessionId: id, ...(from !== undefined ? { resumeCursor: from } : {}) })
      late.push({ c, from })
    }
    const turn = await collectTurn(ctl, id, 30_000)
    expect(turn.some(isEvent("agent_end"))).toBe(true)
    const full = ctl.sequenced(id).map(unflag)
    const last = cursorOf(full[full.length - 1]!)
    for (const [i, { c, from }] of late.entries()) {
      await c.waitFor((m) => isSequenced(m) && cursorOf(m).generation === last.generation && cursorOf(m).sequence === last.sequence, 20_000, `client ${i} reaching the last event`)
      const got = c.sequenced(id)
      const keys = got.map((m) => `${cursorOf(m).generation}:${cursorOf(m).sequence}`)
      expect(new Set(keys).size, `client ${i}: duplicates`).toBe(keys.length)
      expect(cursorGap(got, from), `client ${i} (from ${JSON.stringify(from)})`).toBeUndefined()
      if (from === undefined) expect(cursorOf(got[0]!)).toEqual({ generation: 1, sequence: 0 })
      // Same events as ctl saw; replayed ones flagged, then live ones unflagged (never a flag after a live event).
      expect(got.map(unflag)).toEqual(full.slice(full.length - got.length))
      const firstLive = got.findIndex((m) => m["meta"].replayed !== true)
      if (firstLive >= 0) expect(got.slice(firstLive).filter((m) => m["meta"].replayed === true).map(describeMsg), `client ${i}`).toEqual([])
    }
  }, 45_000)

  it("one connection attached to two sessions gets each session's events with its own cursors; others get none", async () => {
    const d = shared()
    const both = await d.connect("both")
    const onlyA = await d.connect("onlyA")
    const { id: a } = await createSession(both)
    const { id: b } = await createSession(both)
    await attachAndReplay(both, { activeSessionId: a })
    await attachAndReplay(both, { activeSessionId: b })
    await attachAndReplay(onlyA, { activeSessionId: a })
    await Promise.all([
      both.ok({ type: "prompt", activeSessionId: a, message: "in a one two three" }),
      both.ok({ type: "prompt", activeSessionId: b, message: "in b four five six" })
    ])
    await Promise.all([collectTurn(both, a), collectTurn(both, b), collectTurn(onlyA, a)])
    await sleep(100)
    expect(cursorGap(both.sequenced(a))).toBeUndefined()
    expect(cursorGap(both.sequenced(b))).toBeUndefined()
    expect(onlyA.all.filter((m) => m["activeSessionId"] === b).map(describeMsg)).toEqual([])
    const contents = (sid: string) => both.sequenced(sid).filter(isEvent("message_end")).map((m) => m["event"]["message"]["content"])
    expect(contents(a)).toEqual(["in a one two three", "echo: in a one two three"])
    expect(contents(b)).toEqual(["in b four five six", "echo: in b four five six"])
    expect(onlyA.sequenced(a).map(unflag)).toEqual(both.sequenced(a).map(unflag))
  })

  it("kill during a turn: session_closed, no event after it, the worker stops", async () => {
    const d = shared()
    const c = await d.connect()
    const { id } = await createSession(c)
    await attachAndReplay(c, { activeSessionId: id })
    await c.ok({ type: "prompt", activeSessionId: id, message: "/sleep 3000" })
    await c.waitFor(isEvent("tool_execution_start"))
    const st = await c.ok({ type: "get_state", activeSessionId: id })
    d.recordWorkers(st)
    expect(await c.ok({ type: "kill", activeSessionId: id })).toEqual({})
    const closed = await c.waitFor((m) => m["type"] === "session_closed", 10_000)
    expect(closed["reason"]).toBe("killed")
    expect(await waitGone([st["workerPid"] as number], 5_000)).toEqual([])
    await sleep(3_200) // past the end of the /sleep: nothing may follow session_closed
    const seq = c.sequenced(id)
    expect(seq[seq.length - 1]).toBe(closed)
    expect(cursorGap(seq)).toBeUndefined()
    expect((await c.request({ type: "get_state", activeSessionId: id }))["error"]?.code).toBe("session_not_found")
  }, 20_000)

  // Chunks read from the transcript lend their buffers to later reads once every socket took
  // them: a buffer reused too early would show here as a chunk with another chunk's bytes.
  it("readers of one chunked snapshot at different paces (fast, stalling, quitting) each get every chunk's exact bytes", async () => {
    const d = shared()
    const a = await d.connect("a")
    const { id, transcript } = await checkpointedSession(a, Array.from({ length: 8 }, (_, i) => 300_000 + i * 150_000))
    const readers = await Promise.all(Array.from({ length: 8 }, (_, i) => d.connect(`reader${i}`)))
    const timers: Array<NodeJS.Timeout> = []
    let stopped = false
    try {
      // Readers 3-5 stall their sockets at random; 6-7 quit after a few chunks.
      for (const r of readers.slice(3, 6)) {
        const stall = () => {
          if (stopped) return
          r.socket.pause()
          timers.push(setTimeout(() => {
            r.socket.resume()
            timers.push(setTimeout(stall, Math.random() * 15))
          }, Math.random() * 25))
        }
        stall()
      }
      const attaches = readers.map(async (r, i) => {
        if (i < 6) return attachAndReplay(r, { activeSessionId: id, capabilities: ["chunked_snapshot"] })
        r.sendCommand({ type: "attach", activeSessionId: id, capabilities: ["chunked_snapshot"] })
        for (let seen = 0; seen < 1 + i - 6;) {
          await r.waitFor((m) => m["type"] === "session_snapshot_chunk", 20_000)
          seen++
        }
        r.close()
        return undefined
      })
      const results = await Promise.all(attaches)
      for (const [i, r] of readers.slice(0, 6).entries()) {
        expect(results[i]!.data["snapshotStream"], `reader${i}`).toBeDefined()
        const chunks = r.all.filter((m) => m["type"] === "session_snapshot_chunk")
        expect(chunks.length, `reader${i}`).toBeGreaterThan(3)
        expect(chunks.map((m) => m["index"]), `reader${i}`).toEqual(chunks.map((_, k) => k))
        expect(new Set(chunks.map((m) => m["snapshotId"])).size, `reader${i}`).toBe(1)
        expect(chunks.flatMap((m) => m["messages"]), `reader${i}`).toEqual(transcript)
        expect(r.badLines, `reader${i}`).toEqual([])
        expect(r.all.some((m) => m["type"] === "session_snapshot_failed"), `reader${i}`).toBe(false)
      }
    } finally {
      stopped = true
      for (const t of timers) clearTimeout(t)
      for (const r of readers) r.close()
    }
    expect(await a.ok({ type: "ping" })).toEqual({ pong: true })
  }, 90_000)

  it("a client that disconnects in the middle of a chunked snapshot does not disturb the next reader", async () => {
    const d = shared()
    const a = await d.connect("a")
    const { id, transcript } = await checkpointedSession(a, [1_500_000, 1_500_000, 1_500_000])
    for (let round = 0; round < 3; round++) {
      const quitter = await d.connect(`quitter${round}`)
      quitter.sendCommand({ type: "attach", activeSessionId: id, capabilities: ["chunked_snapshot"] })
      await quitter.waitFor((m) => m["type"] === "session_snapshot_chunk", 20_000)
      quitter.close()
    }
    const reader = await d.connect("reader")
    const r = await attachAndReplay(reader, { activeSessionId: id, capabilities: ["chunked_snapshot"] })
    expect(r.data["snapshotStream"]).toBeDefined()
    const chunks = reader.all.filter((m) => m["type"] === "session_snapshot_chunk")
    expect(chunks.flatMap((m) => m["messages"])).toEqual(transcript)
    expect(reader.all.some((m) => m["type"] === "session_snapshot_failed")).toBe(false)
    expect(await a.ok({ type: "ping" })).toEqual({ pong: true })
  }, 40_000)
})
