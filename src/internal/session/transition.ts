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
  /** A forwarded prompt's id (cluster mode): its turn's first status carries it (docs/cluster.md section 3). */
  readonly promptId?: string | undefined
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
  | { readonly _tag: "Prompt"; readonly req: ReqId; readonly message: string; readonly promptId?: string | undefined }
  | { readonly _tag: "Abort"; readonly req: ReqId }
  | { readonly _tag: "Checkpoint"; readonly req: ReqId }
  | { readonly _tag: "Retry"; readonly req: ReqId }
  | { readonly _tag: "Kill"; readonly req: ReqId }
  /** A new name for the session (no lifecycle fact: the same in every live phase). */
  | { readonly _tag: "Rename"; readonly req: ReqId; readonly name: string }
  /** Give up the worker if between turns (another session waits for a slot). */
  | { readonly _tag: "Passivate" }
  /** The daemon stops; `done` is released once no turn runs; `force`: cut it here. */
  | { readonly _tag: "ShuttingDown"; readonly done: ReqId; readonly force: boolean }
  /** At daemon start: the session was running a turn when the last daemon died. */
  | { readonly _tag: "Restore" }
  // The worker's acquisition.
  | { readonly _tag: "Acquired"; readonly epoch: number; readonly worker: WorkerId }
  | { readonly _tag: "AcquireFailed"; readonly epoch: number }
  /**
   * The turn `StartTurn` began could not be made durable: its prompt was refused. `shownBusy`:
   * the stream shows the session busy (the prompt was reserved before the worker was ready).
   */
  | { readonly _tag: "TurnRefused"; readonly turn: number; readonly shownBusy: boolean }
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
  /**
   * Make the prompt's turn durable (journal busy, busy status), send it to the worker and settle
   * its request accepted; or, should storage refuse, settle it storage_unavailable and feed
   * `TurnRefused` back.
   */
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
  /**
   * Claim the name (unless another session has it), make it durable in the session's metadata,
   * then settle `req` with the summary (or `name_taken`, or the store's failure).
   */
  | { readonly _tag: "Rename"; readonly req: ReqId; readonly name: string }

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

// The states are built field by field, never spread: the shapes stay few and fixed (object
// spread of these records is slow in V8, and the simulation runs step by the million).
type Running = Extract<State, { _tag: "Running" }>
type Starting = Extract<State, { _tag: "Starting" }>

const baseWith = (b: Base, epoch: number, turns = b.turns): Base => ({
  epoch,
  turns,
  restarts: b.restarts,
  crashes: b.crashes,
  stopping: b.stopping
})

const starting = (b: Base, worker: WorkerId | undefined, state: "starting" | "recovering", backoff: boolean, w: Waiting): State => ({
  _tag: "Starting",
  worker,
  state,
  backoff,
  epoch: b.epoch,
  turns: b.turns,
  restarts: b.restarts,
  crashes: b.crashes,
  stopping: b.stopping,
  reserved: w.reserved,
  cut: w.cut,
  afterCut: w.afterCut,
  checkpoints: w.checkpoints,
  retries: w.retries
})

const idleOn = (b: Base, worker: WorkerId): State => ({
  _tag: "Idle",
  worker,
  epoch: b.epoch,
  turns: b.turns,
  restarts: b.restarts,
  crashes: b.crashes,
  stopping: b.stopping
})

const running = (
  b: Base,
  worker: WorkerId,
  turn: number,
  aborts: ReadonlyArray<ReqId>,
  checkpoints: ReadonlyArray<ReqId>,
  rewrite: boolean,
  shutdown: ReadonlyArray<ReqId>
): Running => ({
  _tag: "Running",
  worker,
  turn,
  aborts,
  checkpoints,
  rewrite,
  shutdown,
  epoch: b.epoch,
  turns: b.turns,
  restarts: b.restarts,
  crashes: b.crashes,
  stopping: b.stopping
})

const without = (tag: "Passivated" | "Failed" | "Closed", b: Base): State => ({
  _tag: tag,
  epoch: b.epoch,
  turns: b.turns,
  restarts: b.restarts,
  crashes: b.crashes,
  stopping: b.stopping
})

const stalled = (
  b: Base,
  shown: { readonly busy: boolean; readonly worker: WorkerState },
  cut: CutTurn | undefined,
  checkpoints: ReadonlyArray<ReqId>,
  retries: ReadonlyArray<ReqId>
): State => ({
  _tag: "Stalled",
  shown,
  cut,
  checkpoints,
  retries,
  epoch: b.epoch,
  turns: b.turns,
  restarts: b.restarts,
  crashes: b.crashes,
  stopping: b.stopping
})

const waiting = (
  reserved: Prompt | undefined,
  cut: CutTurn | undefined,
  afterCut: Prompt | undefined,
  checkpoints: ReadonlyArray<ReqId>,
  retries: ReadonlyArray<ReqId>
): Waiting => ({ reserved, cut, afterCut, checkpoints, retries })

const NONE: ReadonlyArray<ReqId> = []
const noWaiting: Waiting = waiting(undefined, undefined, undefined, NONE, NONE)

const waitingOf = (s: State): Waiting => {
  switch (s._tag) {
    case "Starting":
      return s
    case "Running":
      return waiting(undefined, undefined, undefined, s.checkpoints, NONE)
    case "Stalled":
      return waiting(undefined, s.cut, undefined, s.checkpoints, s.retries)
    default:
      return noWaiting
  }
}

/** A new session whose first worker is being started (`StartWorker` done by its creator). */
export const initial: State = starting({ epoch: 1, turns: 0, restarts: 0, crashes: [], stopping: false }, undefined, "starting", false, noWaiting)

/** A session loaded at daemon start, without a worker. */
export const loaded: State = without("Passivated", { epoch: 0, turns: 0, restarts: 0, crashes: [], stopping: false })

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
/** The actions of an event of the current worker that changes nothing (the hot path: always this array). */
export const EVENTS: ReadonlyArray<Action> = [{ _tag: "PublishEvents" }]

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
const startWorker = (s: Base & { readonly _tag: Phase }, state: "starting" | "recovering", w: Waiting, out: Array<Action>): State => {
  const epoch = s.epoch + 1
  const next = starting(baseWith(s, epoch), undefined, state, false, w)
  if (workerStateOf(s as State) !== state) out.push(status(next))
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
  const reserved = starting(to, to.worker, to.state, to.backoff, waiting(afterCut, undefined, undefined, to.checkpoints, to.retries))
  out.push(status(reserved))
  return reserved
}

/** The running turn ended (its end event is out): the journal says idle, the idle status follows. */
const endTurn = (s: Running, how: TurnEnd, env: Env, out: Array<Action>): State => {
  out.push({ _tag: "Journal", busy: false, op: "turn_end", required: false })
  const idle = idleOn(s, s.worker)
  out.push(status(idle))
  for (const a of s.aborts) out.push(ok(a, how === "aborted" ? "aborted" : "not_aborted"))
  // Checkpoints asked during the turn, or due: taken now, between turns.
  if (s.checkpoints.length > 0 || env.generationFull) out.push({ _tag: "RunCheckpoint", waiters: s.checkpoints })
  return idle
}

/** A worker exited without being asked (or could not be spawned): restored on the schedule, or failed. */
const crash = (s: State, policy: RestartPolicy, env: Env, out: Array<Action>): State => {
  const recent = [...s.crashes.filter((t) => env.now - t < policy.restartWindowMs), env.now]
  const counted: Base = { epoch: s.epoch, turns: s.turns, restarts: s.restarts + 1, crashes: recent, stopping: s.stopping }
  if (recent.length > policy.maxRestarts) return failSession(s, counted, waitingOf(s), out)
  let w = waitingOf(s)
  if (s._tag === "Running") {
    w = waiting(w.reserved, { _tag: "InterruptOwed", reason: "worker_crashed" }, w.afterCut, w.checkpoints, w.retries)
    if (s.rewrite) out.push({ _tag: "AbandonRewrite" })
    for (const a of s.aborts) out.push(ok(a, "not_aborted"))
  }
  const epoch = s.epoch + 1
  const delayMs = recent.length <= 1 ? 0 : policy.backoffBaseMs * 2 ** (recent.length - 2)
  let next = starting(baseWith(counted, epoch), undefined, "recovering", delayMs > 0, w)
  // A replacement that crashed after reporting the cut turn: this status ends that turn.
  if (w.cut?._tag === "StatusOwed") {
    next = endCutTurn(starting(next, undefined, "recovering", delayMs > 0, waiting(w.reserved, undefined, undefined, w.checkpoints, w.retries)), w.afterCut, out)
  } else {
    out.push(status(next))
  }
  releaseShutdown(s, next, out)
  if (delayMs === 0) return startWorker(next, "recovering", waitingOf(next), out)
  out.push({ _tag: "ScheduleRestart", epoch, delayMs })
  return next
}

/**
 * The session cannot run: every request waiting on a worker is answered, a cut turn not reported
 * yet is reported, the session is `failed` until `retry_worker`.
 */
const failSession = (s: State, b: Base, w: Waiting, out: Array<Action>): State => {
  const worker = workerOf(s)
  const cut = s._tag === "Running" ? "worker_crashed" as const : w.cut?._tag === "InterruptOwed" ? w.cut.reason : undefined
  if (s._tag === "Running" && s.rewrite) out.push({ _tag: "AbandonRewrite" })
  const next = without("Failed", baseWith(b, s.epoch + 1))
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
  const next = stalled(baseWith(s, epoch), { busy: busyOf(s), worker: workerStateOf(s) }, cut, w.checkpoints, w.retries)
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
const cutForShutdown = (s: Running, out: Array<Action>): State => {
  if (s.rewrite) out.push({ _tag: "AbandonRewrite" })
  const next = without("Passivated", baseWith(s, s.epoch + 1))
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
  const next = without("Passivated", baseWith(s, s.epoch + 1))
  out.push(status(next))
  return next
}

/**
 * Between turns, work waiting runs: a session that another one waits a slot for gives its
 * worker up. (A reserved prompt starts its turn and a checkpoint runs where they are taken:
 * an Idle or Passivated state holds neither.)
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
  return running(baseWith(s, s.epoch, turn), s.worker, turn, NONE, NONE, false, NONE)
}

/** `kill`: closed for everyone, the worker stops, what waits is answered, the files are archived. */
const kill = (s: State, req: ReqId, out: Array<Action>): State => {
  const worker = workerOf(s)
  out.push({ _tag: "PublishClosed" })
  const next = without("Closed", baseWith(s, s.epoch + 1))
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
 * Pure: the same state, input, env and policy always give the same transition.
 */
export const step = (s: State, input: Input, env: Env, policy: RestartPolicy): Transition => {
  // The hot path: events of the current worker pass through, nothing else changes, nothing is
  // allocated.
  if (input._tag === "Events" && !(s._tag === "Idle" && env.slotsWanted)) {
    return { state: s, actions: workerOf(s) === input.worker ? EVENTS : NOTHING }
  }
  const out: Array<Action> = []
  const next = drain(take(s, input, env, policy, out), env, out)
  return { state: next, actions: out }
}

const take = (s: State, input: Input, env: Env, policy: RestartPolicy, out: Array<Action>): State => {
  if (s._tag === "Closed") return takeClosed(input, out) ?? s
  switch (input._tag) {
    case "Prompt": {
      const prompt: Prompt = { req: input.req, message: input.message, promptId: input.promptId }
      if (s.stopping) return out.push(err(input.req, "ShuttingDown")), s
      if (s._tag === "Failed") return out.push(err(input.req, "SessionFailed", "failed")), s
      if (s._tag === "Stalled") return out.push(err(input.req, "StorageUnavailable", "stalled")), s
      if (s._tag === "Running" || (s._tag === "Starting" && (s.reserved !== undefined || s.afterCut !== undefined))) {
        return out.push(err(input.req, "SessionBusy")), s
      }
      if (s._tag === "Starting") {
        // The worker recovers from a crash that cut a turn: the prompt waits for that turn's end.
        if (s.cut !== undefined) return starting(s, s.worker, s.state, s.backoff, waiting(undefined, s.cut, prompt, s.checkpoints, s.retries))
        const reserved = starting(s, s.worker, s.state, s.backoff, waiting(prompt, undefined, undefined, s.checkpoints, s.retries))
        out.push(status(reserved))
        return reserved
      }
      if (s._tag === "Passivated") return startWorker(s, "starting", waiting(prompt, undefined, undefined, NONE, NONE), out)
      return startTurn(s, prompt, out)
    }
    case "Abort": {
      // Only a running turn can be aborted; a prompt that has not started yet is not a turn.
      if (s._tag !== "Running") return out.push(ok(input.req, "not_aborted")), s
      out.push({ _tag: "SendAbort", worker: s.worker, turn: s.turn, reason: "aborted" })
      return running(s, s.worker, s.turn, [...s.aborts, input.req], s.checkpoints, s.rewrite, s.shutdown)
    }
    case "Checkpoint": {
      if (s._tag === "Failed") return out.push(err(input.req, "SessionFailed", "failed")), s
      // Between turns it needs no worker: taken now. Else once the session is between turns.
      if (s._tag === "Idle" || s._tag === "Passivated") {
        if (s.stopping) return out.push(err(input.req, "ShuttingDown")), s
        return out.push({ _tag: "RunCheckpoint", waiters: [input.req] }), s
      }
      const checkpoints = [...s.checkpoints, input.req]
      if (s._tag === "Running") return running(s, s.worker, s.turn, s.aborts, checkpoints, s.rewrite, s.shutdown)
      if (s._tag === "Stalled") return stalled(s, s.shown, s.cut, checkpoints, s.retries)
      return starting(s, s.worker, s.state, s.backoff, waiting(s.reserved, s.cut, s.afterCut, checkpoints, s.retries))
    }
    case "Retry": {
      if (s._tag !== "Failed") return out.push(ok(input.req, "summary")), s
      if (s.stopping) return out.push(err(input.req, "ShuttingDown")), s
      // A retry starts the restart schedule afresh.
      const fresh: Base & { readonly _tag: Phase } = { _tag: "Failed", epoch: s.epoch, turns: s.turns, restarts: s.restarts, crashes: NO_CRASHES, stopping: s.stopping }
      return startWorker(fresh, "recovering", waiting(undefined, undefined, undefined, NONE, [input.req]), out)
    }
    case "Kill":
      return kill(s, input.req, out)
    case "Rename":
      return out.push({ _tag: "Rename", req: input.req, name: input.name }), s
    case "Passivate":
      return s._tag === "Idle" && !s.stopping ? passivate(s, out) : s
    case "ShuttingDown":
      return shuttingDown(s, input, out)
    case "Restore": {
      if (s._tag !== "Passivated") return s
      return startWorker(s, "recovering", waiting(undefined, { _tag: "InterruptOwed", reason: "daemon_restarted" }, undefined, NONE, NONE), out)
    }
    case "Acquired": {
      if (s._tag !== "Starting" || s.epoch !== input.epoch || s.worker !== undefined || s.backoff) {
        return out.push({ _tag: "StopWorker", worker: input.worker }), s
      }
      out.push({ _tag: "Pump", worker: input.worker })
      return starting(s, input.worker, s.state, false, s)
    }
    case "AcquireFailed": {
      // A spawn refused because the daemon stops is no crash; one that fails otherwise is.
      if (s._tag !== "Starting" || s.epoch !== input.epoch || s.worker !== undefined || s.stopping) return s
      return crash(s, policy, env, out)
    }
    case "TurnRefused": {
      if (s._tag !== "Running" || s.turn !== input.turn) return s
      // Nothing of the turn remains; the stream, which may have shown the prompt waiting, says so.
      const idle = idleOn(s, s.worker)
      out.push({ _tag: "Journal", busy: false, op: "prompt_refused", required: false })
      // Nothing of a refused prompt is published, unless the stream showed it waiting.
      if (input.shownBusy) out.push(status(idle))
      return idle
    }
    case "RestartDue": {
      if (s._tag !== "Starting" || s.epoch !== input.epoch || !s.backoff || s.stopping) return s
      return startWorker(s, "recovering", s, out)
    }
    case "StorageRetry": {
      if (s._tag !== "Stalled" || s.epoch !== input.epoch || s.stopping) return s
      if (!env.storageOk) return out.push({ _tag: "ScheduleStorageRetry", epoch: s.epoch }), s
      // The owed end, then the journal's idle record (before a worker restores: a journal still
      // saying busy would have it report the turn cut once more), then its status.
      if (s.cut?._tag === "InterruptOwed") out.push({ _tag: "PublishInterrupt", reason: s.cut.reason })
      out.push({ _tag: "Journal", busy: false, op: "turn_end", required: true })
      const w = waiting(undefined, undefined, undefined, s.checkpoints, s.retries)
      const recovering = starting(s, undefined, "recovering", false, w)
      out.push(status(recovering))
      return startWorker(recovering, "recovering", w, out)
    }
    case "Events":
      if (workerOf(s) === input.worker) out.push(EVENTS[0]!)
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
        return starting(s, s.worker, s.state, s.backoff, waiting(s.reserved, STATUS_OWED, s.afterCut, s.checkpoints, s.retries))
      }
      // An agent_end outside a turn passes as an event; a cut turn reported that no turn is
      // owed (its end is logged already) is not published: a second end would be a lie.
      if (input.how === "agent_end") out.push(EVENTS[0]!)
      return s
    }
    case "Ready": {
      if (s._tag !== "Starting" || s.worker !== input.worker) return s
      // The turn cut by a crash ends before the worker is ready, whatever the worker said.
      if (s.cut?._tag === "InterruptOwed") {
        out.push({ _tag: "PublishInterrupt", reason: s.cut.reason })
        out.push({ _tag: "Journal", busy: false, op: "turn_end", required: false })
      }
      const idle = idleOn(s, s.worker)
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
        if (s.stopping) return out.push(err(prompt.req, "ShuttingDown")), idle
        return startTurn(idle as Extract<State, { _tag: "Idle" }>, prompt, out)
      }
      return idle
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
        return running(s, s.worker, s.turn, s.aborts, s.checkpoints, true, s.shutdown)
      }
      if (input.part === "end" && s.rewrite) {
        out.push({ _tag: "RewriteFrame", part: "end" })
        return running(s, s.worker, s.turn, s.aborts, s.checkpoints, false, s.shutdown)
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

const STATUS_OWED: CutTurn = { _tag: "StatusOwed" }
const NO_CRASHES: ReadonlyArray<number> = []

/** A rewrite that cannot be kept: its entry goes, the worker is killed (its replacement restores the files). */
const rewriteNotKept = (s: Running, out: Array<Action>): State => {
  out.push({ _tag: "AbandonRewrite" })
  out.push({ _tag: "KillWorker", worker: s.worker })
  return running(s, s.worker, s.turn, s.aborts, s.checkpoints, false, s.shutdown)
}

/** The daemon stops: what waits is answered `shutting_down`, a running turn is cut. */
const shuttingDown = (s: State, input: Extract<Input, { _tag: "ShuttingDown" }>, out: Array<Action>): State => {
  const b: Base = { epoch: s.epoch, turns: s.turns, restarts: s.restarts, crashes: s.crashes, stopping: true }
  if (s._tag === "Running") {
    for (const a of s.aborts) out.push(err(a, "ShuttingDown"))
    for (const r of s.checkpoints) out.push(err(r, "ShuttingDown"))
    const cut = running(b, s.worker, s.turn, NONE, NONE, s.rewrite, [...s.shutdown, input.done])
    if (input.force) return cutForShutdown(cut, out)
    out.push({ _tag: "SendAbort", worker: s.worker, turn: s.turn, reason: "daemon_shutdown" })
    return cut
  }
  const w = waitingOf(s)
  answerWaiting(w, "ShuttingDown", out)
  let next: State
  switch (s._tag) {
    case "Starting":
      next = starting(b, s.worker, s.state, s.backoff, waiting(undefined, s.cut, undefined, NONE, NONE))
      break
    case "Stalled":
      next = stalled(b, s.shown, s.cut, NONE, NONE)
      break
    case "Idle":
      next = idleOn(b, s.worker)
      break
    default:
      next = without(s._tag, b)
  }
  // A turn cut by a crash still waiting for its end: said now, with its reason, and the status
  // that ends it; the worker being restored is stopped. The journal says idle.
  if (w.cut !== undefined) {
    const worker = workerOf(s)
    if (w.cut._tag === "InterruptOwed") {
      out.push({ _tag: "PublishInterrupt", reason: w.cut.reason })
      out.push({ _tag: "Journal", busy: false, op: "turn_end", required: false })
    }
    next = without("Passivated", baseWith(b, s.epoch + 1))
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
    case "Rename":
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
