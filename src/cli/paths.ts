/** Where a command line finds the daemon: its state dir and socket, from the options and the environment. */
import * as path from "node:path"
import * as Remote from "../internal/remote.js"
import { defaultStateDir, resolveSocketPath } from "../StatePaths.js"
import type { Parsed } from "./args.js"
import type { ServeOptions } from "./main.js"

export const stateDirOf = (p: Parsed) => path.resolve((p.options.get("state-dir") as string | undefined) ?? defaultStateDir())

export const socketOf = (p: Parsed) => resolveSocketPath(stateDirOf(p), p.options.get("socket") as string | undefined)

/**
 * Where a command reaches the daemon: `--url` (else `$AGENTD_URL`, unless `--socket` is given)
 * for the commands that take it, else the socket. Over a URL the token is resolved here, with
 * this command line's state dir (`--state-dir`): `$AGENTD_TOKEN`, else, for a loopback URL, the
 * state dir's http-token, put in `AGENTD_TOKEN` of this process, where every connection of it
 * (the SDK's followers too) reads it.
 */
export const addressOf = (p: Parsed, env: NodeJS.ProcessEnv = process.env): string | { readonly error: string } => {
  const takesUrl = p.command.options.some((o) => o.name === "url")
  const given = p.options.get("url") as string | undefined
  if (given !== undefined && p.options.get("socket") !== undefined) return { error: "--url and --socket do not go together" }
  const url = !takesUrl ? undefined : given ?? (p.options.get("socket") === undefined ? env["AGENTD_URL"] || undefined : undefined)
  if (url === undefined) return socketOf(p)
  const checked = Remote.socketUrl(url)
  if (typeof checked === "string") return { error: `${given === undefined ? "AGENTD_URL" : "--url"}: ${checked}` }
  if (!env["AGENTD_TOKEN"]) {
    const token = Remote.tokenFor(checked, undefined, stateDirOf(p), env)
    if (token !== undefined) env["AGENTD_TOKEN"] = token
  }
  return url
}

/** `agentd serve`'s options, resolved (`socketPath`: what addressOf gave). */
export const serveOptionsOf = (p: Parsed, socketPath: string): ServeOptions => {
  const int = (name: string) => p.options.get(name) as number | undefined
  return {
    stateDir: stateDirOf(p),
    socketPath,
    engine: p.options.get("engine") as string | undefined,
    maxWorkers: int("max-workers"),
    sessionsPerWorker: int("sessions-per-worker"),
    shutdownGraceMs: int("shutdown-grace-ms"),
    logLevel: p.options.get("log-level") as string | undefined,
    store: p.options.get("store") as string | undefined,
    http: p.options.get("http") as string | undefined,
    httpInsecure: p.options.get("http-insecure") === true,
    cluster: p.options.get("cluster") === true,
    runnerAddress: p.options.get("runner-address") as string | undefined
  }
}
