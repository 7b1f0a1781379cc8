/**
 * `npm run bench -- webOpen`: how long the web page takes to open a large session (the issue's
 * aim: 100 MB in under 2 s), in Debian's chromium driven by playwright-core: from navigating to
 * the session until its transcript is shown and the page follows live. The session is made of
 * `/bulk` turns (4 MiB messages) and checkpointed, so the page reads one snapshot.
 * `AGENTD_BENCH_WEB_MB` sets the size (default 100). Skips without chromium.
 */
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { chromium } from "playwright-core"
import { createSession, type Daemon, nowMs, runTurn, sleep, waitReady, withDaemon } from "./daemonHarness.js"

const MESSAGE_BYTES = 4 * 1024 * 1024
const RUNS = 3
const BUDGET_MS = 2000
const CHROMIUM = [process.env["AGENTD_CHROMIUM"], "/usr/bin/chromium", "/usr/bin/chromium-browser"].find((p): p is string => !!p && fs.existsSync(p))

const httpPortOf = async (daemon: Daemon): Promise<number> => {
  for (let i = 0; i < 400; i++) {
    const m = /agentd HTTP at http:\/\/[^\s]+:(\d+)/.exec(daemon.stderrTail(100_000))
    if (m !== null) return Number(m[1])
    await sleep(25)
  }
  throw new Error(`no HTTP log line: ${daemon.stderrTail()}`)
}

export default async function webOpen(): Promise<void> {
  if (CHROMIUM === undefined) {
    console.log("skipped: no chromium (apt-get install chromium, or set AGENTD_CHROMIUM)")
    return
  }
  const megabytes = Number(process.env["AGENTD_BENCH_WEB_MB"] ?? "100")
  const turns = Math.max(1, Math.ceil((megabytes * 1024 * 1024) / MESSAGE_BYTES))
  await withDaemon({ extraArgs: ["--http", "127.0.0.1:0"] }, async (daemon) => {
    const port = await httpPortOf(daemon)
    const token = fs.readFileSync(path.join(daemon.stateDir, "http-token"), "utf8").trim()
    const ctl = await daemon.connect("ctl")
    const { id } = await createSession(ctl)
    await waitReady(ctl, id)
    await ctl.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    for (let i = 0; i < turns; i++) await runTurn(ctl, id, `/bulk ${MESSAGE_BYTES}`, 120_000)
    await ctl.ok({ type: "checkpoint", activeSessionId: id }, 120_000)
    const total = turns * 2
    console.log(`session: ${turns} turns, ${total} messages, ~${Math.round((turns * MESSAGE_BYTES) / 1024 / 1024)} MiB`)

    const profile = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-bench-chromium-"))
    const context = await chromium.launchPersistentContext(profile, {
      executablePath: CHROMIUM,
      headless: true,
      chromiumSandbox: false,
      args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
    })
    try {
      const page = await context.newPage()
      await page.goto(`http://127.0.0.1:${port}/login?token=${token}`)
      const times: Array<number> = []
      for (let run = 0; run < RUNS; run++) {
        await page.goto("about:blank")
        const start = nowMs()
        await page.goto(`http://127.0.0.1:${port}/#/s/${id}`)
        await page.waitForFunction(
          (n) => {
            const d = (globalThis as unknown as { document: { querySelector(s: string): { textContent: string } | null } }).document
            const text = d.querySelector("#session-state")?.textContent ?? ""
            return text.includes(`${n} messages`) && text.includes("live")
          },
          total,
          { timeout: 120_000, polling: 20 }
        )
        times.push(nowMs() - start)
      }
      const median = [...times].sort((a, b) => a - b)[Math.floor(times.length / 2)]!
      console.log(`open to live: ${times.map((t) => `${Math.round(t)} ms`).join(", ")}; median ${Math.round(median)} ms (aim: under ${BUDGET_MS} ms) ${median < BUDGET_MS ? "OK" : "OVER"}`)
    } finally {
      await context.close()
      fs.rmSync(profile, { recursive: true, force: true })
    }
  })
}
