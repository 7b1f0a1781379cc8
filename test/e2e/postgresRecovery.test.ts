/**
 * A session created with `--store postgres` survives a worker SIGKILL mid-turn and a daemon
 * SIGKILL mid-turn with contiguous cursors, as with files (test/e2e/recovery.test.ts): every
 * event a client saw before either crash is replayed by the restarted daemon with the same
 * cursor and content, the cut turns end `turn_interrupted`, and the transcript the replacement
 * workers were restored from (read from PostgreSQL by the supervisor) holds every message.
 *
 * One daemon life cycle over a fresh schema, a few seconds. Needs `npm run build` first, and
 * PostgreSQL (test/support/postgres.ts: under CI=true it fails without it, never skips).
 */
import { expect, it, onTestFinished } from "vitest"
import { describePg, freshSchemaUrl } from "../support/postgres.js"
import { attachAndReplay, unflag } from "./attach.js"
import {
  allMessages,
  cleanUpAfterTests,
  collectTurn,
  collectUntil,
  compareCursor,
  createSession,
  cursorGap,
  cursorOf,
  describeMsg,
  isEvent,
  isIdleStatus,
  type Msg,
  sleep,
  useDaemon,
  waitGone
} from "./harness.js"

cleanUpAfterTests()

/** Words the echo engine streams back one delta each (2 ms apart): a turn long enough to cut. */
const longPrompt = (tag: string) => Array.from({ length: 600 }, (_, i) => `${tag}${i}`).join(" ")

/** `got`, completed until the cut turn is closed: its `turn_interrupted`, then an idle status. */
const closeCutTurn = async (client: Parameters<typeof collectUntil>[0], id: string, got: Array<Msg>): Promise<Array<Msg>> => {
  const at = got.findIndex(isEvent("turn_interrupted"))
  if (at >= 0 && got.slice(at + 1).some(isIdleStatus)) return got
  let interrupted = at >= 0
  got.push(...await collectUntil(client, id, (m) => {
    if (isEvent("turn_interrupted")(m)) interrupted = true
    return interrupted && isIdleStatus(m)
  }, 20_000))
  return got
}

describePg("serve --store postgres: crash recovery", () => {
  it("worker SIGKILL mid-turn, then daemon SIGKILL mid-turn: contiguous cursors, nothing seen is lost, transcript whole", async () => {
    const store = await freshSchemaUrl()
    onTestFinished(() => store.drop())
    const d1 = await useDaemon({ extraArgs: ["--store", store.url] })
    const a = await d1.connect("a")
    const { id } = await createSession(a, { config: { tokenDelayMs: 2 } })
    await attachAndReplay(a, { activeSessionId: id })
    await a.ok({ type: "prompt", activeSessionId: id, message: "first turn" })
    await collectTurn(a, id)
    // Generation 2: the replacement worker is restored from a transcript in PostgreSQL plus the
    // events logged after it, not from generation 1's events alone.
    await a.ok({ type: "checkpoint", activeSessionId: id }, 20_000)

    // 1. The worker, SIGKILLed while deltas stream.
    const st = await a.ok({ type: "get_state", activeSessionId: id })
    d1.recordWorkers(st)
    const pid = st["workerPid"] as number
    await a.ok({ type: "prompt", activeSessionId: id, message: longPrompt("w") })
    await a.waitFor((m) => isEvent("message_update")(m) && m["event"]["delta"] === " w100", 20_000)
    process.kill(pid, "SIGKILL")
    const crash = await closeCutTurn(a, id, [])
    expect(crash.map(describeMsg).join(", ")).toContain("recovering")
    expect(a.sequenced(id).find(isEvent("turn_interrupted"))?.["event"]).toEqual({ type: "turn_interrupted", reason: "worker_crashed" })
    expect(await waitGone([pid], 3_000)).toEqual([])
    expect(cursorGap(a.sequenced(id))).toBeUndefined()
    // The replacement worker holds the whole transcript: its next turn sees it and adds to it.
    await a.ok({ type: "prompt", activeSessionId: id, message: "after the worker crash" })
    await collectTurn(a, id, 20_000)
    const messages = await allMessages(a, id)
    expect(messages.map((m) => m["content"])).toEqual(expect.arrayContaining(["first turn", "echo: first turn", "after the worker crash", "echo: after the worker crash"]))
    expect(messages.map((m) => m["content"]).slice(-2)).toEqual(["after the worker crash", "echo: after the worker crash"])

    // 2. The daemon, SIGKILLed while deltas stream.
    await a.ok({ type: "prompt", activeSessionId: id, message: longPrompt("d") })
    await a.waitFor((m) => isEvent("message_update")(m) && m["event"]["delta"] === " d100", 20_000)
    await d1.sigkill()
    await sleep(50)
    const seen = a.sequenced(id).map(unflag)
    expect(cursorGap(seen)).toBeUndefined()
    const lastSeen = cursorOf(seen[seen.length - 1]!)

    const d2 = await useDaemon({ stateDir: d1.stateDir, extraArgs: ["--store", store.url] })
    // Resume from the last event seen before the crash: complete (never cursor_ahead), no gap.
    const b = await d2.connect("b")
    const resumed = await attachAndReplay(b, { activeSessionId: id, resumeCursor: lastSeen })
    expect(resumed.data["replay"]["status"], `resume from ${JSON.stringify(lastSeen)}`).toBe("complete")
    expect(cursorGap(resumed.replayed, lastSeen)).toBeUndefined()
    // A replay from the first event holds exactly what a saw, same cursors, same content.
    const c = await d2.connect("c")
    const replay = await attachAndReplay(c, { activeSessionId: id, resumeCursor: cursorOf(seen[0]!) })
    expect(replay.data["replay"]["status"]).toBe("complete")
    const all = replay.replayed
    const byCursor = new Map(all.map((m) => [JSON.stringify(cursorOf(m)), unflag(m)]))
    const missing = seen.slice(1).filter((m) => JSON.stringify(byCursor.get(JSON.stringify(cursorOf(m)))) !== JSON.stringify(m))
    expect(missing.map(describeMsg), "events a client saw before the crashes, not replayed as they were").toEqual([])
    // The cut turn ends daemon_restarted; cursors run on without a gap.
    const after = await closeCutTurn(c, id, all.filter((m) => compareCursor(cursorOf(m), lastSeen) > 0))
    const interrupted = after.filter(isEvent("turn_interrupted")).map((m) => m["event"])
    expect(interrupted).toEqual([{ type: "turn_interrupted", reason: "daemon_restarted" }])
    expect(after.some(isEvent("agent_end"))).toBe(false)
    expect(cursorGap(after, lastSeen)).toBeUndefined()

    // The restored session works and its transcript kept every message before the crash.
    await c.ok({ type: "prompt", activeSessionId: id, message: "after the daemon crash" })
    await collectTurn(c, id, 20_000)
    expect(cursorGap(c.sequenced(id))).toBeUndefined()
    const final = (await allMessages(c, id)).map((m) => m["content"])
    expect(final.slice(0, messages.length)).toEqual(messages.map((m) => m["content"]))
    expect(final.slice(-2)).toEqual(["after the daemon crash", "echo: after the daemon crash"])
  }, 60_000)
})
