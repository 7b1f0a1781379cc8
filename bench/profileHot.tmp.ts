// Profiles daemon and worker over warm 1-client echo turns: NODE_OPTIONS=--cpu-prof for both.
import * as fs from "node:fs"
import { createSession, runTurn, waitReady, withDaemon, sleep } from "./daemonHarness.js"
const WORDS = 20000
const message = Array.from({ length: WORDS }, (_, i) => `w${i}`).join(" ")
const dir = process.argv[2] ?? "/tmp/hot/prof"
const turns = Number(process.argv[3] ?? "6")
fs.rmSync(dir, { recursive: true, force: true }); fs.mkdirSync(dir, { recursive: true })
await withDaemon({ nodeArgs: ["--cpu-prof", `--cpu-prof-dir=${dir}`], env: { AGENTD_WORKER_NODE_ARGS: `--cpu-prof --cpu-prof-dir=${dir}`, AGENTD_CHECKPOINT_EVENTS: "1000000000", AGENTD_CHECKPOINT_BYTES: String(1024 ** 3), AGENTD_WARM_SPARE: "0" } }, async (d) => {
  const ctl = await d.connect("ctl")
  const { id } = await createSession(ctl)
  await waitReady(ctl, id)
  const c = await d.connect("c")
  await c.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
  for (let i = 0; i < turns; i++) await runTurn(c, id, message)
  d.stopping = true
  await ctl.ok({ type: "shutdown" }).catch(() => {})
  await Promise.race([d.exited, sleep(10000)])
  await sleep(500)
})
console.log(fs.readdirSync(dir))
