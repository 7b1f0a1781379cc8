/**
 * The daemon's metrics (docs/protocol.md section 10), in Effect's `Metric` registry: `GET /metrics`
 * renders them in Prometheus text, and an app that embeds the daemon reads the same values with
 * `Metric.snapshot` (or any one of them with `Metric.value`).
 *
 * Each is updated at the narrowest seam that sees it, outside the session core: the storage's
 * appends (wrapped by {@link instrumentStorage}: events appended, turn durations from the
 * `agent_start`/`agent_end` events, checkpoint durations from the snapshot write to the new
 * generation), the delivery of events to socket clients (internal/delivery), the HTTP front's
 * reads, the socket server's and the HTTP front's connections, and the worker pool's processes.
 * Updates from callbacks use the metrics' synchronous `unsafeUpdate`/`unsafeModify`, which is
 * what `Metric.update` does inside an effect.
 */
import * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import * as Metric from "effect/Metric"
import * as MetricBoundaries from "effect/MetricBoundaries"
import { EncodedEvent, EventLog, type EventData, withAppendAllNow } from "./EventLog.js"
import { SessionStore } from "./SessionStore.js"

/** Where events are delivered: the daemon's socket (WebSocket clients included), or an HTTP read. */
export type DeliveryTransport = "socket" | "http"
/** Which kind of client is connected. */
export type ClientTransport = "socket" | "ws" | "sse"

const NO_TAGS: ReadonlyArray<never> = []

/** A counter of whole increments (every counter here counts things, never sets a level). */
const counter = (name: string, description: string): Metric.Metric.Counter<number> =>
  Metric.counter(name, { description, incremental: true })

/** Events appended to the event log (every sequenced message of every session). */
export const eventsAppended: Metric.Metric.Counter<number> = counter("agentd_events_appended_total", "Events appended to the event log.")

const deliveredBase = counter("agentd_events_delivered_total", "Events delivered to clients: socket (and WebSocket) connections, HTTP reads (catch-up, long-poll, SSE).")
const bytesBase = counter("agentd_delivered_bytes_total", "Bytes of events delivered to clients, by transport.")

/** Events delivered, by transport. */
export const eventsDelivered: Readonly<Record<DeliveryTransport, Metric.Metric.Counter<number>>> = {
  socket: Metric.tagged(deliveredBase, "transport", "socket"),
  http: Metric.tagged(deliveredBase, "transport", "http")
}
/** Bytes of events delivered, by transport. */
export const bytesDelivered: Readonly<Record<DeliveryTransport, Metric.Metric.Counter<number>>> = {
  socket: Metric.tagged(bytesBase, "transport", "socket"),
  http: Metric.tagged(bytesBase, "transport", "http")
}

const clientsBase = Metric.gauge("agentd_clients", {
  description: "Connected clients: socket connections (a WebSocket's bridge included), WebSockets, SSE streams."
})
/** Connected clients, by kind. */
export const clients: Readonly<Record<ClientTransport, Metric.Metric.Gauge<number>>> = {
  socket: Metric.tagged(clientsBase, "transport", "socket"),
  ws: Metric.tagged(clientsBase, "transport", "ws"),
  sse: Metric.tagged(clientsBase, "transport", "sse")
}

/** Slow clients paused (live delivery stopped until they drain; they then catch up from the log). */
export const slowClientPauses: Metric.Metric.Counter<number> = counter("agentd_slow_client_pauses_total", "Times a client that did not read was paused (then caught up from the event log).")
/** Slow clients resynced (the events they lacked were pruned meanwhile: a snapshot instead). */
export const slowClientResyncs: Metric.Metric.Counter<number> = counter("agentd_slow_client_resyncs_total", "Resyncs: a paused client whose missing events were pruned got the current snapshot instead.")

/** Worker processes started (warm spares included). */
export const workerStarts: Metric.Metric.Counter<number> = counter("agentd_worker_starts_total", "Worker processes started (spares included).")
/** Workers that exited without being asked to (a crash, a kill from outside). */
export const workerCrashes: Metric.Metric.Counter<number> = counter("agentd_worker_crashes_total", "Worker processes that exited without being asked to.")
/** Workers started for a session whose previous worker crashed. */
export const workerRestarts: Metric.Metric.Counter<number> = counter("agentd_worker_restarts_total", "Workers started for a session after its previous worker crashed.")
/** Live worker processes (spares included). */
export const liveWorkers: Metric.Metric.Gauge<number> = Metric.gauge("agentd_workers_live", {
  description: "Live worker processes (spares included)."
})

/** Seconds: 1 ms, doubling, to about 4.5 minutes. */
const durationBoundaries = MetricBoundaries.exponential({ start: 0.001, factor: 2, count: 19 })

/** Turn durations, from a turn's `agent_start` to its `agent_end` or `turn_interrupted`, logged. */
export const turnDuration: Metric.Metric.Histogram<number> = Metric.histogram(
  "agentd_turn_duration_seconds",
  durationBoundaries,
  "Turn durations (agent_start to agent_end or turn_interrupted), in seconds."
)
/** Checkpoint durations: its snapshot written, its new generation started. */
export const checkpointDuration: Metric.Metric.Histogram<number> = Metric.histogram(
  "agentd_checkpoint_duration_seconds",
  durationBoundaries,
  "Checkpoint durations (transcript snapshot written and the next generation started), in seconds."
)

/**
 * Registers every metric of this module, so that a scrape lists those still at zero (a metric
 * enters Effect's registry at its first use).
 */
export const registerAll = (): void => {
  const all: ReadonlyArray<{ unsafeValue(tags: ReadonlyArray<never>): unknown }> = [
    eventsAppended,
    ...Object.values(eventsDelivered),
    ...Object.values(bytesDelivered),
    ...Object.values(clients),
    slowClientPauses,
    slowClientResyncs,
    workerStarts,
    workerCrashes,
    workerRestarts,
    liveWorkers,
    turnDuration,
    checkpointDuration
  ]
  for (const metric of all) metric.unsafeValue(NO_TAGS)
}

/** Adds `n` to a counter from a callback (no effect to run). */
export const count = (counter: Metric.Metric.Counter<number>, n = 1): void => counter.unsafeUpdate(n, NO_TAGS)

/** Moves a gauge by `delta` from a callback. */
export const gaugeBy = (gauge: Metric.Metric.Gauge<number>, delta: number): void => gauge.unsafeModify(delta, NO_TAGS)

/** Counts `count` events of `bytes` delivered over `transport`. */
export const delivered = (transport: DeliveryTransport, count: number, bytes: number): void => {
  eventsDelivered[transport].unsafeUpdate(count, NO_TAGS)
  bytesDelivered[transport].unsafeUpdate(bytes, NO_TAGS)
}

/** The number of lines (events) in a batch of wire lines. */
export const lineCount = (lines: Uint8Array): number => {
  let n = 0
  for (let i = lines.indexOf(10); i !== -1; i = lines.indexOf(10, i + 1)) n++
  return n
}

const TURN_START = '{"type":"session_event","event":{"type":"agent_start"'
/** Where an event's type starts in a logged `session_event`. */
const EVENT_TYPE_AT = '{"type":"session_event","event":{"type":"'.length
const TURN_ENDS = ['{"type":"session_event","event":{"type":"agent_end"', '{"type":"session_event","event":{"type":"turn_interrupted"']

/** Whether a logged message starts or ends a turn (read from its head: events are never parsed on the live path). */
const turnEdge = (event: EventData | EncodedEvent): "start" | "end" | undefined => {
  if (event instanceof EncodedEvent) {
    // Most events are neither (message_update...): told by one character, before any prefix.
    const first = event.charCodeAt(EVENT_TYPE_AT)
    if (first !== 0x61 /* a */ && first !== 0x74 /* t */) return undefined
    if (event.startsWith(TURN_START)) return "start"
    return TURN_ENDS.some((p) => event.startsWith(p)) ? "end" : undefined
  }
  const inner = event["type"] === "session_event" ? (event["event"] as { readonly type?: unknown } | undefined)?.type : undefined
  return inner === "agent_start" ? "start" : inner === "agent_end" || inner === "turn_interrupted" ? "end" : undefined
}

/**
 * The storage with its metrics: the event log counts appends and times turns (from the logged
 * `agent_start` to the logged end) and checkpoints (a checkpoint writes its snapshot with
 * `appendSnapshot`, then starts the log's next generation: the time between is its duration).
 * Whatever the store (files, PostgreSQL, an embedder's): it wraps the services, not their code.
 */
export const instrumentStorage = <R>(context: Context.Context<R | EventLog | SessionStore>): Context.Context<R | EventLog | SessionStore> => {
  const log = Context.get(context, EventLog)
  const store = Context.get(context, SessionStore)
  const turnsStarted = new Map<string, number>()
  const checkpointsStarted = new Map<string, number>()
  const observe = (sessionId: string, events: ReadonlyArray<EventData | EncodedEvent>) => {
    eventsAppended.unsafeUpdate(events.length, NO_TAGS)
    for (const event of events) {
      const edge = turnEdge(event)
      if (edge === "start") turnsStarted.set(sessionId, performance.now())
      else if (edge === "end") {
        const started = turnsStarted.get(sessionId)
        turnsStarted.delete(sessionId)
        if (started !== undefined) turnDuration.unsafeUpdate((performance.now() - started) / 1000, NO_TAGS)
      }
    }
  }
  const instrumentedLog: typeof log = withAppendAllNow({
    ...log,
    append: (sessionId, event) => Effect.tap(log.append(sessionId, event), () => observe(sessionId, [event])),
    appendAll: (sessionId, events) => Effect.tap(log.appendAll(sessionId, events), () => observe(sessionId, events)),
    startGeneration: (sessionId) =>
      Effect.tap(log.startGeneration(sessionId), () => {
        const started = checkpointsStarted.get(sessionId)
        checkpointsStarted.delete(sessionId)
        if (started !== undefined) checkpointDuration.unsafeUpdate((performance.now() - started) / 1000, NO_TAGS)
      })
  }, log.appendAllNow === undefined ? undefined : (sessionId, events, tracer, done) =>
    log.appendAllNow!(sessionId, events, tracer, (error) => {
      if (error === undefined) observe(sessionId, events)
      done(error)
    }))
  const instrumentedStore: typeof store = {
    ...store,
    appendSnapshot: (sessionId, header, messages) =>
      Effect.suspend(() => {
        checkpointsStarted.set(sessionId, performance.now())
        return store.appendSnapshot(sessionId, header, messages).pipe(
          Effect.onError(() => Effect.sync(() => checkpointsStarted.delete(sessionId)))
        )
      })
  }
  return Context.add(Context.add(context, EventLog, instrumentedLog), SessionStore, instrumentedStore)
}
