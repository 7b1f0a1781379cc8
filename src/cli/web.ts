/**
 * `agentd web`: the login link of the daemon's web page (`serve --http`), opened in a browser
 * when one can be, printed always (a server without a display, an SSH session). The link holds
 * the token: it goes to this terminal and to the browser started here, nowhere else.
 */
import { spawn } from "node:child_process"
import { usage } from "./errors.js"

/** `HOST:PORT`, `:PORT`, `PORT`, `[V6]:PORT` or `http://HOST:PORT` as the base URL to log in at. */
export const webBaseUrl = (address: string): string | undefined => {
  const text = address.trim().replace(/\/+$/, "")
  if (/^https?:\/\//.test(text)) return text
  const m = /^(\d{1,5})$/.exec(text) ?? /^(\[[0-9a-fA-F:.]+\]|[^:[\]]*):(\d{1,5})$/.exec(text)
  if (m === null) return undefined
  const port = Number(m.length === 2 ? m[1] : m[2])
  if (port < 1 || port > 65535) return undefined
  let host = m.length === 2 || m[1] === "" ? "127.0.0.1" : m[1]!
  // A wildcard bind is reached on loopback from here.
  if (host === "0.0.0.0") host = "127.0.0.1"
  if (host === "[::]") host = "[::1]"
  return `http://${host}:${port}`
}

/** Opens `url` with the desktop's opener when there seems to be a desktop; whether it tried. */
const openInBrowser = (url: string): boolean => {
  const opener = process.platform === "darwin"
    ? "open"
    : process.platform === "win32"
    ? undefined
    : process.env["DISPLAY"] || process.env["WAYLAND_DISPLAY"]
    ? "xdg-open"
    : undefined
  if (opener === undefined) return false
  try {
    const child = spawn(opener, [url], { stdio: "ignore", detached: true })
    child.on("error", () => {})
    child.unref()
    return true
  } catch {
    return false
  }
}

/** The login URL for `address` (else $AGENTD_HTTP) and `token`; opens it unless `noOpen`. */
export const web = (address: string | undefined, token: string, noOpen: boolean): string => {
  const given = address ?? process.env["AGENTD_HTTP"]
  if (given === undefined || given === "") {
    throw usage("which address does the daemon serve HTTP at? Pass --http HOST:PORT (what `serve --http` was given) or set AGENTD_HTTP.")
  }
  const base = webBaseUrl(given)
  if (base === undefined) throw usage(`--http ${JSON.stringify(given)} is not HOST:PORT or an http:// URL.`)
  const url = `${base}/login?token=${encodeURIComponent(token)}`
  const opened = !noOpen && openInBrowser(url)
  return opened ? `Opened ${base}/ in the browser; the login link, if it did not show:\n${url}` : url
}
