/**
 * Linux /proc helpers shared by the end-to-end harness and the benchmarks: which processes
 * exist, which descend from a daemon, which carry a marker in their environment. Plain Node
 * (no vitest), so that the compiled benchmarks can use it too.
 */
import * as fs from "node:fs"

/** The fields of /proc/<pid>/stat after the parenthesised comm (which may contain spaces). */
const statFields = (pid: number): Array<string> | undefined => {
  try {
    const stat = fs.readFileSync(`/proc/${pid}/stat`, "utf8")
    return stat.slice(stat.lastIndexOf(")") + 2).split(" ")
  } catch {
    return undefined
  }
}

/** Is `pid` a live (non-zombie) process? */
export const isAlive = (pid: number): boolean => {
  const state = statFields(pid)?.[0]
  return state !== undefined && state !== "Z" && state !== "X"
}

/** The parent of `pid`, or undefined when it is gone. */
export const parentOf = (pid: number): number | undefined => {
  const ppid = statFields(pid)?.[1]
  return ppid === undefined ? undefined : Number(ppid)
}

/** CPU ticks (utime + stime, fields 14 and 15 of stat(5)) of a process, or undefined when it is gone. */
export const cpuTicksOf = (pid: number): number | undefined => {
  const fields = statFields(pid)
  // The fields start at field 3.
  return fields === undefined ? undefined : Number(fields[11]) + Number(fields[12])
}

/**
 * How long (ns) the process's main thread has waited on a run queue, runnable but not running
 * (the second field of /proc/<pid>/schedstat); undefined when it is gone or the kernel has no
 * schedstats.
 */
export const runQueueWaitNs = (pid: number): number | undefined => {
  try {
    const wait = Number(fs.readFileSync(`/proc/${pid}/schedstat`, "utf8").split(" ")[1])
    return Number.isFinite(wait) ? wait : undefined
  } catch {
    return undefined
  }
}

/** Every pid in /proc. */
export const listPids = (): Array<number> => {
  try {
    return fs.readdirSync("/proc").filter((d) => /^\d+$/.test(d)).map(Number)
  } catch {
    return []
  }
}

/** Every live descendant of `root` (children, grandchildren...). */
export const descendantsOf = (root: number): Array<number> => {
  const parents = new Map<number, number>()
  for (const pid of listPids()) {
    const ppid = parentOf(pid)
    if (ppid !== undefined) parents.set(pid, ppid)
  }
  const out: Array<number> = []
  const frontier = [root]
  while (frontier.length > 0) {
    const p = frontier.pop()!
    for (const [pid, ppid] of parents) {
      if (ppid === p && !out.includes(pid)) {
        out.push(pid)
        frontier.push(pid)
      }
    }
  }
  return out.filter(isAlive)
}

/** Every live process (but this one) whose environment holds `KEY=value` (only ours are readable). */
export const processesWithEnv = (key: string, value: string): Array<number> => {
  const needle = Buffer.from(`${key}=${value}\0`)
  const out: Array<number> = []
  for (const pid of listPids()) {
    if (pid === process.pid) continue
    try {
      if (fs.readFileSync(`/proc/${pid}/environ`).indexOf(needle) >= 0) out.push(pid)
    } catch {
      // gone, or not ours
    }
  }
  return out.filter(isAlive)
}

/** Sends `signal` to `pid` if it still exists. */
export const killQuietly = (pid: number, signal: NodeJS.Signals): void => {
  try {
    process.kill(pid, signal)
  } catch {
    // already gone
  }
}
