/**
 * A graceful stop said once and acted on (docs/protocol.md sections 4, 6 and 8): a turn running at
 * `shutdown`, SIGINT or SIGTERM ends with `turn_interrupted {daemon_shutdown}` and its idle
 * status before the socket closes, the journal says idle (a restart adds no `daemon_restarted`
 * and no `recovering`), `agentd prompt` ends at once (exit 1) and `agentd attach` too (exit 0)
 * unless `--reconnect-timeout` asks to wait for a restart; workers run in process groups of
 * their own, so a Ctrl-C to the terminal's group reaches only the daemon; a SIGKILLed daemon
 * leaves no worker behind.
 *
 * Every process a test starts is killed when it finishes, pass or fail (the harness's cleanup,
 * and the CLI runs here). Needs `npm run build` first.
 */
import * as Schedule from "effect/Schedule"
import * as fs from "node:fs"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { assert, describe, it, onTestFinished } from "vitest"
import * as Client from "../../src/client.js"
import { chat, startFakeModel } from "../support/fakeModels.js"
import {
  cleanUpAfterTests,
  type Client as WireClient,
  createSession,

  type Daemon,
  describeMsg,
  isAlive,
  isEvent,
  type Msg,
  sleep,
  useDaemon,
  waitGone
} from "./harness.js"
import { startCli, until } from "./cliRun.js"

cleanUpAfterTests()

/** `agentd` with a worker entry whose `ctrl-c` engine dies of a SIGINT sent to the daemon too (test/fixtures/ctrlCWorker.ts). */
const CTRL_C_AGENTD = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..", "dist", "test", "fixtures", "agentdWithCtrlCWorker.js")

/**
 * `agentd attach` on a session, once it follows: it follows from the last event it reads at its
 * start, so a turn started before that shows nothing until its end. A first turn gives it a
 * history line and its separator to wait for.
 */
const followingAttach = async (watcher: WireClient, id: string, args: ReadonlyArray<string>) => {
  await watcher.ok({ type: "prompt", activeSessionId: id, message: "one" })
  await watcher.waitFor((m) => isEvent("agent_end")(m) && m["activeSessionId"] === id, 15_000)
  const attach = startCli(["attach", id, "--history", "1", ...args])
  await until("attach follows", () => attach.stdout.includes("----- live -----"))
  return attach
}

/** Waits until the session runs a turn whose tool call (`/sleep`) has started; returns its worker's pid. */
const inToolCall = async (watcher: WireClient, d: Daemon, id: string): Promise<number> => {
  await watcher.waitFor((m) => isEvent("tool_execution_start")(m) && m["activeSessionId"] === id, 15_000)
  const s = await watcher.ok({ type: "get_state", activeSessionId: id })
  d.recordWorkers(s)
  assert.isTrue(s["busy"], JSON.stringify(s))
  return s["workerPid"] as number
}

/** Every sequenced message of a session as the daemon's log holds it (generation 1 only: short sessions). */
const history = async (d: Daemon, id: string): Promise<Array<Msg>> => {
  const c = await d.connect("history")
  const att = await c.ok({ type: "attach", activeSessionId: id })
  const last = att["lastEventCursor"] as { generation: number; sequence: number }
  assert.strictEqual(last.generation, 1, "the session checkpointed: this reader sees generation 1 only")
  const out: Array<Msg> = []
  while (out.length < last.sequence + 1) {
    out.push(await c.waitFor((m) => (m["type"] === "session_event" || m["type"] === "session_status" || m["type"] === "session_closed") && m["activeSessionId"] === id, 10_000))
  }
  c.close()
  return out
}

/** What a graceful stop must never write: a crash, a restore, a daemon-restart interruption. */
const crashTraces = (log: ReadonlyArray<Msg>): Array<string> =>
  log.filter((m) =>
    (m["type"] === "session_status" && (m["state"]?.worker === "recovering" || m["state"]?.worker === "failed")) ||
    (isEvent("turn_interrupted")(m) && m["event"].reason !== "daemon_shutdown")
  ).map(describeMsg)

/** The process group of a pid (from /proc/<pid>/stat). */
const pgidOf = (pid: number): number => {
  const stat = fs.readFileSync(`/proc/${pid}/stat`, "utf8")
  // After the command name (in parentheses, which may hold spaces): state, ppid, pgrp.
  const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ")
  return Number(fields[2])
}

/** The cut turn ends: `turn_interrupted {daemon_shutdown}`, then the idle status, then `daemon_closing`. */
const assertCutTurnSeen = async (watcher: WireClient, id: string): Promise<void> => {
  const closing = await watcher.waitFor((m) => m["type"] === "daemon_closing", 15_000)
  const all = watcher.all
  const cut = all.findIndex((m) => isEvent("turn_interrupted")(m) && m["activeSessionId"] === id)
  const trace = all.slice(-8).map(describeMsg).join(", ")
  assert.isAtLeast(cut, 0, `no turn_interrupted reached the attached client: ${trace}`)
  assert.strictEqual(all[cut]!["event"].reason, "daemon_shutdown", trace)
  const idle = all.findIndex((m, i) => i > cut && m["type"] === "session_status" && m["activeSessionId"] === id)
  assert.isAbove(idle, cut, `no status after the cut: ${trace}`)
  assert.isFalse(all[idle]!["state"].busy, trace)
  assert.isBelow(idle, all.indexOf(closing), `the turn's end came after daemon_closing: ${trace}`)
}

describe("a graceful stop", () => {
  it("agentd shutdown during a turn: prompt exits 1 at once, attach exits 0; turn_interrupted {daemon_shutdown} logged; a restart adds no daemon_restarted and no recovering", async () => {
    const d = await useDaemon()
    const s = ["--socket", d.socketPath]
    const c = await d.connect("setup")
    const { id } = await createSession(c)
    const watcher = await d.connect("watcher")
    await watcher.ok({ type: "attach", activeSessionId: id })
    const attach = await followingAttach(watcher, id, s)
    const prompt = startCli(["prompt", id, "/sleep 20000", ...s])
    await inToolCall(watcher, d, id)
    await until("attach shows the turn", () => attach.stdout.includes("sleep"))
    const asked = Date.now()
    const stop = await startCli(["shutdown", ...s]).done
    assert.strictEqual(stop.code, 0, stop.stderr)
    const p = await prompt.done
    assert.strictEqual(p.code, 1, `prompt: ${p.stderr}`)
    assert.include(p.stderr, "daemon shut down")
    assert.include(p.stderr, "daemon_shutdown")
    assert.notInclude(p.stderr, "reconnecting")
    // At once: not after a reconnect timeout (30 s by default), not after the turn (20 s).
    assert.isBelow(prompt.exitedAt - asked, 5_000, p.stderr)
    const a = await attach.done
    assert.strictEqual(a.code, 0, `attach: ${a.stderr}`)
    assert.include(a.stderr, "daemon shut down")
    assert.isBelow(attach.exitedAt - asked, 5_000, a.stderr)
    await assertCutTurnSeen(watcher, id)
    await d.exited
    assert.strictEqual(d.exitCode, 0, d.output)
    assert.notMatch(d.stderr, /exited unexpectedly/, d.output)
    // The journal says idle: the next start restores nothing and cuts no turn again.
    const journal = fs.readFileSync(path.join(d.stateDir, "recovery.jsonl"), "utf8").trim().split("\n").map((l) => JSON.parse(l) as Msg)
    assert.isFalse(journal.filter((r) => r["activeSessionId"] === id).at(-1)!["busy"], JSON.stringify(journal))
    const d2 = await useDaemon({ stateDir: d.stateDir })
    const c2 = await d2.connect("after")
    const state = await c2.ok({ type: "get_state", activeSessionId: id })
    assert.isFalse(state["busy"], JSON.stringify(state))
    const log = await history(d2, id)
    assert.deepStrictEqual(crashTraces(log), [], log.map(describeMsg).join(", "))
    assert.deepStrictEqual(log.filter(isEvent("turn_interrupted")).map((m) => m["event"].reason), ["daemon_shutdown"])
    // The log ends with the turn's end and its idle status: the restart added nothing.
    assert.deepStrictEqual(log.slice(-2).map(describeMsg).map((x) => x.replace(/@.*/, "")), ["ev:turn_interrupted(daemon_shutdown)", "status(busy=false,worker=ready)"])
    // The transcript holds the cut turn's user message, and the session takes the next prompt.
    await c2.ok({ type: "attach", activeSessionId: id })
    await c2.ok({ type: "prompt", activeSessionId: id, message: "after" })
    await c2.waitFor((m) => isEvent("agent_end")(m) && m["activeSessionId"] === id, 15_000)
  }, 90_000)

  it("with --reconnect-timeout, attach waits for the daemon to be started again and resumes; prompt still ends with the cut turn", async () => {
    const d = await useDaemon()
    const s = ["--socket", d.socketPath]
    const c = await d.connect("setup")
    const { id } = await createSession(c)
    const watcher = await d.connect("watcher")
    await watcher.ok({ type: "attach", activeSessionId: id })
    const attach = await followingAttach(watcher, id, [...s, "--reconnect-timeout", "20"])
    const prompt = startCli(["prompt", id, "/sleep 20000", "--reconnect-timeout", "10", ...s])
    await inToolCall(watcher, d, id)
    await until("attach shows the turn", () => attach.stdout.includes("sleep"))
    assert.strictEqual((await startCli(["shutdown", ...s]).done).code, 0)
    // The turn's end is what a prompt waits for, and it came: the cut turn is over for good.
    const p = await prompt.done
    assert.strictEqual(p.code, 1, p.stderr)
    assert.include(p.stderr, "daemon_shutdown")
    await d.exited
    await sleep(1_000)
    assert.isNull(attach.proc.exitCode, `attach gave up: ${attach.stderr}`)
    const d2 = await useDaemon({ stateDir: d.stateDir })
    await until("attach says the daemon restarted", () => attach.stderr.includes("restarted"), 15_000)
    const c2 = await d2.connect("after")
    await c2.ok({ type: "prompt", activeSessionId: id, message: "back again" })
    await until("attach shows the turn after the restart", () => attach.stdout.includes("echo: back again"), 15_000)
    assert.isNull(attach.proc.exitCode, attach.stderr)
  }, 90_000)

  it("SIGINT to the daemon's whole process group (a terminal's Ctrl-C) during a turn: exit 0, turn_interrupted {daemon_shutdown}, no crash and no recovering in any history", async () => {
    const d = await useDaemon()
    const c = await d.connect("setup")
    const busy = await createSession(c)
    const idle = await createSession(c)
    const watcher = await d.connect("watcher")
    for (const { id } of [busy, idle]) await watcher.ok({ type: "attach", activeSessionId: id })
    await watcher.ok({ type: "prompt", activeSessionId: idle.id, message: "hello" })
    await watcher.waitFor((m) => isEvent("agent_end")(m) && m["activeSessionId"] === idle.id, 15_000)
    await watcher.ok({ type: "prompt", activeSessionId: busy.id, message: "/sleep 20000" })
    const worker = await inToolCall(watcher, d, busy.id)
    // The harness starts the daemon as the leader of its own group, as a shell starts a job.
    assert.strictEqual(pgidOf(d.pid), d.pid)
    const workerGroup = pgidOf(worker)
    process.kill(-d.pid, "SIGINT")
    await assertCutTurnSeen(watcher, busy.id)
    await Promise.race([d.exited, sleep(15_000)])
    assert.strictEqual(d.exitCode, 0, d.output)
    assert.notMatch(d.stderr, /exited unexpectedly/, d.output)
    assert.deepStrictEqual(await waitGone(d.workerProcesses(), 5_000), [], "workers left after the stop")
    const d2 = await useDaemon({ stateDir: d.stateDir })
    for (const { id } of [busy, idle]) {
      const log = await history(d2, id)
      assert.deepStrictEqual(crashTraces(log), [], `${id}: ${log.map(describeMsg).join(", ")}`)
    }
    const cut = (await history(d2, busy.id)).filter(isEvent("turn_interrupted")).map((m) => m["event"].reason)
    assert.deepStrictEqual(cut, ["daemon_shutdown"])
    assert.notStrictEqual(workerGroup, d.pid, "the worker was in the daemon's process group")
  }, 90_000)

  it("a worker dying of the same Ctrl-C (the signal caught it between its fork and its own process group): no crash, no recovering, the turn cut with daemon_shutdown", async () => {
    // The kernel signals the daemon, then the worker dies of it: its exit may reach the daemon
    // before the stop has begun, and must not be taken for a crash. A few rounds: it is a race.
    for (let round = 0; round < 2; round++) {
      const d = await useDaemon({ bin: CTRL_C_AGENTD, env: { AGENTD_WARM_UP: "1" } })
      const c = await d.connect("setup")
      const pidFile = path.join(path.dirname(d.stateDir), `ctrl-c-${round}.pid`)
      const { id } = await createSession(c, { engine: "ctrl-c", config: { pidFile } })
      await c.ok({ type: "attach", activeSessionId: id })
      await c.ok({ type: "prompt", activeSessionId: id, message: "go" })
      await Promise.race([d.exited, sleep(15_000)])
      assert.strictEqual(d.exitCode, 0, d.output)
      assert.isTrue(fs.existsSync(pidFile), "the worker did not signal")
      await c.waitFor((m) => m["type"] === "daemon_closing", 5_000)
      const seen = c.all.filter((m) => m["activeSessionId"] === id)
      assert.deepStrictEqual(crashTraces(seen), [], `round ${round}: ${seen.map(describeMsg).join(", ")}`)
      assert.notMatch(d.stderr, /exited unexpectedly|did not start/, d.output)
      const d2 = await useDaemon({ stateDir: d.stateDir, bin: CTRL_C_AGENTD })
      const log = await history(d2, id)
      assert.deepStrictEqual(crashTraces(log), [], `round ${round}: ${log.map(describeMsg).join(", ")}`)
      assert.deepStrictEqual(log.filter(isEvent("turn_interrupted")).map((m) => m["event"].reason), ["daemon_shutdown"])
      await d2.stop()
    }
  }, 90_000)
})

/** Runs a follow loop in the background, collecting what it yields and how it ends. */
const follow = (iterable: AsyncIterable<Client.FollowEvent>) => {
  const events: Array<Client.FollowEvent> = []
  const out = { events, error: undefined as unknown, done: false }
  void (async () => {
    try {
      for await (const e of iterable) events.push(e)
    } catch (e) {
      out.error = e
    } finally {
      out.done = true
    }
  })()
  return out
}

describe("a graceful stop during a model engine's streamed message", () => {
  it("keeps the text streamed so far: message_end (interrupted) then turn_interrupted {daemon_shutdown}; the transcript holds it after a restart", async () => {
    const fake = await startFakeModel()
    onTestFinished(() => fake.close())
    const d = await useDaemon({ env: { OPENAI_API_KEY: "sk-e2e-shutdown" } })
    const c = await d.connect("client")
    const { id } = await createSession(c, { engine: "openai-compat", config: { model: "fake-model", baseUrl: `${fake.url}/v1`, retryBaseDelayMs: 10 } })
    await c.ok({ type: "attach", activeSessionId: id })
    fake.reply({ steps: chat.hang(["partial ", "text"]) })
    await c.ok({ type: "prompt", activeSessionId: id, message: "long one" })
    await c.waitFor((m) => isEvent("message_update")(m) && m["event"].delta === "text", 20_000)
    c.sendCommand({ type: "shutdown" })
    await assertCutTurnSeen(c, id)
    const cut = c.all.filter((m) => isEvent("message_end")(m)).at(-1)!["event"].message
    assert.deepStrictEqual([cut.role, cut.content, cut.interrupted], ["assistant", "partial text", true])
    const order = c.all.filter((m) => m["activeSessionId"] === id && (isEvent("message_end")(m) || isEvent("turn_interrupted")(m))).slice(-2).map(describeMsg)
    assert.match(order.join(" "), /^ev:message_end@\S+ ev:turn_interrupted\(daemon_shutdown\)@/)
    await d.exited
    assert.strictEqual(d.exitCode, 0, d.output)
    const d2 = await useDaemon({ stateDir: d.stateDir, env: { OPENAI_API_KEY: "sk-e2e-shutdown" } })
    const c2 = await d2.connect("after")
    const messages = (await c2.ok({ type: "get_messages", activeSessionId: id }))["messages"] as Array<Msg>
    assert.deepStrictEqual(messages.map((m) => [m["role"], m["content"], m["interrupted"] === true]), [["user", "long one", false], ["assistant", "partial text", true]])
    assert.deepStrictEqual(crashTraces(await history(d2, id)), [])
  }, 60_000)
})

describe("the SDK's follow on a graceful stop", () => {
  it("ends with DaemonShutDown at once (no reconnect); with waitForRestart it resumes after the daemon is started again, no event lost or repeated", async () => {
    const d = await useDaemon()
    const driver = await Client.connect({ socketPath: d.socketPath })
    const handle = await driver.create({ name: "sdk-stop" })
    const reconnect = Schedule.spaced("50 millis")
    const plain = follow(handle.follow({ reconnect }))
    const waiting = follow(driver.session(handle.activeSessionId).follow({ reconnect, waitForRestart: true }))
    const turn = (async () => {
      try {
        for await (const _ of handle.prompt("/sleep 20000")) {
          // the turn's events
        }
        return "ended"
      } catch (e) {
        return `${(e as { _tag?: string })._tag}:${(e as { reason?: string }).reason}`
      }
    })()
    await until("both followers in the tool call", () =>
      [plain, waiting].every((f) => f.events.some((e) => e.type === "session_event" && e.event.type === "tool_execution_start")))
    const asked = Date.now()
    await driver.shutdown()
    assert.strictEqual(await turn, "TurnInterrupted:daemon_shutdown")
    await until("the plain follower ends", () => plain.done, 5_000)
    assert.isBelow(Date.now() - asked, 5_000)
    assert.strictEqual((plain.error as { _tag?: string } | undefined)?._tag, "DaemonShutDown", String(plain.error))
    const cut = plain.events.filter((e) => e.type === "session_event" && e.event.type === "turn_interrupted")
    assert.deepStrictEqual(cut.map((e) => e.type === "session_event" && e.event.type === "turn_interrupted" && e.event.reason), ["daemon_shutdown"])
    await d.exited
    await sleep(500)
    assert.isFalse(waiting.done, `the waiting follower ended: ${String(waiting.error)}`)
    const d2 = await useDaemon({ stateDir: d.stateDir })
    const driver2 = await Client.connect({ socketPath: d2.socketPath })
    for await (const _ of driver2.session(handle.activeSessionId).prompt("back")) {
      // the turn's events
    }
    await until("the waiting follower sees the turn after the restart", () =>
      waiting.events.some((e) => e.type === "session_event" && e.event.type === "message_end" && e.event.message.content === "echo: back"), 15_000)
    const cursors = waiting.events.flatMap((e) => (e.type === "baseline" ? [] : [`${e.meta.cursor.generation}:${e.meta.cursor.sequence}`]))
    assert.strictEqual(new Set(cursors).size, cursors.length, "an event seen twice")
    assert.deepStrictEqual(waiting.events.filter((e) => e.type === "baseline").length, 1, "resumed, not a new baseline")
    await driver2.close()
  }, 60_000)
})

describe("a SIGKILLed daemon", () => {
  it("leaves no worker behind: neither a worker mid-turn nor the warm spare, though they run in process groups of their own", async () => {
    const d = await useDaemon()
    const c = await d.connect("setup")
    const { id } = await createSession(c)
    await c.ok({ type: "attach", activeSessionId: id })
    await c.ok({ type: "prompt", activeSessionId: id, message: "/sleep 60000" })
    const worker = await inToolCall(c, d, id)
    // The spare the pool started after handing one to the session.
    await until("a warm spare beside the session's worker", () => d.workerProcesses().length >= 2, 15_000)
    const workers = d.workerProcesses()
    assert.include(workers, worker)
    for (const pid of workers) {
      assert.notStrictEqual(pgidOf(pid), pgidOf(d.pid), `worker ${pid} shares the daemon's process group`)
    }
    await d.sigkill()
    const left = await waitGone(workers, 5_000)
    assert.deepStrictEqual(left.filter(isAlive), [], `workers outlived the daemon: ${left.join(", ")}`)
  }, 60_000)
})
