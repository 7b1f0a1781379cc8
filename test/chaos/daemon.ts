/**
 * The daemon under chaos: the real built `agentd serve` over one state dir, which a run may
 * SIGKILL and start again. Every process it spawns carries `AGENTD_CHAOS_MARK` in its
 * environment, so clean-up (and the orphan check) finds them all, whatever their parent.
 */
import { type ChildProcess, execFileSync, spawn } from "node:child_process"
import { randomUUID } from "node:crypto"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { descendantsOf, isAlive, killQuietly, processesWithEnv } from "../support/procfs.js"

const here = path.dirname(fileURLToPath(import.meta.url))
export const DAEMON_BIN = process.env["AGENTD_CHAOS_BIN"] ?? path.resolve(here, "..", "..", "dist", "src", "bin", "agentd.js")

export const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms))

const live = new Set<ChaosDaemon>()
let hooked = false
const installExitHook = () => {
  if (hooked) return
  hooked = true
  process.on("exit", () => {
    for (const d of live) d.killAllSync()
  })
  for (const signal of ["SIGINT", "SIGTERM"] as const) {
    process.once(signal, () => {
      for (const d of live) d.killAllSync()
      process.exit(130)
    })
  }
}

export class ChaosDaemon {
  private proc: ChildProcess | undefined
  private exitInfo: { code: number | null; signal: NodeJS.Signals | null } | undefined
  private exited: Promise<void> = Promise.resolve()
  private readonly log: Array<string> = []
  readonly mark = randomUUID()
  readonly root: string
  readonly stateDir: string
  readonly socketPath: string
  starts = 0
  /** Called with each chunk of the daemon's output (the cluster run counts fence alarms in it). */
  onOutput: ((chunk: string) => void) | undefined
  /** The run's dir is a tmpfs of its own (`disk_full` fills it), unmounted at clean-up. */
  readonly onTmpfs: boolean

  constructor(
    private readonly env: Readonly<Record<string, string>>,
    private readonly limits: { readonly tmpfsMiB?: number | undefined; readonly fdLimit?: number | undefined } = {}
  ) {
    this.root = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-chaos-"))
    this.stateDir = path.join(this.root, "state")
    this.socketPath = path.join(this.stateDir, "agentd.sock")
    let mounted = false
    if (limits.tmpfsMiB !== undefined) {
      try {
        execFileSync("mount", ["-t", "tmpfs", "-o", `size=${limits.tmpfsMiB}m,mode=0700`, "tmpfs", this.root], { stdio: "ignore" })
        mounted = true
      } catch {
        // Not allowed here (not root, no mount namespace): `disk_full` is then skipped.
      }
    }
    this.onTmpfs = mounted
    live.add(this)
    installExitHook()
  }

  get pid(): number | undefined {
    return this.proc?.pid
  }

  get running(): boolean {
    return this.proc !== undefined && this.exitInfo === undefined
  }

  /** How the last daemon process ended, if it did. */
  get exit(): { code: number | null; signal: NodeJS.Signals | null } | undefined {
    return this.exitInfo
  }

  logTail(chars = 4000): string {
    return this.log.join("").slice(-chars)
  }

  /** Starts `agentd serve` over the state dir and waits for its hello. */
  async start(): Promise<void> {
    if (!fs.existsSync(DAEMON_BIN)) throw new Error(`${DAEMON_BIN} does not exist: run \`npm run build\` first`)
    const env: Record<string, string> = {}
    for (const [k, v] of Object.entries(process.env)) {
      if (v === undefined || k.startsWith("AGENTD_") || k === "NODE_OPTIONS" || k.startsWith("VITEST")) continue
      env[k] = v
    }
    Object.assign(env, this.env, { AGENTD_CHAOS_MARK: this.mark })
    const argv = [DAEMON_BIN, "serve", "--state-dir", this.stateDir]
    const fdLimit = this.limits.fdLimit
    // Under `ulimit -n` (for `fd_pressure`): the shell execs the daemon, same pid.
    const proc = spawn(fdLimit === undefined ? process.execPath : "/bin/sh", fdLimit === undefined ? argv : [
      "-c",
      `ulimit -n ${fdLimit} && exec "$0" "$@"`,
      process.execPath,
      ...argv
    ], {
      cwd: this.root,
      env,
      stdio: ["ignore", "pipe", "pipe"],
      detached: true
    })
    this.proc = proc
    this.exitInfo = undefined
    this.starts++
    const keep = (d: string) => {
      this.onOutput?.(d)
      this.log.push(d)
      if (this.log.length > 600) this.log.splice(0, 300)
    }
    proc.stderr?.setEncoding("utf8")
    proc.stderr?.on("data", keep)
    proc.stdout?.setEncoding("utf8")
    proc.stdout?.on("data", (d: string) => keep(`[stdout] ${d}`))
    this.exited = new Promise((resolve) => {
      proc.once("exit", (code, signal) => {
        this.exitInfo = { code, signal }
        resolve()
      })
    })
    const deadline = Date.now() + 20_000
    while (Date.now() < deadline) {
      if (!this.running) throw new Error(`daemon exited during start-up (${JSON.stringify(this.exitInfo)}):\n${this.logTail()}`)
      if (await this.greets()) return
      await sleep(30)
    }
    const diagnosis = this.diagnose()
    this.abandon()
    await this.exited
    throw new Error(`daemon did not greet within 20 s (${diagnosis}):\n${this.logTail()}`)
  }

  /** What the daemon process is doing (for a start that hangs). */
  private diagnose(): string {
    const pid = this.proc?.pid
    if (pid === undefined) return "no process"
    const read = (f: string) => {
      try {
        return fs.readFileSync(f, "utf8").trim()
      } catch {
        return "?"
      }
    }
    const state = /State:\s+(.*)/.exec(read(`/proc/${pid}/status`))?.[1] ?? "?"
    const children = descendantsOf(pid).map((c) => `${c}:${/State:\s+(\S+)/.exec(read(`/proc/${c}/status`))?.[1] ?? "?"}`)
    let socket = "absent"
    try {
      socket = `present, mode ${(fs.statSync(this.socketPath).mode & 0o777).toString(8)}`
    } catch {
      // absent
    }
    return `pid ${pid} state ${state}, wchan ${read(`/proc/${pid}/wchan`)}, socket ${socket}, children [${children.join(", ")}], ` +
      `other processes of the run [${this.orphans().filter((p) => p !== pid).join(", ")}]`
  }

  /** Does a daemon answer on the socket with a hello naming this process? */
  private greets(): Promise<boolean> {
    return new Promise((resolve) => {
      if (!fs.existsSync(this.socketPath)) return resolve(false)
      const socket = net.createConnection({ path: this.socketPath })
      let buf = ""
      const done = (ok: boolean) => {
        socket.destroy()
        resolve(ok)
      }
      socket.setEncoding("utf8")
      socket.on("data", (d: string) => {
        buf += d
        const nl = buf.indexOf("\n")
        if (nl < 0) return
        try {
          done(JSON.parse(buf.slice(0, nl))["supervisorPid"] === this.proc?.pid)
        } catch {
          done(false)
        }
      })
      socket.on("error", () => done(false))
      setTimeout(() => done(false), 3_000)
    })
  }

  /**
   * Runs another `agentd serve` on the same state dir with another socket (`second_daemon`), to
   * its exit: it must be refused. One that runs on past `timeoutMs` (it started) is killed.
   */
  async serveSecond(socketPath: string, timeoutMs = 20_000): Promise<{ code: number | null; output: string; ranOn: boolean }> {
    const env: Record<string, string> = {}
    for (const [k, v] of Object.entries(process.env)) {
      if (v === undefined || k.startsWith("AGENTD_") || k === "NODE_OPTIONS" || k.startsWith("VITEST")) continue
      env[k] = v
    }
    Object.assign(env, this.env, { AGENTD_CHAOS_MARK: this.mark })
    const proc = spawn(process.execPath, [DAEMON_BIN, "serve", "--state-dir", this.stateDir, "--socket", socketPath], {
      cwd: this.root,
      env,
      stdio: ["ignore", "pipe", "pipe"],
      detached: true
    })
    let output = ""
    proc.stdout.setEncoding("utf8")
    proc.stderr.setEncoding("utf8")
    proc.stdout.on("data", (d: string) => (output += d))
    proc.stderr.on("data", (d: string) => (output += d))
    const exited = new Promise<number | null>((resolve) => proc.once("exit", (code) => resolve(code)))
    const code = await Promise.race([exited, sleep(timeoutMs).then(() => "timeout" as const)])
    if (code !== "timeout") return { code, output, ranOn: false }
    for (const p of descendantsOf(proc.pid!)) killQuietly(p, "SIGKILL")
    killQuietly(proc.pid!, "SIGKILL")
    return { code: await exited, output, ranOn: true }
  }

  /** SIGKILLs the daemon (only the daemon: its workers must notice and go by themselves). */
  async kill(): Promise<void> {
    if (!this.running) return
    killQuietly(this.proc!.pid!, "SIGKILL")
    await this.exited
  }

  /**
   * SIGINT to the daemon's whole process group, as a terminal's Ctrl-C (the daemon leads its
   * group: it is spawned detached); waits for it to exit, at most `timeoutMs`.
   */
  async sigintGroup(timeoutMs: number): Promise<{ code: number | null; signal: NodeJS.Signals | null } | undefined> {
    if (!this.running) return this.exitInfo
    try {
      process.kill(-this.proc!.pid!, "SIGINT")
    } catch {
      // gone meanwhile
    }
    return (await this.waitExit(timeoutMs)) ? this.exitInfo : undefined
  }

  /** Stops a start that hangs: the process and whatever it spawned. */
  private abandon(): void {
    const pid = this.proc?.pid
    if (pid === undefined || !this.running) return
    for (const p of descendantsOf(pid)) killQuietly(p, "SIGKILL")
    killQuietly(pid, "SIGKILL")
  }

  /** Waits for the daemon to exit by itself (after `shutdown`); false at the timeout. */
  async waitExit(timeoutMs: number): Promise<boolean> {
    if (!this.running) return true
    await Promise.race([this.exited, sleep(timeoutMs)])
    return !this.running
  }

  /** Every live process that carries this run's mark (daemon, workers, spares). */
  markedProcesses(): Array<number> {
    return processesWithEnv("AGENTD_CHAOS_MARK", this.mark)
  }

  /** Marked processes that are not the current daemon or one of its descendants. */
  orphans(): Array<number> {
    // Marked processes first: one the daemon spawns between the two scans is then not in the
    // list (scanned the other way round it was, and not yet among the descendants: a worker
    // just forked, its command line still the daemon's, was taken for an orphan).
    const marked = this.markedProcesses()
    const ours = new Set<number>()
    if (this.running) {
      ours.add(this.proc!.pid!)
      for (const p of descendantsOf(this.proc!.pid!)) ours.add(p)
    }
    return marked.filter((p) => !ours.has(p) && isAlive(p))
  }

  /** A process as /proc tells it (for an orphan or a hang): command line, state, where it waits. */
  describeProcess(pid: number): string {
    const read = (f: string) => {
      try {
        return fs.readFileSync(f, "utf8")
      } catch {
        return "?"
      }
    }
    const cmd = read(`/proc/${pid}/cmdline`).split("\0").filter((x) => x.length > 0).map((x) => path.basename(x)).join(" ")
    const state = /State:\s+(.*)/.exec(read(`/proc/${pid}/status`))?.[1] ?? "?"
    return `${pid} [${cmd}] ${state}, wchan ${read(`/proc/${pid}/wchan`).trim()}`
  }

  /** Worker processes of the current daemon. */
  workers(): Array<number> {
    return this.running ? descendantsOf(this.proc!.pid!) : []
  }

  killAllSync(): void {
    if (this.running) {
      try {
        process.kill(-this.proc!.pid!, "SIGKILL")
      } catch {
        // no such group
      }
    }
    for (const p of this.markedProcesses()) killQuietly(p, "SIGKILL")
  }

  /** Kills everything of this run and removes its temp dir (keeps it when `keep`). */
  async cleanup(keep = false): Promise<void> {
    this.killAllSync()
    await Promise.race([this.exited, sleep(5_000)])
    const deadline = Date.now() + 3_000
    while (Date.now() < deadline && this.markedProcesses().some(isAlive)) {
      for (const p of this.markedProcesses()) killQuietly(p, "SIGKILL")
      await sleep(25)
    }
    live.delete(this)
    if (this.onTmpfs) {
      // A kept state dir outlives the mount: copied out of the tmpfs and back onto the plain dir.
      const copy = keep ? `${this.root}.kept` : undefined
      const files = (src: string) => !fs.lstatSync(src).isSocket()
      if (copy !== undefined) fs.cpSync(this.stateDir, copy, { recursive: true, filter: files })
      try {
        execFileSync("umount", ["-l", this.root], { stdio: "ignore" })
      } catch {
        // best effort
      }
      if (copy !== undefined) {
        fs.cpSync(copy, this.stateDir, { recursive: true })
        fs.rmSync(copy, { recursive: true, force: true })
      }
    }
    if (!keep) fs.rmSync(this.root, { recursive: true, force: true })
  }
}
