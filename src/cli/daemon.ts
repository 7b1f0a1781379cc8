/**
 * Running the daemon in the background (`serve --detach`) and reading its log (`logs`). The
 * detached daemon is this command line started again with `serve` in its own session, its
 * stdout and stderr appended to `<state dir>/agentd.log`.
 */
import * as Effect from "effect/Effect"
import { spawn } from "node:child_process"
import * as Schedule from "effect/Schedule"
import * as fs from "../internal/fileIoSync.js"
import * as path from "node:path"
import * as DaemonClient from "../DaemonClient.js"
import type * as Protocol from "../Protocol.js"
import * as StateDirLock from "../StateDirLock.js"
import { semiSpaceFlags } from "../internal/youngGeneration.js"
import type { Context } from "./commands.js"
import { CliError, EXIT, failed } from "./errors.js"
import type { ServeOptions } from "./main.js"

/** The log of a detached daemon. */
export const logFile = (stateDir: string) => path.join(stateDir, "agentd.log")

/** How long `serve --detach` waits for the daemon to listen. */
const START_TIMEOUT_MS = 30_000

const tail = (file: string, lines: number): string => {
  try {
    const text = fs.readFileSync(file, "utf8").trimEnd().split("\n")
    return text.slice(-lines).join("\n")
  } catch {
    return ""
  }
}

const greets = (socketPath: string) =>
  Effect.scoped(DaemonClient.make({ socketPath, helloTimeout: "2 seconds" })).pipe(Effect.map((c) => c.hello))

/** `agentd serve --detach`: starts the daemon in the background and returns once it listens. */
export const detach = (ctx: Context, options: ServeOptions, self: ReadonlyArray<string>) =>
  Effect.gen(function*() {
    // Before the log is opened in the state dir: a refused start changes nothing there. (A
    // daemon that takes the state dir between this check and the child's start refuses the
    // child, which then says so below, through its log.)
    const holder = yield* StateDirLock.holderOf(options.stateDir)
    if (holder._tag === "Some") return yield* Effect.fail(failed(holder.value.message))
    const running = yield* Effect.option(greets(options.socketPath))
    if (running._tag === "Some") {
      return yield* Effect.fail(failed(`another daemon is listening at ${options.socketPath} (pid ${running.value.supervisorPid})`))
    }
    const log = logFile(options.stateDir)
    const fd = yield* Effect.try({
      try: () => {
        fs.mkdirSync(options.stateDir, { recursive: true, mode: 0o700 })
        return fs.openSync(log, "a", 0o600)
      },
      catch: (e) => failed(`cannot open ${log}: ${(e as NodeJS.ErrnoException).code ?? String(e)}`)
    })
    const args = [
      // The young generation's cap, exact from the start (see src/internal/youngGeneration.ts).
      ...semiSpaceFlags(self),
      ...self,
      "serve",
      "--state-dir",
      options.stateDir,
      "--socket",
      options.socketPath,
      ...(options.engine === undefined ? [] : ["--engine", options.engine]),
      ...(options.maxWorkers === undefined ? [] : ["--max-workers", String(options.maxWorkers)]),
      ...(options.sessionsPerWorker === undefined ? [] : ["--sessions-per-worker", String(options.sessionsPerWorker)]),
      ...(options.shutdownGraceMs === undefined ? [] : ["--shutdown-grace-ms", String(options.shutdownGraceMs)]),
      ...(options.logLevel === undefined ? [] : ["--log-level", options.logLevel]),
      ...(options.store === undefined ? [] : ["--store", options.store]),
      ...(options.http === undefined ? [] : ["--http", options.http]),
      ...(options.httpInsecure === true ? ["--http-insecure"] : []),
      ...(options.cluster === true ? ["--cluster"] : []),
      ...(options.runnerAddress === undefined ? [] : ["--runner-address", options.runnerAddress])
    ]
    const child = spawn(process.execPath, args, { detached: true, stdio: ["ignore", fd, fd] })
    fs.closeSync(fd)
    let exited: string | undefined
    child.once("exit", (code, signal) => (exited = signal === null ? `exit code ${code}` : `signal ${signal}`))
    child.once("error", (e) => (exited = e.message))
    child.unref()

    const started = Date.now()
    const attempt = Effect.suspend((): Effect.Effect<Protocol.DaemonHello, CliError | DaemonClient.ConnectError> =>
      exited !== undefined
        ? Effect.fail(failed(`the daemon stopped (${exited})`))
        : greets(options.socketPath)
    )
    const hello = yield* attempt.pipe(
      Effect.retry({
        schedule: Schedule.spaced("100 millis"),
        while: (e) => e._tag !== "CliError" && Date.now() - started < START_TIMEOUT_MS
      }),
      Effect.mapError((e) => {
        const last = tail(log, 10)
        const why = e._tag === "CliError" ? e.message : `it did not listen within ${START_TIMEOUT_MS / 1000} s`
        return failed(`the daemon could not start: ${why}${last === "" ? "" : `; the end of ${log}:\n${last}`}`)
      })
    )
    const info = { pid: hello.supervisorPid, socketPath: options.socketPath, logFile: log }
    process.stdout.write(
      ctx.json ? `${JSON.stringify(info)}\n` : `agentd listening at ${options.socketPath} (pid ${hello.supervisorPid}); log: ${log}\n`
    )
  })

/** `agentd logs`: prints the detached daemon's log; `follow` keeps printing what is appended. */
export const logs = (stateDir: string, options: { readonly follow: boolean; readonly lines: number | undefined }) =>
  Effect.gen(function*() {
    const file = logFile(stateDir)
    if (!fs.existsSync(file)) {
      return yield* Effect.fail(failed(`no log at ${file} (a daemon started with \`agentd serve --detach\` writes it)`))
    }
    const text = fs.readFileSync(file)
    let position = text.length
    if (options.lines === undefined) process.stdout.write(text)
    else {
      const shown = tail(file, options.lines)
      if (shown !== "") process.stdout.write(`${shown}\n`)
    }
    if (!options.follow) return
    yield* Effect.sync(() => {
      const size = fs.statSync(file).size
      if (size < position) position = 0 // truncated or replaced: start over
      if (size > position) {
        const fd = fs.openSync(file, "r")
        try {
          const buffer = Buffer.alloc(size - position)
          fs.readSync(fd, buffer, 0, buffer.length, position)
          process.stdout.write(buffer)
        } finally {
          fs.closeSync(fd)
        }
        position = size
      }
    }).pipe(Effect.repeat(Schedule.spaced("200 millis")))
  })
