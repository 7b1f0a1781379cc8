/**
 * Events, cursors, attach and replay against the real daemon (docs/protocol.md sections 4, 5, 7):
 * the echo engine's turns, cursor continuity, every replay status, slim and chunked attach,
 * fan-out to many clients, and kill.
 *
 * Needs `npm run build` first.
 */
import { describe, expect, it } from "vitest"
import { attachAndReplay, attachProblems, unflag } from "./attach.js"
import {
  agentMessageProblems,
  allMessages,
  cleanUpAfterTests,
  type Client,
  collectTurn,
  createSession,
  type Cursor,
  cursorGap,
  cursorOf,
  describeMsg,
  isEvent,
  isIdleStatus,
  isSequenced,
  metaProblems,
  type Msg,
  nextId,
  sharedDaemon,
  sleep,
  summaryProblems,
  waitIdle
} from "./harness.js"

cleanUpAfterTests()

/** One daemon for the whole file: every test works on sessions of its own. */
const shared = sharedDaemon()


describe("echo engine turns as seen by an attached client", () => {
  it("a plain-text turn: event order, deltas, cursors +1 without gap, agent_end then busy:false", async () => {
    const d = shared()
    const c = await d.connect()
    const { id } = await createSession(c)
    // create answers while the worker starts; once get_state says ready, its `ready` status is
    // logged and belongs to the attach baseline.
    await waitIdle(c, id)
    const { data, replayed } = await attachAndReplay(c, { activeSessionId: id })
    const start = c.all.length
    const pr = await c.request({ type: "prompt", activeSessionId: id, message: "hello   big\tworld" })
    expect(pr["data"]).toEqual({ accepted: true })
    const turn = await collectTurn(c, id)

    // Cursor continuity from the attach baseline through the live turn.
    expect(cursorGap([...replayed, ...turn])).toBeUndefined()
    if (replayed.length === 0) {
      if (data["lastEventCursor"] === undefined) expect(cursorOf(turn[0]!)).toEqual({ generation: 1, sequence: 0 })
      else expect(cursorGap(turn, data["lastEventCursor"])).toBeUndefined()
    } else expect(cursorOf(replayed[0]!)).toEqual({ generation: 1, sequence: 0 })
    // Strictly +1 within the generation (no checkpoint happened).
    for (let i = 1; i < turn.length; i++) {
      expect(cursorOf(turn[i]!).generation).toBe(cursorOf(turn[0]!).generation)
      expect(cursorOf(turn[i]!).sequence).toBe(cursorOf(turn[i - 1]!).sequence + 1)
    }
    for (const m of turn) expect(metaProblems(m, false)).toEqual([])
    for (const m of replayed) expect(metaProblems(m, true)).toEqual([])

    const events = turn.filter((m) => m["type"] === "session_event").map((m) => m["event"] as Msg)
    expect(events.map((e) => e["type"])).toEqual([
      "agent_start",
      "turn_start",
      "message_start",
      "message_end",
      "message_start",
      "message_update",
      "message_update",
      "message_update",
      "message_update",
      "message_end",
      "turn_end",
      "agent_end"
    ])
    const user = events[3]!["message"]
    expect(user).toMatchObject({ role: "user", content: "hello   big\tworld" })
    expect(agentMessageProblems(user)).toEqual([])
    const assistantStart = events[4]!["message"]
    expect(assistantStart["role"]).toBe("assistant")
    const deltas = events.filter((e) => e["type"] === "message_update")
    expect(deltas.map((e) => e["delta"])).toEqual(["echo:", " hello", " big", " world"])
    expect(deltas.every((e) => e["messageId"] === assistantStart["id"])).toBe(true)
    const assistant = events[9]!["message"]
    expect(assistant).toMatchObject({ id: assistantStart["id"], role: "assistant", content: "echo: hello big world" })
    expect(agentMessageProblems(assistant)).toEqual([])

    // agent_end, then exactly one busy:false status, and it is the last message of the turn.
    const endIdx = turn.findIndex(isEvent("agent_end"))
    const afterEnd = turn.slice(endIdx + 1)
    expect(afterEnd.map(describeMsg)).toEqual([describeMsg(turn[turn.length - 1]!)])
    expect(isIdleStatus(afterEnd[0]!)).toBe(true)
    expect(summaryProblems(afterEnd[0]!["state"], "session_status.state")).toEqual([])
    expect(afterEnd[0]!["state"]["messageCount"]).toBe(2)
    // Some busy:true status precedes the turn's end.
    expect(turn.slice(0, endIdx).some((m) => m["type"] === "session_status" && m["state"]?.busy === true)).toBe(true)
    // Nothing else arrived for this session outside the turn.
    expect(c.all.slice(start).filter((m) => isSequenced(m)).length).toBe(turn.length)

    // get_state's lastEventCursor is the last event.
    const st = await c.ok({ type: "get_state", activeSessionId: id })
    expect(st["lastEventCursor"]).toEqual(cursorOf(turn[turn.length - 1]!))
  })

  it("an attach right after create says the worker is ready only with its ready status in the baseline", async () => {
    const d = shared()
    const a = await d.connect("creator")
    // Attaches, one after another, from the create until one sees the worker ready: some land
    // while the worker turns ready (the warm spare makes that moments after the create).
    for (let i = 0; i < 4; i++) {
      const { activeSessionId: id } = await a.ok({ type: "create" })
      for (let attempt = 0;; attempt++) {
        expect(attempt, "the worker became ready").toBeLessThan(500)
        const b = await d.connect(`early-${i}-${attempt}`)
        const r = await attachAndReplay(b, { activeSessionId: id })
        b.close()
        const worker = r.data["state"]["worker"]
        expect(r.attached["state"]["worker"]).toBe(worker)
        const readyInBaseline = r.replayed.some((m) => m["type"] === "session_status" && m["state"]["worker"] === "ready")
        expect(readyInBaseline, `attach ${i}/${attempt} said ${worker} at ${r.data["lastEventSequence"]}`).toBe(worker === "ready")
        if (worker === "ready") break
      }
    }
    a.close()
  })

  it("/sleep and /bulk turns have the shapes of section 7", async () => {
    const d = shared()
    const c = await d.connect()
    const { id } = await createSession(c)
    await attachAndReplay(c, { activeSessionId: id })
    await c.ok({ type: "prompt", activeSessionId: id, message: "/sleep 300" })
    const t0 = Date.now()
    const turn = await collectTurn(c, id)
    const ev = turn.filter((m) => m["type"] === "session_event").map((m) => m["event"] as Msg)
    const start = ev.find((e) => e["type"] === "tool_execution_start")!
    const end = ev.find((e) => e["type"] === "tool_execution_end")!
    expect(start).toMatchObject({ name: "sleep" })
    expect(typeof start["toolCallId"]).toBe("string")
    expect(end).toMatchObject({ toolCallId: start["toolCallId"], isError: false })
    expect(ev.indexOf(end) - ev.indexOf(start)).toBe(1)
    expect(Date.now() - t0).toBeGreaterThanOrEqual(250)
    const ends = ev.filter((e) => e["type"] === "message_end").map((e) => e["message"] as Msg)
    expect(ends.map((m) => [m["role"], m["content"]])).toEqual([
      ["user", "/sleep 300"],
      ["tool", "slept 300 ms"],
      ["assistant", "done"]
    ])
    expect(ends[1]).toMatchObject({ toolCallId: start["toolCallId"], toolName: "sleep" })
    expect(ev[ev.length - 1]!["type"]).toBe("agent_end")
    expect(cursorGap(turn)).toBeUndefined()

    const N = 150_000
    await c.ok({ type: "prompt", activeSessionId: id, message: `/bulk ${N}` })
    const bulk = await collectTurn(c, id)
    const bev = bulk.filter((m) => m["type"] === "session_event").map((m) => m["event"] as Msg)
    const deltas = bev.filter((e) => e["type"] === "message_update").map((e) => e["delta"] as string)
    expect(deltas.length).toBeGreaterThanOrEqual(3)
    expect(deltas.every((x) => Buffer.byteLength(x) <= 65536)).toBe(true)
    const content = bev.filter((e) => e["type"] === "message_end").map((e) => e["message"])[1]["content"] as string
    expect(content.length).toBe(N)
    expect(Buffer.byteLength(content)).toBe(N)
    expect(/^[\x20-\x7e]*$/.test(content)).toBe(true)
    expect(deltas.join("")).toBe(content)
    expect(cursorGap(c.sequenced(id))).toBeUndefined()
  }, 20_000)

  it("config.tokenDelayMs is waited between two deltas", async () => {
    const d = shared()
    const c = await d.connect()
    const { id } = await createSession(c, { config: { tokenDelayMs: 150 } })
    await attachAndReplay(c, { activeSessionId: id })
    const t0 = Date.now()
    await c.ok({ type: "prompt", activeSessionId: id, message: "a b c d" })
    const turn = await collectTurn(c, id)
    const elapsed = Date.now() - t0
    const updates = turn.filter(isEvent("message_update"))
    expect(updates.map((m) => m["event"]["delta"])).toEqual(["echo:", " a", " b", " c", " d"])
    // 4 waits of 150 ms between the 5 deltas. (Not measured between emittedAt stamps: the
    // supervisor may log a burst of frames in one go, which compresses their stamps.)
    expect(elapsed).toBeGreaterThanOrEqual(4 * 150)
  })

  it("checkpoint during a turn answers at the turn's end, keeps per-connection response order, and starts the next generation after it", async () => {
    const d = shared()
    const c = await d.connect()
    const { id } = await createSession(c)
    await attachAndReplay(c, { activeSessionId: id })
    await c.ok({ type: "prompt", activeSessionId: id, message: "/sleep 1000" })
    await c.waitFor(isEvent("tool_execution_start"))
    const cpId = c.sendCommand({ type: "checkpoint", activeSessionId: id })
    const pingId = c.sendCommand({ type: "ping" })
    const turn = await collectTurn(c, id)
    const cp = await c.response(cpId, 15_000)
    const ping = await c.response(pingId)
    expect(cp["success"], JSON.stringify(cp)).toBe(true)
    expect(cp["data"]["generation"]).toBe(2)
    // The snapshot is durable only at the turn's end, so the response comes after agent_end...
    expect(c.all.indexOf(cp)).toBeGreaterThan(c.all.indexOf(turn.find(isEvent("agent_end"))!))
    // ...and responses keep the order of their commands on a connection.
    expect(c.all.indexOf(ping), "ping answered before the earlier checkpoint").toBeGreaterThan(c.all.indexOf(cp))
    // Never in the middle of a turn: the whole turn is in generation 1.
    expect(turn.every((m) => cursorOf(m).generation === 1), turn.map(describeMsg).join(", ")).toBe(true)
    await c.ok({ type: "prompt", activeSessionId: id, message: "next" })
    const next = await collectTurn(c, id)
    expect(cursorOf(next[0]!).generation).toBe(2)
    expect(cursorGap(c.sequenced(id))).toBeUndefined()
    // The generation-2 snapshot holds the /sleep turn's three messages.
    const b = await d.connect("b")
    const r = await attachAndReplay(b, { activeSessionId: id })
    expect(r.data["snapshot"]["messages"].map((m: Msg) => m["role"])).toEqual(["user", "tool", "assistant"])
    expect(r.replayed.map(unflag)).toEqual(c.sequenced(id).filter((m) => cursorOf(m).generation === 2).map(unflag))
  }, 20_000)

  it("a command waiting for its answer does not hold back the next: an abort behind a pending checkpoint aborts the turn; answers stay in order", async () => {
    const d = shared()
    const c = await d.connect()
    const { id } = await createSession(c)
    await attachAndReplay(c, { activeSessionId: id })
    const started = Date.now()
    const promptId = c.sendCommand({ type: "prompt", activeSessionId: id, message: "/sleep 20000" })
    await c.waitFor(isEvent("tool_execution_start"))
    // One write: the checkpoint waits for the turn's end; the state and the abort do not wait for it.
    const cpId = c.sendCommand({ type: "checkpoint", activeSessionId: id })
    const stateId = c.sendCommand({ type: "get_state", activeSessionId: id })
    const abortId = c.sendCommand({ type: "abort", activeSessionId: id })
    const turn = await collectTurn(c, id)
    expect(Date.now() - started, "the turn did not run its 20 s").toBeLessThan(15_000)
    expect(turn.find(isEvent("turn_interrupted"))?.["event"]["reason"]).toBe("aborted")
    const [prompt, cp, state, abort] = [await c.response(promptId), await c.response(cpId, 15_000), await c.response(stateId), await c.response(abortId)]
    expect(abort["data"]).toEqual({ aborted: true })
    // Taken in order: the state was read during the turn, after the checkpoint was asked for.
    expect(state["data"]["busy"]).toBe(true)
    expect(cp["data"]["generation"]).toBe(2)
    const order = [prompt, cp, state, abort].map((m) => c.all.indexOf(m))
    expect(order, "answers in the order of their commands").toEqual([...order].sort((a, b) => a - b))
    expect(turn.every((m) => cursorOf(m).generation === 1)).toBe(true)
  }, 30_000)

  it("back-to-back turns: a prompt sent on the busy:false status is accepted at once", async () => {
    const d = shared()
    const c = await d.connect()
    const { id } = await createSession(c)
    await attachAndReplay(c, { activeSessionId: id })
    for (let i = 0; i < 8; i++) {
      const r = await c.request({ type: "prompt", activeSessionId: id, message: `quick ${i}` })
      expect(r["success"], `turn ${i}: ${JSON.stringify(r)}`).toBe(true)
      await collectTurn(c, id)
    }
    expect(cursorGap(c.sequenced(id))).toBeUndefined()
  })

  it("a prompt sent the moment agent_end arrives is accepted (it waits for the turn's idle status)", async () => {
    const d = shared()
    const c = await d.connect()
    const { id } = await createSession(c)
    await attachAndReplay(c, { activeSessionId: id })
    await c.ok({ type: "prompt", activeSessionId: id, message: "turn 0" })
    for (let i = 1; i <= 8; i++) {
      await c.waitFor((m) => m["activeSessionId"] === id && isEvent("agent_end")(m), 15_000, `agent_end of turn ${i - 1}`)
      const r = await c.request({ type: "prompt", activeSessionId: id, message: `turn ${i}` })
      expect(r["success"], `turn ${i}: ${JSON.stringify(r)}`).toBe(true)
    }
    await collectTurn(c, id)
    await waitIdle(c, id)
    const all = c.sequenced(id)
    expect(cursorGap(all)).toBeUndefined()
    // Every agent_end is followed by its own busy:false status before the next busy:true.
    const marks = all.filter((m) => m["type"] === "session_status" || isEvent("agent_end")(m))
    for (const [i, m] of marks.entries()) if (isEvent("agent_end")(m)) expect(marks[i + 1]?.["state"]?.busy).toBe(false)
    expect(all.filter(isEvent("agent_end"))).toHaveLength(9)
  })

  it("a prompt racing a turn's end starts the next turn only after that turn's busy:false status", async () => {
    const d = shared()
    const watcher = await d.connect("watcher")
    const prompter = await d.connect("prompter")
    const { id } = await createSession(watcher)
    await attachAndReplay(watcher, { activeSessionId: id })
    // Prompts back to back, each sent the moment the previous answer arrives: many land while
    // a turn is ending (logged agent_end, idle status not yet out).
    let accepted = 0
    let busy = 0
    while (accepted < 12) {
      const r = await prompter.request({ type: "prompt", activeSessionId: id, message: `race ${accepted}` })
      if (r["success"] === true) accepted++
      else {
        expect(r["error"]?.code, JSON.stringify(r)).toBe("session_busy")
        busy++
      }
    }
    await waitIdle(prompter, id)
    const settled = () => {
      const all = watcher.sequenced(id)
      const ends = all.filter(isEvent("agent_end"))
      return ends.length === accepted && isIdleStatus(all[all.length - 1]!)
    }
    for (let i = 0; i < 300 && !settled(); i++) await sleep(20)
    expect(settled(), "the watcher saw every turn end, then an idle status").toBe(true)
    const events = watcher.sequenced(id)
    expect(cursorGap(events)).toBeUndefined()
    // Each turn's end is followed by its own busy:false status before the next turn's busy:true.
    const statuses = events.filter((m) => m["type"] === "session_status" || isEvent("agent_end")(m))
    for (const [i, m] of statuses.entries()) {
      if (!isEvent("agent_end")(m)) continue
      const next = statuses[i + 1]
      expect(next?.["state"]?.busy, `after the agent_end at ${JSON.stringify(cursorOf(m))} (${busy} prompts refused)`).toBe(false)
    }
  })

  it("only one turn at a time: of simultaneous prompts exactly one is accepted, the others get session_busy (also right after create)", async () => {
    const d = shared()
    const ctl = await d.connect("ctl")
    // Right after create, while the worker may still be starting: the first prompt reserves the session.
    const created = await ctl.ok({ type: "create" })
    const id0 = created["activeSessionId"] as string
    const p1 = nextId("p")
    const p2 = nextId("p")
    await ctl.sendRaw(
      `${JSON.stringify({ type: "prompt", id: p1, activeSessionId: id0, message: "first" })}\n${JSON.stringify({ type: "prompt", id: p2, activeSessionId: id0, message: "second" })}\n`
    )
    expect((await ctl.response(p1))["success"]).toBe(true)
    const r2 = await ctl.response(p2)
    expect(r2["error"]?.code, JSON.stringify(r2)).toBe("session_busy")
    // Eight clients prompt one idle session at the same moment.
    const { id } = await createSession(ctl)
    await ctl.ok({ type: "prompt", activeSessionId: id, message: "warm" })
    await waitIdle(ctl, id)
    const clients = await Promise.all(Array.from({ length: 8 }, (_, i) => d.connect(`p${i}`)))
    // A turn that lasts, so that "at the same moment" holds on a loaded machine too.
    const answers = await Promise.all(clients.map((c) => c.request({ type: "prompt", activeSessionId: id, message: "/sleep 400" })))
    const accepted = answers.filter((r) => r["success"] === true)
    expect(accepted.length, answers.map((r) => JSON.stringify(r["data"] ?? r["error"]?.code)).join(", ")).toBe(1)
    expect(answers.filter((r) => r["error"]?.code === "session_busy").length).toBe(7)
    await waitIdle(ctl, id)
    const users = ((await ctl.ok({ type: "get_messages", activeSessionId: id }))["messages"] as Array<Msg>).filter((m) => m["role"] === "user")
    expect(users.filter((m) => m["content"] === "/sleep 400").length).toBe(1)
  })

  /** Runs `rounds` prompt+abort pairs (one write each) and returns the abort answers and the log. */
  const promptAbortRounds = async (rounds: number): Promise<{ aborted: Array<boolean>; log: Array<Msg>; id: string; c: Client }> => {
    const d = shared()
    const c = await d.connect()
    const { id } = await createSession(c)
    await attachAndReplay(c, { activeSessionId: id })
    const start = c.all.length
    const messages = ["hi there", "/sleep 0", "/bulk 100000", "/sleep 30"]
    const aborted: Array<boolean> = []
    for (let i = 0; i < rounds; i++) {
      const pid = nextId("p")
      const aid = nextId("a")
      const prompt = JSON.stringify({ type: "prompt", id: pid, activeSessionId: id, message: messages[i % messages.length] })
      const abort = JSON.stringify({ type: "abort", id: aid, activeSessionId: id })
      await c.sendRaw(`${prompt}\n${abort}\n`)
      const p = await c.response(pid)
      expect(p["success"], `round ${i}: ${JSON.stringify(p)}`).toBe(true)
      const ab = await c.response(aid)
      aborted.push(ab["data"]?.aborted === true)
      // Wait for the daemon to call the session idle again before the next round.
      for (let k = 0; k < 400; k++) {
        const st = await c.ok({ type: "get_state", activeSessionId: id })
        if (st["busy"] === false) break
        await sleep(10)
      }
    }
    await sleep(300)
    return { aborted, log: c.all.slice(start).filter((m) => isSequenced(m) && m["activeSessionId"] === id), id, c }
  }

  /** Splits a session's log into turns: each ends at agent_end / turn_interrupted and its busy:false status. */
  const turnGrammarProblems = (log: ReadonlyArray<Msg>): { problems: Array<string>; terminals: Array<Msg> } => {
    const problems: Array<string> = []
    const terminals: Array<Msg> = []
    let inTurn = false // between agent_start and its terminal event
    let awaitingIdle: Msg | undefined // a terminal event whose busy:false has not come yet
    for (const m of log) {
      const where = describeMsg(m)
      if (m["type"] === "session_event") {
        const t = m["event"]["type"]
        if (awaitingIdle !== undefined) {
          problems.push(`no busy:false status between ${describeMsg(awaitingIdle)} and ${where}`)
          awaitingIdle = undefined
        }
        if (t === "agent_start") {
          if (inTurn) problems.push(`${where}: a second agent_start before the turn ended`)
          inTurn = true
        } else if (t === "agent_end" || t === "turn_interrupted") {
          if (t === "agent_end" && !inTurn) problems.push(`${where}: agent_end without agent_start (after an interruption?)`)
          inTurn = false
          terminals.push(m)
          awaitingIdle = m
        } else if (!inTurn) problems.push(`${where} outside a turn`)
      } else if (m["type"] === "session_status" && m["state"]?.busy === false) {
        if (inTurn) problems.push(`${where}: busy:false while a turn runs`)
        awaitingIdle = undefined
      }
    }
    if (awaitingIdle !== undefined) problems.push(`no busy:false after ${describeMsg(awaitingIdle)}`)
    return { problems, terminals }
  }

  // A regression guard: an abort landing near a turn boundary used to be forwarded to a worker
  // that was done, answer `aborted: true`, and surface as a stray turn_interrupted.
  it("prompt+abort races keep the turn grammar of section 4: one end per turn, then busy:false, no agent_end after turn_interrupted", async () => {
    const rounds = 40
    const { log, id, c } = await promptAbortRounds(rounds)
    const { problems, terminals } = turnGrammarProblems(log)
    expect(problems.slice(0, 6)).toEqual([])
    expect(terminals.length, "one ending per accepted prompt").toBe(rounds)
    expect(cursorGap(log)).toBeUndefined()
    const st = await c.ok({ type: "get_state", activeSessionId: id })
    expect(st["busy"]).toBe(false)
  }, 60_000)

  it("abort's `aborted` matches what happened: true exactly when the turn ends with turn_interrupted{aborted}", async () => {
    const rounds = 40
    const { aborted, log } = await promptAbortRounds(rounds)
    const { terminals } = turnGrammarProblems(log)
    expect(terminals.length, "one ending per accepted prompt").toBe(rounds)
    const mismatches = terminals.flatMap((t, i) => {
      const interrupted = t["event"]["type"] === "turn_interrupted"
      return interrupted === aborted[i] ? [] : [`round ${i}: abort said aborted:${aborted[i]}, turn ended with ${describeMsg(t)}`]
    })
    expect(mismatches).toEqual([])
  }, 60_000)

})

// ---------------------------------------------------------------------------------------------

describe("attach and replay", () => {
  /** A session with `turns` completed plain turns, watched by `watcher`. Returns the full event log. */
  const sessionWithTurns = async (c: Client, turns: number): Promise<{ id: string; log: Array<Msg> }> => {
    const { id } = await createSession(c)
    const { replayed } = await attachAndReplay(c, { activeSessionId: id })
    const log = [...replayed]
    for (let i = 0; i < turns; i++) {
      await c.ok({ type: "prompt", activeSessionId: id, message: `turn ${i} a b` })
      log.push(...(await collectTurn(c, id)))
    }
    expect(cursorGap(log)).toBeUndefined()
    return { id, log: log.map(unflag) }
  }

  it("no_cursor: baseline snapshot + the generation's events, replayed, then live without the flag", async () => {
    const d = shared()
    const a = await d.connect("a")
    const { id, log } = await sessionWithTurns(a, 2)
    const b = await d.connect("b")
    const { data, attached, replayed, response } = await attachAndReplay(b, { activeSessionId: id })
    expect(attachProblems(data, { id, clientId: b.hello!["clientId"] })).toEqual([])
    expect(data["replay"]).toMatchObject({ status: "unavailable", reason: "no_cursor" })
    expect(data["client"]["capabilities"].slice().sort()).toEqual(["attach_snapshot", "event_sequence"])
    expect(data["snapshot"]["messageCount"]).toBe(0) // generation 1: the empty state
    expect(data["snapshot"]["messages"]).toEqual([])
    expect("cursor" in data["snapshot"]).toBe(false)
    const last = cursorOf(log[log.length - 1]!)
    expect(data["lastEventCursor"]).toEqual(last)
    expect(data["lastEventSequence"]).toBe(last.sequence)
    // session_attached repeats the replay decision.
    expect(attached["replay"]).toEqual(data["replay"])
    expect(attached["lastEventCursor"]).toEqual(last)
    expect(summaryProblems(attached["state"], "session_attached.state")).toEqual([])
    // Order: response → session_attached → replayed events.
    const iResp = b.all.indexOf(response)
    const iAtt = b.all.indexOf(attached)
    expect(iResp).toBeLessThan(iAtt)
    expect(b.all.slice(iResp + 1, iAtt).map(describeMsg)).toEqual([])
    if (replayed.length > 0) expect(b.all.indexOf(replayed[0]!)).toBeGreaterThan(iAtt)
    // Replayed = exactly the whole log of generation 1, flagged.
    for (const m of replayed) expect(metaProblems(m, true)).toEqual([])
    expect(replayed.map(unflag)).toEqual(log)
    // Folding the baseline gives the transcript.
    const folded = replayed.filter(isEvent("message_end")).map((m) => m["event"]["message"])
    expect(folded).toEqual((await b.ok({ type: "get_messages", activeSessionId: id }))["messages"])
    // Live events afterwards: no flag, continuing the cursor.
    await a.ok({ type: "prompt", activeSessionId: id, message: "live one" })
    const live = await collectTurn(b, id)
    expect(cursorGap(live, last)).toBeUndefined()
    for (const m of live) expect(metaProblems(m, false)).toEqual([])
    expect((await collectTurn(a, id)).map(unflag)).toEqual(live)
  })

  it("complete: resuming from a mid-way cursor replays exactly the later events, then live ones", async () => {
    const d = shared()
    const a = await d.connect("a")
    const { id, log } = await sessionWithTurns(a, 2)
    const k = Math.floor(log.length / 2)
    const from = cursorOf(log[k]!)
    const b = await d.connect("b")
    const { data, replayed, attached } = await attachAndReplay(b, { activeSessionId: id, resumeCursor: from })
    expect(attachProblems(data, { id, clientId: b.hello!["clientId"] })).toEqual([])
    const expected = log.slice(k + 1)
    expect(data["replay"]).toMatchObject({ status: "complete", eventCount: expected.length })
    expect(attached["replay"]).toEqual(data["replay"])
    expect(data["snapshot"]["messages"]).toEqual([])
    expect(b.all.filter((m) => m["type"]?.startsWith("session_snapshot_")).map(describeMsg)).toEqual([])
    for (const m of replayed) expect(metaProblems(m, true)).toEqual([])
    expect(replayed.map(unflag)).toEqual(expected)
    await a.ok({ type: "prompt", activeSessionId: id, message: "after resume" })
    const live = await collectTurn(b, id)
    for (const m of live) expect(metaProblems(m, false)).toEqual([])
    expect(cursorGap([...replayed, ...live], from)).toBeUndefined()
    // No duplicates anywhere on b's connection.
    const seen = b.sequenced(id).map((m) => `${cursorOf(m).generation}:${cursorOf(m).sequence}`)
    expect(new Set(seen).size).toBe(seen.length)

    // Resuming at the very last event: complete, nothing to replay.
    const c = await d.connect("c")
    const lastNow = cursorOf(live[live.length - 1]!)
    const r = await attachAndReplay(c, { activeSessionId: id, resumeCursor: lastNow })
    expect(r.data["replay"]["status"]).toBe("complete")
    expect(r.data["replay"]["eventCount"] ?? 0).toBe(0)
    expect(r.replayed).toEqual([])
    await sleep(100)
    expect(c.sequenced(id)).toEqual([])
  })

  it("cursor_ahead: a cursor past the last event gets the baseline", async () => {
    const d = shared()
    const a = await d.connect("a")
    const { id, log } = await sessionWithTurns(a, 1)
    const last = cursorOf(log[log.length - 1]!)
    for (const ahead of [{ generation: last.generation, sequence: last.sequence + 10 }, { generation: last.generation + 3, sequence: 0 }]) {
      const b = await d.connect("b")
      const { data, replayed, attached } = await attachAndReplay(b, { activeSessionId: id, resumeCursor: ahead })
      expect(attachProblems(data, { id, clientId: b.hello!["clientId"] })).toEqual([])
      expect(data["replay"]).toMatchObject({ status: "unavailable", reason: "cursor_ahead" })
      expect(attached["replay"]).toEqual(data["replay"])
      expect(replayed.map(unflag)).toEqual(log)
      for (const m of replayed) expect(metaProblems(m, true)).toEqual([])
      b.close()
    }
  })

  it("cursor_unknown and resume across a generation boundary after a checkpoint", async () => {
    const d = shared()
    const a = await d.connect("a")
    const { id } = await sessionWithTurns(a, 1)
    const cp = await a.ok({ type: "checkpoint", activeSessionId: id }, 20_000)
    expect(cp["generation"]).toBe(2)
    await a.ok({ type: "prompt", activeSessionId: id, message: "in gen two" })
    await collectTurn(a, id)
    const full = a.sequenced(id).map(unflag)
    expect(cursorGap(full)).toBeUndefined()
    const gen1 = full.filter((m) => cursorOf(m).generation === 1)
    const afterCp = full.filter((m) => cursorOf(m).generation === 2)
    expect(full.length).toBe(gen1.length + afterCp.length)
    const lastGen1 = cursorOf(gen1[gen1.length - 1]!)
    expect(cursorOf(afterCp[0]!)).toEqual({ generation: 2, sequence: 0 })

    // A sequence past the end of generation 1 names no event.
    const b = await d.connect("b")
    const unknown = await attachAndReplay(b, { activeSessionId: id, resumeCursor: { generation: 1, sequence: lastGen1.sequence + 3 } })
    expect(unknown.data["replay"]).toMatchObject({ status: "unavailable", reason: "cursor_unknown" })
    // Baseline: the generation-2 snapshot (state at the checkpoint), then generation 2's events.
    const snap = unknown.data["snapshot"]
    expect(snap["cursor"]).toEqual(lastGen1)
    expect(snap["messageCount"]).toBe(2)
    expect(snap["messages"].map((m: Msg) => m["content"])).toEqual(["turn 0 a b", "echo: turn 0 a b"])
    expect(unknown.replayed.map(unflag)).toEqual(afterCp)
    for (const m of unknown.replayed) expect(metaProblems(m, true)).toEqual([])

    // Resuming from generation 1's last event: complete, starting at (2,0).
    const c = await d.connect("c")
    const resumed = await attachAndReplay(c, { activeSessionId: id, resumeCursor: lastGen1 })
    expect(resumed.data["replay"]).toMatchObject({ status: "complete", eventCount: afterCp.length })
    expect(resumed.replayed.map(unflag)).toEqual(afterCp)
    // And from a mid-way cursor of generation 1.
    const e = await d.connect("e")
    const r2 = await attachAndReplay(e, { activeSessionId: id, resumeCursor: cursorOf(gen1[2]!) })
    expect(r2.data["replay"]["status"]).toBe("complete")
    expect(r2.replayed.map(unflag)).toEqual(full.slice(3))
  }, 30_000)

  it("partial / cursor_expired once the cursor's generation is pruned (retainGenerations 4); complete from the very end of a pruned one", async () => {
    const d = shared()
    const a = await d.connect("a")
    const { id, log } = await sessionWithTurns(a, 1)
    const gen1 = cursorOf(log[3]!)
    for (let g = 2; g <= 6; g++) {
      const cp = await a.ok({ type: "checkpoint", activeSessionId: id }, 20_000)
      expect(cp["generation"]).toBe(g)
      await a.ok({ type: "prompt", activeSessionId: id, message: `gen ${g}` })
      const t = await collectTurn(a, id)
      expect(cursorOf(t[t.length - 1]!).generation).toBe(g)
    }
    expect(cursorGap(a.sequenced(id))).toBeUndefined()
    const lastOf: Array<Cursor> = [] // last cursor of each generation, index = generation
    for (const m of a.sequenced(id)) lastOf[cursorOf(m).generation] = cursorOf(m)
    const transcript = await allMessages(a, id)
    expect(transcript.length).toBe(12)
    const gen6Events = a.sequenced(id).filter((m) => cursorOf(m).generation === 6).map(unflag)

    // Generations 3..6 are retained; 1 and 2 are pruned.
    for (const cursor of [gen1, lastOf[1]!, { generation: 2, sequence: 0 }]) {
      const b = await d.connect("b")
      const r = await attachAndReplay(b, { activeSessionId: id, resumeCursor: cursor })
      expect(r.data["replay"], `resume from ${JSON.stringify(cursor)}`).toMatchObject({ status: "partial", reason: "cursor_expired" })
      expect(r.data["snapshot"]["cursor"]).toEqual(lastOf[5])
      expect(r.data["snapshot"]["messages"]).toEqual(transcript.slice(0, 10))
      expect(r.data["snapshot"]["messageCount"]).toBe(10)
      expect(r.replayed.map(unflag)).toEqual(gen6Events)
      b.close()
    }
    // Chunked: the baseline travels with purpose "resync".
    const cc = await d.connect("chunked")
    const r = await attachAndReplay(cc, { activeSessionId: id, resumeCursor: gen1, capabilities: ["chunked_snapshot", "event_sequence"] })
    expect(r.data["replay"]).toMatchObject({ status: "partial", reason: "cursor_expired" })
    const begin = cc.all.find((m) => m["type"] === "session_snapshot_begin")
    expect(begin?.["purpose"]).toBe("resync")
    const chunks = cc.all.filter((m) => m["type"] === "session_snapshot_chunk")
    expect(chunks.flatMap((m) => m["messages"])).toEqual(transcript.slice(0, 10))
    // The very last event of pruned generation 2: every event after it is kept, so complete
    // (from 3:0); one past it names no event (generation 3 began right after 2's last).
    const end = await d.connect("end")
    const atEnd = await attachAndReplay(end, { activeSessionId: id, resumeCursor: lastOf[2]! })
    expect(atEnd.data["replay"]).toMatchObject({ status: "complete", fromCursor: { generation: 3, sequence: 0 } })
    expect(cursorOf(atEnd.replayed[0]!)).toEqual({ generation: 3, sequence: 0 })
    expect(cursorGap(atEnd.replayed, lastOf[2])).toBeUndefined()
    const past = await d.connect("past")
    const beyond = await attachAndReplay(past, { activeSessionId: id, resumeCursor: { generation: 2, sequence: lastOf[2]!.sequence + 1 } })
    expect(beyond.data["replay"]).toMatchObject({ status: "unavailable", reason: "cursor_unknown" })
    // A cursor in a retained generation (3) is still complete.
    const k = await d.connect("kept")
    const kept = await attachAndReplay(k, { activeSessionId: id, resumeCursor: lastOf[3]! })
    expect(kept.data["replay"]["status"]).toBe("complete")
    expect(cursorOf(kept.replayed[0]!)).toEqual({ generation: 4, sequence: 0 })
    expect(cursorGap(kept.replayed, lastOf[3])).toBeUndefined()
  }, 45_000)

  it("slim_attach leaves out state and messages", async () => {
    const d = shared()
    const a = await d.connect("a")
    const { id } = await sessionWithTurns(a, 1)
    await a.ok({ type: "checkpoint", activeSessionId: id }, 20_000)
    const b = await d.connect("b")
    const { data, attached } = await attachAndReplay(b, { activeSessionId: id, capabilities: ["slim_attach", "event_sequence", "attach_snapshot", "some_future_cap"] })
    expect(attachProblems(data, { id, clientId: b.hello!["clientId"], slim: true })).toEqual([])
    expect(data["snapshot"]["messageCount"]).toBe(2)
    expect(data["snapshot"]["messages"].length).toBe(2)
    expect(summaryProblems(attached["state"])).toEqual([])
  })

  it("attaching twice on one connection replaces the attachment (events once)", async () => {
    const d = shared()
    const a = await d.connect("a")
    const { id } = await createSession(a)
    // Ready first: a `ready` status sent live to the first attachment between the two attaches
    // would be taken for the second one's replay (which then comes after it).
    await waitIdle(a, id)
    await attachAndReplay(a, { activeSessionId: id })
    const second = await attachAndReplay(a, { activeSessionId: id })
    a.drain()
    const mark = a.all.length
    await a.ok({ type: "prompt", activeSessionId: id, message: "once" })
    await collectTurn(a, id)
    await sleep(200)
    const got = a.all.slice(mark).filter(isSequenced)
    const keys = got.map((m) => `${cursorOf(m).generation}:${cursorOf(m).sequence}`)
    expect(new Set(keys).size, got.map(describeMsg).join(", ")).toBe(keys.length)
    expect(cursorGap(got, second.data["lastEventCursor"])).toBeUndefined()
  })
})
