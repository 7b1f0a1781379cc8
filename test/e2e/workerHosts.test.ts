/**
 * Worker hosts through the real daemon (`agentd serve --sessions-per-worker N`): sessions with no
 * `launchEnv` share `agentd-worker host` processes, packed into the fullest host with room; a
 * SIGKILLed host is a crash of each of its sessions (and of no other), each restored with nothing
 * logged lost; `kill` of one session leaves its host and the host's other sessions alone; a
 * session with a `launchEnv` gets a process of its own; hosts do not outlive a SIGKILLed daemon,
 * and a restarted one restores the sessions into hosts again.
 */
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { afterAll, describe, expect, it } from "vitest"
import { probeSocket } from "../../src/internal/liveness.js"
import { WORKER_TITLE_PREFIX, workerTitleKey } from "../../src/WorkerProtocol.js"
import { parentOf } from "../support/procfs.js"
import {
  allMessages,
  type Client,
  cleanUpAfterTests,
  collectTurn,
  collectUntil,
  createSession,
  type Cursor,
  cursorGap,
  type Daemon,
  describeMsg,
  isAlive,
  isEvent,
  type Msg,
  sleep,
  type StartOptions,
  useDaemon as startWithCleanup,
  waitGone,
  waitIdle
} from "./harness.js"

cleanUpAfterTests()

const HOST_TITLE = `${WORKER_TITLE_PREFIX}host`

/** A process's title: its /proc cmdline up to the first NUL ("" when it is gone). */
const titleOf = (pid: number): string => {
  try {
    return fs.readFileSync(`/proc/${pid}/cmdline`, "utf8").split("\0")[0] ?? ""
  } catch {
    return ""
  }
}

/** The environment of a process of ours, as `KEY=value` strings. */
const environOf = (pid: number): Array<string> => fs.readFileSync(`/proc/${pid}/environ`, "utf8").split("\0")

/** The private socket directories of a daemon's worker hosts (`$TMPDIR/agentd-hosts-<pid>-XXXX`). */
const hostDirsOf = (daemonPid: number): Array<string> =>
  fs.readdirSync(os.tmpdir()).filter((name) => name.startsWith(`agentd-hosts-${daemonPid}-`)).map((name) => path.join(os.tmpdir(), name))

/**
 * The daemons of this file: the harness SIGKILLs them, so their pools never remove their hosts'
 * socket directories (the next daemon with hosts would); removed here once they are gone.
 */
const daemonPids = new Set<number>()
const useDaemon = async (options: StartOptions): Promise<Daemon> => {
  const daemon = await startWithCleanup(options)
  daemonPids.add(daemon.pid)
  return daemon
}
afterAll(() => {
  for (const pid of daemonPids) {
    if (!isAlive(pid)) for (const dir of hostDirsOf(pid)) fs.rmSync(dir, { recursive: true, force: true })
  }
})

/** `status.workers`, its pids recorded for cleanup. */
const statusWorkers = async (daemon: Daemon, client: Client): Promise<Array<{ pid: number; activeSessionId: string; state: string; restarts: number }>> => {
  const status = await client.ok({ type: "status" })
  daemon.recordWorkers(status)
  return status["workers"] as Array<{ pid: number; activeSessionId: string; state: string; restarts: number }>
}

/** `get_state`, its worker pid recorded for cleanup. */
const stateOf = async (daemon: Daemon, client: Client, id: string): Promise<Msg> => {
  const s = await client.ok({ type: "get_state", activeSessionId: id })
  daemon.recordWorkers(s)
  return s
}

/** How many sessions each pid runs. */
const countByPid = (workers: ReadonlyArray<{ pid: number }>): Map<number, number> => {
  const out = new Map<number, number>()
  for (const w of workers) out.set(w.pid, (out.get(w.pid) ?? 0) + 1)
  return out
}

/** Live worker processes of the daemon whose title says they are hosts. */
const hostProcesses = (daemon: Daemon): Array<number> => daemon.workerProcesses().filter((p) => titleOf(p) === HOST_TITLE)

/** A prompt of `words` words: echo streams one delta per word, `tokenDelayMs` apart. */
const longPrompt = (tag: string, words: number): string => Array.from({ length: words }, (_, i) => `${tag}w${i}`).join(" ")

/** Attaches `client` to `id` for live events from now on. */
const attach = (client: Client, id: string) =>
  client.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })

/** What a turn's message_end events said, in order. */
const endContents = (turn: ReadonlyArray<Msg>): Array<string> => turn.filter(isEvent("message_end")).map((m) => m["event"].message.content as string)

const shape = (m: Msg): string => (m["type"] === "session_event" ? m["event"].type as string : `status:${m["state"]?.worker}`)

/** A full replay (from `{generation: 1, sequence: 0}`) of a session on a new connection, up to its last event cursor. */
const fullReplay = async (daemon: Daemon, id: string, label: string): Promise<Array<Msg>> => {
  const reader = await daemon.connect(label)
  const last = (await stateOf(daemon, reader, id))["lastEventCursor"] as Cursor
  await reader.ok({ type: "attach", activeSessionId: id, resumeCursor: { generation: 1, sequence: 0 } })
  const replayed = await collectUntil(
    reader,
    id,
    (m) => m["meta"].cursor.generation === last.generation && m["meta"].cursor.sequence === last.sequence,
    15_000
  )
  reader.close()
  return replayed
}

describe("worker hosts (e2e)", () => {
  it("--sessions-per-worker 3: five sessions created at once share at most 2 host processes, 3 at most each, and each answers with its own echo", async () => {
    const daemon = await useDaemon({ extraArgs: ["--sessions-per-worker", "3"] })
    const client = await daemon.connect()
    // Created all at once: the packing must hold with acquisitions racing for the same hosts.
    const ids = (await Promise.all(Array.from({ length: 5 }, (_, i) => createSession(client, { name: `pack${i}`, config: { tokenDelayMs: 1 } })))).map((c) => c.id)
    expect(new Set(ids).size).toBe(5)
    const states = await Promise.all(ids.map((id) => waitIdle(client, id, 20_000)))
    for (const s of states) daemon.recordWorkers(s)

    const workers = await statusWorkers(daemon, client)
    expect(workers.map((w) => w.activeSessionId).sort()).toEqual([...ids].sort())
    const byPid = countByPid(workers)
    expect([...byPid.values()].every((n) => n <= 3), `sessions per pid: ${JSON.stringify([...byPid])}`).toBe(true)
    expect(byPid.size, `sessions per pid: ${JSON.stringify([...byPid])}`).toBeLessThanOrEqual(2)
    // Five sessions at three a host need two hosts: fewer would mean a host holds more than 3.
    expect(byPid.size).toBe(2)
    for (const pid of byPid.keys()) {
      expect(titleOf(pid), `title of ${pid}`).toBe(HOST_TITLE)
      expect(parentOf(pid), `parent of host ${pid}`).toBe(daemon.pid)
    }
    // get_state names the same host as status.
    for (const s of states) {
      expect(s["workerPid"]).toBe(workers.find((w) => w.activeSessionId === s["activeSessionId"])!.pid)
    }
    // Every process of the daemon is a host now: no session has a process of its own, and at
    // most one spare host (not listed) beside the two.
    const processes = daemon.workerProcesses()
    expect(processes.every((p) => titleOf(p) === HOST_TITLE), `titles: ${processes.map((p) => `${p}=${titleOf(p)}`).join(", ")}`).toBe(true)
    expect(processes.length).toBeLessThanOrEqual(3)

    // The hosts' sockets (and the daemon's marker, daemon.sock) are in a private directory of this
    // daemon's, reachable by its user only.
    const dirs = hostDirsOf(daemon.pid)
    expect(dirs).toHaveLength(1)
    expect(fs.statSync(dirs[0]!).mode & 0o777).toBe(0o700)
    const sockets = fs.readdirSync(dirs[0]!).map((name) => path.join(dirs[0]!, name))
    expect(sockets.filter((s) => /h\d+\.sock$/.test(s)).length).toBeGreaterThanOrEqual(2)
    expect(sockets.map((s) => path.basename(s))).toContain("daemon.sock")
    for (const s of sockets) {
      expect(fs.statSync(s).isSocket(), s).toBe(true)
      expect(fs.statSync(s).mode & 0o777, s).toBe(0o600)
    }

    // Every session streams its own echo at once, interleaved in the shared processes: nobody's
    // words end up in another's turn.
    for (const id of ids) await attach(client, id)
    const messages = ids.map((id, i) => `${longPrompt(`s${i}x`, 30)} ${id}`)
    await Promise.all(ids.map((id, i) => client.ok({ type: "prompt", activeSessionId: id, message: messages[i] })))
    const turns = await Promise.all(ids.map((id) => collectTurn(client, id, 20_000)))
    ids.forEach((id, i) => {
      const turn = turns[i]!
      expect(endContents(turn), `session ${i}`).toEqual([messages[i], `echo: ${messages[i]}`])
      const deltas = turn.filter(isEvent("message_update")).map((m) => m["event"].delta as string).join("")
      expect(deltas, `session ${i}'s deltas`).toBe(`echo: ${messages[i]}`)
      expect(turn.filter(isEvent("turn_interrupted"))).toHaveLength(0)
      expect(cursorGap(client.sequenced(id)), `session ${i}`).toBeUndefined()
    })
    for (const [i, id] of ids.entries()) {
      expect((await allMessages(client, id)).map((m) => m["content"])).toEqual([messages[i], `echo: ${messages[i]}`])
    }
    // Still the same two hosts.
    expect(countByPid(await statusWorkers(daemon, client))).toEqual(byPid)
  }, 40_000)

  it("a host SIGKILLed while its sessions stream: each of them is restored (recovering, turn_interrupted, ready) with nothing logged lost; a session on another host streams on", async () => {
    const daemon = await useDaemon({ extraArgs: ["--sessions-per-worker", "3"] })
    const client = await daemon.connect()
    const ids: Array<string> = []
    for (let i = 0; i < 4; i++) {
      const { id } = await createSession(client, { name: `crash${i}`, config: { tokenDelayMs: 5 } })
      await waitIdle(client, id, 20_000)
      ids.push(id)
    }
    const workers = await statusWorkers(daemon, client)
    const byPid = countByPid(workers)
    // Created one by one: three in the first host, the fourth in the next.
    expect([...byPid.values()].sort(), JSON.stringify([...byPid])).toEqual([1, 3])
    const victimPid = [...byPid].find(([, n]) => n === 3)![0]
    const otherPid = [...byPid].find(([, n]) => n === 1)![0]
    expect(titleOf(victimPid)).toBe(HOST_TITLE)
    expect(titleOf(otherPid)).toBe(HOST_TITLE)
    const victims = workers.filter((w) => w.pid === victimPid).map((w) => w.activeSessionId)
    const survivor = workers.find((w) => w.pid === otherPid)!.activeSessionId

    for (const id of ids) await attach(client, id)
    // ~600 deltas 5 ms apart: about 3 s of streaming for each.
    const prompt = longPrompt("long", 600)
    await Promise.all(ids.map((id) => client.ok({ type: "prompt", activeSessionId: id, message: prompt })))
    // Every session is in the middle of its assistant message.
    for (const id of ids) {
      await collectUntil(client, id, (m) => isEvent("message_update")(m) && (m["event"].delta as string).startsWith(" long"), 10_000)
    }
    expect(client.sequenced(survivor).some(isEvent("agent_end")), "the survivor's turn ended before the kill: too fast to test").toBe(false)
    process.kill(victimPid, "SIGKILL")

    const [survivorTurn, ...cut] = await Promise.all([
      collectTurn(client, survivor, 20_000),
      ...victims.map((id) => collectUntil(client, id, (m) => m["type"] === "session_status" && m["state"].worker === "ready", 20_000))
    ])
    // The survivor: its whole answer, never interrupted, no gap.
    expect(survivorTurn!.map(shape)).not.toContain("turn_interrupted")
    expect(survivorTurn!.map(shape)).not.toContain("status:recovering")
    expect(endContents(survivorTurn!)).toEqual([`echo: ${prompt}`])
    expect(cursorGap(client.sequenced(survivor))).toBeUndefined()
    const survivorState = await stateOf(daemon, client, survivor)
    expect(survivorState["workerPid"]).toBe(otherPid)
    expect(survivorState["restarts"]).toBe(0)

    // Each session of the dead host: its deltas up to the crash, then recovering, turn_interrupted (worker_crashed), ready.
    victims.forEach((id, i) => {
      const rest = cut[i]!
      const kinds = rest.map(shape)
      const what = `${id}: ${rest.map(describeMsg).join(", ")}`
      expect(kinds.filter((k) => k !== "message_update"), what).toEqual(["status:recovering", "turn_interrupted", "status:ready"])
      expect(kinds.lastIndexOf("message_update"), what).toBeLessThan(kinds.indexOf("status:recovering"))
      expect(rest.find(isEvent("turn_interrupted"))!["event"].reason, what).toBe("worker_crashed")
      expect(cursorGap(client.sequenced(id)), what).toBeUndefined()
    })

    const after = await statusWorkers(daemon, client)
    expect(after.map((w) => w.activeSessionId).sort()).toEqual([...ids].sort())
    expect(after.map((w) => w.pid)).not.toContain(victimPid)
    expect([...countByPid(after).values()].every((n) => n <= 3), JSON.stringify(after)).toBe(true)
    for (const id of victims) {
      const s = await stateOf(daemon, client, id)
      expect(s["restarts"], id).toBe(1)
      expect(s["worker"], id).toBe("ready")
      expect(titleOf(s["workerPid"] as number), `${id} restored in a host`).toBe(HOST_TITLE)
    }

    // Everything logged is still in each log: a full replay has no gap and one interruption.
    for (const id of victims) {
      const replayed = await fullReplay(daemon, id, `reader-${id}`)
      expect(cursorGap(replayed, { generation: 1, sequence: 0 }), id).toBeUndefined()
      const interrupted = replayed.filter(isEvent("turn_interrupted"))
      expect(interrupted, id).toHaveLength(1)
      expect(interrupted[0]!["event"].reason).toBe("worker_crashed")
    }

    // Every session answers a new prompt with its own echo.
    await Promise.all(ids.map((id, i) => client.ok({ type: "prompt", activeSessionId: id, message: `after the crash ${i}` })))
    const turns = await Promise.all(ids.map((id) => collectTurn(client, id, 20_000)))
    ids.forEach((id, i) => {
      expect(endContents(turns[i]!), id).toEqual([`after the crash ${i}`, `echo: after the crash ${i}`])
      expect(cursorGap(client.sequenced(id)), id).toBeUndefined()
    })
    expect(await waitGone([victimPid], 2_000)).toEqual([])
  }, 40_000)

  it("kill of one session of a host whose other session is mid-turn: the turn streams on to its end, the host lives on and takes the next session; emptied, it is stopped", async () => {
    // The environment variable this time (the other tests pass the flag).
    const daemon = await useDaemon({ env: { AGENTD_SESSIONS_PER_WORKER: "2" } })
    const client = await daemon.connect()
    const { id: s1 } = await createSession(client, { name: "streams", config: { tokenDelayMs: 5 } })
    await waitIdle(client, s1, 20_000)
    const { id: s2 } = await createSession(client, { name: "killed" })
    await waitIdle(client, s2, 20_000)
    const pid = (await stateOf(daemon, client, s1))["workerPid"] as number
    expect((await stateOf(daemon, client, s2))["workerPid"]).toBe(pid)
    expect(titleOf(pid)).toBe(HOST_TITLE)
    // The host is full: a spare host starts (a host with room is the spare). Up and listening:
    // once s2 is gone, the next session has the choice between a host with one session and an empty one.
    const deadline = Date.now() + 10_000
    while (hostProcesses(daemon).filter((p) => p !== pid).length < 1 || fs.readdirSync(hostDirsOf(daemon.pid)[0]!).filter((name) => /^h\d+\.sock$/.test(name)).length < 2) {
      if (Date.now() > deadline) throw new Error(`no spare host after 10 s: ${daemon.workerProcesses().map((p) => `${p}=${titleOf(p)}`).join(", ")}`)
      await sleep(50)
    }
    const spare = hostProcesses(daemon).filter((p) => p !== pid)
    expect(spare).toHaveLength(1)
    await sleep(300) // its worker_ready on its way to the daemon

    await attach(client, s1)
    const prompt = longPrompt("k", 300)
    await client.ok({ type: "prompt", activeSessionId: s1, message: prompt })
    await collectUntil(client, s1, (m) => isEvent("message_update")(m) && (m["event"].delta as string).startsWith(" k"), 10_000)
    await client.ok({ type: "kill", activeSessionId: s2 })
    expect(client.sequenced(s1).some(isEvent("agent_end")), "the turn ended before the kill: too fast to test").toBe(false)
    expect(isAlive(pid)).toBe(true)

    const turn = await collectTurn(client, s1, 20_000)
    expect(turn.map(shape)).not.toContain("turn_interrupted")
    expect(turn.map(shape)).not.toContain("status:recovering")
    expect(endContents(turn)).toEqual([`echo: ${prompt}`])
    expect(cursorGap(client.sequenced(s1))).toBeUndefined()
    expect(isAlive(pid)).toBe(true)
    const state1 = await stateOf(daemon, client, s1)
    expect(state1["workerPid"]).toBe(pid)
    expect(state1["restarts"]).toBe(0)
    const workers = await statusWorkers(daemon, client)
    expect(workers.map((w) => w.activeSessionId)).toEqual([s1])
    expect(workers[0]!.pid).toBe(pid)
    expect((await client.request({ type: "get_state", activeSessionId: s2 }))["error"]?.code).toBe("session_not_found")

    // The freed place is taken by the next session: the fullest host with room, not the empty spare.
    const { id: s3 } = await createSession(client, { name: "next" })
    await waitIdle(client, s3, 20_000)
    expect((await stateOf(daemon, client, s3))["workerPid"]).toBe(pid)
    await attach(client, s3)
    await client.ok({ type: "prompt", activeSessionId: s3, message: "third" })
    expect(endContents(await collectTurn(client, s3))).toEqual(["third", "echo: third"])

    // With the spare host up (another host with room), the host is stopped once its last session is killed.
    await client.ok({ type: "kill", activeSessionId: s1 })
    expect(isAlive(pid), "the host still has a session").toBe(true)
    await client.ok({ type: "kill", activeSessionId: s3 })
    expect(await waitGone([pid], 5_000), "the emptied host was not stopped").toEqual([])
    expect(isAlive(spare[0]!)).toBe(true)
    expect(await statusWorkers(daemon, client)).toEqual([])
    // The next session goes to the spare.
    const { id: s4 } = await createSession(client, { name: "after" })
    await waitIdle(client, s4, 20_000)
    expect((await stateOf(daemon, client, s4))["workerPid"]).toBe(spare[0])
  }, 40_000)

  it("a session created with launchEnv runs in a process of its own, not a host, and gets one again after a crash", async () => {
    const daemon = await useDaemon({ extraArgs: ["--sessions-per-worker", "3"] })
    const client = await daemon.connect()
    const { id: a } = await createSession(client, { name: "plain-a" })
    await waitIdle(client, a, 20_000)
    const { id: b } = await createSession(client, { name: "own", launchEnv: { HOSTS_E2E_PROBE: "launch-1234" } })
    await waitIdle(client, b, 20_000)
    const { id: c } = await createSession(client, { name: "plain-c" })
    await waitIdle(client, c, 20_000)
    const pa = (await stateOf(daemon, client, a))["workerPid"] as number
    const pb = (await stateOf(daemon, client, b))["workerPid"] as number
    const pc = (await stateOf(daemon, client, c))["workerPid"] as number
    expect(titleOf(pa)).toBe(HOST_TITLE)
    expect(pc).toBe(pa)
    expect(pb).not.toBe(pa)
    expect(titleOf(pb)).not.toBe(HOST_TITLE)
    expect(titleOf(pb)).toBe(`${WORKER_TITLE_PREFIX}${workerTitleKey(b)}`)
    expect(environOf(pb)).toContain("HOSTS_E2E_PROBE=launch-1234")
    expect(environOf(pa)).not.toContain("HOSTS_E2E_PROBE=launch-1234")
    const workers = await statusWorkers(daemon, client)
    expect(workers.find((w) => w.activeSessionId === b)?.pid).toBe(pb)
    expect(workers.filter((w) => w.pid === pb)).toHaveLength(1)
    expect(workers.filter((w) => w.pid === pa).map((w) => w.activeSessionId).sort()).toEqual([a, c].sort())

    for (const id of [a, b]) await attach(client, id)
    await client.ok({ type: "prompt", activeSessionId: b, message: "own process" })
    expect(endContents(await collectTurn(client, b))).toEqual(["own process", "echo: own process"])

    // Its process crashes: only it is restored, again in a process of its own with its launchEnv.
    process.kill(pb, "SIGKILL")
    const rest = await collectUntil(client, b, (m) => m["type"] === "session_status" && m["state"].worker === "ready", 20_000)
    expect(rest.map(shape)).toEqual(["status:recovering", "status:ready"])
    const pb2 = (await stateOf(daemon, client, b))["workerPid"] as number
    expect(pb2).not.toBe(pb)
    expect(pb2).not.toBe(pa)
    expect(titleOf(pb2)).toBe(`${WORKER_TITLE_PREFIX}${workerTitleKey(b)}`)
    expect(environOf(pb2)).toContain("HOSTS_E2E_PROBE=launch-1234")
    expect(client.sequenced(a).map(shape)).not.toContain("status:recovering")
    const sa = await stateOf(daemon, client, a)
    expect(sa["workerPid"]).toBe(pa)
    expect(sa["restarts"]).toBe(0)
    await client.ok({ type: "prompt", activeSessionId: a, message: "hosted" })
    expect(endContents(await collectTurn(client, a))).toEqual(["hosted", "echo: hosted"])
    await client.ok({ type: "prompt", activeSessionId: b, message: "again" })
    expect(endContents(await collectTurn(client, b))).toEqual(["again", "echo: again"])
  }, 40_000)

  it("daemon SIGKILLed: its hosts exit within 5 s; a restarted daemon (--sessions-per-worker 3) restores the sessions into hosts and they answer", async () => {
    const args = ["--sessions-per-worker", "3"]
    const first = await useDaemon({ extraArgs: args })
    const client = await first.connect()
    const ids: Array<string> = []
    for (let i = 0; i < 4; i++) {
      const { id } = await createSession(client, { name: `restart${i}` })
      await waitIdle(client, id, 20_000)
      ids.push(id)
    }
    for (const id of ids) await attach(client, id)
    await Promise.all(ids.map((id, i) => client.ok({ type: "prompt", activeSessionId: id, message: `before ${i}` })))
    await Promise.all(ids.map((id) => collectTurn(client, id, 20_000)))
    // One of them in the middle of a turn when the daemon dies.
    await client.ok({ type: "prompt", activeSessionId: ids[0], message: "/sleep 20000" })
    await collectUntil(client, ids[0]!, isEvent("tool_execution_start"))
    const listed = countByPid(await statusWorkers(first, client))
    expect(listed.size).toBe(2)
    const hosts = first.workerProcesses()
    expect(hosts.every((p) => titleOf(p) === HOST_TITLE), hosts.map((p) => `${p}=${titleOf(p)}`).join(", ")).toBe(true)
    for (const pid of listed.keys()) expect(hosts).toContain(pid)
    expect(hostDirsOf(first.pid)).toHaveLength(1)

    await first.sigkill()
    expect(await waitGone(hosts, 5_000), "hosts alive 5 s after their daemon's SIGKILL").toEqual([])

    const second = await useDaemon({ stateDir: first.stateDir, extraArgs: args })
    // The dead daemon's socket directory is removed by the next one.
    // Removed by the new daemon's pool in the background (its dead hosts' sockets refuse).
    for (const until = Date.now() + 5_000; hostDirsOf(first.pid).length > 0 && Date.now() < until;) await sleep(50)
    expect(hostDirsOf(first.pid), "the dead daemon's host dir was not removed").toEqual([])
    expect(hostDirsOf(second.pid)).toHaveLength(1)
    const again = await second.connect("again")
    const listedAgain = (await again.ok({ type: "list" }))["sessions"] as Array<Msg>
    expect(listedAgain.map((s) => s["activeSessionId"]).sort()).toEqual([...ids].sort())
    for (const id of ids) await attach(again, id)
    await Promise.all(ids.map((id, i) => again.ok({ type: "prompt", activeSessionId: id, message: `after ${i}` }, 20_000)))
    await Promise.all(ids.map((id) => waitIdle(again, id, 20_000)))
    for (const [i, id] of ids.entries()) {
      const contents = (await allMessages(again, id)).map((m) => m["content"])
      expect(contents.slice(0, 3), id).toEqual([`before ${i}`, `echo: before ${i}`, ...(i === 0 ? ["/sleep 20000"] : [`after ${i}`])])
      expect(contents.slice(-2), id).toEqual([`after ${i}`, `echo: after ${i}`])
    }
    const restored = await statusWorkers(second, again)
    expect(restored.map((w) => w.activeSessionId).sort()).toEqual([...ids].sort())
    const byPid = countByPid(restored)
    expect([...byPid.values()].every((n) => n <= 3), JSON.stringify([...byPid])).toBe(true)
    expect(byPid.size).toBe(2)
    for (const pid of byPid.keys()) {
      expect(titleOf(pid)).toBe(HOST_TITLE)
      expect(hosts).not.toContain(pid)
    }
  }, 40_000)

  it("a host that cannot be reached takes no more sessions (they go to another, with no restart) and is stopped once empty; a client env with no allowed key is no environment of its own", async () => {
    const daemon = await useDaemon({ extraArgs: ["--sessions-per-worker", "3"] })
    const client = await daemon.connect()
    const { id: a } = await createSession(client, { name: "first" })
    await waitIdle(client, a)
    const hostA = (await stateOf(daemon, client, a))["workerPid"] as number
    // Its socket vanishes (someone cleaned /tmp): the host itself runs on.
    const dir = hostDirsOf(daemon.pid)[0]!
    for (const name of fs.readdirSync(dir)) if (/^h\d+\.sock$/.test(name)) {
      if ((await probeSocket(path.join(dir, name))) === "answers") fs.rmSync(path.join(dir, name))
    }
    // A client env whose variables the daemon does not let through: no environment of its own.
    const { id: b } = await createSession(client, { name: "second", env: { NOT_ALLOWED_HOSTS_E2E: "1" } })
    await waitIdle(client, b)
    const stateB = await stateOf(daemon, client, b)
    expect(stateB["restarts"]).toBe(0)
    expect(stateB["workerPid"]).not.toBe(hostA)
    expect(titleOf(stateB["workerPid"] as number)).toBe(HOST_TITLE)
    // The first session is not disturbed, and answers.
    const stateA = await stateOf(daemon, client, a)
    expect(stateA["workerPid"], JSON.stringify(stateA)).toBe(hostA)
    await attach(client, a)
    await client.ok({ type: "prompt", activeSessionId: a, message: "still in the old host" })
    expect(endContents(await collectTurn(client, a))).toEqual(["still in the old host", "echo: still in the old host"])
    // Empty, the unreachable host is stopped.
    await client.ok({ type: "kill", activeSessionId: a })
    expect(await waitGone([hostA], 5_000), "the unreachable host was not stopped once empty").toEqual([])
  }, 40_000)

  it("a dead daemon's host directory is removed by the next daemon with hosts; a live one's (in another pid namespace: its pid runs nothing here) is not", async () => {
    const { spawn } = await import("node:child_process")
    const net = await import("node:net")
    const unusedPid = 4_194_000 + Math.floor(Math.random() * 200)
    const live = fs.mkdtempSync(path.join(os.tmpdir(), `agentd-hosts-${unusedPid}-`))
    const dead = fs.mkdtempSync(path.join(os.tmpdir(), `agentd-hosts-${unusedPid + 1}-`))
    const marker = net.createServer((c) => c.destroy())
    await new Promise<void>((resolve) => marker.listen(path.join(live, "daemon.sock"), resolve))
    // A marker nobody listens on any more: its process was SIGKILLed.
    const child = spawn(process.execPath, ["-e", `require("net").createServer().listen(${JSON.stringify(path.join(dead, "daemon.sock"))}, () => process.stdout.write("up"))`])
    await new Promise((resolve) => child.stdout!.once("data", resolve))
    child.kill("SIGKILL")
    await new Promise((resolve) => child.once("exit", resolve))
    try {
      expect(fs.existsSync(path.join(dead, "daemon.sock"))).toBe(true)
      await useDaemon({ extraArgs: ["--sessions-per-worker", "2"] })
      for (const until = Date.now() + 5_000; fs.existsSync(dead) && Date.now() < until;) await sleep(50)
      expect(fs.existsSync(dead), "the dead daemon's directory is still there").toBe(false)
      expect(fs.existsSync(live), "a live daemon's directory was removed").toBe(true)
    } finally {
      marker.close()
      fs.rmSync(live, { recursive: true, force: true })
      fs.rmSync(dead, { recursive: true, force: true })
    }
  }, 30_000)
})
