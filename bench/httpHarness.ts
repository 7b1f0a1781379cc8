/**
 * What the HTTP benchmarks share: a daemon started with `--http 127.0.0.1:0`, its port (read from
 * its log line) and its token (from the state dir), and a bearer-authenticated GET.
 */
import * as fs from "node:fs"
import * as http from "node:http"
import * as path from "node:path"
import { type Daemon, sleep, type StartOptions, withDaemon } from "./daemonHarness.js"

/** A daemon serving HTTP: where, and the token every request needs. */
export interface HttpDaemon {
  readonly daemon: Daemon
  readonly port: number
  readonly token: string
}

/** The HTTP port the daemon took (port 0), from its `agentd HTTP at http://HOST:PORT` line. */
export const httpPortOf = async (daemon: Daemon): Promise<number> => {
  for (let i = 0; i < 400; i++) {
    const m = /agentd HTTP at http:\/\/[^\s]+:(\d+)/.exec(daemon.stderrTail(100_000))
    if (m !== null) return Number(m[1])
    await sleep(25)
  }
  throw new Error(`no HTTP log line: ${daemon.stderrTail()}`)
}

/** Big sessions without automatic checkpoints: what a benchmark measures stays in one generation. */
export const NO_AUTO_CHECKPOINT = { AGENTD_CHECKPOINT_EVENTS: "1000000000", AGENTD_CHECKPOINT_BYTES: String(1024 * 1024 * 1024) }

/** Runs `f` with a daemon serving HTTP on a free loopback port; stops it after. */
export const withHttpDaemon = <A>(options: StartOptions, f: (h: HttpDaemon) => Promise<A>): Promise<A> =>
  withDaemon({ ...options, extraArgs: [...(options.extraArgs ?? []), "--http", "127.0.0.1:0"] }, async (daemon) => {
    const port = await httpPortOf(daemon)
    const token = fs.readFileSync(path.join(daemon.stateDir, "http-token"), "utf8").trim()
    return f({ daemon, port, token })
  })

/** A GET with the token, the body read whole. */
export const get = (h: Pick<HttpDaemon, "port" | "token">, target: string, agent?: http.Agent) =>
  new Promise<{ readonly status: number; readonly headers: http.IncomingHttpHeaders; readonly text: string }>((resolve, reject) => {
    const req = http.request({ host: "127.0.0.1", port: h.port, path: target, headers: { authorization: `Bearer ${h.token}` }, agent })
    req.on("error", reject)
    req.on("response", (res) => {
      const chunks: Array<Buffer> = []
      res.on("data", (c: Buffer) => chunks.push(c))
      res.on("end", () => resolve({ status: res.statusCode ?? 0, headers: res.headers, text: Buffer.concat(chunks).toString("utf8") }))
      res.on("error", reject)
    })
    req.end()
  })
