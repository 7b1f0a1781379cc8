/**
 * The transition table of `step` (src/internal/session/transition.ts), derived from the function
 * itself: for every phase (a sample state of each, and of the sub-cases a reader asks about) and
 * every input kind, the next phase and the actions. docs/session-core.md holds it, and
 * test/transition.table.test.ts checks that it still says what `step` does.
 */
import {
  type Action,
  defaultEnv,
  type Input,
  type InputTag,
  initial,
  loaded,
  type RestartPolicy,
  type State,
  step
} from "../../src/internal/session/transition.js"

export const policy: RestartPolicy = { maxRestarts: 5, restartWindowMs: 60_000, backoffBaseMs: 100 }

const W = 1
const after = (s: State, ...inputs: Array<Input>) => inputs.reduce((x, i) => step(x, i, defaultEnv, policy).state, s)

const loading = after(initial, { _tag: "Acquired", epoch: initial.epoch, worker: W })
const idle = after(loading, { _tag: "Ready", worker: W })
const running = after(idle, { _tag: "Prompt", req: 90, message: "m" })
const runningCheckpoint = after(running, { _tag: "Checkpoint", req: 91 })
const reserved = after(initial, { _tag: "Prompt", req: 90, message: "m" })
const crashedRunning = after(running, { _tag: "Exited", worker: W, asked: false })
const cutLoading = after(crashedRunning, { _tag: "Acquired", epoch: crashedRunning.epoch, worker: W })
const cutStatusOwed = after(cutLoading, { _tag: "TurnEnded", worker: W, how: "worker_crashed" })
const backoff = after(cutLoading, { _tag: "Exited", worker: W, asked: false })
let failedState: State = idle
let lastChance: State = idle
// Crashes past the policy's limit (each restart's backoff timer fired first).
for (let i = 0; i < 10 && failedState._tag !== "Failed"; i++) {
  if (failedState._tag === "Starting" && failedState.backoff) failedState = after(failedState, { _tag: "RestartDue", epoch: failedState.epoch })
  lastChance = after(failedState, { _tag: "Acquired", epoch: failedState.epoch, worker: W })
  failedState = after(lastChance, { _tag: "Exited", worker: W, asked: false })
}
const runningStopping = after(running, { _tag: "ShuttingDown", done: 93, force: false })
const stalledState = after(running, { _tag: "StorageFailed" })
const closed = after(idle, { _tag: "Kill", req: 92 })

/** The sample states, by the name the doc gives them. */
export const samples: ReadonlyArray<readonly [string, State]> = [
  ["Starting: acquiring a worker", initial],
  ["Starting: a prompt reserved", reserved],
  ["Starting: loading", loading],
  ["Starting: restart backing off", backoff],
  ["Starting: cut turn owed its end", cutLoading],
  ["Starting: cut turn owed its status", cutStatusOwed],
  ["Starting: loading, one crash from failing", lastChance],
  ["Idle", idle],
  ["Running", running],
  ["Running: a checkpoint waits", runningCheckpoint],
  ["Running: the daemon stops", runningStopping],
  ["Passivated", loaded],
  ["Failed", failedState],
  ["Stalled: storage cut the turn", stalledState],
  ["Closed", closed]
]

/** One input of each kind, aimed at `s` (its worker, its epoch, its turn). */
export const inputsFor = (s: State): ReadonlyArray<Input> => {
  const turn = s._tag === "Running" ? s.turn : 1
  const all: Record<InputTag, Input> = {
    Prompt: { _tag: "Prompt", req: 1, message: "m" },
    Abort: { _tag: "Abort", req: 1 },
    Checkpoint: { _tag: "Checkpoint", req: 1 },
    Retry: { _tag: "Retry", req: 1 },
    Kill: { _tag: "Kill", req: 1 },
    Rename: { _tag: "Rename", req: 1, name: "n" },
    Passivate: { _tag: "Passivate" },
    ShuttingDown: { _tag: "ShuttingDown", done: 2, force: false },
    Restore: { _tag: "Restore" },
    Acquired: { _tag: "Acquired", epoch: s.epoch, worker: 7 },
    AcquireFailed: { _tag: "AcquireFailed", epoch: s.epoch },
    TurnRefused: { _tag: "TurnRefused", turn, shownBusy: true },
    Events: { _tag: "Events", worker: W },
    TurnEnded: { _tag: "TurnEnded", worker: W, how: "agent_end" },
    Ready: { _tag: "Ready", worker: W },
    WorkerError: { _tag: "WorkerError", worker: W },
    Rewrite: { _tag: "Rewrite", worker: W, part: "begin" },
    Exited: { _tag: "Exited", worker: W, asked: false },
    RestartDue: { _tag: "RestartDue", epoch: s.epoch },
    StorageRetry: { _tag: "StorageRetry", epoch: s.epoch },
    StorageFailed: { _tag: "StorageFailed" }
  }
  return Object.values(all)
}

const describeAction = (a: Action): string => {
  switch (a._tag) {
    case "PublishStatus":
      return `status(${a.busy ? "busy" : "idle"}, ${a.worker})`
    case "PublishEvents":
      return a.end === undefined ? "events" : `events(${a.end})`
    case "PublishInterrupt":
      return `interrupt(${a.reason})`
    case "Journal":
      return `journal(${a.busy ? "busy" : "idle"}${a.required ? ", required" : ""})`
    case "Settle":
      return a.result._tag === "Ok" ? `ok(${a.result.value})` : `error(${a.result.error})`
    case "SendAbort":
      return `send abort(${a.reason})`
    case "StartWorker":
      return `start worker(${a.state}${a.interruptedReason === undefined ? "" : `, cut ${a.interruptedReason}`})`
    case "ScheduleRestart":
      return `restart in ${a.delayMs} ms`
    case "RunCheckpoint":
      return `checkpoint(${a.waiters.length})`
    default:
      return a._tag.replace(/([a-z])([A-Z])/g, "$1 $2").toLowerCase()
  }
}

/** A state's phase and the facts it carries, as the table names them. */
const phaseOf = (s: State): string => {
  const facts: Array<string> = []
  switch (s._tag) {
    case "Starting":
      facts.push(s.backoff ? "backing off" : s.worker === undefined ? "acquiring" : "loading")
      if (s.reserved !== undefined) facts.push("prompt reserved")
      if (s.cut !== undefined) facts.push(s.cut._tag === "InterruptOwed" ? "cut turn owed its end" : "cut turn owed its status")
      if (s.afterCut !== undefined) facts.push("a prompt waits for the cut turn")
      if (s.checkpoints.length > 0) facts.push("a checkpoint waits")
      if (s.retries.length > 0) facts.push("a retry waits")
      break
    case "Running":
      if (s.aborts.length > 0) facts.push("an abort waits")
      if (s.checkpoints.length > 0) facts.push("a checkpoint waits")
      if (s.rewrite) facts.push("rewrite under way")
      break
    case "Stalled":
      if (s.cut !== undefined) facts.push(s.cut._tag === "InterruptOwed" ? "cut turn owed its end" : "cut turn owed its status")
      if (s.checkpoints.length > 0) facts.push("a checkpoint waits")
      break
  }
  if (s.stopping) facts.push("the daemon stops")
  return facts.length === 0 ? s._tag : `${s._tag} (${facts.join(", ")})`
}

/** The table, as markdown: a section per sample state, a row per input kind. */
export const renderTable = (): string => {
  const out: Array<string> = []
  for (const [name, s] of samples) {
    out.push(`### ${name}`, "", "| input | next | actions |", "|---|---|---|")
    for (const input of inputsFor(s)) {
      const t = step(s, input, defaultEnv, policy)
      const next = t.state === s ? "(same)" : phaseOf(t.state)
      const actions = t.actions.length === 0 ? "(none)" : t.actions.map(describeAction).join(", ")
      out.push(`| ${input._tag} | ${next} | ${actions} |`)
    }
    out.push("")
  }
  return out.join("\n")
}

/** The state diagram: every phase-to-phase move the table shows, as mermaid. */
export const renderDiagram = (): string => {
  const edges = new Map<string, Set<string>>()
  for (const [, s] of samples) {
    for (const input of inputsFor(s)) {
      const t = step(s, input, defaultEnv, policy)
      if (t.state._tag === s._tag) continue
      const key = `${s._tag} --> ${t.state._tag}`
      const set = edges.get(key) ?? new Set<string>()
      set.add(input._tag)
      edges.set(key, set)
    }
  }
  const lines = ["stateDiagram-v2", "    [*] --> Starting: create", "    [*] --> Passivated: daemon start"]
  for (const [key, inputs] of [...edges].sort(([a], [b]) => a.localeCompare(b))) lines.push(`    ${key}: ${[...inputs].join(", ")}`)
  return lines.join("\n")
}
