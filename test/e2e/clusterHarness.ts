/**
 * Runners of a cluster for the e2e tests (docs/cluster.md): `agentd serve --cluster` processes
 * with their own state dirs and runner ports over one store, restartable on the same state dir
 * and address; followers, clients that keep following one session across runner deaths and
 * shard moves and keep every sequenced message they were sent, for a gap/duplicate check.
 */
import { attachAndReplay } from "./attach.js"
import { type Client, compareCursor, type Cursor, cursorOf, type Daemon, describeMsg, isEvent, isIdleStatus, freshStateDir, type Msg, sleep, startDaemon } from "./harness.js"
import { freePort } from "./httpHarness.js"

/** How long the log may stand ahead of what a follower was sent before it re-attaches. */
const SILENT_DROP_MS = 3_000

export interface RunnerOptions {
  readonly storeUrl: string
  readonly leaseMs: number
  /** Extra environment of every runner. */
  readonly env?: Record<string, string>
}

/** Where a runner runs: its store URL (default the cluster's), its network namespace, its address. */
export interface Placement {
  readonly storeUrl?: string
  readonly netns?: string
  /** `HOST:PORT` of `--runner-address` (default 127.0.0.1 and a free port). */
  readonly address?: string
}

/** One runner: its address and state dir stay across restarts; `daemon` is its current process. */
export class Runner {
  daemon: Daemon
  /** Every process this runner has been (cleaned up at the end). */
  readonly incarnations: Array<Daemon> = []
  /** Cut off by a test (a partition): not asked anything by the helpers meanwhile. */
  cut = false
  constructor(readonly address: string, readonly stateDir: string, readonly placement: Placement, daemon: Daemon) {
    this.daemon = daemon
    this.incarnations.push(daemon)
  }
  get running(): boolean {
    return this.daemon.running
  }
}

export class Cluster {
  readonly runners: Array<Runner> = []
  constructor(readonly options: RunnerOptions) {}

  private start(stateDir: string, address: string, placement: Placement): Promise<Daemon> {
    return startDaemon({
      stateDir,
      // Kept across the tests of a block; `cleanup` ends them.
      shared: true,
      ...(placement.netns === undefined ? {} : { netns: placement.netns }),
      extraArgs: ["--store", placement.storeUrl ?? this.options.storeUrl, "--cluster", "--runner-address", address],
      env: { AGENTD_CLUSTER_LEASE_MS: String(this.options.leaseMs), AGENTD_WARM_SPARE: "0", ...this.options.env }
    })
  }

  /** A new runner (one at a time: the first makes the tables). */
  async add(placement: Placement = {}): Promise<Runner> {
    const address = placement.address ?? `127.0.0.1:${await freePort()}`
    const stateDir = freshStateDir()
    const runner = new Runner(address, stateDir, placement, await this.start(stateDir, address, placement))
    this.runners.push(runner)
    return runner
  }

  /** Starts a stopped runner again on its state dir and address. */
  async restart(runner: Runner): Promise<void> {
    if (runner.running) throw new Error(`runner ${runner.address} still runs`)
    runner.daemon = await this.start(runner.stateDir, runner.address, runner.placement)
    runner.incarnations.push(runner.daemon)
  }

  byAddress(address: string | undefined): Runner | undefined {
    return this.runners.find((r) => r.address === address)
  }

  /** The runners running and not cut off. */
  live(): Array<Runner> {
    return this.runners.filter((r) => r.running && !r.cut)
  }

  /** A `get_state` through any live runner (the first that answers). */
  async state(id: string, via?: Client): Promise<Msg | undefined> {
    const clients = via !== undefined ? [via] : await Promise.all(this.live().map((r) => this.clientOf(r)))
    for (const c of clients) {
      try {
        const r = await c.request({ type: "get_state", activeSessionId: id }, 30_000)
        if (r["success"] === true) return r["data"] as Msg
      } catch {
        // that runner went away meanwhile: the next
      }
    }
    return undefined
  }

  private readonly control = new Map<Daemon, Client>()
  /** A control connection to the runner's current process. */
  async clientOf(runner: Runner): Promise<Client> {
    const known = this.control.get(runner.daemon)
    if (known !== undefined && !known.closed) return known
    const c = await runner.daemon.connect(`control ${runner.address}`)
    this.control.set(runner.daemon, c)
    return c
  }

  /**
   * Polls `status` until `count` live runners are listed, healthy, holding every shard between
   * them, each some (a rebalance done).
   */
  async settled(count: number, timeoutMs = 60_000): Promise<Array<Msg>> {
    const deadline = Date.now() + timeoutMs
    let listed: Array<Msg> = []
    for (;;) {
      const live = this.live()
      if (live.length > 0) {
        try {
          const status = await (await this.clientOf(live[0]!)).ok({ type: "status" }, 10_000)
          listed = (status["runners"] ?? []) as Array<Msg>
          const total = listed.reduce((n, r) => n + (r["shards"] as number), 0)
          if (listed.length === count && total === 300 && listed.every((r) => r["shards"] > 0 && r["healthy"] === true)) return listed
        } catch {
          // a runner going away: ask again
        }
      }
      if (Date.now() > deadline) throw new Error(`runners not settled in ${timeoutMs} ms: ${JSON.stringify(listed)}`)
      await sleep(200)
    }
  }

  /** Waits until the session answers through a live runner with `pred` true of its state. */
  async until(id: string, pred: (state: Msg) => boolean, timeoutMs = 60_000): Promise<Msg> {
    const deadline = Date.now() + timeoutMs
    let last: Msg | undefined
    for (;;) {
      last = await this.state(id)
      if (last !== undefined && pred(last)) return last
      if (Date.now() > deadline) throw new Error(`session ${id}: not as expected in ${timeoutMs} ms: ${JSON.stringify(last)}`)
      await sleep(100)
    }
  }

  async cleanup(): Promise<void> {
    for (const runner of this.runners) for (const d of runner.incarnations) await d.cleanup()
  }
}

/**
 * A client following one session through the cluster. It attaches through the session's owner
 * (attach through another runner is refused today; `via` is where that choice is made), and
 * `follow()` re-attaches from the last cursor it was sent when its runner died or the session
 * moved to another runner (an attachment on the runner the session left receives nothing more).
 * Every sequenced message of every attachment is kept, in order, in `sequenced`.
 */
export class Follower {
  /** The sequenced messages of closed attachments, in order. */
  private readonly before: Array<Msg> = []
  private client: Client | undefined
  /** The runner the current attachment goes through. */
  runner: string | undefined
  attachments = 0
  /** Attachments found dropped without a word (see `follow`). */
  silentDrops = 0
  private behindSince: number | undefined
  constructor(readonly cluster: Cluster, readonly id: string) {}

  get sequenced(): Array<Msg> {
    return [...this.before, ...(this.client?.sequenced(this.id) ?? [])]
  }

  get last(): Cursor | undefined {
    const all = this.sequenced
    return all.length === 0 ? undefined : cursorOf(all[all.length - 1]!)
  }

  /** Which runner to attach through, given the owner. */
  private via(owner: string): Runner | undefined {
    return this.cluster.byAddress(owner)
  }

  /**
   * Attached through the session's current owner, re-attached if needed. Resolves once the
   * attachment's replay is in.
   */
  async follow(timeoutMs = 60_000): Promise<void> {
    const deadline = Date.now() + timeoutMs
    for (;;) {
      const state = await this.cluster.state(this.id)
      const owner = state?.["runner"] as string | undefined
      if (owner !== undefined && owner === this.runner && this.client !== undefined && !this.client.closed) {
        // An attachment on a runner the session left is dropped with no notice to the client;
        // should the session come back to that runner, the owner is the same again and only
        // the log moving on without it shows it: re-attached once that lasts.
        const head = state?.["lastEventCursor"] as Cursor | undefined
        const last = this.last
        const behind = head !== undefined && (last === undefined || compareCursor(head, last) > 0)
        if (!behind) {
          this.behindSince = undefined
          return
        }
        this.behindSince ??= Date.now()
        if (Date.now() - this.behindSince < SILENT_DROP_MS) return
        this.behindSince = undefined
        this.silentDrops++
      }
      const runner = owner === undefined ? undefined : this.via(owner)
      if (runner !== undefined && runner.running && !runner.cut) {
        // Nothing more is taken from the old attachment: closed first, so that what it had is final.
        if (this.client !== undefined) {
          this.client.close()
          this.before.push(...this.client.sequenced(this.id))
          this.client = undefined
        }
        try {
          const client = await runner.daemon.connect(`follower ${this.id}`)
          const last = this.last
          const attached = await attachAndReplay(client, { activeSessionId: this.id, ...(last === undefined ? {} : { resumeCursor: last }) })
          if (last !== undefined && attached.data["replay"]["status"] !== "complete") {
            throw new Error(`session ${this.id}: resume from ${JSON.stringify(last)} through ${owner} was ${JSON.stringify(attached.data["replay"])}`)
          }
          this.client = client
          this.runner = owner
          this.attachments++
          return
        } catch (e) {
          if (String(e).includes("was {")) throw e
          // The owner moved or died meanwhile: ask again.
        }
      }
      if (Date.now() > deadline) throw new Error(`session ${this.id}: could not follow in ${timeoutMs} ms (owner ${owner})`)
      await sleep(200)
    }
  }

  /** Waits, following, until a sequenced message matching `pred` arrives after `from` messages. */
  async waitFor(pred: (m: Msg) => boolean, from: number, timeoutMs = 60_000): Promise<Msg> {
    const deadline = Date.now() + timeoutMs
    for (;;) {
      const found = this.sequenced.slice(from).find(pred)
      if (found !== undefined) return found
      if (Date.now() > deadline) {
        const state = await this.cluster.state(this.id)
        throw new Error(
          `session ${this.id}: no such message in ${timeoutMs} ms; following through ${this.runner} (${this.attachments} attachments), ` +
            `now ${JSON.stringify(state)}; last: ${this.sequenced.slice(-6).map(describeMsg).join(", ")}`
        )
      }
      await this.follow(Math.max(1_000, deadline - Date.now()))
      await sleep(100)
    }
  }

  /**
   * One turn of `text` prompted through `through` (a runner, or the first live one that does not
   * own the session), seen by this follower to its idle status. A turn cut because its session
   * moved meanwhile (`turn_interrupted`, a rebalance still under way), or a prompt answered
   * `internal` because it left its runner, is prompted again (at most 3 times): what a client
   * is told to do then.
   */
  async turn(text: string, through?: () => Runner | undefined): Promise<void> {
    for (let attempt = 1; ; attempt++) {
      await this.follow()
      const from = this.sequenced.length
      const runner = through?.() ?? this.cluster.live().find((r) => r.address !== this.runner) ?? this.cluster.live()[0]!
      const r = await (await this.cluster.clientOf(runner)).request({ type: "prompt", activeSessionId: this.id, message: text }, 60_000)
      if (r["success"] !== true) {
        if (r["error"]?.["code"] !== "internal" || attempt >= 3) throw new Error(`prompt of ${this.id} through ${runner.address}: ${JSON.stringify(r["error"])}`)
        continue
      }
      const end = await this.waitFor((m) =>
        (isEvent("message_end")(m) && m["event"]["message"]["content"] === `echo: ${text}`) || isEvent("turn_interrupted")(m), from)
      if (isEvent("turn_interrupted")(end)) {
        if (end["event"]["reason"] !== "daemon_restarted" || attempt >= 3) throw new Error(`turn of ${this.id} cut: ${JSON.stringify(end["event"])}`)
        await this.waitFor(isIdleStatus, this.sequenced.indexOf(end))
        continue
      }
      await this.waitFor(isIdleStatus, this.sequenced.indexOf(end))
      return
    }
  }

  close(): void {
    this.client?.close()
  }
}
