/**
 * The process-table checker of "a session never has two live workers": it samples /proc every
 * ~20 ms, finds agentd workers by their process title (`agentd-worker <key>`, set by a worker
 * when it is given its session: src/Worker.ts; the key is `workerTitleKey` of the session's id,
 * which is what `sessions`, `seen` and `doubles` name) and records every sample in which one
 * session has two live (non-zombie) workers, whichever daemon or runner started them and
 * whether or not their parent is still alive (an orphaned worker of a SIGKILLed runner counts).
 *
 * A spare worker (no session yet) has its node command line and is not counted. Plain Node (no
 * vitest), so that the chaos harness uses it too.
 *
 * Sampling costs about 5 ms of CPU per scan of a /proc of ~100 processes; the gaps between
 * samples are recorded (`maxGapMs`) so that a report says how fine the check really was on a
 * loaded machine.
 */
import * as fs from "node:fs"
import * as path from "node:path"
import { HOST_TITLE_KEY, WORKER_TITLE_PREFIX } from "../../src/WorkerProtocol.js"

/** One moment where a session had more than one live worker. */
export interface Double {
  /** `Date.now()` of the sample. */
  readonly at: number
  readonly session: string
  readonly pids: ReadonlyArray<number>
}

const TITLE = Buffer.from(WORKER_TITLE_PREFIX)
const scratch = Buffer.alloc(512)

/** The first bytes of a file, or undefined when it cannot be read (the process is gone). */
const head = (file: string): Buffer | undefined => {
  let fd: number | undefined
  try {
    fd = fs.openSync(file, "r")
    const n = fs.readSync(fd, scratch, 0, scratch.length, 0)
    return scratch.subarray(0, n)
  } catch {
    return undefined
  } finally {
    if (fd !== undefined) fs.closeSync(fd)
  }
}

/** The state letter of /proc/<pid>/stat (after the parenthesised comm, which may hold spaces). */
const stateOf = (procRoot: string, pid: string): string | undefined => {
  const stat = head(path.join(procRoot, pid, "stat"))?.toString("latin1")
  if (stat === undefined) return undefined
  const close = stat.lastIndexOf(")")
  return close < 0 ? undefined : stat.charAt(close + 2)
}

/**
 * The live workers of every session in a /proc-like tree: session id -> pids. A worker is a
 * process whose cmdline starts with the title prefix; its session id runs to the first NUL (the
 * rest of the original argv area is NULs, or, for a title shorter than it, nothing). Zombies
 * and exiting processes (`Z`, `X`) and processes gone between the reads are not live.
 */
export const workersBySession = (procRoot = "/proc"): Map<string, Array<number>> => {
  const out = new Map<string, Array<number>>()
  let entries: Array<string>
  try {
    entries = fs.readdirSync(procRoot)
  } catch {
    return out
  }
  for (const pid of entries) {
    const c = pid.charCodeAt(0)
    if (c < 48 || c > 57) continue
    const cmdline = head(path.join(procRoot, pid, "cmdline"))
    if (cmdline === undefined || cmdline.length <= TITLE.length || !cmdline.subarray(0, TITLE.length).equals(TITLE)) continue
    const end = cmdline.indexOf(0, TITLE.length)
    const session = cmdline.subarray(TITLE.length, end < 0 ? cmdline.length : end).toString("utf8")
    // A spare names no session yet; a host (several sessions) names none.
    if (session === "" || session === HOST_TITLE_KEY) continue
    const state = stateOf(procRoot, pid)
    if (state === undefined || state === "Z" || state === "X") continue
    const pids = out.get(session)
    if (pids === undefined) out.set(session, [Number(pid)])
    else pids.push(Number(pid))
  }
  return out
}

export interface CensusOptions {
  /** Between samples (default 20 ms). */
  readonly intervalMs?: number
  /** Only these sessions count (default: every agentd worker of the machine). */
  readonly sessions?: (id: string) => boolean
  /** The /proc to read (a fake tree in unit tests). */
  readonly procRoot?: string
}

/** A running census: start it before the faults, stop it after, then read `doubles`. */
export class WorkerCensus {
  readonly doubles: Array<Double> = []
  /** Every worker pid seen per session over the run. */
  readonly seen = new Map<string, Set<number>>()
  samples = 0
  maxGapMs = 0
  private last = 0
  private timer: ReturnType<typeof setInterval> | undefined

  constructor(private readonly options: CensusOptions = {}) {}

  /** One sample now; returns the doubles it found. */
  sample(): Array<Double> {
    const now = Date.now()
    if (this.last !== 0) this.maxGapMs = Math.max(this.maxGapMs, now - this.last)
    this.last = now
    this.samples++
    const found: Array<Double> = []
    for (const [session, pids] of workersBySession(this.options.procRoot)) {
      if (this.options.sessions !== undefined && !this.options.sessions(session)) continue
      let seen = this.seen.get(session)
      if (seen === undefined) this.seen.set(session, seen = new Set())
      for (const pid of pids) seen.add(pid)
      if (pids.length > 1) found.push({ at: now, session, pids: [...pids].sort((a, b) => a - b) })
    }
    this.doubles.push(...found)
    return found
  }

  start(): this {
    if (this.timer === undefined) {
      this.sample()
      this.timer = setInterval(() => this.sample(), this.options.intervalMs ?? 20)
    }
    return this
  }

  stop(): this {
    if (this.timer !== undefined) clearInterval(this.timer)
    this.timer = undefined
    return this
  }

  /** One line for a log: samples, the widest gap, the doubles (first few). */
  summary(): string {
    const workers = [...this.seen.values()].reduce((n, s) => n + s.size, 0)
    const doubles = this.doubles.length === 0
      ? "no session ever had two live workers"
      : `${this.doubles.length} samples with a session on two live workers, first: ${
        this.doubles.slice(0, 3).map((d) => `${d.session} pids ${d.pids.join(",")} at ${new Date(d.at).toISOString()}`).join("; ")
      }`
    return `worker census: ${this.samples} samples (widest gap ${this.maxGapMs} ms), ${this.seen.size} sessions, ${workers} workers; ${doubles}`
  }
}
