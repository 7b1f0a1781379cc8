/**
 * A daemon over the network (docs/protocol.md section 10): the socket protocol carried by the
 * HTTP front's `/v1/socket` WebSocket, one JSON line per text frame. The transport both clients
 * share (the SDK's DaemonClient and the command line's one-shot connection), so that the
 * protocol code above it is the same for a socket path and a URL: lines in, lines out, a close.
 *
 * No Effect here: the command line's one-shot commands load none. `ws` (Node 20 has no
 * WebSocket of its own) is loaded on the first connection over a URL only.
 */
import * as fs from "./fileIoSync.js"
import * as path from "node:path"
import { defaultStateDir } from "../StatePaths.js"
import { isLoopback } from "./http/security.js"
import { TOKEN_FILE } from "./http/token.js"
import type { WebSocket } from "ws"

/** True when a daemon address is a URL rather than a socket path. */
export const isUrl = (address: string): boolean => /^[a-z][a-z0-9+.-]*:\/\//i.test(address)

/**
 * The `/v1/socket` WebSocket URL of a daemon URL (`http://HOST:PORT`, `https://...`, `ws://...`,
 * `wss://...`; a path is a prefix, for a daemon behind a reverse proxy), or why the text is not
 * one. A token in the URL is refused: URLs end up in logs and shell histories.
 */
export const socketUrl = (text: string): URL | string => {
  let url: URL
  try {
    url = new URL(text)
  } catch {
    return `${JSON.stringify(text)} is not a URL (expected http://HOST:PORT, e.g. http://127.0.0.1:7433)`
  }
  const schemes: Record<string, string> = { "http:": "ws:", "ws:": "ws:", "https:": "wss:", "wss:": "wss:" }
  const scheme = schemes[url.protocol]
  if (scheme === undefined) {
    return `${JSON.stringify(text)}: the URL scheme must be http, https, ws or wss (not ${url.protocol.slice(0, -1)})`
  }
  if (url.hostname === "") return `${JSON.stringify(text)} names no host`
  if (url.username !== "" || url.password !== "") {
    return `${JSON.stringify(url.host)}: no credentials in the URL; the token goes in AGENTD_TOKEN (or the client's token option)`
  }
  const ws = new URL(url.href)
  ws.protocol = scheme
  const prefix = ws.pathname.replace(/\/+$/, "")
  ws.pathname = prefix.endsWith("/v1/socket") ? prefix : `${prefix}/v1/socket`
  ws.hash = ""
  return ws
}

/** A URL's host without IPv6 brackets. */
const hostOf = (url: URL) => url.hostname.replace(/^\[(.*)\]$/, "$1")

/** The HTTP front's token in a state dir, if it has one (never made here: that is the daemon's). */
export const readToken = (stateDir: string): string | undefined => {
  try {
    const text = fs.readFileSync(path.join(stateDir, TOKEN_FILE), "utf8").trim()
    return text.length > 0 ? text : undefined
  } catch {
    return undefined
  }
}

/**
 * The token to present: the one given, else `AGENTD_TOKEN`, else, for a daemon on this machine
 * (a loopback URL), the http-token of `stateDir` (default: the default state dir). A remote
 * daemon's token is never guessed from a local file.
 */
export const tokenFor = (
  url: URL,
  given: string | undefined,
  stateDir?: string | undefined,
  env: NodeJS.ProcessEnv = process.env
): string | undefined =>
  given ?? (env["AGENTD_TOKEN"] || undefined) ??
    (isLoopback(hostOf(url)) ? readToken(path.resolve(stateDir ?? defaultStateDir(env))) : undefined)

/** Why a connection over a URL could not be made. */
export interface OpenFailure {
  readonly message: string
  /** The connect's errno (`ECONNREFUSED`, `ENOTFOUND`...), when the TCP connect failed. */
  readonly errno?: string | undefined
  /** The HTTP status the upgrade was refused with (401, 403, 421...). */
  readonly status?: number | undefined
}

/** An open connection: lines go out with `write` (with or without their `\n`). */
export interface LineTransport {
  readonly write: (line: string) => void
  readonly close: () => void
}

export interface LineHandlers {
  readonly onOpen: (transport: LineTransport) => void
  readonly onFail: (failure: OpenFailure) => void
  readonly onLine: (line: string) => void
  /** Once, after the connection (opened) ended. */
  readonly onClose: () => void
}

/** What an upgrade refused with `status` means for the person connecting. */
/** The daemon's URL as a person gives it (`http://HOST:PORT`), for messages. */
const shown = (url: URL) => `${url.protocol === "wss:" ? "https" : "http"}://${url.host}${url.pathname.replace(/\/v1\/socket$/, "")}`

const refusedText = (url: URL, status: number, serverMessage: string | undefined): string => {
  const where = `the daemon at ${shown(url)}`
  const said = serverMessage === undefined ? "" : ` (${serverMessage})`
  switch (status) {
    case 401:
      return `${where} refused the token (401)${said}. The token is what \`agentd http-token\` prints on the daemon's machine: ` +
        "pass it in AGENTD_TOKEN (or the client's token option)"
    case 421:
      return `${where} refused the Host ${JSON.stringify(url.host)} (421: not a name of that server). ` +
        "Use the address it listens on (e.g. http://127.0.0.1:PORT), not another name that resolves to it"
    case 403:
      return `${where} refused the request (403)${said}`
    case 404:
      return `${where} has no ${url.pathname} (404): is it agentd's \`serve --http\`?`
    default:
      return `${where} refused the WebSocket upgrade with HTTP ${status}${said}`
  }
}

/** What the connect's errno says, for the person connecting. */
const ERRNO_TEXT: Readonly<Record<string, string>> = {
  ECONNREFUSED: "connection refused: is the daemon running with --http on that port?",
  ENOTFOUND: "no such host",
  EAI_AGAIN: "the host name could not be resolved now",
  ETIMEDOUT: "the connection timed out",
  EHOSTUNREACH: "no route to the host",
  ECONNRESET: "the connection was reset"
}

/** How long the TCP connect and the upgrade may take. */
const HANDSHAKE_TIMEOUT_MS = 10_000

let wsModule: Promise<typeof WebSocket> | undefined
const loadWs = (): Promise<typeof WebSocket> => wsModule ??= import("ws").then((m) => m.WebSocket)

/**
 * Opens `url` (a {@link socketUrl}) with the bearer `token`; calls `onOpen` or `onFail` once,
 * then, if open, `onLine` per frame and `onClose` at the end. Returns a function that aborts
 * (before `onOpen`) or closes.
 */
export const openLines = (url: URL, token: string | undefined, handlers: LineHandlers): () => void => {
  let ws: WebSocket | undefined
  let settled = false
  let opened = false
  let aborted = false
  const fail = (failure: OpenFailure) => {
    if (settled) return
    settled = true
    ws?.terminate()
    handlers.onFail(failure)
  }
  loadWs().then((Ws) => {
    if (aborted) return
    const socket = new Ws(url.href, {
      headers: token === undefined ? {} : { authorization: `Bearer ${token}` },
      handshakeTimeout: HANDSHAKE_TIMEOUT_MS,
      perMessageDeflate: false,
      // The daemon's own line limit applies (as on its socket); no second, smaller one here.
      maxPayload: 0
    })
    ws = socket
    socket.on("unexpected-response", (req, res) => {
      // The refusal's JSON error says why: read a little of it for the message.
      let body = ""
      res.on("data", (chunk) => {
        if (body.length < 4096) body += chunk.toString("utf8")
      })
      const done = () => {
        req.destroy()
        let serverMessage: string | undefined
        try {
          const m = (JSON.parse(body) as { error?: { message?: unknown } }).error?.message
          if (typeof m === "string") serverMessage = m
        } catch {
          // Not ours: the status says enough.
        }
        const status = res.statusCode ?? 0
        fail({ status, message: refusedText(url, status, status === 401 ? undefined : serverMessage) })
      }
      res.on("end", done)
      res.on("error", done)
    })
    socket.on("error", (err: Error & { readonly code?: unknown }) => {
      if (settled) return
      const errno = typeof err.code === "string" && /^E[A-Z_]+$/.test(err.code) ? err.code : undefined
      const why = errno === undefined ? err.message : `${ERRNO_TEXT[errno] ?? err.message}: ${errno}`
      fail({ message: `cannot reach the daemon at ${shown(url)} (${why})`, ...(errno === undefined ? {} : { errno }) })
    })
    socket.on("open", () => {
      if (settled) return
      settled = true
      opened = true
      handlers.onOpen({ write: (line) => socket.send(line.endsWith("\n") ? line.slice(0, -1) : line), close: () => socket.terminate() })
    })
    socket.on("message", (data) => {
      if (!opened) return
      handlers.onLine(Array.isArray(data) ? Buffer.concat(data).toString("utf8") : Buffer.from(data as Uint8Array).toString("utf8"))
    })
    socket.on("close", () => {
      if (!settled) return fail({ message: `the daemon at ${shown(url)} closed the connection during the upgrade` })
      if (opened) handlers.onClose()
    })
  }, (e: unknown) => fail({ message: `cannot load the WebSocket client: ${e instanceof Error ? e.message : String(e)}` }))
  return () => {
    aborted = true
    if (ws === undefined) return
    if (!settled) fail({ message: "aborted" })
    else ws.terminate()
  }
}
