/**
 * `GET /metrics` (docs/protocol.md section 10): Prometheus text from Effect's Metric registry,
 * so an embedding app reads the same values with `Metric.snapshot`. Counters and gauges the
 * HTTP front keeps, and gauges of the sessions computed at each scrape from the manager's list.
 */
import * as Effect from "effect/Effect"
import * as Metric from "effect/Metric"
import * as MetricState from "effect/MetricState"
import * as DaemonMetrics from "../../Metrics.js"
import type { SessionSummary } from "../../Protocol.js"

export const httpRequests = (status: number): Metric.Metric.Counter<number> =>
  Metric.counter("agentd_http_requests_total", { description: "HTTP requests answered, by status." }).pipe(
    Metric.tagged("status", String(status))
  )


const sessionsByState = (state: string) =>
  Metric.gauge("agentd_sessions", { description: "Sessions, by worker state." }).pipe(Metric.tagged("worker", state))

const busySessions = Metric.gauge("agentd_sessions_busy", { description: "Sessions running a turn." })
const supervisorGeneration = Metric.gauge("agentd_supervisor_generation", { description: "This daemon's supervisor generation." })

const STATES = ["starting", "ready", "recovering", "passivated", "failed", "damaged", "closed"]

const escape = (v: string) => v.replace(/\\/g, "\\\\").replace(/"/g, '\\"').replace(/\n/g, "\\n")

/** Updates the gauges computed from the sessions, then renders every metric of the registry. */
export const render = (sessions: ReadonlyArray<SessionSummary>, generation: number) =>
  Effect.gen(function*() {
    DaemonMetrics.registerAll()
    // Listed from the first scrape, which is answered before its own request is counted.
    httpRequests(200).unsafeValue([])
    for (const state of STATES) yield* Metric.set(sessionsByState(state), sessions.filter((s) => s.worker === state).length)
    yield* Metric.set(busySessions, sessions.filter((s) => s.busy).length)
    yield* Metric.set(supervisorGeneration, generation)
    const pairs = yield* Metric.snapshot
    const byName = new Map<string, { type: string; help: string; lines: Array<string> }>()
    for (const pair of pairs) {
      const key = pair.metricKey
      const name = key.name.replace(/[^a-zA-Z0-9_:]/g, "_")
      const labels = key.tags.map((t) => `${t.key.replace(/[^a-zA-Z0-9_]/g, "_")}="${escape(t.value)}"`)
      const lab = (extra: Array<string> = []) => (labels.length + extra.length === 0 ? "" : `{${[...labels, ...extra].join(",")}}`)
      const state = pair.metricState
      let entry = byName.get(name)
      const add = (type: string) => {
        if (entry === undefined) byName.set(name, entry = { type, help: key.description._tag === "Some" ? key.description.value : name, lines: [] })
        return entry
      }
      if (MetricState.isCounterState(state)) {
        add("counter").lines.push(`${name}${lab()} ${Number(state.count)}`)
      } else if (MetricState.isGaugeState(state)) {
        add("gauge").lines.push(`${name}${lab()} ${Number(state.value)}`)
      } else if (MetricState.isHistogramState(state)) {
        const e = add("histogram")
        for (const [bound, count] of state.buckets) {
          e.lines.push(`${name}_bucket${lab([`le="${Number.isFinite(bound) ? bound : "+Inf"}"`])} ${count}`)
        }
        e.lines.push(`${name}_sum${lab()} ${state.sum}`, `${name}_count${lab()} ${state.count}`)
      }
    }
    let text = ""
    for (const [name, e] of byName) text += `# HELP ${name} ${e.help}\n# TYPE ${name} ${e.type}\n${e.lines.join("\n")}\n`
    return text
  })
