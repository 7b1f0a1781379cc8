import { createSession, runTurn, waitReady, withDaemon, descendantsOf, nowMs, sleep } from "./daemonHarness.js"
import { cpuTicksOf } from "../test/support/procfs.js"
const WORDS = 20000
const message = Array.from({ length: WORDS }, (_, i) => `w${i}`).join(" ")
const bins = process.argv.slice(2)
for (let round = 0; round < Number(process.env.ROUNDS ?? 2); round++) for (const bin of bins) {
  await withDaemon({ bin, nodeArgs: (process.env.DFLAGS ?? "").split(" ").filter(Boolean), env: { AGENTD_CHECKPOINT_EVENTS: "1000000000", AGENTD_CHECKPOINT_BYTES: String(1024 ** 3) } }, async (d) => {
    const ctl = await d.connect("ctl")
    const { id } = await createSession(ctl)
    const st = await waitReady(ctl, id)
    await sleep(1500)
    const c = await d.connect("c")
    await c.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    const wp = st.workerPid as number
    const line: string[] = []
    for (let i = 0; i < 3; i++) {
      const d0 = cpuTicksOf(d.pid)!, w0 = cpuTicksOf(wp)!, t = nowMs()
      await runTurn(c, id, message)
      line.push(`turn ${i + 1}: ${(nowMs() - t).toFixed(0)} ms, daemon ${(cpuTicksOf(d.pid)! - d0) * 10} ms, worker ${(cpuTicksOf(wp)! - w0) * 10} ms CPU`)
    }
    console.log(bin.split("/").slice(-5, -3).join("/"), "|", line.join(" | "))
  })
}
