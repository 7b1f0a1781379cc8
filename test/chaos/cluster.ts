/**
 * Chaos over a cluster (`npm run chaos -- --cluster N`, docs/cluster.md): N real runners
 * (`agentd serve --cluster`, each its own state dir and runner port) over one private
 * PostgreSQL of the run, each reaching it through a TCP proxy of its own; sessions spread over
 * them, a follower per session (attached through its owner, re-attached from its last cursor
 * when its runner dies or the session moves), prompts sent through random runners, and faults:
 *
 * - `runner_kill`: SIGKILL a runner, start it again a few seconds later on its state dir;
 * - `runner_partition`: cut a runner off from PostgreSQL for a while: its proxy closes the
 *   server's side of every connection at once (as a server that noticed a dead peer: its
 *   advisory locks are freed) and swallows everything the runner sends (a link gone quiet: the
 *   runner sees no reset, only silence), then lets it connect again. Runner-to-runner traffic
 *   is not cut (a proxy per runner only stands between it and the database).
 *
 * Invariants: at no sample of /proc does a session have two live workers (test/support/
 * workerCensus.ts); every command is answered within its bound unless its connection died with
 * its runner; each follower's messages have contiguous cursors across all its attachments (no
 * gap, no duplicate) and every resume from a cursor replays `complete`; a cut turn ends
 * `turn_interrupted {reason: "daemon_restarted"}`; at the end, everything healed, every session
 * takes a turn through a runner that does not own it.
 */
import { execFileSync } from "node:child_process"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { WorkerCensus } from "../support/workerCensus.js"
import { workerTitleKey } from "../../src/WorkerProtocol.js"
import { ChaosDaemon, sleep } from "./daemon.js"
import { Rng } from "./rng.js"

const here = path.dirname(fileURLToPath(import.meta.url))
const PG_SCRIPT = path.resolve(here, "..", "..", "scripts", "pg-test-server.sh")

export const CLUSTER_FAULT_KINDS = ["runner_kill", "runner_partition"] as const
export type ClusterFaultKind = typeof CLUSTER_FAULT_KINDS[number]

export interface ClusterRunOptions {
  readonly seed: number
  readonly runners: number
  readonly seconds: number
  readonly kinds?: ReadonlyArray<ClusterFaultKind>
  readonly leaseMs?: number
  readonly verbose?: boolean
}

export interface ClusterRunResult {
  readonly seed: number
  readonly violation: string | undefined
  readonly counts: Record<string, number>
  readonly stats: Record<string, number>
  readonly census: string
  readonly schedule: ReadonlyArray<string>
}

type Msg = Record<string, any>
interface Cursor {
  readonly generation: number
  readonly sequence: number
}

/** A TCP proxy in front of PostgreSQL's Unix socket that can be cut (see the module's header). */
class PgProxy {
  private server: net.Server | undefined
  private pairs = new Set<{ client: net.Socket; upstream: net.Socket | undefined }>()
  cut = false
  port = 0
  constructor(private readonly upstreamPath: string) {}

  async start(): Promise<void> {
    this.server = net.createServer((client) => {
      const pair: { client: net.Socket; upstream: net.Socket | undefined } = { client, upstream: undefined }
      this.pairs.add(pair)
      client.on("error", () => {})
      client.on("close", () => {
        pair.upstream?.destroy()
        this.pairs.delete(pair)
      })
      if (this.cut) {
        client.on("data", () => {}) // swallowed
        return
      }
      const upstream = net.createConnection({ path: this.upstreamPath })
      pair.upstream = upstream
      upstream.on("error", () => {})
      upstream.on("close", () => {
        if (!this.cut) client.destroy()
      })
      client.on("data", (d) => {
        if (!this.cut) upstream.write(d)
      })
      upstream.on("data", (d) => {
        if (!this.cut) client.write(d)
      })
    })
    await new Promise<void>((resolve) => this.server!.listen(0, "127.0.0.1", resolve))
    this.port = (this.server!.address() as net.AddressInfo).port
  }

  /** The server's side closed now, the runner's side left open and silent. */
  partition(): void {
    this.cut = true
    for (const pair of this.pairs) pair.upstream?.destroy()
  }

  /** The runner's stale connections reset, new ones proxied again. */
  heal(): void {
    this.cut = false
    for (const pair of this.pairs) pair.client.destroy()
  }

  close(): void {
    for (const pair of this.pairs) {
      pair.client.destroy()
      pair.upstream?.destroy()
    }
    this.server?.close()
  }
}

/** A line client of one runner's socket. */
class LineClient {
  readonly all: Array<Msg> = []
  private waiters = new Map<string, (m: Msg | undefined) => void>()
  private buf = ""
  closed = false
  private seq = 0
  private constructor(private readonly socket: net.Socket, readonly label: string) {
    socket.setEncoding("utf8")
    socket.on("data", (d: string) => {
      this.buf += d
      let nl: number
      while ((nl = this.buf.indexOf("\n")) >= 0) {
        const line = this.buf.slice(0, nl)
        this.buf = this.buf.slice(nl + 1)
        if (line === "") continue
        const m = JSON.parse(line) as Msg
        this.all.push(m)
        if (m["type"] === "response") {
          const w = this.waiters.get(m["id"])
          this.waiters.delete(m["id"])
          w?.(m)
        }
      }
    })
    socket.on("error", () => {})
    socket.on("close", () => {
      this.closed = true
      for (const w of this.waiters.values()) w(undefined)
      this.waiters.clear()
    })
  }

  static connect(socketPath: string, label: string): Promise<LineClient> {
    return new Promise((resolve, reject) => {
      const socket = net.createConnection({ path: socketPath })
      const client = new LineClient(socket, label)
      socket.once("error", reject)
      const started = Date.now()
      const waitHello = () => {
        if (client.all.some((m) => m["type"] === "daemon_hello")) return resolve(client)
        if (client.closed || Date.now() - started > 10_000) return reject(new Error(`${label}: no hello`))
        setTimeout(waitHello, 10)
      }
      socket.once("connect", waitHello)
    })
  }

  /** The response, or undefined when the connection closed first; "timeout" past the bound. */
  request(command: Msg, boundMs: number): Promise<Msg | undefined | "timeout"> {
    if (this.closed) return Promise.resolve(undefined)
    const id = `${this.label}-${++this.seq}`
    return new Promise((resolve) => {
      const timer = setTimeout(() => {
        this.waiters.delete(id)
        resolve("timeout")
      }, boundMs)
      this.waiters.set(id, (m) => {
        clearTimeout(timer)
        resolve(m)
      })
      this.socket.write(JSON.stringify({ type: "command", id, protocol: { name: "agentd", version: 1 }, command }) + "\n")
    })
  }

  sequenced(id: string): Array<Msg> {
    return this.all.filter((m) => ["session_event", "session_status", "session_closed"].includes(m["type"]) && m["activeSessionId"] === id)
  }

  close(): void {
    this.socket.destroy()
  }
}

const follows = (prev: Cursor | undefined, c: Cursor): boolean =>
  prev === undefined ||
  (c.generation === prev.generation && c.sequence === prev.sequence + 1) ||
  (c.generation > prev.generation && c.sequence === 0)

class ViolationError extends Error {}

export const runClusterChaos = async (options: ClusterRunOptions): Promise<ClusterRunResult> => {
  const rng = new Rng(options.seed)
  const kinds = options.kinds ?? CLUSTER_FAULT_KINDS
  const leaseMs = options.leaseMs ?? 10_000
  const t0 = Date.now()
  const schedule: Array<string> = []
  const counts: Record<string, number> = {}
  const stats = {
    commands: 0,
    lostWithRunner: 0,
    prompts: 0,
    turnsInterrupted: 0,
    reattaches: 0,
    silentDrops: 0,
    finalTurns: 0,
    // The self-fence coming up (fence.ts) on a runner not cut off: a false alarm (its workers killed).
    fenceUp: 0,
    fenceUpNotCut: 0,
    // @effect/cluster's own reaction to a late lock refresh (the runner drops its shards).
    locksUnhealthy: 0
  }
  let violation: string | undefined
  const log = (line: string) => {
    const stamped = `${((Date.now() - t0) / 1000).toFixed(2)}s ${line}`
    schedule.push(stamped)
    if (options.verbose === true) console.log(`  ${stamped}`)
  }
  const violate = (what: string) => {
    if (violation === undefined) {
      violation = what
      log(`VIOLATION ${what}`)
    }
  }

  const pgDir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-chaos-pg-"))
  const sessionIds: Array<string> = []
  const census = new WorkerCensus({ sessions: (key) => sessionIds.some((id) => workerTitleKey(id) === key) })
  const proxies: Array<PgProxy> = []
  const runners: Array<{ daemon: ChaosDaemon; address: string; proxy: PgProxy; down: boolean; cut: boolean }> = []
  const followers = new Map<string, { client: LineClient | undefined; owner: string | undefined; before: Array<Msg>; behindSince: number | undefined }>()
  let running = true
  try {
    execFileSync(PG_SCRIPT, ["start", pgDir], { encoding: "utf8" })
    const upstream = path.join(pgDir, "sock", ".s.PGSQL.5432")
    for (let i = 0; i < options.runners; i++) {
      const proxy = new PgProxy(upstream)
      await proxy.start()
      proxies.push(proxy)
      const port = await new Promise<number>((resolve) => {
        const s = net.createServer().listen(0, "127.0.0.1", () => {
          const p = (s.address() as net.AddressInfo).port
          s.close(() => resolve(p))
        })
      })
      const address = `127.0.0.1:${port}`
      const daemon = new ChaosDaemon({
        AGENTD_STORE: `postgresql://agentd@127.0.0.1:${proxy.port}/postgres`,
        AGENTD_CLUSTER: "1",
        AGENTD_RUNNER_ADDRESS: address,
        AGENTD_CLUSTER_LEASE_MS: String(leaseMs),
        AGENTD_WARM_SPARE: "0"
      })
      const runner = { daemon, address, proxy, down: false, cut: false }
      daemon.onOutput = (chunk) => {
        if (chunk.includes("no shard lock refresh succeeded")) {
          stats.fenceUp++
          if (!runner.cut) stats.fenceUpNotCut++
          log(`fence up on ${address}${runner.cut ? " (cut off)" : " (NOT cut off: a false alarm)"}`)
        }
        if (chunk.includes("Shard lock storage is unhealthy")) stats.locksUnhealthy++
      }
      // One after the other: the first makes the tables.
      await daemon.start()
      runners.push(runner)
    }
    log(`${options.runners} runners up: ${runners.map((r) => `${r.address} pid ${r.daemon.pid}`).join(", ")}`)
    census.start()

    const usable = () => runners.filter((r) => !r.down && !r.cut && r.daemon.running)
    // A connection per runner and per loop: a runner answers a connection's commands one at a
    // time, and each loop sends one command at a time, so each bound counts from its send.
    const controls = new Map<string, LineClient>()
    const controlOf = async (r: typeof runners[number], loop: string): Promise<LineClient> => {
      const key = `${loop} ${r.daemon.pid} ${r.address}`
      const known = controls.get(key)
      if (known !== undefined && !known.closed) return known
      const c = await LineClient.connect(r.daemon.socketPath, `${loop}-${r.address}`)
      controls.set(key, c)
      return c
    }
    /** A command through a runner: answered within its bound, or lost with the runner. */
    const command = async (r: typeof runners[number], cmd: Msg, boundMs: number, loop = "main"): Promise<Msg | undefined> => {
      stats.commands++
      let c: LineClient
      try {
        c = await controlOf(r, loop)
      } catch {
        stats.lostWithRunner++
        return undefined
      }
      const answer = await c.request(cmd, boundMs)
      if (answer === "timeout") {
        violate(`${cmd["type"]} ${cmd["activeSessionId"] ?? ""} through ${r.address} unanswered after ${boundMs} ms`)
        return undefined
      }
      if (answer === undefined) stats.lostWithRunner++
      return answer
    }
    const stateOf = async (id: string, loop = "main"): Promise<Msg | undefined> => {
      for (const r of usable()) {
        const answer = await command(r, { type: "get_state", activeSessionId: id }, 60_000, loop)
        if (answer?.["success"] === true) return answer["data"]
      }
      return undefined
    }

    /** Keeps a session's follower attached through its owner; checks what it is sent. */
    const follow = async (id: string, loop = "main"): Promise<void> => {
      const f = followers.get(id)!
      const state = await stateOf(id, loop)
      const owner = state?.["runner"] as string | undefined
      const runner = runners.find((r) => r.address === owner && !r.down && !r.cut && r.daemon.running)
      if (runner === undefined) return
      if (f.client !== undefined && !f.client.closed && f.owner === owner) {
        // An attachment on a runner the session left is dropped without notice; back on that
        // runner, only the log moving on without the follower shows it (re-attached then).
        const head = state?.["lastEventCursor"] as Cursor | undefined
        const got = messagesOf(id)
        const last = got.length === 0 ? undefined : got[got.length - 1]!["meta"]["cursor"] as Cursor
        const behind = head !== undefined && (last === undefined || head.generation > last.generation ||
          (head.generation === last.generation && head.sequence > last.sequence))
        if (!behind) {
          f.behindSince = undefined
          return
        }
        f.behindSince ??= Date.now()
        if (Date.now() - f.behindSince < 3_000) return
        f.behindSince = undefined
        stats.silentDrops++
      }
      if (f.client !== undefined) {
        f.client.close()
        f.before.push(...f.client.sequenced(id))
      }
      f.client = undefined
      let c: LineClient
      try {
        c = await LineClient.connect(runner.daemon.socketPath, `follower-${id.slice(2, 10)}`)
      } catch {
        return
      }
      const last = f.before.length === 0 ? undefined : f.before[f.before.length - 1]!["meta"]["cursor"] as Cursor
      const r = await c.request({ type: "attach", activeSessionId: id, ...(last === undefined ? {} : { resumeCursor: last }) }, 60_000)
      if (r === "timeout") return violate(`attach of ${id} through ${owner} unanswered`)
      if (r === undefined || r["success"] !== true) {
        c.close()
        return // moved or died meanwhile: the next round tries again
      }
      if (last !== undefined && r["data"]["replay"]["status"] !== "complete") {
        return violate(`resume of ${id} from ${JSON.stringify(last)} through ${owner}: ${JSON.stringify(r["data"]["replay"])}`)
      }
      if (f.owner !== undefined) stats.reattaches++
      f.client = c
      f.owner = owner
    }
    const messagesOf = (id: string): Array<Msg> => {
      const f = followers.get(id)!
      return [...f.before, ...(f.client?.sequenced(id) ?? [])]
    }
    const checkStream = (id: string) => {
      let prev: Cursor | undefined
      for (const m of messagesOf(id)) {
        const c = m["meta"]?.["cursor"] as Cursor
        if (!follows(prev, c)) throw new ViolationError(`session ${id}: cursor ${JSON.stringify(c)} after ${JSON.stringify(prev)}`)
        prev = c
        if (m["type"] === "session_event" && m["event"]?.type === "turn_interrupted" && m["event"].reason !== "daemon_restarted") {
          throw new ViolationError(`session ${id}: a turn interrupted with ${m["event"].reason}`)
        }
      }
    }

    // The cluster settled first (every runner listed, every shard held): a create sent before
    // its shard has an owner waits for one (seen waiting over a minute at load 15).
    const settleBy = Date.now() + 120_000
    for (;;) {
      const status = await command(runners[0]!, { type: "status" }, 30_000)
      const listed = (status?.["data"]?.["runners"] ?? []) as Array<Msg>
      if (listed.length === runners.length && listed.reduce((n, r) => n + r["shards"], 0) === 300) break
      if (Date.now() > settleBy) throw new Error(`the cluster did not settle: ${JSON.stringify(listed)}`)
      await sleep(250)
    }
    log("cluster settled")
    // Sessions, spread by their ids' hashes.
    const count = rng.int(4, 6)
    for (let i = 0; i < count; i++) {
      const r = await command(runners[i % runners.length]!, { type: "create" }, 60_000)
      if (r?.["success"] !== true) throw new Error(`create failed: ${JSON.stringify(r)}`)
      sessionIds.push(r["data"]["activeSessionId"])
      followers.set(r["data"]["activeSessionId"], { client: undefined, owner: undefined, before: [], behindSince: undefined })
      log(`session ${r["data"]["activeSessionId"]} on ${r["data"]["state"]["runner"]}`)
    }

    const followLoop = (async () => {
      while (running && violation === undefined) {
        for (const id of sessionIds) {
          await follow(id, "follow")
          try {
            checkStream(id)
          } catch (e) {
            violate((e as Error).message)
          }
        }
        await sleep(300)
      }
    })()
    const loadRng = rng.fork()
    const loadLoop = (async () => {
      while (running && violation === undefined) {
        const live = usable()
        if (live.length > 0) {
          const r = live[loadRng.int(0, live.length - 1)]!
          const id = sessionIds[loadRng.int(0, sessionIds.length - 1)]!
          const message = loadRng.chance(0.5) ? `/sleep ${loadRng.int(200, 4000)}` : `hello ${stats.prompts}`
          stats.prompts++
          const answer = await command(r, { type: "prompt", activeSessionId: id, message }, 60_000, "load")
          const code = answer?.["error"]?.["code"]
          // Busy sessions refuse; a session moving answers internal ("send the command again").
          if (answer !== undefined && answer["success"] !== true && !["session_busy", "internal"].includes(code)) {
            violate(`prompt ${id} through ${r.address}: ${JSON.stringify(answer["error"])}`)
          }
        }
        await sleep(loadRng.int(200, 1500))
      }
    })()

    const faultRng = rng.fork()
    const deadline = t0 + options.seconds * 1000
    const pending: Array<Promise<void>> = []
    while (Date.now() < deadline && violation === undefined) {
      await sleep(faultRng.int(6_000, 15_000))
      if (Date.now() >= deadline || violation !== undefined) break
      // One fault at a time: a majority of runners stays up.
      const candidates = runners.filter((r) => !r.down && !r.cut)
      if (candidates.length < runners.length) continue
      const kind = kinds[faultRng.int(0, kinds.length - 1)]!
      const victim = candidates[faultRng.int(0, candidates.length - 1)]!
      counts[kind] = (counts[kind] ?? 0) + 1
      // A partition longer than the lease moves the runner's shards; a shorter one may not.
      const downFor = kind === "runner_kill" ? faultRng.int(3_000, 15_000) : faultRng.int(Math.floor(leaseMs / 2), leaseMs * 3)
      if (kind === "runner_kill") {
        log(`runner_kill ${victim.address} pid ${victim.daemon.pid} (back in ${downFor} ms)`)
        victim.down = true
        await victim.daemon.kill()
        pending.push((async () => {
          await sleep(downFor)
          await victim.daemon.start()
          victim.down = false
          log(`runner ${victim.address} back, pid ${victim.daemon.pid}`)
        })())
      } else {
        log(`runner_partition ${victim.address} (healed in ${downFor} ms)`)
        victim.cut = true
        victim.proxy.partition()
        pending.push((async () => {
          await sleep(downFor)
          victim.proxy.heal()
          victim.cut = false
          log(`runner ${victim.address} healed`)
        })())
      }
      await Promise.all(pending.splice(0))
      if (census.doubles.length > 0) violate(census.summary())
    }
    running = false
    await Promise.all([followLoop, loadLoop, ...pending])
    log("faults over: settling")

    // Settle: every runner up, every session idle, a turn each through a non-owner.
    if (violation === undefined) {
      const settleBy = Date.now() + 120_000
      for (const id of sessionIds) {
        for (;;) {
          const s = await stateOf(id)
          if (s !== undefined && s["busy"] === false && ["ready", "passivated"].includes(s["worker"])) break
          if (Date.now() > settleBy) {
            violate(`session ${id} did not settle: ${JSON.stringify(s)}`)
            break
          }
          await sleep(250)
        }
        if (violation !== undefined) break
        await follow(id)
        const f = followers.get(id)!
        const owner = f.owner
        const through = usable().find((r) => r.address !== owner) ?? usable()[0]!
        const before = messagesOf(id).length
        const text = `final ${id}`
        const answer = await command(through, { type: "prompt", activeSessionId: id, message: text }, 60_000)
        if (answer?.["success"] !== true) {
          violate(`final prompt of ${id} through ${through.address}: ${JSON.stringify(answer)}`)
          break
        }
        const turnBy = Date.now() + 60_000
        while (!messagesOf(id).slice(before).some((m) => m["event"]?.type === "message_end" && m["event"].message?.content === `echo: ${text}`)) {
          if (Date.now() > turnBy) {
            violate(`session ${id}: the final turn was not seen by its follower`)
            break
          }
          await follow(id)
          await sleep(100)
        }
        stats.finalTurns++
        try {
          checkStream(id)
        } catch (e) {
          violate((e as Error).message)
        }
      }
    }
    for (const id of sessionIds) {
      stats.turnsInterrupted += messagesOf(id).filter((m) => m["event"]?.type === "turn_interrupted").length
    }
    census.stop()
    if (census.doubles.length > 0) violate(census.summary())
    for (const f of followers.values()) f.client?.close()
    for (const c of controls.values()) c.close()
  } catch (e) {
    violate(`harness: ${e instanceof Error ? e.stack ?? e.message : String(e)}`)
  } finally {
    running = false
    census.stop()
    if (violation !== undefined) {
      for (const r of runners) schedule.push(`--- runner ${r.address} (pid ${r.daemon.pid}) log tail ---\n${r.daemon.logTail(6000)}`)
    }
    for (const r of runners) await r.daemon.cleanup(violation !== undefined)
    for (const p of proxies) p.close()
    try {
      execFileSync(PG_SCRIPT, ["stop", pgDir], { stdio: "ignore" })
    } catch {
      // best effort
    }
    fs.rmSync(pgDir, { recursive: true, force: true })
  }
  return { seed: options.seed, violation, counts, stats, census: census.summary(), schedule }
}
