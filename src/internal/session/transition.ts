/**
 * A session's lifecycle as one immutable value (`State`) and one pure transition function
 * (`step`): no Effect, no clock, no I/O. What the world says when an input is taken (the time,
 * whether spawns wait for a worker slot, whether the generation has grown past its checkpoint
 * thresholds, whether storage takes writes again) arrives with it, in {@link Env}. Requests and
 * workers are named by plain ids; the caller keeps their Deferreds and handles.
 *
 * Owns: which phase follows which input, which requests each transition settles (and how),
 * what is published, journaled, sent and started as a consequence (`Action`), and the facts
 * that exist only in one phase (the reserved prompt, the cut turn owed its end, the checkpoint
 * waiters, the restart history, the storage stall). docs/session-core.md is its state diagram
 * and table, checked against this function by test/transition.table.test.ts; the simulation
 * in test/transition.sim.test.ts drives it with seeded random inputs and checks its invariants.
 *
 * The order of the actions returned is the order they are to be performed in.
 */

/** A request's handle (the caller maps it to the request's Deferred). */
export type ReqId = number
/** A worker process's handle (the caller maps it to its WorkerHandle). */
export type WorkerId = number

export type InterruptReason = "worker_crashed" | "aborted" | "daemon_restarted" | "daemon_shutdown" | "storage_failed"
/** How a turn ended. */
export type TurnEnd = "agent_end" | InterruptReason

/** A prompt that reserved the session (it is busy) and waits to start its turn. */
export interface Prompt {
  readonly req: ReqId
  readonly message: string
}

/**
 * Where a cut turn's end stands: its `turn_interrupted` is owed (the supervisor or the restored
 * worker says it), or it is out and the `busy: false` status that must come next is owed.
 */
export type CutTurn =
  | { readonly _tag: "InterruptOwed"; readonly reason: InterruptReason }
  | { readonly _tag: "StatusOwed" }

/** The restart policy (a crash within the window counts; past `maxRestarts` the session fails). */
export interface RestartPolicy {
  readonly maxRestarts: number
  readonly restartWindowMs: number
  readonly backoffBaseMs: number
}

/** True in every phase of a live session. */
interface Base {
  /** Bumped at every worker start and stop: inputs of an older attempt are ignored. */
  readonly epoch: number
  /** Turns started so far (names the next turn). */
  readonly turns: number
  /** Restarts so far (shown in the summary). */
  readonly restarts: number
  /** The restart history: the crash times still inside the policy's window. */
  readonly crashes: ReadonlyArray<number>
  /** The daemon stops: nothing new starts. */
  readonly stopping: boolean
}

/** What waits for a worker that is not there yet. */
interface Waiting {
  /** A prompt that reserved the session; its turn starts once a worker is ready. */
  readonly reserved: Prompt | undefined
  /** A turn cut by a crash (of the worker, the daemon or storage) whose end is owed. */
  readonly cut: CutTurn | undefined
  /** A prompt that came while a cut turn waited for its end: reserved once that end is out. */
  readonly afterCut: Prompt | undefined
  /** Checkpoints asked for, taken once the session is between turns. */
  readonly checkpoints: ReadonlyArray<ReqId>
  /** `retry_worker` requests answered once the worker is ready. */
  readonly retries: ReadonlyArray<ReqId>
}

export type State =
  /**
   * A worker is being acquired (`worker` undefined: waiting for a slot or spawning; `backoff`: a
   * restart waits for its timer) or loaded (`worker` set, its `worker_ready` not in yet).
   */
  | ({
    readonly _tag: "Starting"
    readonly worker: WorkerId | undefined
    readonly state: "starting" | "recovering"
    readonly backoff: boolean
  } & Base & Waiting)
  /** A worker is ready and nothing waits (work that waits for an idle session ran at once). */
  | ({ readonly _tag: "Idle"; readonly worker: WorkerId } & Base)
  | ({
    readonly _tag: "Running"
    readonly worker: WorkerId
    readonly turn: number
    /** Aborts answered at the turn's end, with how it ended. */
    readonly aborts: ReadonlyArray<ReqId>
    /** Checkpoints asked for during the turn: taken at its end. */
    readonly checkpoints: ReadonlyArray<ReqId>
    /** A history rewrite the worker streams. */
    readonly rewrite: boolean
    /** The daemon's stop waits for this turn to be cut (the waits to release at its end). */
    readonly shutdown: ReadonlyArray<ReqId>
  } & Base)
  /** No worker; the next prompt or checkpoint wakes the session (a checkpoint needs none). */
  | ({ readonly _tag: "Passivated" } & Base)
  /** The worker kept crashing (or could not be spawned): nothing runs until `retry_worker`. */
  | ({ readonly _tag: "Failed" } & Base)
  /**
   * Storage refused a write the session depended on: no worker, prompts refused, the summary
   * frozen at what the stream last showed (`shown`) until the owed end (if any) and its status
   * are logged; then a worker restores the session.
   */
  | ({
    readonly _tag: "Stalled"
    readonly shown: { readonly busy: boolean; readonly worker: WorkerState }
    readonly cut: CutTurn | undefined
    readonly checkpoints: ReadonlyArray<ReqId>
    readonly retries: ReadonlyArray<ReqId>
  } & Base)
  | ({ readonly _tag: "Closed" } & Base)

export type Phase = State["_tag"]
export type WorkerState = "starting" | "ready" | "recovering" | "passivated" | "failed" | "closed"

/** What the world says as an input is taken (read by whoever feeds `step`). */
export interface Env {
  /** The time, in ms (restart history). */
  readonly now: number
  /** Spawns wait for a worker slot: a session between turns gives its worker up. */
  readonly slotsWanted: boolean
  /** The generation has grown past the checkpoint thresholds (read at a turn's end). */
  readonly generationFull: boolean
  /** Storage takes writes again (read when a stalled session retries). */
  readonly storageOk: boolean
}

export const defaultEnv: Env = { now: 0, slotsWanted: false, generationFull: false, storageOk: true }

export type Input =
  // Commands, each with its request.
  | { readonly _tag: "Prompt"; readonly req: ReqId; readonly message: string }
  | { readonly _tag: "Abort"; readonly req: ReqId }
  | { readonly _tag: "Checkpoint"; readonly req: ReqId }
  | { readonly _tag: "Retry"; readonly req: ReqId }
  | { readonly _tag: "Kill"; readonly req: ReqId }
  /** Give up the worker if between turns (another session waits for a slot). */
  | { readonly _tag: "Passivate" }
  /** The daemon stops; `done` is released once no turn runs; `force`: cut it here. */
  | { readonly _tag: "ShuttingDown"; readonly done: ReqId; readonly force: boolean }
  /** At daemon start: the session was running a turn when the last daemon died. */
  | { readonly _tag: "Restore" }
  // The worker's acquisition.
  | { readonly _tag: "Acquired"; readonly epoch: number; readonly worker: WorkerId }
  | { readonly _tag: "AcquireFailed"; readonly epoch: number }
  // The worker's frames and exit.
  /** Events that change no lifecycle fact (message_update, tool steps...): passed through. */
  | { readonly _tag: "Events"; readonly worker: WorkerId }
  /** `agent_end` or `turn_interrupted`. */
  | { readonly _tag: "TurnEnded"; readonly worker: WorkerId; readonly how: TurnEnd }
  | { readonly _tag: "Ready"; readonly worker: WorkerId }
  | { readonly _tag: "WorkerError"; readonly worker: WorkerId }
  | { readonly _tag: "Rewrite"; readonly worker: WorkerId; readonly part: "begin" | "end" | "failed" }
  /** The worker's process exited (`asked`: it was stopped). */
  | { readonly _tag: "Exited"; readonly worker: WorkerId; readonly asked: boolean }
  // Timers.
  | { readonly _tag: "RestartDue"; readonly epoch: number }
  | { readonly _tag: "StorageRetry"; readonly epoch: number }
  // Storage.
  /** A write the session depended on failed (the event log or the journal). */
  | { readonly _tag: "StorageFailed" }

export type InputTag = Input["_tag"]

/** Why a request failed (the wire's code is chosen at the server edge). */
export type RequestError = "SessionNotFound" | "SessionBusy" | "SessionFailed" | "StorageUnavailable" | "ShuttingDown"

/** A request's answer. */
export type Settlement =
  | { readonly _tag: "Ok"; readonly value: "accepted" | "aborted" | "not_aborted" | "summary" }
  | { readonly _tag: "Error"; readonly error: RequestError; readonly detail?: "stalled" | "failed" }

export type Action =
  /** Publish the session's status: its summary at that point of the transition. */
  | { readonly _tag: "PublishStatus"; readonly busy: boolean; readonly worker: WorkerState }
  /** Publish the worker's events (a turn's end among them). */
  | { readonly _tag: "PublishEvents"; readonly end?: TurnEnd }
  /** Publish `turn_interrupted` for a cut turn, said by the supervisor. */
  | { readonly _tag: "PublishInterrupt"; readonly reason: InterruptReason }
  | { readonly _tag: "PublishClosed" }
  /** A journal record (`required`: a failure is a storage failure of the step). */
  | { readonly _tag: "Journal"; readonly busy: boolean; readonly op: string; readonly required: boolean }
  | { readonly _tag: "SendAbort"; readonly worker: WorkerId; readonly turn: number; readonly reason: "aborted" | "daemon_shutdown" }
  /** Make the prompt's turn durable (journal busy, busy status), send it, settle `req`: accepted, or refused storage_unavailable. */
  | { readonly _tag: "StartTurn"; readonly worker: WorkerId; readonly turn: number; readonly prompt: Prompt }
  | {
    readonly _tag: "StartWorker"
    readonly epoch: number
    readonly state: "starting" | "recovering"
    readonly restore: boolean
    readonly interruptedReason: InterruptReason | undefined
  }
  /** Pump the acquired worker's frames into the mailbox. */
  | { readonly _tag: "Pump"; readonly worker: WorkerId }
  | { readonly _tag: "StopWorker"; readonly worker: WorkerId }
  /** The worker cannot load its session: killed, its exit is a crash. */
  | { readonly _tag: "KillWorker"; readonly worker: WorkerId }
  /** The worker gives up its slot (passivation): counted on its way out. */
  | { readonly _tag: "SlotLeaving"; readonly worker: WorkerId }
  | { readonly _tag: "Settle"; readonly req: ReqId; readonly result: Settlement }
  /** Take a checkpoint and settle `waiters` with its outcome. */
  | { readonly _tag: "RunCheckpoint"; readonly waiters: ReadonlyArray<ReqId> }
  /** Before a passivation: what the generation added goes to the transcript. */
  | { readonly _tag: "CheckpointIfGrown" }
  | { readonly _tag: "RewriteFrame"; readonly part: "begin" | "end" }
  | { readonly _tag: "AbandonRewrite" }
  | { readonly _tag: "ScheduleRestart"; readonly epoch: number; readonly delayMs: number }
  | { readonly _tag: "ScheduleStorageRetry"; readonly epoch: number }
  /** The session's scope closes (its fibers end; an acquisition is interrupted). */
  | { readonly _tag: "CloseScope" }
  /** `kill`: the files move to the archive, then `req` is settled. */
  | { readonly _tag: "Archive"; readonly req: ReqId }
  /** A wait of the daemon's stop is released. */
  | { readonly _tag: "ShutdownDone"; readonly done: ReqId }

export type ActionTag = Action["_tag"]

export interface Transition {
  readonly state: State
  readonly actions: ReadonlyArray<Action>
}

// ---------------------------------------------------------------------------------------------
// Functions of the state
// ---------------------------------------------------------------------------------------------

/** Whether the session is busy: a prompt reserved or waiting, a turn running or owed its end. */
export const busyOf = (s: State): boolean => {
  switch (s._tag) {
    case "Running":
      return true
    case "Starting":
      return s.reserved !== undefined || s.cut !== undefined || s.afterCut !== undefined
    case "Stalled":
      return s.shown.busy
    default:
      return false
  }
}

/** The worker state the session shows. */
export const workerStateOf = (s: State): WorkerState => {
  switch (s._tag) {
    case "Starting":
      return s.state
    case "Idle":
    case "Running":
      return "ready"
    case "Passivated":
      return "passivated"
    case "Failed":
      return "failed"
    case "Stalled":
      return s.shown.worker
    case "Closed":
      return "closed"
  }
}

/** The session's worker, if it has one. */
export const workerOf = (s: State): WorkerId | undefined =>
  s._tag === "Idle" || s._tag === "Running" || s._tag === "Starting" ? s.worker : undefined

/** The requests the state holds unanswered (they are answered when it leaves them). */
export const heldRequests = (s: State): ReadonlyArray<ReqId> => {
  switch (s._tag) {
    case "Starting": {
      const out: Array<ReqId> = [...s.checkpoints, ...s.retries]
      if (s.reserved !== undefined) out.push(s.reserved.req)
      if (s.afterCut !== undefined) out.push(s.afterCut.req)
      return out
    }
    case "Running":
      return [...s.aborts, ...s.checkpoints]
    case "Stalled":
      return [...s.checkpoints, ...s.retries]
    default:
      return []
  }
}

/** What the state waits for: the inputs, besides commands, that move it on. */
export const awaits = (s: State): ReadonlyArray<InputTag> => {
  switch (s._tag) {
    case "Starting":
      return s.backoff ? ["RestartDue"] : s.worker === undefined ? ["Acquired", "AcquireFailed"] : ["Ready", "WorkerError", "Exited"]
    case "Idle":
      return ["Exited"]
    case "Running":
      return ["TurnEnded", "Exited"]
    case "Stalled":
      return ["StorageRetry"]
    case "Passivated":
    case "Failed":
    case "Closed":
      return []
  }
}

// ---------------------------------------------------------------------------------------------
// step
// ---------------------------------------------------------------------------------------------

/** A new session whose first worker is being started (`StartWorker` done by its creator). */
export const initial: State = {
  _tag: "Starting",
  worker: undefined,
  state: "starting",
  backoff: false,
  epoch: 1,
  turns: 0,
  restarts: 0,
  crashes: [],
  stopping: false,
  reserved: undefined,
  cut: undefined,
  afterCut: undefined,
  checkpoints: [],
  retries: []
}

/** A session loaded at daemon start, without a worker. */
export const loaded: State = {
  _tag: "Passivated",
  epoch: 0,
  turns: 0,
  restarts: 0,
  crashes: [],
  stopping: false
}

const base = (s: State): Base => ({ epoch: s.epoch, turns: s.turns, restarts: s.restarts, crashes: s.crashes, stopping: s.stopping })

const noWaiting: Waiting = { reserved: undefined, cut: undefined, afterCut: undefined, checkpoints: [], retries: [] }

const waitingOf = (s: State): Waiting => {
  switch (s._tag) {
    case "Starting":
      return { reserved: s.reserved, cut: s.cut, afterCut: s.afterCut, checkpoints: s.checkpoints, retries: s.retries }
    case "Running":
      return { ...noWaiting, checkpoints: s.checkpoints }
    case "Stalled":
      return { ...noWaiting, cut: s.cut, checkpoints: s.checkpoints, retries: s.retries }
    default:
      return noWaiting
  }
}

const ok = (req: ReqId, value: "accepted" | "aborted" | "not_aborted" | "summary"): Action => ({
  _tag: "Settle",
  req,
  result: { _tag: "Ok", value }
})
const err = (req: ReqId, error: RequestError, detail?: "stalled" | "failed"): Action => ({
  _tag: "Settle",
  req,
  result: detail === undefined ? { _tag: "Error", error } : { _tag: "Error", error, detail }
})
/** The status that says `s`. */
const status = (s: State): Action => ({ _tag: "PublishStatus", busy: busyOf(s), worker: workerStateOf(s) })
const NOTHING: ReadonlyArray<Action> = []

/**
 * Takes every request that waits for a worker or a turn's end, answered `error`: the reserved
 * prompt, a prompt after a cut turn, checkpoints, retries.
 */
const answerWaiting = (w: Waiting, error: RequestError, out: Array<Action>) => {
  if (w.reserved !== undefined) out.push(err(w.reserved.req, error))
  if (w.afterCut !== undefined) out.push(err(w.afterCut.req, error))
  for (const r of w.checkpoints) out.push(err(r, error))
  for (const r of w.retries) out.push(err(r, error))
}

/** Releases the daemon stop's waits once no turn runs. */
const releaseShutdown = (from: State, to: State, out: Array<Action>) => {
  if (from._tag === "Running" && to._tag !== "Running") for (const d of from.shutdown) out.push({ _tag: "ShutdownDone", done: d })
}

/** Starts a worker: the acquisition runs beside the entity and comes back as Acquired/AcquireFailed. */
const startWorker = (
  s: State,
  state: "starting" | "recovering",
  w: Waiting,
  out: Array<Action>
): State => {
  const epoch = s.epoch + 1
  const next: State = { ...base(s), _tag: "Starting", worker: undefined, state, backoff: false, epoch, ...w }
  if (workerStateOf(s) !== state) out.push(status(next))
  out.push({
    _tag: "StartWorker",
    epoch,
    state,
    restore: true,
    interruptedReason: w.cut?._tag === "InterruptOwed" ? w.cut.reason : undefined
  })
  return next
}

/**
 * Publishes the status that ends a cut turn (the state `to` has no cut any more): a prompt that
 * waited for it is reserved then, and said so by a status of its own unless its turn starts
 * right away (Idle).
 */
const endCutTurn = (to: State, afterCut: Prompt | undefined, out: Array<Action>): State => {
  out.push(status(to))
  if (afterCut === undefined || to._tag !== "Starting") return to
  const reserved: State = { ...to, reserved: afterCut, afterCut: undefined }
  out.push(status(reserved))
  return reserved
}

/** The running turn ended (its end event is out): the journal says idle, the idle status follows. */
const endTurn = (s: Extract<State, { _tag: "Running" }>, how: TurnEnd, env: Env, out: Array<Action>): State => {
  out.push({ _tag: "Journal", busy: false, op: "turn_end", required: false })
  const idle: State = { ...base(s), _tag: "Idle", worker: s.worker }
  out.push(status(idle))
  for (const a of s.aborts) out.push(ok(a, how === "aborted" ? "aborted" : "not_aborted"))
  // Checkpoints asked during the turn, or due: taken now (the drain after the input).
  if (s.checkpoints.length > 0 || env.generationFull) out.push({ _tag: "RunCheckpoint", waiters: s.checkpoints })
  return idle
}

/** A worker exited without being asked (or could not be spawned): restored on the schedule, or failed. */
const crash = (s: State, policy: RestartPolicy, env: Env, out: Array<Action>): State => {
  const recent = [...s.crashes.filter((t) => env.now - t < policy.restartWindowMs), env.now]
  const counted = { ...s, restarts: s.restarts + 1, crashes: recent } as State
  if (recent.length > policy.maxRestarts) return failSession(counted, waitingOf(s), out)
  let w = waitingOf(s)
  if (s._tag === "Running") {
    w = { ...w, cut: { _tag: "InterruptOwed", reason: "worker_crashed" } }
    if (s.rewrite) out.push({ _tag: "AbandonRewrite" })
    for (const a of s.aborts) out.push(ok(a, "not_aborted"))
  }
  const epoch = s.epoch + 1
  const delayMs = recent.length <= 1 ? 0 : policy.backoffBaseMs * 2 ** (recent.length - 2)
  let next: State = {
    ...base(counted),
    _tag: "Starting",
    worker: undefined,
    state: "recovering",
    backoff: delayMs > 0,
    epoch,
    ...w
  }
  // A replacement that crashed after reporting the cut turn: this status ends that turn.
  if (w.cut?._tag === "StatusOwed") next = endCutTurn({ ...next, cut: undefined, afterCut: undefined }, w.afterCut, out)
  else out.push(status(next))
  releaseShutdown(s, next, out)
  if (delayMs === 0) return startWorker(next, "recovering", waitingOf(next), out)
  out.push({ _tag: "ScheduleRestart", epoch, delayMs })
  return next
}

/**
 * The session cannot run: every request waiting on a worker is answered, a cut turn not reported
 * yet is reported, the session is `failed` until `retry_worker`.
 */
const failSession = (s: State, w: Waiting, out: Array<Action>): State => {
  const worker = workerOf(s)
  const cut = s._tag === "Running" ? "worker_crashed" as const : w.cut?._tag === "InterruptOwed" ? w.cut.reason : undefined
  if (s._tag === "Running" && s.rewrite) out.push({ _tag: "AbandonRewrite" })
  const next: State = { ...base(s), _tag: "Failed", epoch: s.epoch + 1 }
  answerWaiting(w, "SessionFailed", out)
  if (s._tag === "Running") for (const a of s.aborts) out.push(ok(a, "not_aborted"))
  if (worker !== undefined) out.push({ _tag: "StopWorker", worker })
  if (cut !== undefined) {
    out.push({ _tag: "PublishInterrupt", reason: cut })
    out.push({ _tag: "Journal", busy: false, op: "failed", required: false })
  }
  out.push(status(next))
  releaseShutdown(s, next, out)
  return next
}

/** Storage refused a write the session depended on: the session stalls (see `Stalled`). */
const stall = (s: State, out: Array<Action>): State => {
  const w = waitingOf(s)
  let cut = w.cut
  if (s._tag === "Running") {
    if (cut === undefined) cut = { _tag: "InterruptOwed", reason: "storage_failed" }
    for (const a of s.aborts) out.push(ok(a, "not_aborted"))
    if (s.rewrite) out.push({ _tag: "AbandonRewrite" })
  }
  const epoch = s.epoch + 1
  const next: State = {
    ...base(s),
    _tag: "Stalled",
    epoch,
    shown: { busy: busyOf(s), worker: workerStateOf(s) },
    cut,
    checkpoints: w.checkpoints,
    retries: w.retries
  }
  // A prompt waiting to start cannot be made durable now: refused.
  if (w.afterCut !== undefined) out.push(err(w.afterCut.req, "StorageUnavailable"))
  if (w.reserved !== undefined) out.push(err(w.reserved.req, "StorageUnavailable"))
  const worker = workerOf(s)
  if (worker !== undefined) out.push({ _tag: "StopWorker", worker })
  out.push({ _tag: "ScheduleStorageRetry", epoch })
  releaseShutdown(s, next, out)
  return next
}

/** The daemon stops with a turn running that the worker did not cut: cut here, the worker stopped. */
const cutForShutdown = (s: Extract<State, { _tag: "Running" }>, out: Array<Action>): State => {
  if (s.rewrite) out.push({ _tag: "AbandonRewrite" })
  const next: State = { ...base(s), _tag: "Passivated", epoch: s.epoch + 1 }
  out.push({ _tag: "PublishInterrupt", reason: "daemon_shutdown" })
  out.push({ _tag: "Journal", busy: false, op: "turn_end", required: false })
  out.push(status(next))
  for (const a of s.aborts) out.push(ok(a, "not_aborted"))
  out.push({ _tag: "StopWorker", worker: s.worker })
  releaseShutdown(s, next, out)
  return next
}

/** Gives up the worker between turns. */
const passivate = (s: Extract<State, { _tag: "Idle" }>, out: Array<Action>): State => {
  out.push({ _tag: "SlotLeaving", worker: s.worker })
  out.push({ _tag: "CheckpointIfGrown" })
  out.push({ _tag: "StopWorker", worker: s.worker })
  const next: State = { ...base(s), _tag: "Passivated", epoch: s.epoch + 1 }
  out.push(status(next))
  return next
}

/**
 * Between turns, work waiting runs: a reserved prompt starts its turn, and a session that
 * another one waits a slot for gives its worker up. (Checkpoints run where they are asked:
 * an Idle or Passivated state holds none.)
 */
const drain = (s: State, env: Env, out: Array<Action>): State => {
  if (s.stopping || s._tag !== "Idle") return s
  if (env.slotsWanted) return passivate(s, out)
  return s
}

/** Starts the turn of `prompt` on an idle worker. */
const startTurn = (s: Extract<State, { _tag: "Idle" }>, prompt: Prompt, out: Array<Action>): State => {
  const turn = s.turns + 1
  out.push({ _tag: "StartTurn", worker: s.worker, turn, prompt })
  return { ...base(s), turns: turn, _tag: "Running", worker: s.worker, turn, aborts: [], checkpoints: [], rewrite: false, shutdown: [] }
}

/** `kill`: closed for everyone, the worker stops, what waits is answered, the files are archived. */
const kill = (s: State, req: ReqId, out: Array<Action>): State => {
  const worker = workerOf(s)
  out.push({ _tag: "PublishClosed" })
  const next: State = { ...base(s), _tag: "Closed", epoch: s.epoch + 1 }
  if (worker !== undefined) out.push({ _tag: "StopWorker", worker })
  out.push({ _tag: "CloseScope" })
  if (s._tag === "Running") {
    for (const a of s.aborts) out.push(err(a, "SessionNotFound"))
    if (s.rewrite) out.push({ _tag: "AbandonRewrite" })
  }
  answerWaiting(waitingOf(s), "SessionNotFound", out)
  releaseShutdown(s, next, out)
  out.push({ _tag: "Archive", req })
  return next
}

/**
 * One input, taken by the session's entity: the next state and what to do, in order.
 * Pure: the same state, input and env always give the same transition.
 */
export const step = (s: State, input: Input, env: Env, policy: RestartPolicy): Transition => {
  // The hot path: events of the current worker pass through, nothing else changes.
  if (input._tag === "Events" && !(s._tag === "Idle" && env.slotsWanted)) {
    return { state: s, actions: workerOf(s) === input.worker ? EVENTS : NOTHING }
  }
  const out: Array<Action> = []
  const next = drain(take(s, input, env, policy, out), env, out)
  return { state: next, actions: out }
}

const EVENTS: ReadonlyArray<Action> = [{ _tag: "PublishEvents" }]

const take = (s: State, input: Input, env: Env, policy: RestartPolicy, out: Array<Action>): State => {
  if (s._tag === "Closed") return takeClosed(input, out) ?? s
  switch (input._tag) {
    case "Prompt": {
      const prompt: Prompt = { req: input.req, message: input.message }
      if (s.stopping) return out.push(err(input.req, "ShuttingDown")), s
      if (s._tag === "Failed") return out.push(err(input.req, "SessionFailed", "failed")), s
      if (s._tag === "Stalled") return out.push(err(input.req, "StorageUnavailable", "stalled")), s
      if (s._tag === "Running" || (s._tag === "Starting" && (s.reserved !== undefined || s.afterCut !== undefined))) {
        return out.push(err(input.req, "SessionBusy")), s
      }
      if (s._tag === "Starting") {
        // The worker recovers from a crash that cut a turn: the prompt waits for that turn's end.
        if (s.cut !== undefined) return { ...s, afterCut: prompt }
        const reserved: State = { ...s, reserved: prompt }
        out.push(status(reserved))
        return reserved
      }
      if (s._tag === "Passivated") return startWorker(s, "starting", { ...noWaiting, reserved: prompt }, out)
      return startTurn(s, prompt, out)
    }
    case "Abort": {
      // Only a running turn can be aborted; a prompt that has not started yet is not a turn.
      if (s._tag !== "Running") return out.push(ok(input.req, "not_aborted")), s
      out.push({ _tag: "SendAbort", worker: s.worker, turn: s.turn, reason: "aborted" })
      return { ...s, aborts: [...s.aborts, input.req] }
    }
    case "Checkpoint": {
      if (s._tag === "Failed") return out.push(err(input.req, "SessionFailed", "failed")), s
      // Between turns it needs no worker: taken now. Else once the session is between turns.
      if (s._tag === "Idle" || s._tag === "Passivated") {
        if (s.stopping) return out.push(err(input.req, "ShuttingDown")), s
        return out.push({ _tag: "RunCheckpoint", waiters: [input.req] }), s
      }
      return { ...s, checkpoints: [...s.checkpoints, input.req] }
    }
    case "Retry": {
      if (s._tag !== "Failed") return out.push(ok(input.req, "summary")), s
      if (s.stopping) return out.push(err(input.req, "ShuttingDown")), s
      return startWorker({ ...s, crashes: [] }, "recovering", { ...noWaiting, retries: [input.req] }, out)
    }
    case "Kill":
      return kill(s, input.req, out)
    case "Passivate":
      return s._tag === "Idle" && !s.stopping ? passivate(s, out) : s
    case "ShuttingDown":
      return shuttingDown(s, input, out)
    case "Restore": {
      if (s._tag !== "Passivated") return s
      return startWorker(s, "recovering", { ...noWaiting, cut: { _tag: "InterruptOwed", reason: "daemon_restarted" } }, out)
    }
    case "Acquired": {
      if (s._tag !== "Starting" || s.epoch !== input.epoch || s.worker !== undefined || s.backoff) {
        return out.push({ _tag: "StopWorker", worker: input.worker }), s
      }
      out.push({ _tag: "Pump", worker: input.worker })
      return { ...s, worker: input.worker }
    }
    case "AcquireFailed": {
      // A spawn refused because the daemon stops is no crash; one that fails otherwise is.
      if (s._tag !== "Starting" || s.epoch !== input.epoch || s.worker !== undefined || s.stopping) return s
      return crash(s, policy, env, out)
    }
    case "RestartDue": {
      if (s._tag !== "Starting" || s.epoch !== input.epoch || !s.backoff || s.stopping) return s
      return startWorker(s, "recovering", waitingOf(s), out)
    }
    case "StorageRetry": {
      if (s._tag !== "Stalled" || s.epoch !== input.epoch || s.stopping) return s
      if (!env.storageOk) return out.push({ _tag: "ScheduleStorageRetry", epoch: s.epoch }), s
      // The owed end, then the journal's idle record (before a worker restores: a journal still
      // saying busy would have it report the turn cut once more), then its status.
      if (s.cut?._tag === "InterruptOwed") out.push({ _tag: "PublishInterrupt", reason: s.cut.reason })
      out.push({ _tag: "Journal", busy: false, op: "turn_end", required: true })
      const recovering: State = {
        ...base(s),
        _tag: "Starting",
        worker: undefined,
        state: "recovering",
        backoff: false,
        ...noWaiting,
        checkpoints: s.checkpoints,
        retries: s.retries
      }
      out.push(status(recovering))
      return startWorker(recovering, "recovering", waitingOf(recovering), out)
    }
    case "Events":
      if (workerOf(s) === input.worker) out.push({ _tag: "PublishEvents" })
      return s
    case "TurnEnded": {
      if (workerOf(s) !== input.worker) return s
      if (s._tag === "Running") {
        out.push({ _tag: "PublishEvents", end: input.how })
        const next = endTurn(s, input.how, env, out)
        releaseShutdown(s, next, out)
        return next
      }
      // A restored worker reports the turn its predecessor was cut in: its end is out, the
      // journal says idle; the session stays busy until the status that ends it.
      if (s._tag === "Starting" && s.cut?._tag === "InterruptOwed") {
        out.push({ _tag: "PublishEvents", end: input.how })
        out.push({ _tag: "Journal", busy: false, op: "turn_end", required: false })
        return { ...s, cut: { _tag: "StatusOwed" } }
      }
      // An agent_end outside a turn passes as an event; a cut turn reported that no turn is
      // owed (its end is logged already) is not published: a second end would be a lie.
      if (input.how === "agent_end") out.push({ _tag: "PublishEvents" })
      return s
    }
    case "Ready": {
      if (s._tag !== "Starting" || s.worker !== input.worker) return s
      // The turn cut by a crash ends before the worker is ready, whatever the worker said.
      if (s.cut?._tag === "InterruptOwed") {
        out.push({ _tag: "PublishInterrupt", reason: s.cut.reason })
        out.push({ _tag: "Journal", busy: false, op: "turn_end", required: false })
      }
      const idle: State = { ...base(s), _tag: "Idle", worker: s.worker }
      const next: State = idle
      // The `ready` status (busy with a reserved prompt, whose turn starts next); with a cut
      // turn it is the status that ends that turn (busy false), and a prompt that waited runs next.
      if (s.cut === undefined) out.push({ _tag: "PublishStatus", busy: s.reserved !== undefined, worker: "ready" })
      else endCutTurn(idle, undefined, out)
      for (const r of s.retries) out.push(ok(r, "summary"))
      const prompt = s.reserved ?? s.afterCut
      // Between turns: a checkpoint first, then the reserved prompt.
      if (s.checkpoints.length > 0 || (s.cut !== undefined && env.generationFull)) {
        if (s.stopping) for (const r of s.checkpoints) out.push(err(r, "ShuttingDown"))
        else out.push({ _tag: "RunCheckpoint", waiters: s.checkpoints })
      }
      if (prompt !== undefined) {
        if (s.stopping) return out.push(err(prompt.req, "ShuttingDown")), next
        return startTurn(idle, prompt, out)
      }
      return next
    }
    case "WorkerError": {
      // A worker that cannot load its session is as good as crashed.
      if (s._tag === "Starting" && s.worker === input.worker) out.push({ _tag: "KillWorker", worker: input.worker })
      return s
    }
    case "Rewrite": {
      if (s._tag !== "Running" || s.worker !== input.worker) return s
      if (input.part === "begin") {
        if (s.rewrite) return rewriteNotKept(s, out)
        out.push({ _tag: "RewriteFrame", part: "begin" })
        return { ...s, rewrite: true }
      }
      if (input.part === "end" && s.rewrite) {
        out.push({ _tag: "RewriteFrame", part: "end" })
        return { ...s, rewrite: false }
      }
      return rewriteNotKept(s, out)
    }
    case "Exited": {
      if (workerOf(s) !== input.worker || input.asked) return s
      // The daemon stops (its workers are on their way out): no crash, no restore; a turn still
      // running ends `daemon_shutdown`.
      if (s.stopping) return s._tag === "Running" ? cutForShutdown(s, out) : s
      return crash(s, policy, env, out)
    }
    case "StorageFailed": {
      if (s._tag === "Failed") return s
      if (s._tag === "Stalled") return out.push({ _tag: "ScheduleStorageRetry", epoch: s.epoch }), s
      return stall(s, out)
    }
  }
}

/** A rewrite that cannot be kept: its entry goes, the worker is killed (its replacement restores the files). */
const rewriteNotKept = (s: Extract<State, { _tag: "Running" }>, out: Array<Action>): State => {
  out.push({ _tag: "AbandonRewrite" })
  out.push({ _tag: "KillWorker", worker: s.worker })
  return { ...s, rewrite: false }
}

/** The daemon stops: what waits is answered `shutting_down`, a running turn is cut. */
const shuttingDown = (s: State, input: Extract<Input, { _tag: "ShuttingDown" }>, out: Array<Action>): State => {
  const stopping = { ...s, stopping: true } as State
  if (stopping._tag === "Running") {
    for (const a of stopping.aborts) out.push(err(a, "ShuttingDown"))
    for (const r of stopping.checkpoints) out.push(err(r, "ShuttingDown"))
    const running = { ...stopping, aborts: [], checkpoints: [], shutdown: [...stopping.shutdown, input.done] }
    if (input.force) return cutForShutdown(running, out)
    out.push({ _tag: "SendAbort", worker: running.worker, turn: running.turn, reason: "daemon_shutdown" })
    return running
  }
  const w = waitingOf(stopping)
  answerWaiting(w, "ShuttingDown", out)
  let next: State = stopping
  if (stopping._tag === "Starting") next = { ...stopping, reserved: undefined, afterCut: undefined, checkpoints: [], retries: [] }
  if (stopping._tag === "Stalled") next = { ...stopping, checkpoints: [], retries: [] }
  // A turn cut by a crash still waiting for its end: said now, with its reason, and the status
  // that ends it; the worker being restored is stopped. The journal says idle.
  if (w.cut !== undefined) {
    const worker = workerOf(stopping)
    if (w.cut._tag === "InterruptOwed") {
      out.push({ _tag: "PublishInterrupt", reason: w.cut.reason })
      out.push({ _tag: "Journal", busy: false, op: "turn_end", required: false })
    }
    next = { ...base(stopping), _tag: "Passivated", epoch: stopping.epoch + 1 }
    out.push(status(next))
    if (worker !== undefined) out.push({ _tag: "StopWorker", worker })
  }
  out.push({ _tag: "ShutdownDone", done: input.done })
  return next
}

/** A closed session: every command is answered `session_not_found`; a late worker is stopped. */
const takeClosed = (input: Input, out: Array<Action>): State | undefined => {
  switch (input._tag) {
    case "Prompt":
    case "Abort":
    case "Checkpoint":
    case "Retry":
    case "Kill":
      out.push(err(input.req, "SessionNotFound"))
      return
    case "Acquired":
      out.push({ _tag: "StopWorker", worker: input.worker })
      return
    case "ShuttingDown":
      out.push({ _tag: "ShutdownDone", done: input.done })
      return
    default:
      return
  }
}
