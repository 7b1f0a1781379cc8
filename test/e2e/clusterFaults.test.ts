/**
 * Cluster failures with three runners over one private PostgreSQL (docs/cluster.md sections 5
 * and 8): real `agentd serve --cluster` processes with their own state dirs and runner ports,
 * the lease shortened (`AGENTD_CLUSTER_LEASE_MS`, 6000 here; `AGENTD_TEST_CLUSTER_LEASE_MS`
 * sets it). One cluster start for the file; the tests run in order on it:
 *
 * 1. Sessions spread over the three runners, a follower attached to each (through its owner).
 * 2. An owner SIGKILLed mid-turn: its sessions come back on the others, their cut turns end
 *    `turn_interrupted {reason: "daemon_restarted"}`, followers resume by cursor.
 * 3. The killed runner restarted: shards move back to it (a rebalance, turns running meanwhile).
 * 4. A rolling restart of all three (SIGTERM, one by one, each back and the cluster settled
 *    before the next), a long turn running and followers following.
 *
 * 3 and 4 are opt-in (`AGENTD_TEST_CLUSTER_LONG=1`): about 40 s more at load 6, over the suite's
 * budget. (A rejoin with shards moving back while turns run is also in clusterPartition.test.ts,
 * which runs by default.)
 *
 * Throughout: the worker census (test/support/workerCensus.ts) samples /proc every 20 ms and
 * records any moment where a session has two live workers (there must be none); probes send
 * `get_state` through every live runner and every one must be answered (a probe on a runner
 * that dies under it excepted); at the end every follower's messages have contiguous cursors
 * (no gap, no duplicate) from its first attach to its last turn.
 */
import { afterAll, beforeAll, expect, it } from "vitest"
import { describePg, freshDatabaseUrl } from "../support/postgres.js"
import { WorkerCensus } from "../support/workerCensus.js"
import { workerTitleKey } from "../../src/WorkerProtocol.js"
import { Cluster, Follower, type Runner } from "./clusterHarness.js"
import { cleanUpAfterTests, type Client, cursorGap, isEvent, sleep } from "./harness.js"

cleanUpAfterTests()

const LEASE_MS = Number(process.env["AGENTD_TEST_CLUSTER_LEASE_MS"] ?? 6000)
/** The long variants (see the header). */
const itLong = process.env["AGENTD_TEST_CLUSTER_LONG"] === "1" ? it : it.skip

const log = (line: string) => process.stderr.write(`[clusterFaults] ${line}\n`)

/** `get_state` probes through every live runner; every one must be answered. */
class Probes {
  sent = 0
  answered = 0
  /** Probes whose runner died before answering (its connection closed): not an unanswered command. */
  lostWithRunner = 0
  readonly unanswered: Array<string> = []
  private running = true
  private readonly loops: Array<Promise<void>> = []
  constructor(private readonly cluster: Cluster, private readonly sessions: () => Array<string>) {}

  start(): this {
    this.loops.push(this.loop())
    return this
  }

  private async one(client: Client, id: string): Promise<void> {
    this.sent++
    const closed = client.waitClosed(60_000).then((c) => (c ? "closed" : "timeout"))
    const answer = client.request({ type: "get_state", activeSessionId: id }, 60_000).then(() => "answered", () => "timeout")
    const outcome = await Promise.race([answer, closed])
    if (outcome === "answered") this.answered++
    else if (outcome === "closed" || client.closed) this.lostWithRunner++
    else this.unanswered.push(`get_state ${id} through ${client.label}`)
  }

  private async loop(): Promise<void> {
    const inFlight = new Set<Promise<void>>()
    while (this.running) {
      const ids = this.sessions()
      for (const runner of this.cluster.live()) {
        if (ids.length === 0) break
        let client: Client
        try {
          client = await this.cluster.clientOf(runner)
        } catch {
          continue
        }
        const p = this.one(client, ids[Math.floor(Math.random() * ids.length)]!).finally(() => inFlight.delete(p))
        inFlight.add(p)
      }
      await sleep(300)
    }
    await Promise.all(inFlight)
  }

  async stop(): Promise<void> {
    this.running = false
    await Promise.all(this.loops)
  }
}

describePg("serve --cluster: three runners, a runner SIGKILLed, restarted, and a rolling restart", () => {
  let cluster: Cluster
  let drop: (() => Promise<void>) | undefined
  const sessions: Array<string> = []
  const followers = new Map<string, Follower>()
  const census = new WorkerCensus({ sessions: (key) => sessions.some((id) => workerTitleKey(id) === key) })
  let probes: Probes

  beforeAll(async () => {
    const store = await freshDatabaseUrl()
    drop = store.drop
    cluster = new Cluster({ storeUrl: store.url, leaseMs: LEASE_MS })
    for (let i = 0; i < 3; i++) await cluster.add()
    census.start()
    probes = new Probes(cluster, () => sessions).start()
  }, 90_000)

  afterAll(async () => {
    census.stop()
    await probes?.stop()
    for (const f of followers.values()) f.close()
    await cluster?.cleanup()
    await drop?.()
  }, 60_000)

  const ownerOf = async (id: string): Promise<string> => (await cluster.until(id, (s) => typeof s["runner"] === "string"))["runner"]

  /** Sessions of each runner, by the current owners. */
  const byOwner = async (): Promise<Map<string, Array<string>>> => {
    const out = new Map<string, Array<string>>()
    for (const id of sessions) {
      const owner = await ownerOf(id)
      out.set(owner, [...(out.get(owner) ?? []), id])
    }
    return out
  }

  /**
   * Every session idle on a live runner (its worker ready, or passivated: an idle session that
   * moved starts a worker at its next prompt), its follower attached through its owner.
   */
  const allReady = async () => {
    for (const id of sessions) {
      await cluster.until(id, (s) =>
        s["busy"] === false && ["ready", "passivated"].includes(s["worker"]) && cluster.byAddress(s["runner"])?.running === true)
      await followers.get(id)!.follow()
    }
  }

  /** A turn on each session through a runner that does not own it (when there is one); the followers see it. */
  const turnOnEach = async (label: string) => {
    await Promise.all(sessions.map((id) => followers.get(id)!.turn(`${label} ${id}`)))
  }

  const checkInvariants = (where: string) => {
    const drops = [...followers.values()].reduce((n, f) => n + f.silentDrops, 0)
    log(`${where}: ${census.summary()}; probes ${probes.answered}/${probes.sent} answered, ${probes.lostWithRunner} lost with their runner; ` +
      `${drops} attachments found dropped without notice`)
    expect(census.doubles, census.summary()).toEqual([])
    expect(probes.unanswered).toEqual([])
    for (const f of followers.values()) expect(cursorGap(f.sequenced), `session ${f.id}`).toBeUndefined()
  }

  it("sessions spread over the three runners, each followed through its owner, take turns routed through any runner", async () => {
    const listed = await cluster.settled(3)
    expect(listed.map((r) => r["address"]).sort()).toEqual(cluster.runners.map((r) => r.address).sort())
    const owners = new Set<string>()
    const creators = cluster.runners
    for (let i = 0; (i < 6 || owners.size < 3) && i < 30; i++) {
      const created = await (await cluster.clientOf(creators[i % 3]!)).ok({ type: "create" }, 30_000)
      const id = created["activeSessionId"] as string
      sessions.push(id)
      owners.add(created["state"]["runner"])
      followers.set(id, new Follower(cluster, id))
    }
    expect(owners.size).toBe(3)
    await allReady()
    await turnOnEach("first")
    // Every session's worker was seen in the process table under its session's title.
    for (const id of sessions) expect(census.seen.get(workerTitleKey(id))?.size ?? 0, `workers of ${id} in /proc`).toBeGreaterThan(0)
    checkInvariants("spread")
  }, 90_000)

  it("an owner SIGKILLed mid-turn: its sessions come back on the others, cut turns end daemon_restarted, followers resume by cursor", async () => {
    const owned = await byOwner()
    const victim: Runner = cluster.runners.find((r) => (owned.get(r.address)?.length ?? 0) > 0)!
    const cut = owned.get(victim.address)!
    const others = sessions.filter((id) => !cut.includes(id))
    // A turn that outlives its runner on each of its sessions; short ones elsewhere.
    const marks = new Map<string, number>()
    for (const id of sessions) {
      const f = followers.get(id)!
      marks.set(id, f.sequenced.length)
      await (await cluster.clientOf(victim)).ok({ type: "prompt", activeSessionId: id, message: cut.includes(id) ? "/sleep 60000" : "/sleep 3000" }, 30_000)
    }
    for (const id of cut) await followers.get(id)!.waitFor(isEvent("tool_execution_start"), marks.get(id)!)
    const oldPids = new Map<string, number>()
    for (const id of cut) oldPids.set(id, (await cluster.state(id))!["workerPid"])

    const killedAt = Date.now()
    await victim.daemon.sigkill()
    const failover = await Promise.all(cut.map(async (id) => {
      const state = await cluster.until(id, (s) => s["runner"] !== victim.address && s["worker"] === "ready" && s["busy"] === false, 90_000)
      expect(state["workerPid"]).not.toBe(oldPids.get(id))
      return Date.now() - killedAt
    }))
    log(`failover of ${cut.length} sessions after SIGKILL (lease ${LEASE_MS} ms): ${failover.join(", ")} ms`)

    for (const id of cut) {
      const f = followers.get(id)!
      await f.follow()
      const interrupted = await f.waitFor(isEvent("turn_interrupted"), marks.get(id)!)
      expect(interrupted["event"]).toEqual({ type: "turn_interrupted", reason: "daemon_restarted" })
    }
    // The sessions of the survivors finished their turns untouched.
    for (const id of others) {
      const f = followers.get(id)!
      await f.waitFor((m) => isEvent("tool_execution_end")(m), marks.get(id)!)
      expect(f.sequenced.slice(marks.get(id)!).some(isEvent("turn_interrupted"))).toBe(false)
    }
    await allReady()
    await turnOnEach("after the kill")
    checkInvariants("SIGKILL")
  }, 150_000)

  itLong("(AGENTD_TEST_CLUSTER_LONG=1) the killed runner restarted: shards move back to it while turns run, never two live workers", async () => {
    const down = cluster.runners.find((r) => !r.running)!
    const marks = new Map(sessions.map((id) => [id, followers.get(id)!.sequenced.length]))
    // Turns that may be cut by the move (they end either way).
    for (const id of sessions) await (await cluster.clientOf(cluster.live()[0]!)).ok({ type: "prompt", activeSessionId: id, message: "/sleep 4000" }, 30_000)
    await cluster.restart(down)
    await cluster.settled(3)
    const owned = await byOwner()
    log(`after the restart: ${[...owned].map(([r, ids]) => `${r} ${ids.length}`).join(", ")}`)
    expect(owned.get(down.address)?.length ?? 0).toBeGreaterThan(0)
    for (const id of sessions) {
      const f = followers.get(id)!
      // Its turn ended: finished, or cut by the move (then `daemon_restarted`).
      const end = await f.waitFor((m) => isEvent("tool_execution_end")(m) || isEvent("turn_interrupted")(m), marks.get(id)!)
      if (isEvent("turn_interrupted")(end)) expect(end["event"]["reason"]).toBe("daemon_restarted")
    }
    await allReady()
    await turnOnEach("after the rejoin")
    checkInvariants("restart")
  }, 150_000)

  itLong("(AGENTD_TEST_CLUSTER_LONG=1) a rolling restart of all three (SIGTERM one by one) with a long turn running: every command answered, no gap, no duplicate", async () => {
    const long = sessions[0]!
    const f = followers.get(long)!
    const mark = f.sequenced.length
    await (await cluster.clientOf(cluster.live()[0]!)).ok({ type: "prompt", activeSessionId: long, message: "/sleep 120000" }, 30_000)
    await f.waitFor(isEvent("tool_execution_start"), mark)
    const moves: Array<string> = []
    // The long turn's owner first: its hand-over is measured (SIGTERM to the session ready on another runner).
    const owner = await ownerOf(long)
    const order = [...cluster.runners].sort((a, b) => Number(b.address === owner) - Number(a.address === owner))
    for (const runner of order) {
      // Not asked anything by the helpers while it stops (its socket goes away).
      runner.cut = true
      const t0 = Date.now()
      const handedOver = runner.address === owner
        ? cluster.until(long, (s) => s["runner"] !== owner && s["busy"] === false && ["ready", "passivated"].includes(s["worker"]), 90_000)
          .then(() => Date.now() - t0)
        : undefined
      const stopped = await runner.daemon.stop("SIGTERM", 60_000)
      expect(stopped.code, runner.daemon.output).toBe(0)
      if (handedOver !== undefined) {
        log(`SIGTERM of the long turn's owner: stopped after ${Date.now() - t0} ms, its session ready on another runner after ${await handedOver} ms (lease ${LEASE_MS} ms)`)
      }
      await cluster.settled(2)
      await cluster.restart(runner)
      runner.cut = false
      await cluster.settled(3)
      for (const id of sessions) await followers.get(id)!.follow()
      moves.push(`${runner.address} ${Date.now() - t0} ms`)
    }
    log(`rolling restart, each runner stopped and back with the cluster settled: ${moves.join(", ")}`)
    // The long turn was cut when its runner stopped, as a graceful stop cuts it.
    const interrupted = await f.waitFor(isEvent("turn_interrupted"), mark)
    expect(interrupted["event"]).toEqual({ type: "turn_interrupted", reason: "daemon_shutdown" })
    // Once: its new owner found it idle, and cut nothing more.
    expect(f.sequenced.slice(mark).filter(isEvent("turn_interrupted")).length).toBe(1)
    await allReady()
    await turnOnEach("after the rolling restart")
    // The probes in flight are waited for, so that each is counted answered or not.
    await probes.stop()
    const attachments = [...followers.values()].map((x) => x.attachments)
    log(`followers re-attached ${attachments.reduce((a, b) => a + b, 0) - attachments.length} times in all`)
    checkInvariants("rolling restart")
  }, 240_000)
})
