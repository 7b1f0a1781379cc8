/**
 * Damaged sessions against the real daemon (docs/protocol.md section 6): a session whose files
 * do not load is never dropped. It is listed `damaged` with the reason, what can be read of it
 * stays readable, a damaged event log is cut back to its last good record with the rest moved
 * aside (no byte deleted), `retry_worker` loads it again and `kill` archives it.
 *
 * Needs `npm run build` first.
 */
import * as fs from "node:fs"
import * as path from "node:path"
import { describe, expect, it } from "vitest"
import { attachAndReplay } from "./attach.js"
import { cleanUpAfterTests, type Client, collectTurn, createSession, type Daemon, type Msg, useDaemon, waitIdle } from "./harness.js"

cleanUpAfterTests()

const segmentsDir = (stateDir: string, id: string) => path.join(stateDir, "events", id, "events")
const sessionDir = (stateDir: string, id: string) => path.join(stateDir, "sessions", id)

/** A session with `turns` echo turns, attached on `client`; returns its id and messages. */
const sessionWithTurns = async (client: Client, turns: ReadonlyArray<string>, checkpointAfter?: number, name = "hurt") => {
  const { id } = await createSession(client, { name })
  await attachAndReplay(client, { activeSessionId: id })
  for (const [i, text] of turns.entries()) {
    await client.ok({ type: "prompt", activeSessionId: id, message: text })
    await collectTurn(client, id)
    if (checkpointAfter === i) await client.ok({ type: "checkpoint", activeSessionId: id })
  }
  const { messages } = await client.ok({ type: "get_messages", activeSessionId: id, limit: 1000 })
  return { id, messages: messages as Array<Msg> }
}

const restart = async (d: Daemon): Promise<Daemon> => {
  const stopped = await d.stop("SIGTERM")
  expect(stopped.code).toBe(0)
  return useDaemon({ stateDir: d.stateDir })
}

const listed = async (c: Client, id: string): Promise<Msg | undefined> =>
  ((await c.ok({ type: "list" }))["sessions"] as Array<Msg>).find((s) => s["activeSessionId"] === id)

const expectError = async (c: Client, command: Msg, code: string): Promise<Msg> => {
  const r = await c.request(command)
  expect(r["success"], JSON.stringify(r)).toBe(false)
  expect(r["error"]["code"]).toBe(code)
  return r["error"] as Msg
}

describe("damaged sessions", () => {
  it("an event log overwritten in the middle: listed damaged, read up to the damage, the rest moved aside whole; retry goes on", async () => {
    const d = await useDaemon()
    const a = await d.connect("a")
    const { id, messages } = await sessionWithTurns(a, ["one two", "three four", "five six", "seven eight"], 0)
    const dir = segmentsDir(d.stateDir, id)
    const newest = Math.max(...fs.readdirSync(dir).filter((f) => /^\d+\.jsonl$/.test(f)).map((f) => Number.parseInt(f)))
    const d2 = await restart(d)
    // Damage one record in the middle of the current generation (same length: nothing else moves).
    const file = path.join(dir, `${newest}.jsonl`)
    const original = fs.readFileSync(file)
    const lines = original.toString("utf8").split("\n")
    const victim = Math.floor(lines.length / 2)
    const lineStart = Buffer.byteLength(lines.slice(0, victim).map((l) => l + "\n").join(""))
    const damaged = Buffer.from(original)
    damaged.fill("#".charCodeAt(0), lineStart + 5, lineStart + 25)
    await d2.stop("SIGTERM")
    fs.writeFileSync(file, damaged)

    const d3 = await useDaemon({ stateDir: d.stateDir })
    const b = await d3.connect("b")
    const summary = await listed(b, id)
    expect(summary, "the damaged session is listed").toBeDefined()
    expect(summary!["worker"]).toBe("damaged")
    expect(summary!["name"]).toBe("hurt")
    expect(summary!["busy"]).toBe(false)
    expect(String(summary!["damage"]?.["reason"])).toMatch(new RegExp(`${newest}\\.jsonl: line ${victim + 1} .*moved aside`))
    expect((await b.ok({ type: "get_state", activeSessionId: id }))["worker"]).toBe("damaged")
    expect((await b.ok({ type: "status" }))["sessions"]).toBeGreaterThanOrEqual(1)
    expect(d3.stderrChunks.join("")).toContain(`session ${id} is damaged`)

    // Nothing deleted: the kept segment and the file moved aside are the original bytes.
    const aside = fs.readdirSync(dir).filter((f) => f.startsWith(`${newest}.jsonl.damaged-`))
    expect(aside).toHaveLength(1)
    const kept = fs.readFileSync(file)
    expect(Buffer.concat([kept.subarray(0, lineStart), fs.readFileSync(path.join(dir, aside[0]!))]).equals(damaged)).toBe(true)
    expect(fs.statSync(path.join(dir, aside[0]!)).mode & 0o777).toBe(0o600)
    // ... and the notice: the repaired log ends with a status saying so.
    const tail = kept.toString("utf8").trimEnd().split("\n").at(-1)!
    expect(JSON.parse(tail)["event"]["state"]["worker"]).toBe("damaged")

    // What can be read is a prefix of what was there, at least the checkpointed first turn.
    const readable = await b.ok({ type: "get_messages", activeSessionId: id, limit: 1000 })
    const got = readable["messages"] as Array<Msg>
    expect(readable["total"]).toBe(got.length)
    expect(got.length).toBeGreaterThanOrEqual(2)
    expect(got.length).toBeLessThan(messages.length)
    expect(got).toEqual(messages.slice(0, got.length))

    // No turn, no attach while damaged; each says why.
    const refused = await expectError(b, { type: "prompt", activeSessionId: id, message: "hello" }, "session_damaged")
    expect(refused["message"]).toContain("retry_worker")
    await expectError(b, { type: "attach", activeSessionId: id }, "session_damaged")

    // retry_worker loads the repaired log: the session goes on from what was kept.
    const retried = await b.ok({ type: "retry_worker", activeSessionId: id })
    expect(retried["worker"]).not.toBe("damaged")
    expect(retried["damage"]).toBeUndefined()
    await attachAndReplay(b, { activeSessionId: id })
    await b.ok({ type: "prompt", activeSessionId: id, message: "after repair" })
    const turn = await collectTurn(b, id)
    expect(turn.some((m) => m["event"]?.type === "agent_end")).toBe(true)
    await waitIdle(b, id)
    const after = await b.ok({ type: "get_messages", activeSessionId: id, limit: 1000 })
    expect((after["messages"] as Array<Msg>).slice(0, got.length)).toEqual(got)
    expect((after["messages"] as Array<Msg>).at(-1)?.["content"]).toBe("echo: after repair")
  })

  it("unreadable metadata: listed damaged with the reason, transcript readable; retry after a fix loads it; kill archives", async () => {
    const d = await useDaemon()
    const a = await d.connect("a")
    const { id, messages } = await sessionWithTurns(a, ["alpha beta", "gamma"])
    const second = (await createSession(a)).id
    const meta = path.join(sessionDir(d.stateDir, id), "meta.json")
    const good = fs.readFileSync(meta, "utf8")
    await d.stop("SIGTERM")
    fs.writeFileSync(meta, "{\"activeSessionId\": tor")

    const d2 = await useDaemon({ stateDir: d.stateDir })
    const b = await d2.connect("b")
    const summary = await listed(b, id)
    expect(summary?.["worker"]).toBe("damaged")
    expect(String(summary?.["damage"]?.["reason"])).toContain("meta.json")
    expect(await listed(b, second)).toBeDefined()
    const readable = await b.ok({ type: "get_messages", activeSessionId: id, limit: 1000 })
    expect(readable["messages"]).toEqual(messages)

    // Still unreadable: retry says so and leaves it listed.
    await expectError(b, { type: "retry_worker", activeSessionId: id }, "session_damaged")
    expect((await listed(b, id))?.["worker"]).toBe("damaged")
    fs.writeFileSync(meta, good)
    const retried = await b.ok({ type: "retry_worker", activeSessionId: id })
    expect(retried["worker"]).not.toBe("damaged")
    expect(retried["messageCount"]).toBe(messages.length)

    // Damage it again, then kill: the files go to the archive as they are.
    fs.writeFileSync(meta, "not json")
    const d3 = await restart(d2)
    const c = await d3.connect("c")
    expect((await listed(c, id))?.["worker"]).toBe("damaged")
    await c.ok({ type: "kill", activeSessionId: id })
    expect(await listed(c, id)).toBeUndefined()
    await expectError(c, { type: "get_state", activeSessionId: id }, "session_not_found")
    const archived = fs.readdirSync(path.join(d.stateDir, "archive")).filter((n) => n.startsWith(id))
    expect(archived).toHaveLength(1)
    expect(fs.readFileSync(path.join(d.stateDir, "archive", archived[0]!, "meta.json"), "utf8")).toBe("not json")
    expect(fs.existsSync(sessionDir(d.stateDir, id))).toBe(false)
  })

  it("a transcript cut short: listed damaged, never dropped; the other sessions load", async () => {
    const d = await useDaemon()
    const a = await d.connect("a")
    const { id } = await sessionWithTurns(a, ["one", "two three"], 1)
    // Names are unique among live sessions: the healthy one has its own.
    const healthy = await sessionWithTurns(a, ["fine"], undefined, "fine")
    await d.stop("SIGTERM")
    const transcripts = path.join(sessionDir(d.stateDir, id), "transcripts")
    const file = path.join(transcripts, fs.readdirSync(transcripts)[0]!)
    fs.truncateSync(file, Math.max(0, fs.statSync(file).size - 7))

    const d2 = await useDaemon({ stateDir: d.stateDir })
    const b = await d2.connect("b")
    const summary = await listed(b, id)
    expect(summary?.["worker"]).toBe("damaged")
    expect(String(summary?.["damage"]?.["reason"])).toContain("transcript")
    await expectError(b, { type: "prompt", activeSessionId: id, message: "x" }, "session_damaged")
    await b.ok({ type: "prompt", activeSessionId: healthy.id, message: "still here" })
    await attachAndReplay(b, { activeSessionId: healthy.id })
    await waitIdle(b, healthy.id)
  })
})
