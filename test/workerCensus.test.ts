/**
 * The process-table checker (test/support/workerCensus.ts): on a fake /proc, which processes it
 * counts as a session's live workers; on the real /proc, that it catches two live processes
 * titled as workers of one session, and stops seeing the double once one of them is gone.
 */
import { type ChildProcess, spawn } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { afterEach, expect, it } from "vitest"
import { WorkerCensus, workersBySession } from "./support/workerCensus.js"

const dirs: Array<string> = []
const children: Array<ChildProcess> = []
afterEach(() => {
  for (const child of children.splice(0)) child.kill("SIGKILL")
  for (const dir of dirs.splice(0)) fs.rmSync(dir, { recursive: true, force: true })
})

const fakeProc = (processes: Record<string, { cmdline?: string; state?: string }>): string => {
  const root = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-fakeproc-"))
  dirs.push(root)
  fs.mkdirSync(path.join(root, "self"))
  for (const [pid, p] of Object.entries(processes)) {
    fs.mkdirSync(path.join(root, pid))
    if (p.cmdline !== undefined) fs.writeFileSync(path.join(root, pid, "cmdline"), p.cmdline)
    // comm may hold spaces and parentheses: the state is read after the last ')'.
    if (p.state !== undefined) fs.writeFileSync(path.join(root, pid, "stat"), `${pid} (agentd-worker (x) s) ${p.state} 1 ${pid} 0`)
  }
  return root
}

it("counts the live titled workers of each session, not spares, zombies, vanished or other processes", () => {
  const pad = "\0".repeat(40)
  const root = fakeProc({
    "10": { cmdline: `agentd-worker s-a${pad}`, state: "S" },
    "11": { cmdline: `agentd-worker s-a${pad}`, state: "R" },
    "12": { cmdline: `agentd-worker s-a${pad}`, state: "Z" },
    "13": { cmdline: "/usr/bin/node\0/x/dist/src/bin/worker.js\0--warm-up\0", state: "S" },
    "14": { cmdline: "agentd-worker s-b", state: "D" },
    "15": { cmdline: `agentd-worker s-c${pad}` }, // gone before its stat was read
    "16": { cmdline: "", state: "Z" },
    "17": { cmdline: "agentd-worker \0\0", state: "S" },
    "18": { cmdline: "agentd-workers-d\0", state: "S" },
    // Worker hosts run several sessions and name none.
    "19": { cmdline: `agentd-worker host${pad}`, state: "S" },
    "20": { cmdline: `agentd-worker host${pad}`, state: "S" }
  })
  const found = workersBySession(root)
  expect(Object.fromEntries([...found].map(([s, pids]) => [s, pids.sort()]))).toEqual({ "s-a": [10, 11], "s-b": [14] })

  const census = new WorkerCensus({ procRoot: root })
  expect(census.sample()).toEqual([{ at: expect.any(Number), session: "s-a", pids: [10, 11] }])
  expect(new WorkerCensus({ procRoot: root, sessions: (id) => id !== "s-a" }).sample()).toEqual([])
})

it("catches two real processes titled as workers of one session, and sees one once the other is gone", async () => {
  const session = `s-census-${process.pid}-${Date.now().toString(36)}`
  const worker = () => {
    const child = spawn(process.execPath, [
      "-e",
      `process.title = ${JSON.stringify(`agentd-worker ${session}`)}; process.stdout.write("up\\n"); setInterval(() => {}, 1000)`
    ], { stdio: ["ignore", "pipe", "inherit"] })
    children.push(child)
    return new Promise<ChildProcess>((resolve) => child.stdout!.once("data", () => resolve(child)))
  }
  const census = new WorkerCensus({ sessions: (id) => id === session, intervalMs: 10 }).start()
  try {
    const first = await worker()
    const second = await worker()
    const deadline = Date.now() + 10_000
    while (census.doubles.length === 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20))
    expect(census.doubles[0]).toMatchObject({ session, pids: [first.pid!, second.pid!].sort((a, b) => a - b) })
    second.kill("SIGKILL")
    await new Promise((r) => second.once("exit", r))
    expect(census.sample()).toEqual([])
    expect(workersBySession().get(session)).toEqual([first.pid])
    expect(census.summary()).toMatch(/samples with a session on two live workers/)
  } finally {
    census.stop()
  }
})
