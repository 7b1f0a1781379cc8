/**
 * The `agentd` command line run as a user runs it, for the e2e tests: a child process of the
 * built bin whose output is collected, killed (SIGKILL) when the test finishes if it still runs.
 */
import { type ChildProcess, spawn } from "node:child_process"
import { onTestFinished } from "vitest"
import { withTimeout } from "../support/timeout.js"
import { DAEMON_BIN, sleep } from "./harness.js"

export interface CliRun {
  readonly proc: ChildProcess
  stdout: string
  stderr: string
  /** When the process ended (0 while it runs). */
  exitedAt: number
  readonly done: Promise<{ code: number | null; signal: NodeJS.Signals | null; stdout: string; stderr: string }>
}

export interface CliOptions {
  readonly input?: string | Buffer
  readonly env?: Record<string, string>
}

/** Starts `agentd ARGS`; the developer's own AGENTD_* settings (a socket, a home) never reach it. */
export const startCli = (args: ReadonlyArray<string>, options: CliOptions = {}): CliRun => {
  const proc = spawn(process.execPath, [DAEMON_BIN, ...args], {
    stdio: [options.input === undefined ? "ignore" : "pipe", "pipe", "pipe"],
    env: { ...Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith("AGENTD_"))), NO_COLOR: "", ...options.env }
  })
  const run: CliRun = {
    proc,
    stdout: "",
    stderr: "",
    exitedAt: 0,
    done: new Promise((resolve, reject) => {
      proc.once("error", reject)
      proc.once("close", (code, signal) => {
        run.exitedAt = Date.now()
        resolve({ code, signal, stdout: run.stdout, stderr: run.stderr })
      })
    })
  }
  proc.stdout!.setEncoding("utf8").on("data", (d: string) => (run.stdout += d))
  proc.stderr!.setEncoding("utf8").on("data", (d: string) => (run.stderr += d))
  if (options.input !== undefined) proc.stdin!.end(options.input)
  onTestFinished(() => {
    if (proc.exitCode === null && proc.signalCode === null) proc.kill("SIGKILL")
  })
  return run
}

/**
 * Runs `agentd ARGS` to its end. One still running after `timeoutMs` fails with what it printed
 * (a hung command otherwise shows as a test timeout that says nothing).
 */
export const runCli = (args: ReadonlyArray<string>, options: CliOptions & { readonly timeoutMs?: number } = {}) => {
  const run = startCli(args, options)
  return withTimeout(
    run.done,
    options.timeoutMs ?? 40_000,
    () => `agentd ${args.join(" ").slice(0, 200)} still ran\nstdout: ${run.stdout.slice(-2000)}\nstderr: ${run.stderr.slice(-2000)}`
  )
}

/** Polls `f` until it holds; fails naming `what` after `timeoutMs`. */
export const until = async (what: string, f: () => boolean | Promise<boolean>, timeoutMs = 10_000): Promise<void> => {
  const deadline = Date.now() + timeoutMs
  while (!(await f())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`)
    await sleep(25)
  }
}
