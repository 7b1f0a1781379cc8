/**
 * The HTTP front's listen address (`--http HOST:PORT`, `AGENTD_HTTP`), parsed without any import:
 * the command line checks `--http` with it before it loads the daemon.
 */

/** Where the front listens. */
export interface ListenAddress {
  readonly host: string
  readonly port: number
}

/** Parses `HOST:PORT` (`[::1]:7433` for IPv6; `:7433` or a bare port means 127.0.0.1). */
export const parseListen = (text: string): ListenAddress | string => {
  const trimmed = text.trim()
  let host: string
  let portText: string
  const bracket = /^\[([^\]]+)\]:(\d+)$/.exec(trimmed)
  if (bracket !== null) {
    host = bracket[1]!
    portText = bracket[2]!
  } else if (/^\d+$/.test(trimmed)) {
    host = "127.0.0.1"
    portText = trimmed
  } else {
    const at = trimmed.lastIndexOf(":")
    if (at < 0) return `expected HOST:PORT, got ${JSON.stringify(text)}`
    host = trimmed.slice(0, at) || "127.0.0.1"
    portText = trimmed.slice(at + 1)
    if (host.includes(":")) return `an IPv6 address goes in brackets: [${host}]:${portText}`
  }
  const port = Number(portText)
  if (!/^\d+$/.test(portText) || !Number.isInteger(port) || port < 0 || port > 65535) {
    return `invalid port in ${JSON.stringify(text)}`
  }
  return { host: host.toLowerCase(), port }
}
