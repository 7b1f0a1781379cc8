/**
 * `agentd serve --store postgres://...` with the built daemon: sessions, events and the journal
 * go to PostgreSQL (nothing of them to the state dir), survive a SIGKILL of the daemon with the
 * same cursors, and a second daemon on the same store, whatever its state dir, is refused naming
 * the first.
 *
 * Needs `npm run build` first, and PostgreSQL (test/support/postgres.ts).
 */
import * as fs from "node:fs"
import { spawnSync } from "node:child_process"
import { expect, it, onTestFinished } from "vitest"
import { describePg, freshSchemaUrl } from "../support/postgres.js"
import { attachAndReplay } from "./attach.js"
import {
  cleanUpAfterTests,
  collectTurn,
  createSession,
  cursorGap,
  cursorOf,
  DAEMON_BIN,
  freshStateDir,
  type Msg,
  startDaemon,
  waitIdle
} from "./harness.js"

cleanUpAfterTests()

const schema = async () => {
  const s = await freshSchemaUrl()
  onTestFinished(() => s.drop())
  return s.url
}

describePg("serve --store postgres", () => {
  it("sessions, events and the journal live in PostgreSQL; a SIGKILLed daemon's successor replays them with the same cursors", async () => {
    const url = await schema()
    const d = await startDaemon({ extraArgs: ["--store", url] })
    onTestFinished(() => d.cleanup())
    const c = await d.connect()
    const { id } = await createSession(c, { name: "pg" })
    await waitIdle(c, id)
    const live: Array<Msg> = []
    for (const text of ["one two", "three four five"]) {
      const { replayed } = live.length === 0 ? await attachAndReplay(c, { activeSessionId: id }) : { replayed: [] }
      live.push(...replayed)
      expect((await c.ok({ type: "prompt", activeSessionId: id, message: text }))).toEqual({ accepted: true })
      live.push(...await collectTurn(c, id))
    }
    expect(cursorGap(live)).toBeUndefined()
    const last = cursorOf(live[live.length - 1]!)
    // Nothing of the store is in the state dir: no event log, no session files, no journal.
    const entries = fs.readdirSync(d.stateDir)
    for (const name of ["events", "sessions", "recovery.jsonl", "archive"]) expect(entries).not.toContain(name)

    await d.sigkill()
    const again = await startDaemon({ stateDir: d.stateDir, extraArgs: ["--store", url] })
    onTestFinished(() => again.cleanup())
    const c2 = await again.connect()
    const list = await c2.ok({ type: "list" })
    expect((list["sessions"] as Array<Msg>).map((s) => s["activeSessionId"])).toEqual([id])
    const st = await c2.ok({ type: "get_state", activeSessionId: id })
    expect(st["lastEventCursor"]).toEqual(last)
    // Replay from the start: every event the first daemon sent, same cursors, same content.
    const { replayed } = await attachAndReplay(c2, { activeSessionId: id, fromCursor: { generation: 1, sequence: 0 } })
    const sent = live.filter((m) => m["type"] === "session_event" && m["activeSessionId"] === id)
    const seen = new Map(replayed.map((m) => [JSON.stringify(cursorOf(m)), m]))
    for (const m of sent) {
      const r = seen.get(JSON.stringify(cursorOf(m)))
      expect(r?.["event"], JSON.stringify(cursorOf(m))).toEqual(m["event"])
    }
  })

  it("a second daemon on the same store, with another state dir, exits 1 naming the first", async () => {
    const url = await schema()
    const d = await startDaemon({ extraArgs: ["--store", url] })
    onTestFinished(() => d.cleanup())
    const other = freshStateDir()
    const second = spawnSync(process.execPath, [DAEMON_BIN, "serve", "--state-dir", other, "--store", url], {
      encoding: "utf8",
      timeout: 30_000,
      env: Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith("AGENTD_")))
    })
    expect(second.status).toBe(1)
    expect(second.stderr).toContain(`another daemon (pid ${d.proc.pid}, socket ${d.socketPath}) holds the store`)
    // The first one is untouched.
    const c = await d.connect()
    await createSession(c)
    fs.rmSync(other, { recursive: true, force: true })
  })

  it("an invalid --store is a usage error that starts nothing", () => {
    const dir = freshStateDir()
    const run = spawnSync(process.execPath, [DAEMON_BIN, "serve", "--state-dir", dir, "--store", "mysql://x"], { encoding: "utf8", timeout: 30_000 })
    expect(run.status).toBe(2)
    expect(run.stderr).toContain("invalid store `mysql://x`")
    expect(fs.existsSync(dir)).toBe(false)
  })
})
