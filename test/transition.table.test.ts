/**
 * `step` phase by input, in one place: docs/session-core.md's table and diagram are derived from
 * the function (test/support/stepTable.ts) and must say what it does; the cells a reader asks
 * about are spelled out below. AGENTD_WRITE_DOC=1 rewrites the doc's generated parts.
 */
import { readFileSync, writeFileSync } from "node:fs"
import { describe, expect, it } from "vitest"
import { busyOf, defaultEnv, type Input, type State, step, workerStateOf } from "../src/internal/session/transition.js"
import { policy, renderDiagram, renderTable, samples } from "./support/stepTable.js"

const DOC = new URL("../docs/session-core.md", import.meta.url)
const between = (text: string, name: string) => {
  const begin = `<!-- ${name}:begin -->\n`
  const end = `<!-- ${name}:end -->`
  const a = text.indexOf(begin)
  const b = text.indexOf(end)
  return { a: a + begin.length, b, found: a >= 0 && b > a }
}
const generated: ReadonlyArray<readonly [string, () => string]> = [
  ["step-diagram", () => "```mermaid\n" + renderDiagram() + "\n```\n"],
  ["step-table", () => renderTable()]
]

const sample = (name: string): State => samples.find(([n]) => n === name)![1]
const take = (s: State, input: Input, env = defaultEnv) => step(s, input, env, policy)
const tags = (s: State, input: Input, env = defaultEnv) => take(s, input, env).actions.map((a) => a._tag)

describe("the transition table", () => {
  it("docs/session-core.md says what step does", () => {
    let doc = readFileSync(DOC, "utf8")
    for (const [name, render] of generated) {
      const { a, b, found } = between(doc, name)
      expect(found, `docs/session-core.md has no ${name} markers`).toBe(true)
      if (process.env["AGENTD_WRITE_DOC"] === "1") doc = doc.slice(0, a) + render() + doc.slice(b)
      else expect(doc.slice(a, b), `${name} of docs/session-core.md (AGENTD_WRITE_DOC=1 rewrites it)`).toBe(render())
    }
    if (process.env["AGENTD_WRITE_DOC"] === "1") writeFileSync(DOC, doc)
  })

  it("a prompt while a checkpoint waits for the turn's end is refused busy; the checkpoint runs at the turn's end", () => {
    const s = sample("Running: a checkpoint waits")
    const prompt = take(s, { _tag: "Prompt", req: 5, message: "m" })
    expect(prompt.state).toBe(s)
    expect(prompt.actions).toEqual([{ _tag: "Settle", req: 5, result: { _tag: "Error", error: "SessionBusy" } }])
    const end = take(s, { _tag: "TurnEnded", worker: 1, how: "agent_end" })
    expect(end.state._tag).toBe("Idle")
    expect(end.actions.map((a) => a._tag)).toEqual(["PublishEvents", "Journal", "PublishStatus", "RunCheckpoint"])
  })

  it("a checkpoint due at a turn's end runs before anything else between turns", () => {
    const end = take(sample("Running"), { _tag: "TurnEnded", worker: 1, how: "agent_end" }, { ...defaultEnv, generationFull: true })
    expect(end.actions.at(-1)).toEqual({ _tag: "RunCheckpoint", waiters: [] })
  })

  it("a prompt while a cut turn is owed its end waits for it, and runs after the status that ends it", () => {
    const cut = sample("Starting: cut turn owed its end")
    const waiting = take(cut, { _tag: "Prompt", req: 5, message: "m" })
    expect(waiting.actions).toEqual([])
    expect(busyOf(waiting.state)).toBe(true)
    const reported = take(waiting.state, { _tag: "TurnEnded", worker: 1, how: "worker_crashed" })
    // The end is out; the prompt still waits for the status that ends that turn.
    expect(reported.actions.map((a) => a._tag)).toEqual(["PublishEvents", "Journal"])
    expect(busyOf(reported.state)).toBe(true)
    const ready = take(reported.state, { _tag: "Ready", worker: 1 })
    expect(ready.actions.map((a) => a._tag)).toEqual(["PublishStatus", "StartTurn"])
    expect(ready.actions[0]).toEqual({ _tag: "PublishStatus", busy: false, worker: "ready" })
    expect(ready.state._tag).toBe("Running")
  })

  it("a worker that crashes after reporting the cut turn ends that turn with the recovering status", () => {
    const t = take(sample("Starting: cut turn owed its status"), { _tag: "Exited", worker: 1, asked: false })
    expect(t.actions[0]).toEqual({ _tag: "PublishStatus", busy: false, worker: "recovering" })
    expect(busyOf(t.state)).toBe(false)
  })

  it("an idle session gives its worker up when a spawn waits for a slot, after any input", () => {
    expect(tags(sample("Idle"), { _tag: "Abort", req: 5 }, { ...defaultEnv, slotsWanted: true })).toEqual([
      "Settle",
      "SlotLeaving",
      "CheckpointIfGrown",
      "StopWorker",
      "PublishStatus"
    ])
  })

  it("stale inputs of an older worker or attempt change nothing", () => {
    const loading = sample("Starting: loading")
    expect(take(loading, { _tag: "Ready", worker: 99 }).actions).toEqual([])
    expect(take(loading, { _tag: "Exited", worker: 99, asked: false }).actions).toEqual([])
    expect(take(loading, { _tag: "RestartDue", epoch: loading.epoch - 1 }).actions).toEqual([])
    expect(tags(loading, { _tag: "Acquired", epoch: loading.epoch - 1, worker: 99 })).toEqual(["StopWorker"])
  })

  it("events of the current worker pass through without allocating a transition's array", () => {
    const s = sample("Running")
    const a = take(s, { _tag: "Events", worker: 1 })
    const b = take(s, { _tag: "Events", worker: 1 })
    expect(a.state).toBe(s)
    expect(a.actions).toBe(b.actions)
  })

  it("busy and the worker state are functions of the state", () => {
    expect(samples.map(([name, s]) => `${name}: ${busyOf(s) ? "busy" : "idle"}, ${workerStateOf(s)}`)).toEqual([
      "Starting: acquiring a worker: idle, starting",
      "Starting: a prompt reserved: busy, starting",
      "Starting: loading: idle, starting",
      "Starting: restart backing off: busy, recovering",
      "Starting: cut turn owed its end: busy, recovering",
      "Starting: cut turn owed its status: busy, recovering",
      "Starting: loading, one crash from failing: idle, recovering",
      "Idle: idle, ready",
      "Running: busy, ready",
      "Running: a checkpoint waits: busy, ready",
      "Running: the daemon stops: busy, ready",
      "Passivated: idle, passivated",
      "Failed: idle, failed",
      "Stalled: storage cut the turn: busy, ready",
      "Closed: idle, closed"
    ])
  })
})
