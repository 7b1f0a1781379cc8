/**
 * One chaos run: the real daemon under load from several connections, faults at random moments
 * (all drawn from one seed), and the protocol's promises checked continuously and at the end.
 *
 * Load: one driver per session prompts continuously (plain text, long word lists, `/bulk`,
 * `/sleep`, and now and then `/compact`, a history rewrite in the middle of the turn),
 * sometimes the very moment its turn's `agent_end` arrives; observers attach,
 * detach, resume, drop their socket and stop reading; commanders race `checkpoint`, `abort`,
 * `kill`, `retry_worker` and prompts against the drivers (an abort now and then sent together
 * with a checkpoint on one connection).
 *
 * Continuously: every command answered once, in the order sent on its connection, within its
 * bound (the watchdog), every accepted prompt
 * of a driver ends, every client's events in cursor order, once, with no gap that a resync
 * explains not (streamCheck.ts), a history rewrite's snapshot exactly the compaction of what a
 * client held when it reached it there (`compacted N messages`), the daemon answers `ping`, no
 * orphan worker after a daemon kill. At the end: every session idle and ready again, every
 * client's folded transcript equal to `get_messages`, a rewritten transcript starting with its
 * compaction message (and holding no other), the jumps checked against every event seen and
 * every rewrite known, then a daemon SIGKILL whose
 * successor must resume every client completely and serve the same transcripts, then a clean
 * `shutdown` that leaves no process behind.
 *
 * `disk_full` (the run's state dir on a small tmpfs of its own, filled by a file for a few
 * seconds, then freed) and `fd_pressure` (the daemon under `ulimit -n`, idle connections taking
 * every fd it has left for a few seconds, then closed): storage failures are turn failures. A
 * prompt may be refused `storage_unavailable`, a turn may end `turn_interrupted
 * {storage_failed}`, but every accepted prompt still ends, no event is lost or repeated, and the
 * sessions go on by themselves once the fault is gone.
 *
 * `sigint_group` (a terminal's Ctrl-C to a foreground `agentd serve`): SIGINT to the daemon's
 * whole process group must be a graceful stop, exit 0, with no crash in any history (no
 * `recovering` status, no `turn_interrupted` but `daemon_shutdown`, `aborted` or the reason of
 * a crash from before it), after which a restart resumes every client and adds no
 * `daemon_restarted`.
 */
import { execFile, execFileSync } from "node:child_process"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { type Answer, ChaosClient } from "./client.js"
import { ChaosDaemon, sleep } from "./daemon.js"
import { Rng } from "./rng.js"
import { COMPACT_PROMPT, compactedCount, compareCursor, type Cursor, describeMsg, fmtCursor, type FoldedMessage, type Msg, Truth, Violation } from "./streamCheck.js"

export const FAULT_KINDS = [
  "worker_kill",
  "worker_kill_mid_turn",
  "worker_kill_mid_checkpoint",
  "worker_kill_starting",
  "daemon_kill",
  "client_drop",
  "client_pause",
  "attach_churn",
  "checkpoint",
  "abort",
  "prompt_race",
  "kill_session",
  "retry_worker",
  "spawn_fail",
  "rewrite_while_away",
  "damage_files",
  "second_daemon",
  "sigint_group",
  "stuck_client",
  "disk_full",
  "fd_pressure",
  "store_restart"
] as const
export type FaultKind = typeof FAULT_KINDS[number]

/**
 * The kinds a run draws from unless told (`--kinds`): all but the storage faults, which change
 * the whole run (a tmpfs state dir, which needs root; the daemon under `ulimit -n`) and are
 * asked for by name. Known limit: a worker spawned while `fd_pressure` holds every fd may take
 * until its 30 s ready timeout to be counted a crash, as long as the watchdog's bound.
 */
export const DEFAULT_KINDS: ReadonlyArray<FaultKind> = FAULT_KINDS.filter((k) =>
  k !== "disk_full" && k !== "fd_pressure" && k !== "store_restart"
)

/**
 * The kinds of a run over PostgreSQL unless told: the default ones and `store_restart`, without
 * `damage_files` (the session files it damages are not the store then).
 */
export const POSTGRES_KINDS: ReadonlyArray<FaultKind> = [...DEFAULT_KINDS.filter((k) => k !== "damage_files"), "store_restart"]

/** The private PostgreSQL script (start DIR prints the URL; restart DIR; stop DIR). */
const PG_SCRIPT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..", "scripts", "pg-test-server.sh")

const WEIGHTS: Record<FaultKind, number> = {
  worker_kill: 3,
  worker_kill_mid_turn: 3,
  worker_kill_mid_checkpoint: 3,
  worker_kill_starting: 2,
  daemon_kill: 1,
  client_drop: 3,
  client_pause: 4,
  attach_churn: 3,
  checkpoint: 5,
  abort: 3,
  prompt_race: 3,
  kill_session: 1,
  retry_worker: 2,
  spawn_fail: 1,
  rewrite_while_away: 3,
  damage_files: 1,
  second_daemon: 1,
  sigint_group: 1,
  stuck_client: 1,
  disk_full: 2,
  fd_pressure: 2,
  store_restart: 2
}

/** The daemon's fd limit in a run with `fd_pressure` (ample for its sessions and clients). */
const FD_LIMIT = 256

/** Writes `file` until the file system of `dir` has `leave` bytes left (or none); returns its size. */
const fillDisk = (dir: string, file: string, leave: number): number => {
  const fd = fs.openSync(file, "a")
  const chunk = Buffer.alloc(256 * 1024, 120)
  let written = 0
  try {
    for (;;) {
      const st = fs.statfsSync(dir)
      const free = st.bavail * st.bsize
      if (free <= leave) break
      try {
        written += fs.writeSync(fd, chunk, 0, Math.min(chunk.length, free - leave))
      } catch {
        break // ENOSPC
      }
    }
  } finally {
    fs.closeSync(fd)
  }
  return written
}

/**
 * Idle connections to the daemon until it greets no more (its fds are gone: it accepts and
 * drops, or not at all); the ones it greeted are returned, to be closed when the fault ends.
 */
const hogFds = async (socketPath: string, max = 1000): Promise<Array<net.Socket>> => {
  const hogs: Array<net.Socket> = []
  for (let i = 0; i < max; i++) {
    const greeted = await new Promise<net.Socket | undefined>((resolve) => {
      const socket = net.createConnection({ path: socketPath })
      const done = (ok: boolean) => {
        clearTimeout(timer)
        socket.removeAllListeners("data")
        if (ok) resolve(socket)
        else {
          socket.destroy()
          resolve(undefined)
        }
      }
      const timer = setTimeout(() => done(false), 1000)
      socket.on("error", () => done(false))
      socket.on("close", () => done(false))
      socket.once("data", () => done(true))
    })
    if (greeted === undefined) break
    // Never read again: what the daemon sends it (nothing, idle) stays in the kernel's buffers.
    greeted.on("error", () => {})
    hogs.push(greeted)
  }
  return hogs
}

export interface RunOptions {
  readonly seed: number
  readonly seconds: number
  /** Faults to inject over the run (spread at random). */
  readonly faults: number
  /** The fault kinds drawn from (default: {@link DEFAULT_KINDS}). */
  readonly kinds?: ReadonlyArray<FaultKind>
  /** Print the fault schedule as it happens. */
  readonly verbose?: boolean
  /** Keep the state dir for inspection. */
  readonly keep?: boolean
  /** How often a driver prompts the moment its turn's agent_end arrives (default 0.35). */
  readonly promptAtEnd?: number
  /** Daemon settings (`AGENTD_*`) that replace the drawn ones. */
  readonly settings?: Readonly<Record<string, string>>
  /** The daemon's store: its state dir's files (default), or a private PostgreSQL for the run. */
  readonly store?: "files" | "postgres"
}

export interface RunResult {
  readonly seed: number
  readonly violation: Violation | undefined
  readonly schedule: ReadonlyArray<string>
  readonly counts: Readonly<Record<string, number>>
  readonly settings: Readonly<Record<string, string>>
  readonly stats: Readonly<Record<string, number>>
  readonly notes: ReadonlyArray<string>
  readonly daemonLog: string
  readonly stateDir: string
  /** After a violation: every session's state as a fresh connection sees it, and what each driver saw last. */
  readonly postMortem: ReadonlyArray<string>
}

/** The daemon's settings for a run: tiny thresholds so checkpoints and pruning never stop. */
const drawSettings = (rng: Rng, sessions: number): Record<string, string> => ({
  AGENTD_CHECKPOINT_EVENTS: String(rng.int(1, 50)),
  AGENTD_RETAIN_GENERATIONS: String(rng.int(1, 2)),
  AGENTD_OUTBOX_BYTES: String(rng.pick([16 * 1024, 64 * 1024, 256 * 1024])),
  AGENTD_MAX_WORKERS: String(Math.max(1, sessions + rng.int(-2, 1))),
  AGENTD_TARGET_CHUNK_BYTES: String(rng.pick([2048, 16384, 65536])),
  AGENTD_MEMORY_CACHE_BYTES: String(rng.pick([32 * 1024, 1024 * 1024])),
  AGENTD_WARM_SPARE: rng.chance(0.7) ? "1" : "0"
})

const WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "lambda", "sigma", "omega", "tau", "rho", "phi", "chi"]

const words = (rng: Rng, n: number): string => {
  const out: Array<string> = []
  for (let i = 0; i < n; i++) out.push(`${rng.pick(WORDS)}${i % 7}`)
  return out.join(" ")
}

/** A prompt and how long its turn may take at most (beyond the usual bound). */
const drawPrompt = (rng: Rng): { text: string; extraMs: number } => {
  switch (rng.weighted({ plain: 5, long: 3, bulk: 2, sleep: 3, compact: 1 })) {
    case "compact":
      return { text: COMPACT_PROMPT, extraMs: 0 }
    case "plain":
      return { text: words(rng, rng.int(1, 20)), extraMs: 0 }
    case "long":
      return { text: words(rng, rng.chance(0.15) ? 10_000 : rng.int(200, 3000)), extraMs: 0 }
    case "bulk":
      return { text: `/bulk ${rng.int(1000, 400_000)}`, extraMs: 0 }
    default: {
      const ms = rng.chance(0.15) ? rng.int(6000, 9000) : rng.int(10, 2500)
      return { text: `/sleep ${ms}`, extraMs: ms }
    }
  }
}

const CAPABILITY_SETS: ReadonlyArray<ReadonlyArray<string> | undefined> = [
  undefined,
  ["attach_snapshot", "event_sequence"],
  ["attach_snapshot", "event_sequence", "chunked_snapshot"],
  ["attach_snapshot", "event_sequence", "slim_attach", "chunked_snapshot"],
  ["event_sequence", "slim_attach"]
]

/** How long an accepted prompt's turn may take to end (it may first wait for a worker). */
const TURN_BOUND_MS = 45_000
/** How long a session may take to be idle again at the end. */
const SETTLE_BOUND_MS = 30_000
/**
 * How long a graceful stop may take: the daemon's default grace period for clients (3 s), its
 * bounded steps before it (commands answered: 5 s and 2 s), the workers' SIGKILL fallback (2 s),
 * and slack for a loaded machine.
 */
const STUCK_STOP_BOUND_MS = 3_000 + 5_000 + 2_000 + 5_000

/** A session of the run and its driver's bookkeeping. */
interface SessionCtl {
  readonly id: string
  readonly truth: Truth
  readonly driver: ChaosClient
  killed: boolean
  /** A bad NODE_OPTIONS was given as launchEnv: its next spawns fail. */
  poisoned: boolean
  /** When it was last healed (0: never): a spawn under the old launchEnv may still be failing just after. */
  healedAt: number
  /** Turn ends (agent_end, turn_interrupted) and idle statuses the driver saw. */
  ends: number
  idleAfterEnds: number
  inTurn: boolean
  workerPid: number | undefined
  workerState: string | undefined
  accepted: number
  done: Promise<void>
}

export const runChaos = async (options: RunOptions): Promise<RunResult> => {
  const rng = new Rng(options.seed)
  const sessionCount = rng.int(3, 4)
  const postgres = options.store === "postgres"
  // A private server for the run (its socket only), stopped at the end however the run ends.
  const pgDir = postgres ? fs.mkdtempSync(path.join(os.tmpdir(), "agentd-chaos-pg-")) : undefined
  const pgUrl = pgDir === undefined ? undefined : execFileSync(PG_SCRIPT, ["start", pgDir], { encoding: "utf8" }).trim()
  // Drawn from a generator of their own, so that a seed's other draws stay what they were.
  const walRng = new Rng(options.seed ^ 0x5741)
  const writeAhead = walRng.chance(0.5) ? { AGENTD_WRITE_AHEAD_BYTES: String(walRng.pick([4096, 65536, 1024 * 1024])) } : {}
  const settings = {
    ...drawSettings(rng, sessionCount),
    ...writeAhead,
    ...(pgUrl === undefined ? {} : { AGENTD_STORE: pgUrl }),
    ...options.settings
  }
  const kinds = options.kinds ?? (postgres ? POSTGRES_KINDS : DEFAULT_KINDS)
  const weights = Object.fromEntries(kinds.map((k) => [k, WEIGHTS[k]])) as Record<FaultKind, number>
  // While spawns are being made to fail (and poisons overlap a heal), a retry's own worker can
  // fail to spawn again: it is then answered session_failed, as documented. After the run's
  // heal, retries must succeed (settle).
  // Spawns fail too while no fd is left.
  const retryCodes = kinds.includes("spawn_fail") || kinds.includes("fd_pressure") ? ["session_not_found", "session_failed"] : ["session_not_found"]
  /** Storage faults in the run: a prompt (or a checkpoint) may be refused `storage_unavailable`. */
  const storageFaults = kinds.includes("disk_full") || kinds.includes("fd_pressure") || kinds.includes("store_restart")
  const daemon = new ChaosDaemon(settings, {
    tmpfsMiB: kinds.includes("disk_full") ? 128 : undefined,
    fdLimit: kinds.includes("fd_pressure") ? FD_LIMIT : undefined
  })
  const t0 = Date.now()
  const schedule: Array<string> = []
  const notes: Array<string> = []
  const counts: Record<string, number> = {}
  const stats = {
    turnsAccepted: 0,
    turnsEnded: 0,
    compactsAccepted: 0,
    daemonRestarts: 0,
    resyncs: 0,
    replacements: 0,
    compactionsChecked: 0,
    transcriptReplaced: 0,
    damagedFiles: 0,
    damagedSessions: 0,
    storageRefusals: 0,
    storageCuts: 0,
    events: 0,
    commands: 0
  }
  const truths = new Map<string, Truth>()
  const truthOf = (id: string) => {
    let t = truths.get(id)
    if (t === undefined) truths.set(id, t = new Truth(id))
    return t
  }
  const sessions = new Map<string, SessionCtl>()
  const clients: Array<ChaosClient> = []
  let violation: Violation | undefined
  let stopFaults = false
  let stopLoad = false
  /** Set while the daemon is down on purpose: nothing can be answered then. */
  let daemonDown = false
  /**
   * A graceful stop (`sigint_group`) under way or the last one: from `at` (the signal) to
   * `restartedAt` (the next daemon's start), no crash may enter any history; after it, the
   * next daemon adds no `daemon_restarted` (until a daemon_kill). `crashed`: sessions whose
   * worker was already recovering from a crash at the signal (their cut turn ends then with
   * that crash's reason). `crashLooping`: sessions whose spawns fail (spawn_fail) at the signal
   * or healed just before: each failed spawn is a crash the daemon reports, and one that failed
   * just before the signal is reported once the session's entity takes it, which may be after
   * (it is no crash of the stop).
   */
  let graceful: {
    readonly at: number
    restartedAt: number | undefined
    readonly crashed: ReadonlySet<string>
    readonly crashLooping: ReadonlySet<string>
    readonly strict: boolean
    /** A storage fault ended just before: a turn it cut may get its owed `storage_failed` end now. */
    readonly storageCut: boolean
  } | undefined
  /** When a fault last SIGKILLed a worker: a crash the daemon takes in just after a SIGINT is no fault of the stop. */
  let lastWorkerKillAt = 0
  /** When the last disk_full or fd_pressure ended (0: none yet). */
  let lastStorageFaultAt = 0
  /** Set while the daemon stops gracefully (`stuck_client`): any command may be answered `shutting_down`. */
  let daemonStopping = false
  const stamp = () => `${((Date.now() - t0) / 1000).toFixed(2)}s`
  const log = (line: string) => {
    schedule.push(`${stamp()} ${line}`)
    if (options.verbose === true) console.log(`  ${stamp()} ${line}`)
  }
  const fail = (v: Violation) => {
    if (violation === undefined) {
      violation = v
      log(`VIOLATION ${v.message}`)
    }
  }
  const check = (invariant: string, ok: boolean, details: () => string) => {
    if (!ok) throw new Violation(invariant, details())
  }
  /** Runs an async task of the run; a violation it throws fails the run, anything else too. */
  const task = (what: string, f: () => Promise<void>): Promise<void> =>
    f().catch((e) => fail(e instanceof Violation ? e : new Violation("harness", `${what}: ${e instanceof Error ? e.stack ?? e.message : String(e)}`)))
  const stopped = () => violation !== undefined

  const newClient = (label: string) => {
    const c = new ChaosClient(label, () => daemon.socketPath, truthOf)
    c.onViolation = fail
    clients.push(c)
    return c
  }
  /**
   * Runs `f` with a client of its own (connected for it, watched by the watchdog, dropped
   * after): attaches with a launchEnv must not overlap other attaches of one connection.
   */
  const withOwnClient = async (label: string, f: (c: ChaosClient) => Promise<void>): Promise<void> => {
    const c = new ChaosClient(label, () => daemon.socketPath, truthOf)
    c.onViolation = fail
    try {
      await c.connect()
    } catch {
      return // the daemon is down (being restarted): the fault is moot
    }
    // Watched while it lives; never reconnected by the maintenance loop.
    clients.push(c)
    ownClients.add(c)
    try {
      await f(c)
    } finally {
      c.drop()
      clients.splice(clients.indexOf(c), 1)
      ownClients.delete(c)
    }
  }

  /** Which sessions each client wants to be attached to (the maintenance loop keeps them attached). */
  const wanted = new Map<ChaosClient, Set<string>>()
  const attaching = new Set<string>()
  const ownClients = new Set<ChaosClient>()
  const reconnectAt = new Map<ChaosClient, number>()

  const send = async (c: ChaosClient, command: Msg): Promise<Answer> => {
    stats.commands++
    return c.send(command)
  }

  /** Checks an error response's code is one the situation allows. */
  const expectCodes = (r: Answer, command: string, allowed: ReadonlyArray<string>) => {
    if (r === undefined || r["success"] === true) return
    const code = r["error"]?.code as string
    // What a daemon stopping gracefully answers the commands it will not wait for.
    if (code === "shutting_down" && ((graceful !== undefined && graceful.restartedAt === undefined) || daemonStopping)) return
    // A prompt (or a checkpoint, a create) that could not be made durable while storage failed.
    if (code === "storage_unavailable" && storageFaults) {
      stats.storageRefusals++
      return
    }
    if (code === "internal") {
      notes.push(`${stamp()} ${command} answered internal: ${r["error"]?.message}`)
      return
    }
    check("error codes", allowed.includes(code), () => `${command} answered ${code}: ${r["error"]?.message}`)
  }

  const attach = async (c: ChaosClient, id: string, crng: Rng, resume: boolean) => {
    const key = `${c.label}/${id}`
    if (attaching.has(key) || !c.connected) return
    attaching.add(key)
    try {
      const s = c.stream(id)
      const cursor: Cursor | undefined = resume && !s.attached && s.fold !== undefined ? s.last : undefined
      const caps = crng.pick(CAPABILITY_SETS)
      const r = await send(c, { type: "attach", activeSessionId: id, ...(caps ? { capabilities: caps } : {}), ...(cursor ? { resumeCursor: cursor } : {}) })
      if (r !== undefined && r["success"] !== true) {
        const code = r["error"]?.code
        const ctl = sessions.get(id)
        if (code === "session_not_found" && (ctl === undefined || ctl.killed)) wanted.get(c)?.delete(id)
        else expectCodes(r, "attach", [])
      }
    } finally {
      attaching.delete(key)
    }
  }

  /** Reconnects dropped clients and re-attaches what they want to follow. */
  const maintain = async () => {
    const crng = rng.fork()
    while (!stopped()) {
      await sleep(100)
      if (daemonDown) continue
      for (const c of clients) {
        if (!c.connected && !ownClients.has(c)) {
          if ((reconnectAt.get(c) ?? 0) > Date.now()) continue
          try {
            await c.connect()
          } catch {
            continue
          }
        }
        for (const id of wanted.get(c) ?? []) {
          const ctl = sessions.get(id)
          if (ctl?.killed === true) continue
          // Drivers always resume from their cursor (the final check relies on it); observers mostly.
          const resume = c.label.startsWith("driver") || crng.chance(0.8)
          if (!c.stream(id).attached) void task(`attach ${c.label}`, () => attach(c, id, crng, resume))
        }
      }
    }
  }

  /** Every command answered within its bound; the jumps against the truth; ping. */
  const watchdog = async () => {
    let lastJumpCheck = Date.now()
    while (!stopped()) {
      await sleep(200)
      if (daemonDown) continue
      const now = Date.now()
      for (const c of clients) {
        const late = c.overdue(now)
        if (late !== undefined) {
          const ctl = late.activeSessionId === undefined ? undefined : sessions.get(late.activeSessionId)
          fail(new Violation(
            "every command answered",
            `${late.type} ${late.id}${late.activeSessionId ? ` on session ${late.activeSessionId}` : ""} unanswered after ${late.waitedMs} ms ` +
              `(pending on ${c.label}: ${c.describePending()})` +
              (ctl ? `; session last seen busy-turn=${ctl.inTurn} worker=${ctl.workerState} ends=${ctl.ends} idle-after=${ctl.idleAfterEnds}` : "")
          ))
          return
        }
      }
      if (now - lastJumpCheck > 2000) {
        lastJumpCheck = now
        try {
          for (const t of truths.values()) t.checkJumps()
        } catch (e) {
          if (e instanceof Violation) fail(e)
          else throw e
        }
      }
    }
  }

  const pinger = async (c: ChaosClient) => {
    while (!stopped() && !stopFaults) {
      await sleep(500)
      if (daemonDown || !c.connected) continue
      const r = await send(c, { type: "ping" })
      if (r !== undefined) check("ping", r["success"] === true && r["data"]?.pong === true, () => `ping answered ${JSON.stringify(r)}`)
    }
  }

  // ------------------------------------------------------------------------------------------
  // Sessions and their drivers
  // ------------------------------------------------------------------------------------------

  const commanders: Array<ChaosClient> = []
  /** A commander with nothing in flight if there is one (commands run one at a time per connection). */
  const freeCommander = (): ChaosClient => commanders.find((c) => c.connected && c.pendingCount === 0) ?? rng.pick(commanders)

  const waitUntil = async (cond: () => boolean, timeoutMs: number): Promise<boolean> => {
    const deadline = Date.now() + timeoutMs
    while (!cond()) {
      if (stopped() || Date.now() > deadline) return cond()
      await sleep(15)
    }
    return true
  }

  const driverLoop = async (ctl: SessionCtl, drng: Rng) => {
    const d = ctl.driver
    let immediate = false
    /** Skips of the driver's stream by its last prompt: a baseline since may have carried the idle status. */
    let skipsAtPrompt = 0
    while (!stopped() && !stopLoad && !ctl.killed) {
      if (daemonDown || !d.connected || !d.stream(ctl.id).settled) {
        await sleep(50)
        continue
      }
      if (!immediate) {
        // Wait for the previous turn's idle status (it may already be there).
        // A baseline past the client's cursor (a resync, a rewrite it reached late) replaces its
        // state: the idle status may be inside its snapshot. A rewrite reached where the client
        // is does not: the turn's end follows it.
        if (!await waitUntil(() => ctl.idleAfterEnds >= ctl.ends || ctl.killed || daemonDown || d.stream(ctl.id).skips > skipsAtPrompt, SETTLE_BOUND_MS)) {
          throw new Violation("busy:false after every turn", `session ${ctl.id}: turn end #${ctl.ends} seen but no busy:false status after it within ${SETTLE_BOUND_MS} ms`)
        }
      }
      const { text, extraMs } = drawPrompt(drng)
      const endsBefore = ctl.ends
      const skipsBefore = d.stream(ctl.id).skips
      skipsAtPrompt = skipsBefore
      const r = await send(d, { type: "prompt", activeSessionId: ctl.id, message: text })
      immediate = false
      if (r === undefined) {
        await sleep(100)
        continue
      }
      if (r["success"] !== true) {
        const code = r["error"]?.code as string
        if (code === "session_not_found" && ctl.killed) return
        expectCodes(r, "prompt", ["session_busy", "session_failed"])
        if (code === "session_failed" && drng.chance(0.5) && !ctl.poisoned) {
          expectCodes(await send(d, { type: "retry_worker", activeSessionId: ctl.id }), "retry_worker", retryCodes)
        }
        await sleep(drng.int(20, 300))
        continue
      }
      ctl.accepted++
      stats.turnsAccepted++
      if (text === COMPACT_PROMPT) stats.compactsAccepted++
      const ended = await waitUntil(
        () => ctl.ends > endsBefore || ctl.killed || d.stream(ctl.id).skips > skipsBefore,
        TURN_BOUND_MS + extraMs
      )
      if (!ended && !daemonDown && d.connected) {
        throw new Violation(
          "every accepted prompt ends",
          `session ${ctl.id}: prompt "${text.slice(0, 40)}" accepted at turn-end count ${endsBefore}, no agent_end/turn_interrupted within ${TURN_BOUND_MS + extraMs} ms ` +
            `(driver saw last ${fmtCursor(d.stream(ctl.id).last)}, in-turn ${ctl.inTurn}, worker ${ctl.workerState})`
        )
      }
      if (!ended) continue
      stats.turnsEnded++
      // Sometimes prompt again the moment agent_end arrives, before the turn's idle status.
      immediate = drng.chance(options.promptAtEnd ?? 0.35)
      if (!immediate) await sleep(drng.int(0, 50))
    }
  }

  // Names are unique in the daemon (name_taken): one per attempt, since a create whose answer
  // was lost to a crash may still have made its session.
  let createAttempts = 0
  const addSession = async (via: ChaosClient): Promise<void> => {
    const r = await send(via, { type: "create", name: `chaos-${++createAttempts}` })
    if (r === undefined) return
    if (r["success"] !== true) return expectCodes(r, "create", [])
    const id = r["data"]["activeSessionId"] as string
    const driver = newClient(`driver-${sessions.size}`)
    const ctl: SessionCtl = {
      id,
      truth: truthOf(id),
      driver,
      killed: false,
      poisoned: false,
      healedAt: 0,
      ends: 0,
      idleAfterEnds: 0,
      inTurn: false,
      workerPid: undefined,
      workerState: undefined,
      accepted: 0,
      done: Promise.resolve()
    }
    sessions.set(id, ctl)
    driver.stream(id).onEvent = (m) => {
      stats.events++
      checkGraceful(id, m)
      if (m["type"] === "session_event") {
        const t = m["event"]?.type
        if (t === "agent_start") ctl.inTurn = true
        if (t === "agent_end" || t === "turn_interrupted") {
          ctl.inTurn = false
          ctl.ends++
          if (m["event"]?.reason === "storage_failed" && m["meta"]?.replayed !== true) stats.storageCuts++
        }
      } else if (m["type"] === "session_status") {
        const st = m["state"] as Msg
        ctl.workerState = st["worker"]
        ctl.workerPid = st["workerPid"]
        if (st["busy"] === false) ctl.idleAfterEnds = ctl.ends
      }
    }
    try {
      await driver.connect()
    } catch {
      // The daemon is being restarted (a daemon_kill right after a kill_session's create): the
      // maintenance loop connects the driver and attaches it once the daemon is back.
    }
    wanted.set(driver, new Set([id]))
    await attach(driver, id, rng, false)
    // Observers follow some sessions.
    for (const o of observers) if (rng.chance(0.5)) wanted.get(o)!.add(id)
    ctl.done = task(`driver of ${id}`, () => driverLoop(ctl, rng.fork()))
  }

  // ------------------------------------------------------------------------------------------
  // Faults
  // ------------------------------------------------------------------------------------------

  const liveSessions = () => [...sessions.values()].filter((s) => !s.killed)

  const killPid = (pid: number | undefined, what: string) => {
    if (pid === undefined) return log(`  (${what}: no pid known)`)
    try {
      process.kill(pid, "SIGKILL")
      lastWorkerKillAt = Date.now()
      log(`  SIGKILL ${what} pid ${pid}`)
    } catch {
      log(`  (${what}: pid ${pid} already gone)`)
    }
  }

  /** No crash in any history because of a graceful stop, nor a restart's interruption after it. */
  const checkGraceful = (id: string, m: Msg) => {
    const g = graceful
    if (g === undefined) return
    const at = m["meta"]?.emittedAt as number
    const during = at >= g.at && (g.restartedAt === undefined || at < g.restartedAt)
    const reason = m["type"] === "session_event" && m["event"]?.type === "turn_interrupted" ? m["event"].reason as string : undefined
    if (during && g.strict) {
      check("a graceful stop writes no crash", g.crashLooping.has(id) || !(m["type"] === "session_status" && (m["state"]?.worker === "recovering" || m["state"]?.worker === "failed")), () =>
        `${id}: ${describeMsg(m)} emitted during the graceful stop`)
      const allowed = [
        "daemon_shutdown",
        "aborted",
        ...(g.crashed.has(id) || g.crashLooping.has(id) ? ["worker_crashed", "daemon_restarted"] : []),
        ...(g.storageCut ? ["storage_failed"] : [])
      ]
      check("a graceful stop cuts turns with daemon_shutdown", reason === undefined || allowed.includes(reason), () =>
        `${id}: ${describeMsg(m)} emitted during the graceful stop`)
    } else if (g.restartedAt !== undefined && at >= g.restartedAt) {
      check("no daemon_restarted after a graceful stop", reason !== "daemon_restarted", () => `${id}: ${describeMsg(m)} after the restart`)
    }
  }

  /** SIGINT to the daemon's process group (a terminal's Ctrl-C), then a start as after daemon_kill. */
  const sigintGroup = async () => {
    daemonDown = true
    const crashed = new Set(liveSessions().filter((s) => s.workerState !== "ready" && s.workerState !== "passivated").map((s) => s.id))
    const inTurn = liveSessions().filter((s) => s.inTurn).map((s) => s.id.slice(0, 12))
    // A worker SIGKILLed just before may have its crash taken in after the signal: that stop's
    // window is then not held to "no crash" (the restart after it still is).
    const strict = Date.now() - lastWorkerKillAt > 2_000
    // A turn cut by a full disk or a want of fds owes its `storage_failed` end until a write
    // succeeds (retried every 1.5 s): that end may come during the stop.
    const storageCut = Date.now() - lastStorageFaultAt < 5_000
    const crashLooping = new Set(liveSessions().filter((s) => s.poisoned || Date.now() - s.healedAt < 2_000).map((s) => s.id))
    graceful = { at: Date.now(), restartedAt: undefined, crashed, crashLooping, strict, storageCut }
    log(`sigint_group: SIGINT to the daemon's process group (in turn: ${inTurn.join(", ") || "none"}${strict ? "" : "; a worker was just killed: not strict"})`)
    const exit = await daemon.sigintGroup(20_000)
    check("a graceful stop exits 0", exit?.code === 0 && exit.signal === null, () => `daemon after SIGINT to its group: ${JSON.stringify(exit ?? "still running after 20 s")}`)
    // Its workers were stopped before it exited: none is left for the orphan check to wait for.
    const left = daemon.markedProcesses()
    check("no worker outlives a graceful stop", left.length === 0, () => `still alive: ${left.map((p) => daemon.describeProcess(p)).join("; ")}`)
    for (const c of clients) c.drop()
    await sleep(rng.int(0, 500))
    await daemon.start()
    graceful.restartedAt = Date.now()
    stats.daemonRestarts++
    daemonDown = false
    log(`daemon started again, pid ${daemon.pid}`)
  }

  const restartDaemon = async (why: string) => {
    daemonDown = true
    // A killed daemon's successor may well cut turns (daemon_restarted).
    graceful = undefined
    log(`daemon SIGKILL (${why})`)
    await daemon.kill()
    for (const c of clients) c.drop()
    await sleep(rng.int(0, 500))
    await daemon.start()
    stats.daemonRestarts++
    daemonDown = false
    log(`daemon restarted, pid ${daemon.pid}`)
    // The killed daemon's workers must notice and go.
    void task("orphan check", async () => {
      // Generous: a worker still starting up on a loaded machine notices its pipe only then.
      const deadline = Date.now() + 10_000
      while (Date.now() < deadline && daemon.orphans().length > 0) await sleep(100)
      const left = daemon.orphans()
      check("no orphan worker", left.length === 0 || daemonDown, () => `processes of a killed daemon still alive 10 s after it: ${left.map((p) => daemon.describeProcess(p)).join("; ")}`)
    })
  }

  /**
   * `damage_files`: between a daemon SIGKILL and its restart, a few bytes of one session's event
   * log, transcript or metadata are overwritten or cut. After the restart no session may vanish;
   * the damaged one is whole or listed `damaged`, what it still reads agrees with what its
   * driver saw, and the damage was moved aside, never deleted. It is then killed (archived) and
   * a new session takes its place: its history no longer matches what its clients hold.
   */
  const damageFiles = async (ctl: SessionCtl, frng: Rng) => {
    // The session files it damages are not the store then (asked for by name, as in a run with
    // every kind): skipped, as store_restart is on files.
    if (pgDir !== undefined) return log("damage_files: (PostgreSQL store: skipped)")
    const sid = ctl.id.slice(0, 12)
    ctl.killed = true
    daemonDown = true
    // A killed daemon's successor may well cut turns (daemon_restarted), as after daemon_kill.
    graceful = undefined
    log(`damage_files ${sid}: daemon SIGKILL`)
    await daemon.kill()
    for (const c of clients) c.drop()
    const eventsDir = path.join(daemon.stateDir, "events", ctl.id, "events")
    const sessionDir = path.join(daemon.stateDir, "sessions", ctl.id)
    const ls = (dir: string, re: RegExp) => (fs.existsSync(dir) ? fs.readdirSync(dir).filter((f) => re.test(f)).map((f) => path.join(dir, f)) : [])
    const segments = ls(eventsDir, /^\d+\.jsonl$/)
    const transcripts = ls(path.join(sessionDir, "transcripts"), /^\d+\.jsonl$/)
    const what = frng.weighted({ event_log: segments.length > 0 ? 4 : 0, transcript: transcripts.length > 0 ? 1 : 0, meta: 1 })
    let damaged = ""
    const asideBefore = ls(eventsDir, /\.damaged-/).length
    let expectAside = false
    /** The event log's bytes overwritten: a write-ahead file that still holds them puts them back. */
    let overwritten: { readonly file: string; readonly from: number; readonly n: number } | undefined
    if (what === "event_log") {
      const file = frng.pick(segments)
      const bytes = fs.readFileSync(file)
      const starts = [0]
      for (let i = bytes.indexOf(10); i !== -1 && i < bytes.length - 1; i = bytes.indexOf(10, i + 1)) starts.push(i + 1)
      // A whole line (never the torn tail after the last newline, which is cut, not damage).
      const whole = starts.filter((st) => bytes.indexOf(10, st) !== -1)
      const at = frng.pick(whole)
      const end = bytes.indexOf(10, at)
      // Within the record's cursor (or the header's generation): bytes overwritten inside a
      // string value would leave valid JSON, damage no reader can tell (records carry no checksum).
      const from = at + frng.int(0, Math.min(16, Math.max(0, end - at - 2)))
      const n = Math.max(1, Math.min(frng.int(4, 12), end - from))
      bytes.fill(0x23, from, from + n)
      fs.writeFileSync(file, bytes)
      damaged = `${path.basename(file)} line ${starts.indexOf(at) + 1}, ${n} byte(s) at ${from}`
      expectAside = true
      overwritten = { file, from, n }
    } else if (what === "transcript") {
      const file = frng.pick(transcripts)
      const size = fs.statSync(file).size
      const cut = Math.min(size, frng.int(1, 64))
      fs.truncateSync(file, size - cut)
      damaged = `transcript ${path.basename(file)} cut by ${cut} byte(s)`
    } else {
      fs.writeFileSync(path.join(sessionDir, "meta.json"), frng.chance(0.5) ? "{\"activeSessionId\": tor" : "")
      damaged = "meta.json"
    }
    stats.damagedFiles++
    log(`  damaged ${damaged}`)
    await sleep(frng.int(0, 300))
    await daemon.start()
    stats.daemonRestarts++
    log(`daemon restarted, pid ${daemon.pid}`)
    await withOwnClient("damage-check", async (c) => {
      const listed = await send(c, { type: "list" })
      check("damaged files: list answers", listed?.["success"] === true, () => JSON.stringify(listed))
      const byId = new Map((listed!["data"]["sessions"] as Array<Msg>).map((x) => [x["activeSessionId"] as string, x]))
      for (const other of sessions.values()) {
        check("damaged files: no session vanishes", (other.killed && other !== ctl) || byId.has(other.id), () => `${other.id} is not listed after ${damaged}`)
      }
      const summary = byId.get(ctl.id)!
      const worker = summary["worker"] as string
      if (worker === "damaged") {
        stats.damagedSessions++
        check("damaged files: a reason", typeof summary["damage"]?.["reason"] === "string", () => JSON.stringify(summary))
      } else if (overwritten !== undefined) {
        // Bytes a write-ahead file still held: its replay at the restart wrote them back.
        const now = fs.existsSync(overwritten.file) ? fs.readFileSync(overwritten.file) : Buffer.alloc(0)
        const restored = now.length >= overwritten.from + overwritten.n &&
          !now.subarray(overwritten.from, overwritten.from + overwritten.n).every((b) => b === 0x23)
        check("damaged files: whole or damaged", restored, () => `${damaged} left ${ctl.id} ${worker}, not damaged, and the bytes are not restored`)
        if (restored) log(`  the write-ahead log's replay restored ${damaged}`)
        expectAside = false
      } else {
        // Bytes the session does not read (past the transcript's published length): whole.
        check("damaged files: whole or damaged", what === "transcript", () => `${damaged} left ${ctl.id} ${worker}, not damaged`)
      }
      if (expectAside) {
        check("damaged files: moved aside, not deleted", ls(eventsDir, /\.damaged-/).length > asideBefore, () => `no .damaged- file in ${eventsDir}`)
      }
      // What it still reads agrees, message by message, with what its driver saw (up to the
      // shorter of the two: either may hold messages the other never got).
      const readable: Array<Msg> = []
      for (;;) {
        const page = await send(c, { type: "get_messages", activeSessionId: ctl.id, offset: readable.length, limit: 1000 })
        check("damaged files: get_messages answers", page?.["success"] === true, () => JSON.stringify(page))
        const got = page!["data"]["messages"] as Array<Msg>
        readable.push(...got)
        if (got.length === 0 || readable.length >= page!["data"]["total"]) break
      }
      const seen = ctl.driver.stream(ctl.id).fold ?? []
      const rewritten = [readable[0] as FoldedMessage | undefined, seen[0]].some((m) => compactedCount(m) !== undefined)
      if (!rewritten) {
        for (let i = 0; i < Math.min(readable.length, seen.length); i++) {
          check("damaged files: what is read agrees", readable[i]!["id"] === seen[i]!.id && readable[i]!["content"] === seen[i]!.content,
            () => `${ctl.id} message ${i}: read ${JSON.stringify(readable[i])}, driver folded ${JSON.stringify(seen[i])} (${damaged})`)
        }
      }
      const killed = await send(c, { type: "kill", activeSessionId: ctl.id })
      expectCodes(killed, "kill", [])
      await addSession(c)
    })
    daemonDown = false
  }

  /**
   * `stuck_client`: a graceful stop with clients that do not cooperate. Two raw connections
   * attach to a session and never read a byte (the session's baseline fills their socket
   * buffers), one of them half-closed; then `shutdown`. The daemon must exit 0 within its grace
   * period (default 3 s) plus a bound, leaving no process; it is then started again and every
   * client resumes, as after `daemon_kill`.
   */
  const stuckClient = async (ctl: SessionCtl, frng: Rng) => {
    const sid = ctl.id.slice(0, 12)
    const halfClosed = frng.chance(0.5) ? [true, false] : [false, true]
    const sockets: Array<net.Socket> = []
    try {
      for (const half of halfClosed) {
        const socket = net.createConnection({ path: daemon.socketPath })
        sockets.push(socket)
        socket.on("error", () => {})
        socket.pause()
        await new Promise<void>((resolve) => {
          socket.once("connect", resolve)
          socket.once("close", resolve)
        })
        socket.write(JSON.stringify({ type: "attach", id: `stuck-${half}`, activeSessionId: ctl.id }) + "\n")
        if (half) socket.end()
      }
      log(`stuck_client ${sid}: a non-reading and a half-closed non-reading client attached; shutdown`)
      await sleep(frng.int(50, 500))
      daemonStopping = true
      await withOwnClient("stopper", async (c) => {
        const r = await send(c, { type: "shutdown" })
        check("stuck clients: shutdown answered", r === undefined || r["success"] === true, () => `shutdown answered ${JSON.stringify(r)}`)
      })
      daemonDown = true
      const started = Date.now()
      const exited = await daemon.waitExit(STUCK_STOP_BOUND_MS)
      check("stuck clients: the daemon ends", exited && daemon.exit?.code === 0 && daemon.exit.signal === null,
        () => `${exited ? `exit ${JSON.stringify(daemon.exit)}` : `still running ${Date.now() - started} ms after shutdown`} with a non-reading and a half-closed client`)
      log(`  daemon exited ${JSON.stringify(daemon.exit)} ${Date.now() - started} ms after shutdown`)
      const deadline = Date.now() + 5_000
      while (Date.now() < deadline && daemon.markedProcesses().length > 0) await sleep(50)
      check("stuck clients: no process left after the stop", daemon.markedProcesses().length === 0,
        () => `still alive: ${daemon.markedProcesses().map((p) => daemon.describeProcess(p)).join("; ")}`)
    } finally {
      for (const socket of sockets) socket.destroy()
      daemonStopping = false
    }
    for (const c of clients) c.drop()
    await sleep(frng.int(0, 300))
    await daemon.start()
    stats.daemonRestarts++
    daemonDown = false
    log(`daemon restarted, pid ${daemon.pid}`)
  }

  const fault = async (kind: FaultKind, frng: Rng) => {
    counts[kind] = (counts[kind] ?? 0) + 1
    const live = liveSessions()
    if (live.length === 0) return
    const ctl = frng.pick(live)
    const sid = ctl.id.slice(0, 12)
    switch (kind) {
      case "worker_kill": {
        const pids = daemon.workers()
        log(`worker_kill: any of ${pids.length} worker processes`)
        if (pids.length > 0) killPid(frng.pick(pids), "worker")
        return
      }
      case "worker_kill_mid_turn": {
        log(`worker_kill_mid_turn ${sid}`)
        if (await waitUntil(() => ctl.inTurn, 3000)) await sleep(frng.int(0, 80))
        return killPid(ctl.workerPid, `worker of ${sid} (in turn: ${ctl.inTurn})`)
      }
      case "worker_kill_mid_checkpoint": {
        const c = freeCommander()
        log(`worker_kill_mid_checkpoint ${sid} via ${c.label}`)
        void task("checkpoint", async () => expectCodes(await send(c, { type: "checkpoint", activeSessionId: ctl.id }), "checkpoint", ["session_not_found", "session_failed"]))
        await sleep(frng.int(0, 40))
        return killPid(ctl.workerPid, `worker of ${sid}`)
      }
      case "worker_kill_starting": {
        // Make the session start a worker (kill the one it has, or wake it by a prompt), then
        // kill the new one while it loads.
        const c = freeCommander()
        const before = ctl.workerPid
        log(`worker_kill_starting ${sid} (worker ${ctl.workerState}, pid ${before})`)
        if (ctl.workerState === "passivated") void task("prompt", async () => expectCodes(await send(c, { type: "prompt", activeSessionId: ctl.id, message: "wake" }), "prompt", ["session_busy", "session_failed", "session_not_found"]))
        else killPid(before, `worker of ${sid}`)
        const probe = commanders.find((x) => x !== c && x.connected && x.pendingCount === 0)
        if (probe === undefined) return
        const deadline = Date.now() + 3000
        while (Date.now() < deadline && !stopped()) {
          const r = await send(probe, { type: "get_state", activeSessionId: ctl.id })
          if (r === undefined || r["success"] !== true) return
          const st = r["data"] as Msg
          if ((st["worker"] === "starting" || st["worker"] === "recovering") && typeof st["workerPid"] === "number" && st["workerPid"] !== before) {
            return killPid(st["workerPid"], `${st["worker"]} worker of ${sid}`)
          }
          if (st["worker"] === "ready" && st["workerPid"] !== before) return log(`  (${sid} was ready again before its new worker could be killed)`)
        }
        return
      }
      case "daemon_kill":
        return restartDaemon("fault")
      case "damage_files":
        return damageFiles(ctl, frng)
      case "sigint_group":
        return sigintGroup()
      case "stuck_client":
        return stuckClient(ctl, frng)
      case "client_drop": {
        const o = frng.pick(observers)
        const delay = frng.int(0, 2000)
        log(`client_drop ${o.label}, back in ${delay} ms`)
        reconnectAt.set(o, Date.now() + delay)
        o.drop()
        return
      }
      case "client_pause": {
        const o = frng.pick(observers)
        const ms = frng.int(200, 5000)
        log(`client_pause ${o.label} for ${ms} ms`)
        o.pause()
        void task("resume", async () => {
          await sleep(ms)
          o.resume()
        })
        return
      }
      case "attach_churn": {
        const o = frng.pick(observers)
        const w = wanted.get(o)!
        if (w.has(ctl.id) && frng.chance(0.5)) {
          w.delete(ctl.id)
          log(`detach ${o.label} from ${sid}`)
          void task("detach", async () => expectCodes(await send(o, { type: "detach", activeSessionId: ctl.id }), "detach", ["session_not_found"]))
        } else if (w.has(ctl.id) && o.stream(ctl.id).attached) {
          log(`re-attach ${o.label} to ${sid} on the same connection`)
          void task("re-attach", () => attach(o, ctl.id, frng, false))
        } else {
          w.add(ctl.id)
          log(`attach ${o.label} to ${sid}`)
        }
        return
      }
      case "checkpoint": {
        const c = freeCommander()
        log(`checkpoint ${sid} via ${c.label}`)
        void task("checkpoint", async () => {
          const r = await send(c, { type: "checkpoint", activeSessionId: ctl.id })
          expectCodes(r, "checkpoint", ["session_not_found", "session_failed"])
          if (r?.["success"] === true) check("checkpoint result", Number.isInteger(r["data"]?.generation) && typeof r["data"]?.snapshotId === "string", () => JSON.stringify(r["data"]))
        })
        return
      }
      case "abort": {
        const c = freeCommander()
        // Now and then behind a checkpoint on the same connection, sent together: the checkpoint
        // waits for the turn's end, the abort must not wait for the checkpoint.
        const behindCheckpoint = frng.chance(0.3)
        log(`abort ${sid} via ${c.label} (in turn: ${ctl.inTurn})${behindCheckpoint ? " behind a checkpoint" : ""}`)
        if (behindCheckpoint) {
          void task("checkpoint", async () =>
            expectCodes(await send(c, { type: "checkpoint", activeSessionId: ctl.id }), "checkpoint", ["session_not_found", "session_failed"]))
        }
        void task("abort", async () => expectCodes(await send(c, { type: "abort", activeSessionId: ctl.id }), "abort", ["session_not_found"]))
        return
      }
      case "prompt_race": {
        const c = freeCommander()
        // Now and then the racing prompt is a history rewrite.
        const message = frng.chance(0.2) ? COMPACT_PROMPT : words(frng, frng.int(1, 50))
        log(`prompt_race ${sid} via ${c.label}${message === COMPACT_PROMPT ? ` (${COMPACT_PROMPT})` : ""}`)
        void task("prompt", async () => expectCodes(await send(c, { type: "prompt", activeSessionId: ctl.id, message }), "prompt", ["session_busy", "session_failed", "session_not_found"]))
        return
      }
      case "retry_worker": {
        const c = freeCommander()
        log(`retry_worker ${sid} via ${c.label}`)
        void task("retry_worker", async () => expectCodes(await send(c, { type: "retry_worker", activeSessionId: ctl.id }), "retry_worker", retryCodes))
        return
      }
      case "kill_session": {
        const c = freeCommander()
        log(`kill_session ${sid} via ${c.label}, and a new session`)
        ctl.killed = true
        void task("kill", async () => {
          let r = await send(c, { type: "kill", activeSessionId: ctl.id })
          expectCodes(r, "kill", [])
          // The daemon died before answering: whether the kill was done is unknown; ask again
          // (session_not_found then says it was).
          while (r === undefined && !stopped()) {
            await sleep(200)
            r = await send(freeCommander(), { type: "kill", activeSessionId: ctl.id })
            expectCodes(r, "kill", ["session_not_found"])
          }
          await addSession(c)
        })
        return
      }
      case "rewrite_while_away": {
        // A /compact is raced against the driver until one is accepted; at that moment an
        // observer of the session drops, so the rewrite happens while it is away (it may have
        // the turn's user message, or even the replacement, or not); once the replacement has
        // reached the driver, the observer comes back at once and resumes from its cursor,
        // before the rewrite: `partial`/`transcript_replaced`, never a replay across it.
        const o = observers.find((x) => wanted.get(x)!.has(ctl.id) && x.stream(ctl.id).settled) ?? frng.pick(observers)
        wanted.get(o)!.add(ctl.id)
        const c = freeCommander()
        log(`rewrite_while_away ${sid}: /compact via ${c.label}, ${o.label} away meanwhile`)
        void task("rewrite_while_away", async () => {
          const driverStream = ctl.driver.stream(ctl.id)
          const deadline = Date.now() + 10_000
          while (!stopped() && !stopFaults && !ctl.killed && Date.now() < deadline) {
            const before = driverStream.replacements
            const r = await send(c, { type: "prompt", activeSessionId: ctl.id, message: COMPACT_PROMPT })
            expectCodes(r, "prompt", ["session_busy", "session_failed", "session_not_found"])
            if (r?.["success"] !== true) {
              await sleep(frng.int(20, 200))
              continue
            }
            stats.compactsAccepted++
            reconnectAt.set(o, Date.now() + 60_000)
            o.drop()
            try {
              const seen = await waitUntil(() => driverStream.replacements > before || stopFaults, 10_000)
              log(`  ${sid} rewritten while ${o.label} was away: ${seen && driverStream.replacements > before}`)
              // Back at once, while the generation of its cursor is still retained (the next
              // checkpoints prune it, and a cursor_expired resync would hide a replay across the
              // rewrite).
              reconnectAt.delete(o)
              if (o.connected || daemonDown || stopped()) return
              try {
                await o.connect()
              } catch {
                return
              }
              const from = o.stream(ctl.id).last
              await attach(o, ctl.id, frng, true)
              log(`  ${o.label} back on ${sid} from ${fmtCursor(from)}: replay ${o.stream(ctl.id).lastReplayStatus}`)
            } finally {
              reconnectAt.delete(o)
            }
            return
          }
          log(`  (${sid}: no /compact accepted)`)
        })
        return
      }
      case "second_daemon": {
        // Another serve on the same state dir (another socket): refused by the state dir's
        // lock, naming this daemon, having written nothing (its generation counter is unchanged).
        const generationFile = `${daemon.stateDir}/supervisor-generation`
        const before = fs.readFileSync(generationFile, "utf8")
        const socketPath = `${daemon.root}/second-${counts[kind]}.sock`
        log(`second_daemon at ${socketPath}`)
        const r = await daemon.serveSecond(socketPath)
        const expected = `another daemon (pid ${daemon.pid}, socket ${daemon.socketPath}) holds ${daemon.stateDir}`
        check("second daemon refused", !r.ranOn && r.code === 1 && r.output.includes(expected), () =>
          `${r.ranOn ? "it started beside the first" : `exit ${r.code}`}: ${r.output.slice(0, 500)}`)
        check("second daemon wrote nothing", fs.readFileSync(generationFile, "utf8") === before && !fs.existsSync(socketPath), () =>
          `supervisor-generation ${JSON.stringify(before)} -> ${JSON.stringify(fs.readFileSync(generationFile, "utf8"))}, socket file ${fs.existsSync(socketPath)}`)
        return
      }
      case "disk_full": {
        if (!daemon.onTmpfs) return log("disk_full: (no tmpfs here: skipped)")
        const leave = frng.pick([0, 4096, 64 * 1024, 512 * 1024])
        const holdMs = frng.int(1000, 4000)
        const filler = path.join(daemon.root, `filler-${counts[kind]}`)
        const written = fillDisk(daemon.root, filler, leave)
        log(`disk_full: ${(written / 2 ** 20).toFixed(1)} MiB written, ${leave} bytes left, for ${holdMs} ms`)
        await sleep(holdMs)
        fs.rmSync(filler, { force: true })
        lastStorageFaultAt = Date.now()
        log("  disk freed")
        return
      }
      case "store_restart": {
        // PostgreSQL stopped (fast: its sessions are cut) and started again on the same data:
        // the daemon reconnects; commands in flight fail storage_unavailable or succeed, none
        // hangs, and nothing acknowledged is lost (the run's checks).
        if (pgDir === undefined) return log("store_restart: (files store: skipped)")
        const started = Date.now()
        // Not execFileSync: the harness must go on reading its clients meanwhile, or the answers
        // that came in during the restart look overdue to the watchdog (its timer runs before
        // the sockets are read once the loop is free again).
        await new Promise<void>((resolve, reject) =>
          execFile(PG_SCRIPT, ["restart", pgDir], (error) => (error === null ? resolve() : reject(error)))
        )
        lastStorageFaultAt = Date.now()
        log(`store_restart: PostgreSQL restarted in ${Date.now() - started} ms`)
        return
      }
      case "fd_pressure": {
        const holdMs = frng.int(1000, 3000)
        const hogs = await hogFds(daemon.socketPath)
        log(`fd_pressure: ${hogs.length} idle connections hold the daemon's fds for ${holdMs} ms`)
        await sleep(holdMs)
        for (const h of hogs) h.destroy()
        lastStorageFaultAt = Date.now()
        log("  fds released")
        return
      }
      case "spawn_fail": {
        // The session's next worker spawns fail (a bad NODE_OPTIONS in its launchEnv); its
        // worker is killed (or it is passivated) so that a spawn comes; healed a few seconds later.
        const healIn = frng.int(2000, 8000)
        log(`spawn_fail ${sid}, healed in ${healIn} ms`)
        ctl.poisoned = true
        void task("spawn_fail", async () => {
          await withOwnClient("poison", async (c) => {
            const r = await send(c, { type: "attach", activeSessionId: ctl.id, launchEnv: { NODE_OPTIONS: "--no-such-chaos-option" } })
            if (r?.["success"] === true) {
              expectCodes(await send(c, { type: "detach", activeSessionId: ctl.id }), "detach", ["session_not_found"])
              killPid(ctl.workerPid, `worker of poisoned ${sid}`)
            }
          })
          await sleep(healIn)
          await heal(ctl)
        })
        return
      }
    }
  }

  /** Gives a poisoned session a good launchEnv again, and a worker if it failed. */
  const heal = (ctl: SessionCtl, always = false): Promise<void> =>
    (!ctl.poisoned && !always) || ctl.killed ? Promise.resolve() : withOwnClient("heal", async (c) => {
      const r = await send(c, { type: "attach", activeSessionId: ctl.id, launchEnv: {} })
      if (r?.["success"] !== true) return
      ctl.poisoned = false
      ctl.healedAt = Date.now()
      log(`healed ${ctl.id.slice(0, 12)}`)
      await send(c, { type: "detach", activeSessionId: ctl.id })
      const st = await send(c, { type: "get_state", activeSessionId: ctl.id })
      if (st?.["data"]?.worker === "failed") expectCodes(await send(c, { type: "retry_worker", activeSessionId: ctl.id }), "retry_worker", retryCodes)
    })

  // ------------------------------------------------------------------------------------------
  // The run
  // ------------------------------------------------------------------------------------------

  const observers: Array<ChaosClient> = []
  let background: Array<Promise<void>> = []
  try {
    await daemon.start()
    log(`daemon pid ${daemon.pid}, ${sessionCount} sessions, settings ${JSON.stringify(settings)}`)
    for (let i = 0; i < 3; i++) {
      const c = newClient(`cmd-${i}`)
      await c.connect()
      commanders.push(c)
    }
    for (let i = 0; i < 3; i++) {
      const o = newClient(`obs-${i}`)
      await o.connect()
      wanted.set(o, new Set())
      observers.push(o)
    }
    const ping = newClient("pinger")
    await ping.connect()
    for (let i = 0; i < sessionCount; i++) await addSession(commanders[0]!)
    background = [task("watchdog", watchdog), task("maintain", maintain), task("pinger", () => pinger(ping))]

    // Faults at random moments over the run.
    const frng = rng.fork()
    const end = t0 + options.seconds * 1000
    const meanGap = (options.seconds * 1000) / Math.max(1, options.faults)
    let injected = 0
    while (!stopped() && Date.now() < end && injected < options.faults) {
      await sleep(Math.min(frng.exp(meanGap), end - Date.now()))
      if (stopped() || Date.now() >= end) break
      await task("fault", () => fault(frng.weighted(weights), frng))
      injected++
    }
    while (!stopped() && Date.now() < end) await sleep(100)
    stopFaults = true
    if (!stopped()) await settle()
  } catch (e) {
    fail(e instanceof Violation ? e : new Violation("harness", e instanceof Error ? e.stack ?? e.message : String(e)))
  } finally {
    stopFaults = true
    stopLoad = true
    const postMortem = violation === undefined || !daemon.running ? [] : await inspect()
    const daemonLog = daemon.logTail()
    for (const c of clients) c.drop()
    // A failed run keeps its state dir for inspection.
    await daemon.cleanup(options.keep === true || violation !== undefined)
    if (pgDir !== undefined) {
      try {
        execFileSync(PG_SCRIPT, ["stop", pgDir], { stdio: "ignore" })
      } catch (e) {
        notes.push(`stopping the run's PostgreSQL failed: ${String(e)}`)
      }
    }
    await Promise.race([Promise.all(background), sleep(2000)])
    for (const c of clients) {
      for (const s of c.streams.values()) {
        stats.resyncs += s.resyncs
        stats.replacements += s.replacements
        stats.compactionsChecked += s.compactionsChecked
        stats.transcriptReplaced += s.transcriptReplaced
      }
    }
    return {
      seed: options.seed,
      violation,
      schedule,
      counts,
      settings,
      stats,
      notes,
      daemonLog,
      postMortem,
      stateDir: daemon.stateDir
    }
  }

  /** What a fresh connection sees of every session after a violation (each answer bounded). */
  async function inspect(): Promise<Array<string>> {
    const out: Array<string> = []
    const c = new ChaosClient("post-mortem", () => daemon.socketPath, truthOf)
    try {
      await c.connect(3000)
      for (const ctl of sessions.values()) {
        const r = await Promise.race([c.send({ type: "get_state", activeSessionId: ctl.id }), sleep(3000).then(() => "no answer in 3 s")])
        const st = typeof r === "string" ? r : JSON.stringify(r?.["data"] ?? r?.["error"])
        out.push(`${ctl.id}${ctl.killed ? " (killed)" : ""}: get_state ${st}`)
        out.push(`  its driver saw last: ${ctl.driver.stream(ctl.id).recentMessages().join(", ")}`)
      }
    } catch (e) {
      out.push(`post-mortem connection failed: ${String(e)}`)
    } finally {
      c.drop()
    }
    return out
  }

  /**
   * The end of the run: load stops, every session must be idle and ready again, every client's
   * view must equal the daemon's transcript, and a killed-and-restarted daemon must resume them.
   */
  async function settle(): Promise<void> {
    log("settling: load stops")
    stopLoad = true
    for (const o of observers) o.resume()
    reconnectAt.clear()
    const c = commanders[0]!
    // A daemon restarted just before (a graceful stop's restart at the run's end): the commander
    // is connected again by the maintain loop, within moments; a command sent before that would
    // be taken for a dropped connection.
    await waitUntil(() => c.connected, 10_000)
    await waitUntil(() => commanders.every((x) => x.pendingCount === 0), 60_000)
    // Each driver ends its loop once its turn has ended: bounded, so that a wedged session is
    // reported (with its state) rather than waited for forever.
    // A session whose create was answered after the load stopped (a kill_session's new session
    // made across a daemon restart) joins the wait when it appears, not never.
    const ended = new Set<SessionCtl>()
    const followed = new Set<SessionCtl>()
    const allEnded = () => {
      for (const ctl of liveSessions()) {
        if (followed.has(ctl)) continue
        followed.add(ctl)
        void ctl.done.then(() => ended.add(ctl))
      }
      return liveSessions().every((ctl) => ended.has(ctl))
    }
    if (!(await waitUntil(allEnded, SETTLE_BOUND_MS)) && !stopped()) {
      const wedged = liveSessions().filter((ctl) => !ended.has(ctl))
      const states = await Promise.all(wedged.map((ctl) => send(c, { type: "get_state", activeSessionId: ctl.id })))
      check("every driver's turn ends", false, () => `after ${SETTLE_BOUND_MS} ms: ${states.map((r) => JSON.stringify(r?.["data"] ?? r)).join("; ")}`)
    }
    if (stopped()) return
    // Every session: poisons may have overlapped a heal that then cleared the flag.
    for (const ctl of liveSessions()) await heal(ctl, kinds.includes("spawn_fail"))
    // Every session idle and ready (a failed one is retried once).
    for (const ctl of liveSessions()) {
      const deadline = Date.now() + SETTLE_BOUND_MS
      let retried = false
      for (;;) {
        const r = await send(c, { type: "get_state", activeSessionId: ctl.id })
        check("daemon reachable", r !== undefined, () =>
          `the connection dropped while settling (daemon ${daemon.running ? "running" : `exited ${JSON.stringify(daemon.exit)}`})`)
        check("live session exists", r!["success"] === true, () => `get_state ${ctl.id}: ${JSON.stringify(r!["error"])}`)
        const st = r!["data"] as Msg
        if (st["busy"] === false && (st["worker"] === "ready" || st["worker"] === "passivated")) break
        if (st["worker"] === "failed" && !retried) {
          retried = true
          expectCodes(await send(c, { type: "retry_worker", activeSessionId: ctl.id }), "retry_worker", [])
        }
        check("no session left busy or not ready", Date.now() < deadline, () => `session ${ctl.id} after ${SETTLE_BOUND_MS} ms: ${JSON.stringify(st)}`)
        await sleep(100)
      }
    }
    for (const ctl of sessions.values()) {
      if (!ctl.killed) continue
      const r = await send(c, { type: "get_state", activeSessionId: ctl.id })
      check("killed session gone", r?.["success"] === false && r["error"]?.code === "session_not_found", () => `get_state of killed ${ctl.id}: ${JSON.stringify(r)}`)
    }
    await compareViews("after the run")
    const orphans = daemon.orphans()
    check("no orphan worker", orphans.length === 0, () => `processes not under the daemon: ${orphans.join(", ")}`)

    // The journal and the event log reopen: a killed daemon's successor resumes every client.
    // Its resumes are `complete` only for drivers that hold every event the daemon had: a
    // session may still move after the views were compared (passivated while another took its
    // worker, with a checkpoint that prunes the generation a lagging driver stands in when
    // retainGenerations is 1; its resume is then rightly `cursor_expired`). So the restart waits
    // until no session moves and every driver has every event (bounded: a driver that never
    // gets them is a violation of its own).
    await quiesce()
    await restartDaemon("final restart check")
    await waitUntil(() => clients.every((x) => x.connected), 15_000)
    for (const ctl of liveSessions()) {
      const s = ctl.driver.stream(ctl.id)
      const settled = await waitUntil(() => s.settled, 20_000)
      check("resume after a daemon restart", settled, () => `driver of ${ctl.id} not re-attached`)
      check("cursors stay valid across daemon restarts", s.lastReplayStatus === "complete", () => `driver of ${ctl.id} resumed from ${fmtCursor(s.last)}: replay ${s.lastReplayStatus}`)
    }
    await compareViews("after a daemon restart")
    const list = await send(c, { type: "list" })
    const listed = new Set(((list?.["data"]?.sessions ?? []) as Array<Msg>).map((x) => x["activeSessionId"]))
    for (const ctl of sessions.values()) {
      check("sessions survive a restart", listed.has(ctl.id) === !ctl.killed, () => `${ctl.id} (killed ${ctl.killed}) listed: ${listed.has(ctl.id)}`)
    }
    const r = await send(c, { type: "shutdown" })
    check("shutdown", r?.["success"] === true, () => `shutdown answered ${JSON.stringify(r)}`)
    check("shutdown exits 0", await daemon.waitExit(15_000) && daemon.exit?.code === 0, () => `daemon after shutdown: ${JSON.stringify(daemon.exit)}`)
    const deadline = Date.now() + 5_000
    while (Date.now() < deadline && daemon.markedProcesses().length > 0) await sleep(100)
    check("no process left after shutdown", daemon.markedProcesses().length === 0, () => `still alive: ${daemon.markedProcesses().join(", ")}`)
    log("settled: every check passed")
  }

  /** Every attached client, caught up, folds the transcript the daemon serves; no gap anywhere. */
  /** Waits until every live session's last cursor holds still and every driver has reached it. */
  async function quiesce(): Promise<void> {
    const c = commanders[0]!
    const lastCursors = async () =>
      Promise.all(liveSessions().map(async (ctl) => (await send(c, { type: "get_state", activeSessionId: ctl.id }))?.["data"]?.lastEventCursor as Cursor | undefined))
    const deadline = Date.now() + SETTLE_BOUND_MS
    let lagging = ""
    for (;;) {
      const before = await lastCursors()
      await sleep(300)
      const after = await lastCursors()
      const still = before.every((b, i) => fmtCursor(b) === fmtCursor(after[i]))
      lagging = liveSessions().flatMap((ctl, i) => {
        const s = ctl.driver.stream(ctl.id)
        const last = after[i]
        return last === undefined || (s.settled && s.last !== undefined && compareCursor(s.last, last) >= 0)
          ? []
          : [`driver of ${ctl.id} at ${fmtCursor(s.last)} (settled ${s.settled}), the session at ${fmtCursor(last)}`]
      }).join("; ")
      if (still && lagging === "") return
      check("every event delivered", Date.now() < deadline, () => `before the final restart, after ${SETTLE_BOUND_MS} ms: ${still ? lagging : "sessions still moving"}`)
    }
  }

  async function compareViews(when: string): Promise<void> {
    const c = commanders[0]!
    for (const ctl of liveSessions()) {
      const st = await send(c, { type: "get_state", activeSessionId: ctl.id })
      const last = st?.["data"]?.lastEventCursor as Cursor | undefined
      const messages: Array<Msg> = []
      for (;;) {
        const r = await send(c, { type: "get_messages", activeSessionId: ctl.id, offset: messages.length, limit: 1000 })
        check("get_messages", r?.["success"] === true, () => `get_messages ${ctl.id}: ${JSON.stringify(r)}`)
        const page = r!["data"]["messages"] as Array<Msg>
        messages.push(...page)
        if (page.length === 0 || messages.length >= r!["data"]["total"]) break
      }
      check("messageCount", messages.length === st?.["data"]?.messageCount, () => `${ctl.id}: get_messages has ${messages.length}, messageCount ${st?.["data"]?.messageCount}`)
      // A rewrite leaves exactly its compaction message, then what later turns add: a compaction
      // message anywhere but first was appended rather than made the whole transcript.
      const compactedAt = messages.findIndex((m, i) => i > 0 && compactedCount({ role: String(m["role"]), content: String(m["content"]) }) !== undefined)
      check("transcript after a rewrite", compactedAt < 0, () => `${ctl.id} ${when}: message ${compactedAt} of ${messages.length} is a compaction (${JSON.stringify(messages[compactedAt]?.["content"])})`)
      const first = messages[0] === undefined ? undefined : { role: String(messages[0]["role"]), content: String(messages[0]["content"]) }
      const n = compactedCount(first)
      check(
        "transcript after a rewrite",
        !ctl.truth.rewritten || n !== undefined,
        () => `${ctl.id} ${when}: history was rewritten (a client was sent a replacement) but the transcript starts with ${JSON.stringify(first ?? null)}`
      )
      const expected = messages[0] === undefined ? undefined : ctl.truth.compactions.get(String(messages[0]["id"]))
      check(
        "transcript after a rewrite",
        expected === undefined || expected === n,
        () => `${ctl.id} ${when}: the transcript starts with \`${first?.content}\`, but a client that held every message before that rewrite counted ${expected}`
      )
      for (const o of clients) {
        const s = o.streams.get(ctl.id)
        if (s === undefined || !s.attached) continue
        const caughtUp = await waitUntil(() => s.settled && last !== undefined && s.last !== undefined && compareCursor(s.last, last) >= 0, 20_000)
        check("every event delivered", caughtUp, () => `${o.label} on ${ctl.id} ${when}: last ${fmtCursor(s.last)}, the session's ${fmtCursor(last)}, settled ${s.settled}`)
        const fold = s.fold ?? []
        const diff = fold.findIndex((m, i) => m.id !== messages[i]?.["id"] || m.content !== messages[i]?.["content"] || m.role !== messages[i]?.["role"])
        check(
          "transcript = fold of the events",
          fold.length === messages.length && diff < 0,
          () => `${o.label} on ${ctl.id} ${when}: folded ${fold.length} messages, the daemon serves ${messages.length}; first difference at ${diff < 0 ? Math.min(fold.length, messages.length) : diff}; it saw last: ${s.recentMessages().join(", ")}`
        )
      }
    }
    for (const t of truths.values()) t.checkJumps(true)
  }
}
