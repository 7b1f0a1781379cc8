/**
 * The HTTP front's bearer token (docs/protocol.md section 10): 32 random bytes, base64url, in
 * `<stateDir>/http-token` (0600, in the 0700 state dir), made once and kept across restarts so
 * a browser's cookie and a script's saved token stay valid. No Effect here: `agentd http-token`
 * is a one-shot command that loads none.
 */
import { randomBytes, timingSafeEqual } from "node:crypto"
import * as fs from "../fileIoSync.js"
import * as path from "node:path"

export const TOKEN_FILE = "http-token"

export const tokenPath = (stateDir: string): string => path.join(stateDir, TOKEN_FILE)

const read = (file: string): string | undefined => {
  try {
    const text = fs.readFileSync(file, "utf8").trim()
    return text.length > 0 ? text : undefined
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === "ENOENT") return undefined
    throw e
  }
}

/**
 * The state dir's token, made if there is none yet. Creation is exclusive (`wx`) and atomic
 * (temp file, fsync, link): two processes racing both end up with the one that landed first,
 * and a crash never leaves an empty or partial token.
 */
export const readOrCreateToken = (stateDir: string): string => {
  const file = tokenPath(stateDir)
  const existing = read(file)
  if (existing !== undefined) return existing
  if (!fs.existsSync(stateDir)) fs.mkdirSync(stateDir, { recursive: true, mode: 0o700 })
  const token = randomBytes(32).toString("base64url")
  const temp = `${file}.${process.pid}.${randomBytes(4).toString("hex")}.tmp`
  const fd = fs.openSync(temp, "wx", 0o600)
  try {
    fs.writeFileSync(fd, `${token}\n`)
    fs.fsyncSync(fd)
  } finally {
    fs.closeSync(fd)
  }
  try {
    // link fails if another process made the token meanwhile: theirs is the one.
    fs.linkSync(temp, file)
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== "EEXIST") throw e
  } finally {
    fs.rmSync(temp, { force: true })
  }
  // An existing file's mode is pinned too: the token is worth nothing once others can read it.
  fs.chmodSync(file, 0o600)
  return read(file) ?? token
}

/** Compares a presented token with the real one in constant time (no length or prefix oracle). */
export const tokenMatches = (presented: string | undefined, token: string): boolean => {
  if (presented === undefined) return false
  const a = Buffer.from(presented, "utf8")
  const b = Buffer.from(token, "utf8")
  // Compared at equal length always, so the time does not tell how long the real one is.
  const padded = Buffer.alloc(b.length)
  a.copy(padded, 0, 0, Math.min(a.length, b.length))
  return timingSafeEqual(padded, b) && a.length === b.length
}
