/**
 * EventLog append throughput (group commit) against per-event fsync, in the same run.
 *
 * - EventLog: 64 fibers append to one session as fast as their acknowledgements come back; every
 *   acknowledged append is durable (fdatasync'd).
 * - baseline (a): `fs.appendFileSync` + `fs.fsyncSync` per event, the obvious durable log.
 * - reference (b): `fs.appendFileSync` per event without any sync (not durable: the ceiling).
 *
 * Disk latency on a shared machine drifts by 2-5x within seconds, so the three are measured in
 * alternating rounds and summed, rather than one after the other. The goal is EventLog >= 20x (a).
 */
import * as Effect from "effect/Effect"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import * as EventLog from "../src/EventLog.js"

const APPENDERS = 64
const ROUNDS = 4
const EVENTLOG_MS = 1_200
const BASELINE_MS = 600
const NOSYNC_MS = 250

/** A typical streamed event (a `message_update` delta). */
const event = (w: number, i: number) => ({
  type: "message_update",
  messageId: `m-${w}`,
  delta: ` word${i}`,
  appender: w,
  index: i
})

const line = (i: number) => `${JSON.stringify({ cursor: { generation: 1, sequence: i }, event: event(0, i) })}\n`

interface Tally {
  events: number
  ms: number
}

const rate = (t: Tally) => t.events / (t.ms / 1000)

/** Appends with `sync` after each event until `ms` elapse. */
const perEvent = (fd: number, ms: number, sync: boolean, tally: Tally): void => {
  const start = performance.now()
  let n = 0
  while (performance.now() - start < ms) {
    fs.appendFileSync(fd, line(n))
    if (sync) fs.fsyncSync(fd)
    n++
  }
  tally.events += n
  tally.ms += performance.now() - start
}

/** 64 appenders on one session until `ms` elapse; only acknowledged (durable) appends count. */
const eventLogRound = (log: EventLog.EventLogService, ms: number, tally: Tally) =>
  Effect.gen(function*() {
    let acknowledged = 0
    const start = performance.now()
    const deadline = start + ms
    yield* Effect.forEach(
      Array.from({ length: APPENDERS }, (_, w) => w),
      (w) =>
        Effect.gen(function*() {
          for (let i = 0; performance.now() < deadline; i++) {
            yield* log.append("bench", event(w, i))
            acknowledged++
          }
        }),
      { concurrency: "unbounded", discard: true }
    )
    tally.events += acknowledged
    tally.ms += performance.now() - start
  })

const fmt = (n: number) => Math.round(n).toLocaleString("en-US")

export default async function eventLog(): Promise<void> {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-bench-eventlog-"))
  const baselineFd = fs.openSync(path.join(dir, "baseline.jsonl"), "a", 0o600)
  const nosyncFd = fs.openSync(path.join(dir, "nosync.jsonl"), "a", 0o600)
  const log: Tally = { events: 0, ms: 0 }
  const baseline: Tally = { events: 0, ms: 0 }
  const nosync: Tally = { events: 0, ms: 0 }
  try {
    await Effect.runPromise(
      Effect.gen(function*() {
        const service = yield* EventLog.EventLog
        // Opens the session and creates its first segment outside the measured windows.
        yield* service.append("bench", event(-1, -1))
        for (let round = 0; round < ROUNDS; round++) {
          perEvent(baselineFd, BASELINE_MS, true, baseline)
          perEvent(nosyncFd, NOSYNC_MS, false, nosync)
          yield* eventLogRound(service, EVENTLOG_MS, log)
        }
        const last = yield* service.lastCursor("bench")
        if (last._tag === "None" || last.value.sequence !== log.events) {
          throw new Error("bench: acknowledged appends and the log's last cursor disagree")
        }
      }).pipe(Effect.provide(EventLog.layer({ root: path.join(dir, "log") })))
    )
    console.log(`EventLog.append, ${APPENDERS} concurrent appenders (durable): ${fmt(rate(log))} events/s`)
    console.log(`(a) appendFileSync + fsyncSync per event (durable):  ${fmt(rate(baseline))} events/s`)
    console.log(`(b) appendFileSync, no fsync (not durable):          ${fmt(rate(nosync))} events/s`)
    console.log(`ratio EventLog / (a): ${(rate(log) / rate(baseline)).toFixed(1)}x (goal >= 20x)`)
    console.log(`ratio EventLog / (b): ${(rate(log) / rate(nosync)).toFixed(2)}x`)
    console.log(
      `(${ROUNDS} alternating rounds; ${fmt(log.events)} durable appends in ${(log.ms / 1000).toFixed(1)} s; ` +
        `load average ${os.loadavg().map((l) => l.toFixed(1)).join(" ")} on ${os.cpus().length} cpus)`
    )
  } finally {
    fs.closeSync(baselineFd)
    fs.closeSync(nosyncFd)
    fs.rmSync(dir, { recursive: true, force: true })
  }
}
