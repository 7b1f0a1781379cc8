// A/B: daemon and worker CPU us per delivered event + warm turn time, builds alternating.
import { createSession, runTurn, waitReady, withDaemon, descendantsOf, nowMs } from "./daemonHarness.js"
import { cpuTicksOf } from "../test/support/procfs.js"
const WORDS = 20000
const message = () => Array.from({ length: WORDS }, (_, i) => `w${i}`).join(" ")
const bins = process.argv.slice(2)
const rounds = Number(process.env.ROUNDS ?? 3)
const kids = (pid: number) => descendantsOf(pid).reduce((a, p) => a + (cpuTicksOf(p) ?? 0), 0)
const R: Record<string, { d: number[]; w: number[]; t: number[]; first: number[] }> = {}
for (let round = 0; round < rounds; round++) {
  for (const bin of bins) {
    await withDaemon({ bin, env: { AGENTD_CHECKPOINT_EVENTS: "1000000000", AGENTD_CHECKPOINT_BYTES: String(1024 ** 3), AGENTD_WARM_SPARE: "0" } }, async (d) => {
      const ctl = await d.connect("ctl")
      const { id } = await createSession(ctl)
      await waitReady(ctl, id)
      const c = await d.connect("c")
      await c.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
      const r = (R[bin] ??= { d: [], w: [], t: [], first: [] })
      let t = nowMs()
      await runTurn(c, id, message())
      r.first.push(nowMs() - t)
      await runTurn(c, id, message())
      const d0 = cpuTicksOf(d.pid) ?? 0, w0 = kids(d.pid)
      t = nowMs()
      const N = 3
      for (let i = 0; i < N; i++) await runTurn(c, id, message())
      r.t.push((nowMs() - t) / N)
      r.d.push((((cpuTicksOf(d.pid) ?? 0) - d0) * 10_000) / (N * (WORDS + 1)))
      r.w.push(((kids(d.pid) - w0) * 10_000) / (N * (WORDS + 1)))
      console.log(`round ${round} ${bin.split("/").slice(-5, -3).join("/")}: daemon ${r.d.at(-1)!.toFixed(1)} us/ev, worker ${r.w.at(-1)!.toFixed(1)} us/ev, warm turn ${r.t.at(-1)!.toFixed(0)} ms, first ${r.first.at(-1)!.toFixed(0)} ms`)
    })
  }
}
const med = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!
for (const [b, r] of Object.entries(R)) console.log(`${b}: median daemon ${med(r.d).toFixed(1)} us/ev, worker ${med(r.w).toFixed(1)} us/ev, warm ${med(r.t).toFixed(0)} ms, first ${med(r.first).toFixed(0)} ms`)
