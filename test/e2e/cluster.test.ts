/**
 * `serve --store postgres://... --cluster` (docs/cluster.md): two runners over one store, real
 * `agentd serve` processes with their own state dirs and runner ports.
 *
 * 1. Routing: sessions created through runner A land on their owner (one of each is made);
 *    prompted through runner B, their turns reach a client attached through the owner with
 *    contiguous cursors; `get_state`, `get_messages` and `list` answer the same through either
 *    runner, naming the owner (`runner`); `status` lists both runners and their shards; an
 *    attach through a non-owner answers (test/e2e/clusterEvents.test.ts: its events).
 * 2. Names: unique across the runners (two creates of one name at once through both, a rename).
 * 3. Failover: the owner SIGKILLed mid-turn; the session comes back `ready` on the other runner
 *    once the lease ran out, its cut turn ended `turn_interrupted {reason: "daemon_restarted"}`,
 *    its cursors contiguous with what a client saw through the dead runner, its old worker gone,
 *    and it takes a new turn. The failover time is printed. The cut turn's prompt was forwarded
 *    by the survivor and its answer held by the owner (a test hook) until the kill. First the
 *    survivor's connections to the owner are cut (`ss -K`, root only): the cluster sends the
 *    prompt again to the same owner, which refuses the same request, and the survivor asks again
 *    with the command's id, waiting for the first run's answer (before: answered `internal` at
 *    once). Then the kill: the cluster sends it again, to the survivor once it owns the session,
 *    which answers it `accepted` without a second turn (its id is in the log with the cut
 *    turn's first status).
 * 4. A runner whose stop cannot end (made to hang at its start, uninterruptibly, as a stuck
 *    finalizer did: a test hook on A) SIGTERMed with a turn running: it exits 1 once its stop's
 *    bound (1 s here) has passed, saying where its stop was, and leaves no worker (they were
 *    still running: it killed them).
 *
 * The two runners are shared by both tests (the second kills one). The lease is shortened for
 * the test (`AGENTD_CLUSTER_LEASE_MS`, default here 6000; `AGENTD_TEST_CLUSTER_LEASE_MS` sets
 * it). Needs `npm run build` first, and PostgreSQL (test/support/postgres.ts). Shard locks are
 * advisory locks of the whole database: each cluster test file has a database of its own.
 */
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import { afterAll, beforeAll, expect, it } from "vitest"
import { describePg, freshDatabaseUrl } from "../support/postgres.js"
import { attachAndReplay } from "./attach.js"
import {
  cleanUpAfterTests,
  collectTurn,
  collectUntil,
  createSession,
  cursorGap,
  cursorOf,
  type Daemon,
  isEvent,
  isIdleStatus,
  type Msg,
  freshStateDir,
  sleep,
  startDaemon,
  waitGone
} from "./harness.js"
import { runCli } from "./cliRun.js"
import { freePort } from "./httpHarness.js"

cleanUpAfterTests()

const LEASE_MS = Number(process.env["AGENTD_TEST_CLUSTER_LEASE_MS"] ?? 6000)
/** How long runner B holds its answer to a forwarded prompt once its turn started (the test hook): B is killed first. */
const HOLD_MS = 30_000
/** Runner A's bound on its stop (its stop is made to hang). */
const STOP_BOUND_MS = 1000
/** `ss -K` closes sockets (root, a kernel with SOCK_DESTROY). */
const canKillSockets = process.getuid?.() === 0 && spawnSync("ss", ["-V"]).status === 0

it("--cluster without a PostgreSQL store exits 2 with a clear message, before the state dir is touched", async () => {
  const stateDir = freshStateDir()
  const flag = await runCli(["serve", "--state-dir", stateDir, "--store", "files", "--cluster"])
  expect(flag.code, flag.stderr).toBe(2)
  expect(flag.stderr).toMatch(/--cluster needs a PostgreSQL store/)
  const env = await runCli(["serve", "--state-dir", stateDir], { env: { AGENTD_CLUSTER: "1" } })
  expect(env.code, env.stderr).toBe(2)
  expect(env.stderr).toMatch(/--cluster needs a PostgreSQL store/)
  expect(fs.existsSync(stateDir)).toBe(false)
})

describePg("serve --cluster: two runners over one PostgreSQL store", () => {
  let a: Daemon
  let b: Daemon
  let addressOf: Map<Daemon, string>
  let drop: (() => Promise<void>) | undefined
  /** A session owned by each runner, made by the first test. */
  const ownedBy = new Map<string, string>()

  const startRunner = async (url: string, env: Record<string, string> = {}): Promise<{ daemon: Daemon; address: string }> => {
    const address = `127.0.0.1:${await freePort()}`
    const daemon = await startDaemon({
      // Kept across the tests of this block (the second kills one); afterAll cleans them up.
      shared: true,
      extraArgs: ["--store", url, "--cluster", "--runner-address", address],
      env: { AGENTD_CLUSTER_LEASE_MS: String(LEASE_MS), AGENTD_WARM_SPARE: "0", ...env }
    })
    return { daemon, address }
  }

  beforeAll(async () => {
    const store = await freshDatabaseUrl()
    drop = store.drop
    // At the same moment, on a new store: both race to make the store's and the cluster's tables
    // (a race that one of them lost, and died of, in about one start in three before it was retried).
    // B, killed by the last test, holds its answer to a forwarded prompt (see there).
    // A's stop hangs (the last test), bounded at STOP_BOUND_MS.
    const [ra, rb] = await Promise.all([
      startRunner(store.url, { AGENTD_TEST_HANG_STOP: "1", AGENTD_CLUSTER_STOP_TIMEOUT_MS: String(STOP_BOUND_MS) }),
      startRunner(store.url, { AGENTD_TEST_FORWARDED_PROMPT_REPLY_DELAY_MS: String(HOLD_MS) })
    ])
    a = ra.daemon
    b = rb.daemon
    addressOf = new Map([[a, ra.address], [b, rb.address]])
  }, 60_000)

  afterAll(async () => {
    await a?.cleanup()
    await b?.cleanup()
    await drop?.()
  }, 30_000)

  /** Polls `status` until both runners are listed holding every shard between them. */
  const settled = async (client: Awaited<ReturnType<Daemon["connect"]>>, runners: number): Promise<Msg> => {
    const deadline = Date.now() + 30_000
    for (;;) {
      const status = await client.ok({ type: "status" })
      const listed = (status["runners"] ?? []) as Array<Msg>
      const total = listed.reduce((n, r) => n + (r["shards"] as number), 0)
      if (listed.length === runners && total === 300 && listed.every((r) => r["shards"] > 0 && r["healthy"] === true)) return status
      if (Date.now() > deadline) throw new Error(`runners not settled: ${JSON.stringify(listed)}`)
      await sleep(100)
    }
  }

  it("a session made through A runs on its owner; prompted through B, its events reach a client attached to the owner", async () => {
    const ca = await a.connect("A")
    const cb = await b.connect("B")
    const status = await settled(ca, 2)
    expect(status["runner"]).toBe(addressOf.get(a))
    expect((status["runners"] as Array<Msg>).map((r) => r["address"]).sort()).toEqual([addressOf.get(a), addressOf.get(b)].sort())

    // Sessions made through A until one is owned by each runner (the shard is the hash of the id).
    for (let i = 0; i < 20 && ownedBy.size < 2; i++) {
      const { id, data } = await createSession(ca)
      const owner = data["state"]["runner"] as string
      expect([addressOf.get(a), addressOf.get(b)]).toContain(owner)
      expect((await cb.ok({ type: "get_state", activeSessionId: id }))["runner"]).toBe(owner)
      if (!ownedBy.has(owner)) ownedBy.set(owner, id)
    }
    expect(ownedBy.size).toBe(2)

    for (const [owner, id] of ownedBy) {
      const ownerDaemon = owner === addressOf.get(a) ? a : b
      const other = ownerDaemon === a ? b : a
      const watcher = await ownerDaemon.connect("owner")
      await attachAndReplay(watcher, { activeSessionId: id })
      // Prompted through B: forwarded to the owner when B is not it.
      await cb.ok({ type: "prompt", activeSessionId: id, message: `through B to ${owner}` })
      const turn = await collectTurn(watcher, id, 20_000)
      expect(turn.filter(isEvent("message_end")).map((m) => m["event"]["message"]["content"])).toEqual([
        `through B to ${owner}`,
        `echo: through B to ${owner}`
      ])
      // The baseline then the turn, one after the other.
      expect(cursorGap(watcher.sequenced(id))).toBeUndefined()

      // Reads through either runner agree and name the owner.
      for (const c of [ca, cb]) {
        const state = await c.ok({ type: "get_state", activeSessionId: id })
        expect(state).toMatchObject({ runner: owner, busy: false, worker: "ready", messageCount: 2 })
        const page = await c.ok({ type: "get_messages", activeSessionId: id })
        expect(page["messages"].map((m: Msg) => m["content"])).toEqual([`through B to ${owner}`, `echo: through B to ${owner}`])
      }

      // Attach through the runner that does not own it: the same events (clusterEvents.test.ts
      // covers it in depth).
      const stranger = await other.connect("stranger")
      const through = await attachAndReplay(stranger, { activeSessionId: id })
      expect(through.data["lastEventCursor"]).toEqual(cursorOf(watcher.sequenced(id).at(-1)!))
    }

    // `list` through either runner: every session of the cluster, each with its owner.
    for (const c of [ca, cb]) {
      const listed = new Map(((await c.ok({ type: "list" }))["sessions"] as Array<Msg>).map((s) => [s["activeSessionId"], s["runner"]]))
      for (const [owner, id] of ownedBy) expect(listed.get(id)).toBe(owner)
    }
  }, 60_000)

  it("names are unique across the cluster: two creates of one name through A and B at once, exactly one wins; a rename to a held name is refused through either runner", async () => {
    const ca = await a.connect("A names")
    const cb = await b.connect("B names")
    // Each pair's two sessions get random ids: about half the pairs have their two creates on
    // two different owners, which see only their own sessions' names.
    const owners = new Set<string>()
    const winners: Array<{ id: string; name: string }> = []
    for (let i = 0; i < 12; i++) {
      const name = `twin ${i}`
      const answers = await Promise.all([ca, cb].map((c) => c.request({ type: "create", name })))
      const won = answers.filter((r) => r["success"] === true)
      expect(won.length, JSON.stringify(answers)).toBe(1)
      const lost = answers.find((r) => r["success"] !== true)!
      expect(lost["error"]["code"], JSON.stringify(lost)).toBe("name_taken")
      owners.add(won[0]!["data"]["state"]["runner"])
      winners.push({ id: won[0]!["data"]["activeSessionId"], name })
    }
    expect(owners.size, "the winners are spread over both runners").toBe(2)
    // A rename, sent through either runner, to a name held by a session of the other owner.
    const [first, second] = [winners[0]!, winners.find((w, i) => i > 0)!]
    for (const c of [ca, cb]) {
      const refused = await c.request({ type: "rename", activeSessionId: second.id, name: first.name })
      expect(refused["error"]?.["code"], JSON.stringify(refused)).toBe("name_taken")
    }
    // Killed, a session gives its name back to the whole cluster.
    await ca.ok({ type: "kill", activeSessionId: first.id })
    const again = await cb.ok({ type: "create", name: first.name })
    expect(again["state"]["name"]).toBe(first.name)
    for (const w of [...winners.slice(1), { id: again["activeSessionId"] as string }]) await cb.ok({ type: "kill", activeSessionId: w.id })
  }, 60_000)

  it("the owner SIGKILLed mid-turn: the session comes back ready on the other runner, cursors contiguous; the forwarded prompt the cluster sends again starts no second turn", async () => {
    expect(ownedBy.size).toBe(2)
    const victim = b
    const survivor = a
    const id = ownedBy.get(addressOf.get(victim)!)!
    const watcher = await victim.connect("owner")
    const cs = await survivor.connect("survivor")
    await attachAndReplay(watcher, { activeSessionId: id })
    // A turn that is still running when its runner dies (a tool call that sleeps), prompted
    // through the survivor: forwarded to the owner, which holds its answer (the test hook) so
    // that the kill breaks the connection before the answer came back. (A connection of its own:
    // responses keep their order, and this one comes after the failover.)
    const prompter = await survivor.connect("prompter")
    const prompted = prompter.request({ type: "prompt", activeSessionId: id, message: "/sleep 60000" }, LEASE_MS + 60_000)
    let answeredBeforeKill = false
    void prompted.then(() => (answeredBeforeKill = true), () => undefined)
    await collectUntil(watcher, id, isEvent("tool_execution_start"), 20_000)
    const started = watcher.sequenced(id).filter((m) => m["type"] === "session_status" && m["state"]["busy"] === true).at(-1)
    expect(typeof started?.["promptId"], "the turn's first status carries the forwarded prompt's id").toBe("string")
    if (canKillSockets) {
      // The survivor's connections to the owner cut: the prompt is sent again to the same owner.
      const cut = spawnSync("ss", ["-K", "dst", "127.0.0.1", "dport", "=", addressOf.get(victim)!.split(":")[1]!], { encoding: "utf8" })
      expect(cut.status, cut.stderr).toBe(0)
      expect(cut.stdout.split("\n").filter((l) => l.startsWith("tcp")).length, `the survivor had a connection to the owner: ${cut.stdout}`).toBeGreaterThan(0)
      // Time for the resend and its refusal (answered `internal` at once before the fix).
      await sleep(500)
      expect(answeredBeforeKill, "the prompt sent again to the same owner waits for the first run's answer").toBe(false)
    }
    const before = await cs.ok({ type: "get_state", activeSessionId: id })
    expect(before).toMatchObject({ busy: true, runner: addressOf.get(victim) })
    const oldWorker = before["workerPid"] as number
    const seen = watcher.sequenced(id)
    const lastSeen = cursorOf(seen[seen.length - 1]!)

    // Else the cluster had nothing to send again (the hold was too short for this machine's load).
    expect(answeredBeforeKill, "the owner answered the prompt before it was killed").toBe(false)
    const killedAt = Date.now()
    await victim.sigkill()
    let state: Msg
    for (;;) {
      // A get_state sent to the dead owner waits until its shard is reassigned: the lease.
      const r = await cs.request({ type: "get_state", activeSessionId: id }, LEASE_MS + 30_000)
      state = r["data"] ?? {}
      if (state["runner"] === addressOf.get(survivor) && state["worker"] === "ready" && state["busy"] === false) break
      if (Date.now() - killedAt > LEASE_MS + 60_000) throw new Error(`no failover after ${LEASE_MS / 1000 + 60} s: ${JSON.stringify(r)}`)
      await sleep(100)
    }
    const failoverMs = Date.now() - killedAt
    process.stderr.write(`[cluster.test] failover (owner SIGKILL to ready on the other runner), lease ${LEASE_MS} ms: ${failoverMs} ms\n`)
    // The prompt, sent again by the cluster to its new owner, is answered there as the turn it
    // started: accepted, no second turn (before the fix: a second `/sleep 60000` turn, busy).
    expect(await prompted).toMatchObject({ success: true, data: { accepted: true } })
    // The dead runner's worker is gone: the session has one live worker, the new one.
    expect(await waitGone([oldWorker], 5_000)).toEqual([])
    expect(state["workerPid"]).not.toBe(oldWorker)

    // Resumed through the survivor from the last cursor seen through the dead runner.
    const resumed = await attachAndReplay(cs, { activeSessionId: id, resumeCursor: lastSeen })
    expect(resumed.data["replay"]["status"]).toBe("complete")
    const after = [...resumed.replayed]
    if (!after.some(isIdleStatus)) after.push(...await collectUntil(cs, id, isIdleStatus, 20_000))
    expect(cursorGap([...seen, ...after])).toBeUndefined()
    expect(after.find(isEvent("turn_interrupted"))?.["event"]).toEqual({ type: "turn_interrupted", reason: "daemon_restarted" })
    // A turn starts with the status busy and ready (the restore's busy ones say `recovering`).
    const turnStarts = after.filter((m) => m["type"] === "session_status" && m["state"]["busy"] === true && m["state"]["worker"] === "ready")
    expect(turnStarts, "no second turn").toEqual([])
    expect((await cs.ok({ type: "get_state", activeSessionId: id }))["busy"]).toBe(false)

    // It takes a new turn on its new owner.
    await cs.ok({ type: "prompt", activeSessionId: id, message: "after the failover" })
    const turn = await collectTurn(cs, id, 20_000)
    expect(turn.filter(isEvent("message_end")).map((m) => m["event"]["message"]["content"])).toEqual(["after the failover", "echo: after the failover"])
    expect(cursorGap(cs.sequenced(id))).toBeUndefined()
  }, 90_000 + LEASE_MS * 2)

  it("a runner whose stop cannot end exits 1 once its bound passed, with no worker left", async () => {
    // The session the last test moved to A (its worker started there).
    const id = ownedBy.get(addressOf.get(b)!)!
    const ca = await a.connect("A stop")
    await attachAndReplay(ca, { activeSessionId: id })
    await ca.ok({ type: "prompt", activeSessionId: id, message: "/sleep 60000" })
    await collectUntil(ca, id, isEvent("tool_execution_start"), 20_000)
    const workers = a.workerProcesses()
    expect(workers.length).toBeGreaterThan(0)
    const signalled = Date.now()
    const exit = await a.stop("SIGTERM", STOP_BOUND_MS + 20_000)
    const tookMs = Date.now() - signalled
    process.stderr.write(`[cluster.test] a hanging stop: exit ${exit.code} after ${tookMs} ms (bound ${STOP_BOUND_MS} ms)\n`)
    expect(exit.code, a.output).toBe(1)
    expect(tookMs).toBeGreaterThanOrEqual(STOP_BOUND_MS)
    expect(a.stderr.slice(-2000)).toMatch(/the runner's stop did not end within 1000 ms \(its last step: settling its sessions\): [1-9]\d* worker\(s\) SIGKILLed; still open: /)
    // Its workers were killed before it exited, as a SIGKILLed runner's are gone.
    expect(await waitGone(workers, 2_000)).toEqual([])
    expect(a.workerProcesses()).toEqual([])
  }, 60_000)
})
