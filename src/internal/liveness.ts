/**
 * Whether something is still there: a process by its pid, a listener on a Unix socket, and the
 * temp dirs that name a daemon's pid (a warm-up's, a worker host's sockets) whose daemon is gone.
 * For the daemon's own clean-ups of what a SIGKILLed predecessor left behind, and its socket
 * path's claim.
 */
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { lstatSync, readdirSync } from "./fileIoSync.js"

/** Whether a process with this pid runs here (EPERM: one of another user's, running). */
export const isRunning = (pid: number): boolean => {
  try {
    process.kill(pid, 0)
    return true
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === "EPERM"
  }
}

/**
 * What is at a Unix socket path: a listener that accepts a connection (`answers`), none (a
 * refusal, no file: `refused`), or no answer within `timeoutMs` (`silent`: a listener too busy
 * or stopped, or a wedged one). Callers decide what silence means.
 */
export const probeSocket = (socketPath: string, timeoutMs = 1000): Promise<"answers" | "refused" | "silent"> =>
  new Promise((resolve) => {
    const socket = net.connect(socketPath)
    const done = (outcome: "answers" | "refused" | "silent") => {
      clearTimeout(timer)
      socket.destroy()
      resolve(outcome)
    }
    socket.once("connect", () => done("answers"))
    socket.once("error", () => done("refused"))
    const timer = setTimeout(() => done("silent"), timeoutMs)
    timer.unref()
  })

/**
 * This user's dirs `<tmpdir>/<prefix><pid>-*` whose pid runs no process here, other than this
 * process's: their daemon is gone (or runs in another pid namespace that shares this tmpdir,
 * which a caller that cares must tell apart itself). Unreadable entries are skipped.
 */
export const deadDaemonDirs = (prefix: string): Array<string> => {
  const uid = process.getuid?.()
  const out: Array<string> = []
  let names: Array<string>
  try {
    names = readdirSync(os.tmpdir())
  } catch {
    return out
  }
  for (const name of names) {
    if (!name.startsWith(prefix)) continue
    const pid = Number(/^(\d+)-/.exec(name.slice(prefix.length))?.[1])
    if (!Number.isSafeInteger(pid) || pid <= 0 || pid === process.pid || isRunning(pid)) continue
    const dir = path.join(os.tmpdir(), name)
    try {
      if (uid !== undefined && lstatSync(dir).uid !== uid) continue
    } catch {
      continue
    }
    out.push(dir)
  }
  return out
}
