// Idle echo worker RSS vs bare node (median of a few), for one or more builds.
import { spawn } from "node:child_process"
import { createSession, rssOf, sleep, waitReady, withDaemon } from "./daemonHarness.js"
const bins = process.argv.slice(2)
const med = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!
const bare = async () => { const p = spawn(process.execPath, ["-e", "setInterval(()=>{},1000)"], { stdio: "ignore" }); await sleep(800); const r = rssOf(p.pid!); p.kill("SIGKILL"); return r }
const out: Record<string, number[]> = { bare: [] }
for (let round = 0; round < 3; round++) {
  out.bare!.push(await bare())
  for (const bin of bins) {
    await withDaemon({ bin, env: { AGENTD_WARM_SPARE: "0", ...(process.env.WENV ? { AGENTD_WORKER_NODE_ARGS: process.env.WENV } : {}) } }, async (d) => {
      const ctl = await d.connect("ctl")
      const rs: number[] = []
      for (let i = 0; i < 3; i++) {
        const { id } = await createSession(ctl)
        const st = await waitReady(ctl, id)
        await ctl.ok({ type: "prompt", activeSessionId: id, message: "hello there" })
        await sleep(1500)
        rs.push(rssOf(st.workerPid))
      }
      ;(out[bin] ??= []).push(med(rs))
    })
  }
}
for (const [k, v] of Object.entries(out)) console.log(`${k}: idle RSS median ${(med(v) / 1048576).toFixed(1)} MB (${v.map((x) => (x / 1048576).toFixed(1)).join(", ")})`)
