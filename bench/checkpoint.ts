/**
 * Checkpoint cost, at default settings (automatic checkpoints every 1000 events or 8 MiB):
 *
 * - Turn latency over a ~100 MB session: 40 turns of a 10,000-word prompt (each turn logs about
 *   10,000 events, 2.5 MB); the latency of a turn is from its `prompt` to the idle status after
 *   its `agent_end`, automatic checkpoints included. The project's figure is the median of the
 *   last five turns; the baseline, in the same run, is the median of turns 2-6. Target: within 1.2x.
 * - Checkpoint time against transcript size: sessions grown to about 1, 10 and 100 MB (by
 *   `/bulk` turns), then one more `/bulk 1000000` turn and an explicit `checkpoint`, timed from
 *   the command to its answer. The baseline is the 1 MB session's time (target: 100 MB within
 *   2x of it); also shown next to a plain append + fdatasync of the same new bytes to a file.
 */
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { createSession, nowMs, runTurn, waitReady, withDaemon } from "./daemonHarness.js"
import { percentiles } from "./report.js"

const LATENCY_TURNS = 40
const WORDS = 10_000
const SIZES_MB = [1, 10, 100]
const GROW_BULK = 5_000_000
const ADDED_BYTES = 1_000_000
const REPEATS = 3

const median = (xs: ReadonlyArray<number>) => percentiles(xs).median

const turnLatency = () =>
  withDaemon({}, async (daemon) => {
    const ctl = await daemon.connect("ctl")
    const { id } = await createSession(ctl)
    await waitReady(ctl, id)
    await ctl.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    await ctl.waitFor((m) => m["type"] === "session_attached", 15_000, "session_attached")
    const prompt = Array.from({ length: WORDS }, (_, i) => `w${i % 1000}`).join(" ")
    const latencies: Array<number> = []
    for (let i = 0; i < LATENCY_TURNS; i++) {
      const t = nowMs()
      await runTurn(ctl, id, prompt, 120_000)
      latencies.push(nowMs() - t)
      ctl.drain()
    }
    const state = await ctl.ok({ type: "get_state", activeSessionId: id })
    const early = median(latencies.slice(1, 6))
    const late = median(latencies.slice(-5))
    const ratio = late / early
    console.log(
      `turn latency over ${LATENCY_TURNS} turns of ${WORDS.toLocaleString("en-US")} words (${state["messageCount"]} messages, ` +
        `generation ${state["lastEventCursor"]?.generation}): last 5 turns median ${late.toFixed(0)} ms | baseline (turns 2-6 median) ` +
        `${early.toFixed(0)} ms | ratio ${ratio.toFixed(2)}x  (target <= 1.2x: ${ratio <= 1.2 ? "met" : "MISSED"})`
    )
    console.log(`  (every turn, ms: ${latencies.map((l) => l.toFixed(0)).join(" ")})`)
  })

/** A plain append of `bytes` new bytes to a file that already holds `existing`, then fdatasync. */
const plainAppend = (existing: number, bytes: number): number => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-bench-append-"))
  try {
    const file = path.join(dir, "transcript.jsonl")
    fs.writeFileSync(file, Buffer.alloc(existing, 0x78))
    const data = Buffer.alloc(bytes, 0x79)
    const t = nowMs()
    const fd = fs.openSync(file, "a")
    fs.writeSync(fd, data)
    fs.fdatasyncSync(fd)
    fs.closeSync(fd)
    return nowMs() - t
  } finally {
    fs.rmSync(dir, { recursive: true, force: true })
  }
}

const checkpointTimes = () =>
  withDaemon({}, async (daemon) => {
    const ctl = await daemon.connect("ctl")
    const times = new Map<number, number>()
    for (const sizeMb of SIZES_MB) {
      const { id } = await createSession(ctl)
      await waitReady(ctl, id)
      await ctl.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
      await ctl.waitFor((m) => m["type"] === "session_attached" && m["activeSessionId"] === id, 15_000, "session_attached")
      let grown = 0
      while (grown + GROW_BULK <= sizeMb * 1e6) {
        await runTurn(ctl, id, `/bulk ${GROW_BULK}`, 120_000)
        ctl.drain()
        grown += GROW_BULK
      }
      if (grown < sizeMb * 1e6) {
        await runTurn(ctl, id, `/bulk ${sizeMb * 1e6 - grown}`, 120_000)
        ctl.drain()
      }
      const samples: Array<number> = []
      for (let r = 0; r < REPEATS; r++) {
        // The last generation adds the same amount whatever the session's size.
        await ctl.ok({ type: "checkpoint", activeSessionId: id }, 120_000)
        await runTurn(ctl, id, `/bulk ${ADDED_BYTES}`, 120_000)
        ctl.drain()
        const t = nowMs()
        await ctl.ok({ type: "checkpoint", activeSessionId: id }, 120_000)
        samples.push(nowMs() - t)
      }
      times.set(sizeMb, median(samples))
      await ctl.ok({ type: "kill", activeSessionId: id }, 60_000)
    }
    const base = times.get(SIZES_MB[0]!)!
    const plain = median(Array.from({ length: REPEATS }, () => plainAppend(100e6, ADDED_BYTES)))
    for (const sizeMb of SIZES_MB) {
      const t = times.get(sizeMb)!
      console.log(
        `checkpoint of a ${sizeMb} MB transcript whose last generation added ${ADDED_BYTES / 1e6} MB: ${t.toFixed(1)} ms | ` +
          `baseline (the ${SIZES_MB[0]} MB session's) ${base.toFixed(1)} ms | ratio ${(t / base).toFixed(2)}x` +
          (sizeMb === SIZES_MB.at(-1) ? `  (target <= 2x: ${t / base <= 2 ? "met" : "MISSED"})` : "") +
          ` | plain append + fdatasync of ${ADDED_BYTES / 1e6} MB: ${plain.toFixed(1)} ms (${(t / plain).toFixed(1)}x)`
      )
    }
  })

export default async function checkpoint(): Promise<void> {
  await turnLatency()
  await checkpointTimes()
}
