/**
 * Restore through the supervisor (docs/protocol.md section 6): a restored worker is sent its
 * session by the daemon, read through the daemon's storage layers; it never opens the state dir.
 *
 * The session's workers run under Node's permission model (`NODE_OPTIONS` in the session's
 * `launchEnv`: `--experimental-permission`, reads allowed only under the project, no writes), so
 * they genuinely cannot read the state dir: a worker that tried (as workers once did, reopening
 * the daemon's files by path) fails its restore, and the session never comes back.
 *
 * Needs `npm run build` first.
 */
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { describe, expect, it } from "vitest"
import {
  cleanUpAfterTests,
  collectTurn,
  collectUntil,
  createSession,
  cursorGap,
  describeMsg,
  isEvent,
  type Msg,
  PROJECT_ROOT,
  useDaemon,
  waitGone
} from "./harness.js"
import { attachAndReplay } from "./attach.js"

cleanUpAfterTests()

/** Reads allowed under the project only (its dist and node_modules); writes nowhere. */
const CONFINED = `--experimental-permission --allow-fs-read=${fs.realpathSync(PROJECT_ROOT)}/*`

const isWorkerStatus = (worker: string) => (m: Msg): boolean => m["type"] === "session_status" && m["state"]?.worker === worker

describe("restore through the supervisor", () => {
  it("a worker that cannot read the state dir restores its session after a SIGKILL mid-turn: whole transcript, events after the checkpoint, cut turn", async () => {
    const d = await useDaemon()
    const a = await d.connect("a")
    const { id } = await createSession(a, { launchEnv: { NODE_OPTIONS: CONFINED } })
    await attachAndReplay(a, { activeSessionId: id })

    // A transcript of several restore frames (~2.5 MB in 12 messages), checkpointed, then a
    // turn logged after the checkpoint.
    for (let i = 0; i < 5; i++) {
      await a.ok({ type: "prompt", activeSessionId: id, message: "/bulk 500000" })
      await collectTurn(a, id, 20_000)
    }
    await a.ok({ type: "checkpoint", activeSessionId: id })
    await a.ok({ type: "prompt", activeSessionId: id, message: "after the checkpoint" })
    await collectTurn(a, id)

    const st = await a.ok({ type: "get_state", activeSessionId: id })
    d.recordWorkers(st)
    const pid = st["workerPid"] as number
    // The worker really is confined: the same options deny a read of the state dir's files.
    expect(fs.readFileSync(`/proc/${pid}/environ`, "utf8")).toContain(`NODE_OPTIONS=${CONFINED}\0`)
    const probe = spawnSync(process.execPath, ["-e", `require("fs").readdirSync(${JSON.stringify(path.join(d.stateDir, "sessions"))})`], {
      env: { ...process.env, NODE_OPTIONS: CONFINED },
      encoding: "utf8"
    })
    expect(probe.status).not.toBe(0)
    expect(probe.stderr).toContain("ERR_ACCESS_DENIED")

    // SIGKILL mid-turn: the replacement (confined too) is sent the session and reports the cut turn.
    await a.ok({ type: "prompt", activeSessionId: id, message: "/sleep 5000" })
    await a.waitFor(isEvent("tool_execution_start"), 10_000)
    process.kill(pid, "SIGKILL")
    let recovering = false
    const seen = await collectUntil(a, id, (m) => {
      if (isWorkerStatus("recovering")(m)) recovering = true
      return (recovering && isWorkerStatus("ready")(m)) || isWorkerStatus("failed")(m)
    }, 30_000)
    const story = seen.map(describeMsg).join(", ")
    expect(seen.at(-1)!["state"]?.worker, story).toBe("ready")
    const iInterrupted = seen.findIndex(isEvent("turn_interrupted"))
    expect(seen[iInterrupted]?.["event"], story).toEqual({ type: "turn_interrupted", reason: "worker_crashed" })
    expect(seen.findIndex(isWorkerStatus("recovering")), story).toBeLessThan(iInterrupted)
    expect(await waitGone([pid], 3_000)).toEqual([])
    const after = await a.ok({ type: "get_state", activeSessionId: id })
    d.recordWorkers(after)
    expect(after["workerPid"]).not.toBe(pid)
    expect(fs.readFileSync(`/proc/${after["workerPid"]}/environ`, "utf8")).toContain(`NODE_OPTIONS=${CONFINED}\0`)

    // The restored worker holds the whole history: 10 bulk messages, 2 after the checkpoint,
    // the cut turn's user message and its tool call; `/compact` counts them (and itself).
    const held = ((await a.ok({ type: "get_messages", activeSessionId: id }))["messages"] as Array<Msg>).length
    await a.ok({ type: "prompt", activeSessionId: id, message: "/compact" })
    await collectTurn(a, id, 20_000)
    const messages = (await a.ok({ type: "get_messages", activeSessionId: id }))["messages"] as Array<Msg>
    expect(messages.map((m) => m["content"])).toEqual([`compacted ${held + 1} messages`])
    expect(cursorGap(a.sequenced(id))).toBeUndefined()
  }, 90_000)
})
