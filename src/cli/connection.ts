/**
 * One connection for the command line's one-shot commands (`status`, `sessions`, `create`,
 * `state`, `log`, `abort`, `retry`, `checkpoint`, `kill`, `shutdown`): connect, check the
 * daemon's hello, send commands one at a time, read each one's response, close.
 *
 * It is plain `node:net` and no Effect, unlike the client SDK (`DaemonClient`) that `prompt` and
 * `attach` use: a command line is a short-lived process, and loading Effect and decoding with
 * Schema cost more than the command itself (`npm run bench -- cliStartup`: `agentd status` took
 * 1.66x `node -e 0` over the SDK, 1.1x over this). What it leaves out, it does not need: no
 * events (nothing is attached), no reconnect (the command just fails, exit 3), and the data of a
 * response is taken as the daemon sent it (the daemon checks its own output against the schemas).
 */
import * as net from "node:net"
import * as Remote from "../internal/remote.js"
import { LineDecoder } from "../JsonLines.js"
import { type CliError, daemonErrorText, failed, noDaemonText, unreachable, usage } from "./errors.js"

/** The protocol this command line speaks (the daemon's `daemon_hello.protocol`). */
const PROTOCOL = { name: "agentd", version: 1 } as const

/** How long a daemon that accepted the connection may take to greet (as the SDK). */
const HELLO_TIMEOUT_MS = 10_000

/** What the command line reads of the daemon's hello. */
export interface Hello {
  readonly supervisorGeneration: number
  readonly supervisorPid: number
}

export interface Connection {
  readonly hello: Hello
  /** Sends a command and resolves with its response's `data`; an error response fails (exit 1). */
  readonly request: <A>(command: { readonly type: string; readonly [field: string]: unknown }) => Promise<A>
  readonly close: () => void
}

const isRecord = (u: unknown): u is Record<string, unknown> => typeof u === "object" && u !== null && !Array.isArray(u)

/**
 * Connects to the daemon at `socketPath` (a socket path, or the URL of its HTTP front: the
 * same lines through its `/v1/socket` WebSocket) and waits for its hello.
 */
export const connect = (socketPath: string): Promise<Connection> =>
  new Promise((resolveConnection, rejectConnection) => {
    const transport = Remote.isUrl(socketPath) ? undefined : net.connect(socketPath)
    /** Over a URL: the WebSocket's lines, once open. */
    let remote: Remote.LineTransport | undefined
    let abortRemote: (() => void) | undefined
    const send = (line: string) => (transport === undefined ? remote?.write(line) : void transport.write(line))
    const destroy = () => (transport === undefined ? (remote?.close() ?? abortRemote?.()) : transport.destroy())
    const decoder = new LineDecoder(Number.MAX_SAFE_INTEGER)
    let hello: Hello | undefined
    let nextId = 1
    let pending: { readonly id: string; readonly type: string; readonly resolve: (data: unknown) => void; readonly reject: (e: CliError) => void } | undefined
    // Why the connection ended, for whoever waits on it (the hello or a response).
    let ended: CliError | undefined

    const fail = (e: CliError) => {
      if (ended !== undefined) return
      ended = e
      clearTimeout(helloTimer)
      destroy()
      if (hello === undefined) rejectConnection(e)
      const waiting = pending
      pending = undefined
      waiting?.reject(e)
    }
    const helloTimer = setTimeout(
      () => fail(unreachable(`${socketPath} accepted the connection but sent no daemon_hello within ${HELLO_TIMEOUT_MS / 1000}s`)),
      HELLO_TIMEOUT_MS
    )
    helloTimer.unref()

    const onMessage = (message: unknown) => {
      if (hello === undefined) {
        const protocol = isRecord(message) ? message["protocol"] : undefined
        if (!isRecord(message) || message["type"] !== "daemon_hello") {
          return fail(failed(`${socketPath} did not greet with daemon_hello`))
        }
        if (!isRecord(protocol) || protocol["name"] !== PROTOCOL.name || protocol["version"] !== PROTOCOL.version) {
          return fail(failed(`the daemon at ${socketPath} speaks protocol ${JSON.stringify(protocol)}; this client speaks ${JSON.stringify(PROTOCOL)}`))
        }
        clearTimeout(helloTimer)
        hello = { supervisorGeneration: Number(message["supervisorGeneration"]), supervisorPid: Number(message["supervisorPid"]) }
        return resolveConnection({ hello, request, close: destroy })
      }
      // Nothing is attached: the only messages owed are responses (and `daemon_closing`).
      if (!isRecord(message) || message["type"] !== "response" || pending === undefined || message["id"] !== pending.id) return
      const waiting = pending
      pending = undefined
      if (message["success"] === true) return waiting.resolve(message["data"])
      const error = isRecord(message["error"]) ? message["error"] : {}
      waiting.reject(failed(
        typeof error["message"] === "string"
          ? daemonErrorText(error["code"], error["message"])
          : `${waiting.type} failed (${JSON.stringify(message["error"])})`
      ))
    }
    const onLines = (items: ReadonlyArray<unknown>) => {
      for (const item of items) {
        if (typeof item !== "string") continue
        let message: unknown
        try {
          message = JSON.parse(item)
        } catch {
          return fail(failed(`${socketPath} sent a line that is not JSON: ${item.slice(0, 200)}`))
        }
        onMessage(message)
      }
    }

    const request = <A>(command: { readonly type: string }): Promise<A> =>
      new Promise<A>((resolve, reject) => {
        if (ended !== undefined) return reject(ended)
        const id = String(nextId++)
        pending = { id, type: command.type, resolve: resolve as (data: unknown) => void, reject }
        send(`${JSON.stringify({ type: "command", id, protocol: PROTOCOL, command })}\n`)
      })

    const closed = () =>
      fail(
        hello === undefined
          ? unreachable(`${socketPath}: the connection closed before the daemon's hello`)
          : unreachable("the daemon closed the connection")
      )
    if (transport === undefined) {
      const url = Remote.socketUrl(socketPath)
      if (typeof url === "string") return fail(usage(`--url: ${url}`))
      abortRemote = Remote.openLines(url, Remote.tokenFor(url, undefined), {
        onOpen: (t) => (remote = t),
        onFail: (f) => fail(unreachable(f.message)),
        onLine: (line) => onLines([line]),
        onClose: closed
      })
      return
    }
    transport.once("error", (e: NodeJS.ErrnoException) =>
      fail(
        hello === undefined
          ? unreachable(e.code === undefined ? `no daemon listens at ${socketPath} (${e.message})` : noDaemonText(socketPath, e.code))
          : unreachable(`the connection to the daemon failed (${e.code ?? e.message})`)
      ))
    transport.on("data", (chunk: Buffer) => onLines(decoder.push(chunk)))
    transport.on("end", () => onLines(decoder.end()))
    transport.on("close", closed)
  })

/** Runs `f` on a connection to the daemon, closed afterwards whatever happens. */
export const withConnection = async <A>(socketPath: string, f: (c: Connection) => Promise<A>): Promise<A> => {
  const c = await connect(socketPath)
  try {
    return await f(c)
  } finally {
    c.close()
  }
}
