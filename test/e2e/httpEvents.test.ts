/**
 * The HTTP event stream against the real daemon (docs/protocol.md section 10): Durable Streams
 * catch-up, long-poll and SSE reads with offsets made from cursors; a follower resuming with
 * `Last-Event-ID` across a daemon SIGKILL and restart and a worker SIGKILL sees every event
 * exactly once; a pruned offset answers 410 with a link to the snapshot, which then leads back
 * to the events; a history rewrite is a control event naming the replacement snapshot, which a
 * read of any mode from before it starts with.
 */
import * as http from "node:http"
import { describe, expect, it } from "vitest"
import { cleanUpAfterTests, type Cursor, cursorGap, type Msg, sleep } from "./harness.js"
import { cursorsOf, freePort, type HttpDaemon, isEventOf, offsetOf, readAll, request, SseFollower, useHttpDaemon, waitIdle } from "./httpHarness.js"

cleanUpAfterTests()

const START = offsetOf({ generation: 0, sequence: 0 })

describe("HTTP events (e2e)", () => {
  it("catch-up, now, long-poll (204 and 200) and SSE with keep-alives: contiguous cursors, offsets that sort", async () => {
    const h = await useHttpDaemon({ env: { AGENTD_HTTP_LONG_POLL_MS: "1500", AGENTD_HTTP_KEEPALIVE_MS: "300" } })
    const id = (await request(h, "POST", "/v1/sessions")).json.activeSessionId as string
    // Nothing yet (or only the first status): a read from the start is an array all the same.
    await waitIdle(h, id)
    await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "one two" }) })
    await waitIdle(h, id)

    const first = await request(h, "GET", `/v1/sessions/${id}/events?offset=-1`)
    expect(first.status).toBe(200)
    expect(first.headers["content-type"]).toMatch(/application\/json/)
    expect(first.headers["stream-up-to-date"]).toBe("true")
    const all = first.json as Array<Msg>
    expect(all.length).toBeGreaterThan(5)
    expect(cursorsOf(all)[0]).toBe("1:0")
    expect(cursorGap(all)).toBeUndefined()
    const tail = all.at(-1)!["meta"].cursor as Cursor
    expect(first.headers["stream-next-offset"]).toBe(offsetOf(tail))
    // The same read from the all-zero offset (what an empty stream gives back) and without offset.
    expect(cursorsOf((await request(h, "GET", `/v1/sessions/${id}/events?offset=${START}`)).json)).toEqual(cursorsOf(all))
    expect(cursorsOf((await request(h, "GET", `/v1/sessions/${id}/events`)).json)).toEqual(cursorsOf(all))
    // From the middle: exactly the events after it.
    const mid = all[3]!["meta"].cursor as Cursor
    const rest = await request(h, "GET", `/v1/sessions/${id}/events?offset=${offsetOf(mid)}`)
    expect(cursorsOf(rest.json)).toEqual(cursorsOf(all.slice(4)))
    // Offsets sort as cursors do.
    const offsets = all.map((m) => offsetOf(m["meta"].cursor))
    expect([...offsets].sort()).toEqual(offsets)
    expect(START < offsets[0]!).toBe(true)

    // At the tail, and `now`: an empty array, up to date, the tail as the next offset.
    for (const offset of [offsetOf(tail), "now"]) {
      const res = await request(h, "GET", `/v1/sessions/${id}/events?offset=${offset}`)
      expect(res.status).toBe(200)
      expect(res.json).toEqual([])
      expect(res.headers["stream-next-offset"]).toBe(offsetOf(tail))
      expect(res.headers["stream-up-to-date"]).toBe("true")
    }
    // An offset past the tail names no event.
    const ahead = await request(h, "GET", `/v1/sessions/${id}/events?offset=${offsetOf({ generation: 1, sequence: tail.sequence + 5 })}`)
    expect(ahead.status).toBe(400)
    expect(ahead.json.error.code).toBe("invalid_offset")

    // Long-poll at the tail with nothing new: 204 after the wait, with the tail and a cursor.
    const idle = await request(h, "GET", `/v1/sessions/${id}/events?offset=${offsetOf(tail)}&live=long-poll`)
    expect(idle.status).toBe(204)
    expect(idle.headers["stream-next-offset"]).toBe(offsetOf(tail))
    expect(idle.headers["stream-up-to-date"]).toBe("true")
    expect(idle.headers["stream-cursor"]).toMatch(/^\d+$/)
    // Long-poll answered by a new event.
    const waiting = request(h, "GET", `/v1/sessions/${id}/events?offset=now&live=long-poll`)
    await sleep(300)
    await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "three" }) })
    const woke = await waiting
    expect(woke.status).toBe(200)
    expect(woke.json.length).toBeGreaterThan(0)
    expect(cursorGap(woke.json, tail)).toBeUndefined()
    await waitIdle(h, id)

    // SSE from an offset: data events with `id:` = the offset of their last message, control
    // events, and keep-alive comments while idle.
    const raw = await new Promise<string>((resolve, reject) => {
      const req = http.request({
        host: "127.0.0.1",
        port: h.port,
        path: `/v1/sessions/${id}/events?offset=${offsetOf(tail)}&live=sse`,
        headers: { authorization: `Bearer ${h.token}` },
        agent: false
      })
      req.on("error", reject)
      req.on("response", (res) => {
        expect(res.statusCode).toBe(200)
        expect(res.headers["content-type"]).toMatch(/text\/event-stream/)
        let text = ""
        res.setEncoding("utf8")
        res.on("data", (t: string) => (text += t))
        setTimeout(() => {
          req.destroy()
          resolve(text)
        }, 1500)
      })
      req.end()
    })
    expect(raw).toMatch(/^retry: \d+/)
    expect(raw).toContain(": keep-alive\n\n")
    const dataIds = [...raw.matchAll(/event: data\nid: (\S+)\n/g)].map((m) => m[1])
    const after = (await readAll(h, id, offsetOf(tail))).messages
    expect(dataIds.at(-1)).toBe(offsetOf(after.at(-1)!["meta"].cursor))
    expect(raw).toMatch(/event: control\ndata: \{"streamNextOffset":"[0-9_]+","streamCursor":"\d+","upToDate":true\}/)
  })

  it("an SSE follower resuming with Last-Event-ID sees every event exactly once across a daemon SIGKILL + restart and a worker SIGKILL", async () => {
    const port = await freePort()
    let h = await useHttpDaemon({ port })
    const stateDir = h.daemon.stateDir
    const id = (await request(h, "POST", "/v1/sessions", { body: JSON.stringify({ config: { tokenDelayMs: 30 } }) })).json.activeSessionId as string
    await waitIdle(h, id)
    const follower = new SseFollower(() => h, `/v1/sessions/${id}/events?offset=-1&live=sse`)
    try {
      const words = Array.from({ length: 40 }, (_, i) => `w${i}`).join(" ")
      await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: words }) })
      await follower.waitFor((f) => f.messages.filter(isEventOf("message_update")).length >= 5, 15_000, "deltas before the daemon kill")

      // The daemon dies mid-turn; a new one starts on the same state dir and port.
      await h.daemon.sigkill()
      h = await useHttpDaemon({ port, stateDir })
      await follower.waitFor((f) => f.messages.some((m) => isEventOf("turn_interrupted")(m) && m["event"].reason === "daemon_restarted"), 20_000, "turn_interrupted(daemon_restarted)")
      await waitIdle(h, id)
      await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "after restart" }) })
      await follower.waitFor((f) => f.messages.filter(isEventOf("agent_end")).length >= 1, 15_000, "agent_end after the restart")

      // The worker dies mid-turn: the stream stays open, recovering, turn_interrupted, ready.
      await waitIdle(h, id)
      const state = await waitIdle(h, id)
      await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: words }) })
      const before = follower.messages.filter(isEventOf("message_update")).length
      await follower.waitFor((f) => f.messages.filter(isEventOf("message_update")).length >= before + 5, 15_000, "deltas before the worker kill")
      process.kill(state.workerPid as number, "SIGKILL")
      await follower.waitFor((f) => f.messages.some((m) => isEventOf("turn_interrupted")(m) && m["event"].reason === "worker_crashed"), 20_000, "turn_interrupted(worker_crashed)")
      await waitIdle(h, id)
      await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "the end" }) })
      await follower.waitFor((f) => f.messages.filter(isEventOf("agent_end")).length >= 2, 15_000, "agent_end after the worker kill")
      await waitIdle(h, id)

      const { messages: truth } = await readAll(h, id)
      await follower.waitFor((f) => f.messages.length >= truth.length, 10_000, "the follower catching up with the log")
      expect(follower.connections).toBeGreaterThanOrEqual(2)
      expect(cursorGap(follower.messages)).toBeUndefined()
      expect(cursorsOf(follower.messages)).toEqual(cursorsOf(truth))
      expect(follower.messages.map((m) => m["type"])).toEqual(truth.map((m) => m["type"]))
      // Every data event's id is the offset of its last message.
      const last = follower.events.filter((e) => e.event === "data").at(-1)!
      expect(last.id).toBe(offsetOf(truth.at(-1)!["meta"].cursor))
    } finally {
      follower.stop()
    }
  })

  it("a pruned offset answers 410 with a Link to the snapshot, which ends with the offset to follow on from", async () => {
    const h = await useHttpDaemon({ env: { AGENTD_RETAIN_GENERATIONS: "1" } })
    const id = (await request(h, "POST", "/v1/sessions")).json.activeSessionId as string
    await waitIdle(h, id)
    const texts = ["first", "second", "third"]
    for (const text of texts) {
      await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: text }) })
      await waitIdle(h, id)
      expect((await request(h, "POST", `/v1/sessions/${id}/checkpoint`)).status).toBe(200)
    }
    for (const offset of ["-1", offsetOf({ generation: 1, sequence: 2 })]) {
      for (const live of ["", "&live=sse", "&live=long-poll"]) {
        const res = await request(h, "GET", `/v1/sessions/${id}/events?offset=${offset}${live}`)
        expect(res.status, `${offset}${live}: ${res.text}`).toBe(410)
        expect(res.json.error.code).toBe("offset_gone")
        expect(res.headers.link).toBe(`</v1/sessions/${id}/snapshot>; rel="snapshot"`)
      }
    }
    await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "fourth" }) })
    await waitIdle(h, id)

    const snap = await request(h, "GET", `/v1/sessions/${id}/snapshot`)
    expect(snap.status).toBe(200)
    expect(snap.headers["content-type"]).toMatch(/application\/x-ndjson/)
    const lines = snap.text.trimEnd().split("\n").map((l) => JSON.parse(l) as Msg)
    expect(lines[0]!["type"]).toBe("session_snapshot_begin")
    expect(lines.at(-2)!["type"]).toBe("session_snapshot_end")
    const end = lines.at(-1)!
    expect(end["type"]).toBe("snapshot_offset")
    expect(snap.headers["stream-next-offset"]).toBe(end["offset"])
    const snapshotMessages = lines.filter((l) => l["type"] === "session_snapshot_chunk").flatMap((l) => l["messages"] as Array<Msg>)
    // The snapshot, then the events after its offset, give the whole transcript.
    const { messages: events } = await readAll(h, id, end["offset"] as string)
    const fromEvents = events.filter(isEventOf("message_end")).map((m) => m["event"].message.content)
    const transcript = (await request(h, "GET", `/v1/sessions/${id}/messages?limit=1000`)).json.messages.map((m: Msg) => m["content"])
    expect([...snapshotMessages.map((m) => m["content"]), ...fromEvents]).toEqual(transcript)
    expect(transcript).toContain("echo: fourth")
  })

  it("a snapshot read resumes from a chunk (?id&fromChunk) while its snapshot is retained, or reads only its end (?tailBytes)", async () => {
    const h = await useHttpDaemon({ env: { AGENTD_TARGET_CHUNK_BYTES: "256" } })
    const id = (await request(h, "POST", "/v1/sessions")).json.activeSessionId as string
    await waitIdle(h, id)
    for (let i = 0; i < 4; i++) {
      await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: `message ${i} ${"z".repeat(200)}` }) })
      await waitIdle(h, id)
    }
    expect((await request(h, "POST", `/v1/sessions/${id}/checkpoint`)).status).toBe(200)
    const whole = (await request(h, "GET", `/v1/sessions/${id}/snapshot`)).text.trimEnd().split("\n").map((l) => JSON.parse(l) as Msg)
    const begin = whole[0]!
    const chunks = whole.filter((l) => l["type"] === "session_snapshot_chunk")
    expect(chunks.length).toBeGreaterThan(2)
    const rest = await request(h, "GET", `/v1/sessions/${id}/snapshot?id=${encodeURIComponent(begin["snapshotId"])}&fromChunk=2`)
    expect(rest.status).toBe(200)
    const restLines = rest.text.trimEnd().split("\n").map((l) => JSON.parse(l) as Msg)
    const restChunks = restLines.filter((l) => l["type"] === "session_snapshot_chunk")
    expect(restChunks.map((c) => c["index"])).toEqual(chunks.slice(2).map((c) => c["index"]))
    expect(restChunks.flatMap((c) => c["messages"])).toEqual(chunks.slice(2).flatMap((c) => c["messages"]))
    expect(restLines.at(-1)!["type"]).toBe("snapshot_offset")
    const bad = await request(h, "GET", `/v1/sessions/${id}/snapshot?fromChunk=-1`)
    expect(bad.status).toBe(400)
    // Only its end (`tailBytes`): begin, the last chunks making that many bytes (one at least,
    // with their own indices), end and the offset, as the whole read has them.
    const lineOf = (m: Msg) => JSON.stringify(m).length + 1
    for (const tailBytes of [0, lineOf(chunks.at(-1)!) + 1]) {
      const tail = (await request(h, "GET", `/v1/sessions/${id}/snapshot?tailBytes=${tailBytes}`)).text.trimEnd().split("\n").map((l) => JSON.parse(l) as Msg)
      const kept = tailBytes === 0 ? 1 : 2
      expect(tail).toEqual([begin, ...chunks.slice(-kept), ...whole.slice(-2)])
    }
    expect((await request(h, "GET", `/v1/sessions/${id}/snapshot?tailBytes=x`)).status).toBe(400)
  })

  it("a history rewrite is a control event naming the replacement snapshot; a catch-up, long-poll or SSE read from before it starts with it", async () => {
    const h = await useHttpDaemon()
    const id = (await request(h, "POST", "/v1/sessions")).json.activeSessionId as string
    await waitIdle(h, id)
    await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "before" }) })
    await waitIdle(h, id)
    const { next: beforeRewrite } = await readAll(h, id)
    const follower = new SseFollower(() => h, `/v1/sessions/${id}/events?offset=${beforeRewrite}&live=sse`)
    try {
      await follower.waitFor((f) => f.events.length > 0, 10_000, "the first control event")
      await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "/compact" }) })
      await follower.waitFor(
        (f) => f.events.some((e) => e.event === "control" && JSON.parse(e.data).rewrite !== undefined),
        15_000,
        "the rewrite control event"
      )
      const rewrite = JSON.parse(follower.events.find((e) => e.event === "control" && JSON.parse(e.data).rewrite !== undefined)!.data).rewrite
      expect(typeof rewrite.snapshotId).toBe("string")
      expect(rewrite.snapshot).toBe(`/v1/sessions/${id}/snapshot?id=${encodeURIComponent(rewrite.snapshotId)}`)
      expect(rewrite.offset).toBe(offsetOf(rewrite.cursor))
      const tail = (await waitIdle(h, id)).lastEventCursor as Cursor
      await follower.waitFor((f) => f.messages.at(-1)?.["meta"].cursor.sequence === tail.sequence && f.messages.at(-1)?.["meta"].cursor.generation === tail.generation, 10_000, "the tail")
      // What the SSE follower got after the rewrite control: the events that extend the snapshot.
      const afterRewrite = follower.messages.filter((m) => m["meta"].cursor.generation > rewrite.cursor.generation)
      expect(afterRewrite.length).toBeGreaterThan(0)
      // Catch-up and long-poll reads from before the rewrite agree with SSE (not a 410): the
      // rewrite first (the same snapshot, the offset after it), then the events after it.
      for (const live of ["", "&live=long-poll"]) {
        const read = await request(h, "GET", `/v1/sessions/${id}/events?offset=${beforeRewrite}${live}`)
        expect(read.status, `${live}: ${read.text}`).toBe(200)
        const [control, ...rest] = read.json as Array<Msg>
        expect(control).toEqual({ type: "control", rewrite })
        expect(cursorsOf(rest)).toEqual(cursorsOf(afterRewrite))
        expect(read.headers["stream-next-offset"]).toBe(offsetOf(tail))
        expect(read.headers["stream-up-to-date"]).toBe("true")
        // From there on the stream is the usual one.
        const after = await request(h, "GET", `/v1/sessions/${id}/events?offset=${read.headers["stream-next-offset"]}`)
        expect(after.json).toEqual([])
      }
      // The rewrite's own offset is also one of the history before it: a read from it starts
      // with the same rewrite (a reader holding that snapshot goes on with the events after it).
      const fromSnapshot = await request(h, "GET", `/v1/sessions/${id}/events?offset=${rewrite.offset}`)
      expect(fromSnapshot.json[0]).toEqual({ type: "control", rewrite })
      expect(cursorsOf(fromSnapshot.json.slice(1))).toEqual(cursorsOf(afterRewrite))
      // A new SSE read from before the rewrite starts with the same control event.
      const late = new SseFollower(() => h, `/v1/sessions/${id}/events?offset=${beforeRewrite}&live=sse`)
      try {
        await late.waitFor((f) => f.messages.length >= afterRewrite.length, 10_000, "the events after the rewrite")
        expect(JSON.parse(late.events.find((e) => e.event === "control")!.data).rewrite).toEqual(rewrite)
        expect(cursorsOf(late.messages)).toEqual(cursorsOf(afterRewrite))
      } finally {
        late.stop()
      }
      // The named snapshot is readable, and it holds the rewritten history.
      const snap = await request(h, "GET", rewrite.snapshot)
      expect(snap.status).toBe(200)
      const chunks = snap.text.trimEnd().split("\n").map((l) => JSON.parse(l) as Msg).filter((l) => l["type"] === "session_snapshot_chunk")
      expect(chunks.flatMap((c) => c["messages"]).map((m: Msg) => m["content"])).toEqual(["compacted 3 messages"])
      expect(cursorGap(follower.messages)).toBeUndefined()
    } finally {
      follower.stop()
    }
  })
})
