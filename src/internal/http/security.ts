/**
 * The HTTP front's gate (docs/protocol.md section 10), as pure functions of a request's headers:
 * the `Host` check (no DNS rebinding), the `Origin` check (no cross-site requests; no CORS is
 * ever granted), and where the token is read from (`Authorization: Bearer` or the cookie).
 */
import * as net from "node:net"
import { tokenMatches } from "./token.js"

/** The cookie the login URL sets. */
export const COOKIE_NAME = "agentd_token"

import type { ListenAddress } from "./listen.js"
export { type ListenAddress, parseListen } from "./listen.js"

/** True for addresses only this machine can reach. `localhost` counts: it is resolved to loopback. */
export const isLoopback = (host: string): boolean => {
  if (host === "localhost") return true
  if (net.isIPv4(host)) return host.startsWith("127.")
  if (net.isIPv6(host)) return host === "::1" || host.toLowerCase().startsWith("::ffff:127.")
  return false
}

const isWildcard = (host: string) => host === "0.0.0.0" || host === "::"

/** Splits a `Host` header value into host and port (undefined port: none given). */
const splitHost = (value: string): { host: string; port: number | undefined } | undefined => {
  const v = value.trim().toLowerCase()
  const bracket = /^\[([^\]]+)\](?::(\d+))?$/.exec(v)
  if (bracket !== null) return { host: bracket[1]!, port: bracket[2] === undefined ? undefined : Number(bracket[2]) }
  const m = /^([^:]+)(?::(\d+))?$/.exec(v)
  if (m === null) return undefined
  return { host: m[1]!, port: m[2] === undefined ? undefined : Number(m[2]) }
}

/**
 * Whether a `Host` (or an origin's host) names this server: the bound address or a loopback
 * name, on the bound port. A DNS name that resolves here (rebinding) is refused. On a wildcard
 * bind (with --http-insecure) an IP literal is taken too: an IP literal cannot be rebound.
 */
export const hostAllowed = (value: string | undefined, bound: ListenAddress, actualPort: number): boolean => {
  if (value === undefined) return false
  const parsed = splitHost(value)
  if (parsed === undefined) return false
  if (parsed.port !== undefined && parsed.port !== actualPort) return false
  // Without a port the client spoke to port 80: only right if that is where we are.
  if (parsed.port === undefined && actualPort !== 80) return false
  const h = parsed.host
  if (h === bound.host || h === "localhost" || h === "127.0.0.1" || h === "::1") return true
  return isWildcard(bound.host) && net.isIP(h) !== 0
}

/**
 * Whether a request's `Origin` is acceptable: absent (not a browser's cross-site request), or
 * this server's own origin. `null` (sandboxed frames, file: pages) is refused.
 */
export const originAllowed = (value: string | undefined, bound: ListenAddress, actualPort: number): boolean => {
  if (value === undefined) return true
  let url: URL
  try {
    url = new URL(value)
  } catch {
    return false
  }
  if (url.protocol !== "http:" && url.protocol !== "https:") return false
  const port = url.port === "" ? (url.protocol === "https:" ? 443 : 80) : Number(url.port)
  return hostAllowed(`${url.hostname}:${port}`, bound, actualPort)
}

/** The token a request presents: its bearer token, else its cookie. */
export const presentedToken = (authorization: string | undefined, cookie: string | undefined): string | undefined => {
  if (authorization !== undefined) {
    const m = /^Bearer\s+(\S+)\s*$/i.exec(authorization)
    return m === null ? undefined : m[1]
  }
  if (cookie === undefined) return undefined
  for (const part of cookie.split(";")) {
    const eq = part.indexOf("=")
    if (eq < 0) continue
    if (part.slice(0, eq).trim() === COOKIE_NAME) return part.slice(eq + 1).trim()
  }
  return undefined
}

/** What the gate decided. */
export type Verdict =
  | { readonly _tag: "Pass" }
  | { readonly _tag: "Refuse"; readonly status: number; readonly code: string; readonly message: string }

/** Host, then Origin, then the token. */
export const check = (
  headers: Readonly<Record<string, string | undefined>>,
  bound: ListenAddress,
  actualPort: number,
  token: string,
  needsToken = true
): Verdict => {
  if (!hostAllowed(headers["host"], bound, actualPort)) {
    return { _tag: "Refuse", status: 421, code: "misdirected_request", message: "The Host header does not name this server." }
  }
  if (!originAllowed(headers["origin"], bound, actualPort)) {
    return { _tag: "Refuse", status: 403, code: "forbidden_origin", message: "Cross-origin requests are refused." }
  }
  if (needsToken && !tokenMatches(presentedToken(headers["authorization"], headers["cookie"]), token)) {
    return {
      _tag: "Refuse",
      status: 401,
      code: "unauthorized",
      message: "A valid token is needed (Authorization: Bearer <token>, or log in through /login?token=<token>; `agentd http-token` prints it)."
    }
  }
  return { _tag: "Pass" }
}
