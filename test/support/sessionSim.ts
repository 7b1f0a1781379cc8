/**
 * A deterministic simulation of several sessions driven through the pure `step` of
 * src/internal/session/transition.ts, over in-memory fakes of the worker processes, the worker
 * slots (the real SlotBook), the journal, the timers and the storage. A run is a list of world
 * events (a client's command, the entity taking its next input, a worker emitting its next frame
 * or crashing, a spawn, a timer, the disk filling, the daemon stopping); every event that does
 * not apply where the world stands is a no-op, so any sub-list is a run too (what shrinking
 * needs). Invariants are checked after every event; a violation ends the run with its message.
 */
import {
  type Action,
  busyOf,
  type Env,
  initial,
  type Input,
  loaded,
  type ReqId,
  type RestartPolicy,
  type State,
  step,
  type TurnEnd,
  workerOf,
  type WorkerId
} from "../../src/internal/session/transition.js"
import { SlotBook } from "../../src/internal/session/workerSlots.js"

export type WorldEvent =
  | { readonly k: "cmd"; readonly s: number; readonly c: 0 | 1 | 2 | 3 | 4 | 5 }
  | { readonly k: "deliver"; readonly s: number }
  | { readonly k: "emit"; readonly p: number }
  | { readonly k: "crash"; readonly p: number }
  | { readonly k: "spawn"; readonly fail: boolean }
  | { readonly k: "timer"; readonly s: number }
  | { readonly k: "time"; readonly ms: number }
  | { readonly k: "disk"; readonly full: boolean }
  | { readonly k: "shutdown"; readonly force: boolean }

export const policy: RestartPolicy = { maxRestarts: 3, restartWindowMs: 10_000, backoffBaseMs: 100 }

interface Proc {
  readonly id: WorkerId
  readonly session: number
  alive: boolean
  stopAsked: boolean
  /** Taken by its session's entity (its `Pump`). */
  adopted: boolean
  readonly outbox: Array<Input>
  turn: boolean
}

interface Acquisition {
  readonly session: number
  readonly epoch: number
  readonly restore: boolean
  readonly reportCut: TurnEnd | undefined
  taken: boolean
}

interface Sess {
  state: State
  readonly mailbox: Array<Input>
  readonly timers: Array<Input>
  journalBusy: boolean
  /** A turn accepted whose end is not out yet. */
  openTurn: boolean
  /** The entity took the exit of the worker that ran the open turn (the turn only owes its end). */
  turnWorkerGone: boolean
  turnWorker: WorkerId | undefined
  /** An end is out and no status since. */
  endPending: boolean
  lastUsed: number
  /** Prompts the entity has taken and not answered yet. */
  readonly heldPrompts: Set<ReqId>
}

interface Req {
  readonly session: number
  readonly kind: "prompt" | "other" | "done"
  settled: number
}

export class Violation extends Error {}

/** Runs `events` (then lets the world settle) and returns the first invariant broken, if any. */
export const run = (events: ReadonlyArray<WorldEvent>, sessions = 3, maxWorkers = 2): { steps: number; violation: string | undefined } => {
  const world = new World(sessions, maxWorkers)
  try {
    for (const e of events) {
      world.apply(e)
      world.check()
    }
    world.runOut()
    world.checkEnd()
    return { steps: world.steps, violation: undefined }
  } catch (e) {
    if (e instanceof Violation) return { steps: world.steps, violation: e.message }
    throw e
  }
}

class World {
  steps = 0
  now = 1_000_000
  nextReq = 1
  nextProc = 1
  full = false
  stopping = false
  readonly sessions: Array<Sess> = []
  /** The worker processes alive. */
  readonly procs: Array<Proc> = []
  readonly byId = new Map<WorkerId, Proc>()
  private readonly count: Array<number> = []
  private readonly named: Array<WorkerId> = []
  readonly acquisitions: Array<Acquisition> = []
  readonly requests = new Map<ReqId, Req>()
  readonly book: SlotBook<WorkerId>

  constructor(n: number, maxWorkers: number) {
    this.book = new SlotBook<WorkerId>(maxWorkers)
    for (let i = 0; i < n; i++) {
      // Every third session was running a turn when the last daemon died: restored at start.
      const restored = i % 3 === 2
      const s: Sess = {
        state: restored ? loaded : initial,
        mailbox: [],
        timers: [],
        journalBusy: restored,
        openTurn: restored,
        turnWorkerGone: restored,
        turnWorker: undefined,
        endPending: false,
        lastUsed: 0,
        heldPrompts: new Set()
      }
      this.sessions.push(s)
      // The Restore input is the first the entity takes (nothing can come before it).
      if (restored) this.stepWith(i, { _tag: "Restore" })
      else this.startWorker(i, s.state.epoch, false, undefined)
    }
  }

  fail(message: string): never {
    throw new Violation(message)
  }

  env(): Env {
    return { now: this.now, slotsWanted: this.book.wanted() > 0, generationFull: false, storageOk: !this.full }
  }

  apply(e: WorldEvent) {
    switch (e.k) {
      case "cmd": {
        if (this.stopping) return
        const i = e.s % this.sessions.length
        const req = this.nextReq++
        const kinds = ["Prompt", "Abort", "Checkpoint", "Retry", "Kill", "Rename"] as const
        const tag = kinds[e.c]
        this.requests.set(req, { session: i, kind: tag === "Prompt" ? "prompt" : "other", settled: 0 })
        const input: Input = tag === "Prompt"
          ? { _tag: "Prompt", req, message: "m" }
          : tag === "Rename"
          ? { _tag: "Rename", req, name: `n${req}` }
          : { _tag: tag, req }
        this.sessions[i]!.mailbox.push(input)
        return
      }
      case "deliver": {
        // The first session from `s` on with something in its mailbox.
        const n = this.sessions.length
        for (let j = 0; j < n; j++) {
          const i = (e.s + j) % n
          if (this.sessions[i]!.mailbox.length > 0) return this.deliver(i)
        }
        return
      }
      case "emit": {
        if (this.procs.length === 0) return
        const p = this.procs[e.p % this.procs.length]!
        if (p.outbox.length > 0) this.sessions[p.session]!.mailbox.push(p.outbox.shift()!)
        return
      }
      case "crash": {
        if (this.procs.length === 0) return
        this.exit(this.procs[e.p % this.procs.length]!, false)
        return
      }
      case "spawn": {
        const a = this.acquisitions.find((x) => x.taken)
        if (a === undefined) return
        this.acquisitions.splice(this.acquisitions.indexOf(a), 1)
        if (e.fail) {
          this.releaseSlot(undefined)
          this.post(a.session, { _tag: "AcquireFailed", epoch: a.epoch })
          return
        }
        const p: Proc = { id: this.nextProc++, session: a.session, alive: true, stopAsked: false, adopted: false, outbox: [], turn: false }
        this.procs.push(p)
        this.byId.set(p.id, p)
        this.book.hold(p.id)
        // A restored worker reports the turn its predecessor was cut in, then says it is ready.
        if (a.reportCut !== undefined) p.outbox.push({ _tag: "TurnEnded", worker: p.id, how: a.reportCut })
        p.outbox.push({ _tag: "Ready", worker: p.id })
        if (this.sessions[a.session]!.state._tag === "Closed") {
          // The acquirer stops a worker whose session is gone (nothing is posted to it).
          this.exit(p, true)
          return
        }
        this.post(a.session, { _tag: "Acquired", epoch: a.epoch, worker: p.id })
        return
      }
      case "timer": {
        const s = this.sessions[e.s % this.sessions.length]!
        const t = s.timers.shift()
        if (t !== undefined) s.mailbox.push(t)
        return
      }
      case "time":
        this.now += e.ms
        return
      case "disk":
        this.full = e.full
        return
      case "shutdown": {
        if (e.force && !this.stopping) return
        this.stopping = true
        this.sessions.forEach((s, i) => {
          if (s.state._tag === "Closed" || (e.force && s.state._tag !== "Running")) return
          const done = this.nextReq++
          this.requests.set(done, { session: i, kind: "done", settled: 0 })
          s.mailbox.push({ _tag: "ShuttingDown", done, force: e.force })
        })
        return
      }
    }
  }

  post(i: number, input: Input) {
    // Nothing is posted to a closed session.
    if (this.sessions[i]!.state._tag !== "Closed") this.sessions[i]!.mailbox.push(input)
  }

  deliver(i: number) {
    const s = this.sessions[i]!
    let input = s.mailbox.shift()
    if (input === undefined) return
    if (input._tag === "Exited" && s.openTurn && input.worker === s.turnWorker && !input.asked) s.turnWorkerGone = true
    // Events the log cannot take: the write the entity depended on failed.
    if (input._tag === "Events" && this.full && workerOf(s.state) === input.worker) input = { _tag: "StorageFailed" }
    if (input._tag === "Prompt") {
      this.checkBusyRefusal(i, input.req, s)
      s.heldPrompts.add(input.req)
    }
    this.stepWith(i, input)
  }

  stepWith(i: number, input: Input) {
    const s = this.sessions[i]!
    this.steps++
    const t = step(s.state, input, this.env(), policy)
    const before = s.state
    s.state = t.state
    if (input._tag === "Prompt" && before._tag !== "Closed") s.lastUsed = this.now
    for (const a of t.actions) this.perform(i, a)
  }

  /** A prompt refused `session_busy` while no other prompt holds the session. */
  checkBusyRefusal(i: number, req: ReqId, s: Sess) {
    const t = step(s.state, { _tag: "Prompt", req, message: "m" }, this.env(), policy)
    const refused = t.actions.some((a) => a._tag === "Settle" && a.req === req && a.result._tag === "Error" && a.result.error === "SessionBusy")
    if (!refused) return
    const otherPrompt = s.heldPrompts.size > 0
    const liveTurn = s.openTurn && !s.turnWorkerGone
    if (!otherPrompt && !liveTurn) {
      this.fail(`session ${i}: a prompt was refused session_busy while no other prompt held it (a cut turn only owes its end)`)
    }
  }

  settle(req: ReqId) {
    const r = this.requests.get(req)
    if (r === undefined) this.fail(`unknown request ${req} settled`)
    r.settled++
    if (r.kind === "prompt") this.sessions[r.session]!.heldPrompts.delete(req)
    if (r.settled > 1) this.fail(`request ${req} settled twice`)
  }

  perform(i: number, a: Action) {
    const s = this.sessions[i]!
    switch (a._tag) {
      case "PublishStatus":
        if (s.endPending && a.busy) this.fail(`session ${i}: the status after a turn's end says busy`)
        s.endPending = false
        return
      case "PublishEvents":
        if (a.end !== undefined) this.turnEnd(i, s)
        return
      case "PublishInterrupt":
        return this.turnEnd(i, s)
      case "PublishClosed":
        s.endPending = false
        return
      case "Journal":
        if (a.required && this.full) this.fail(`session ${i}: a required journal record written on a full disk`)
        s.journalBusy = a.busy
        return
      case "SendAbort": {
        const p = this.byId.get(a.worker)
        if (p !== undefined && p.alive && p.turn) {
          // The worker cuts its turn: what it had left to send is replaced by the end.
          p.outbox.splice(0, p.outbox.length, { _tag: "TurnEnded", worker: p.id, how: a.reason })
          p.turn = false
        }
        return
      }
      case "StartTurn": {
        if (this.full) {
          this.settle(a.prompt.req)
          this.stepWith(i, { _tag: "TurnRefused", turn: a.turn, shownBusy: true })
          return
        }
        if (s.endPending) this.fail(`session ${i}: a turn's busy status right after a turn's end`)
        if (s.openTurn) this.fail(`session ${i}: a turn started while another is not ended`)
        s.journalBusy = true
        s.openTurn = true
        s.turnWorkerGone = false
        s.turnWorker = a.worker
        this.settle(a.prompt.req)
        const p = this.byId.get(a.worker)
        if (p !== undefined && p.alive) {
          p.turn = true
          const w = p.id
          p.outbox.push({ _tag: "Events", worker: w })
          if ((a.turn & 3) === 1) p.outbox.push({ _tag: "Rewrite", worker: w, part: "begin" }, { _tag: "Rewrite", worker: w, part: "end" })
          p.outbox.push({ _tag: "Events", worker: w }, { _tag: "TurnEnded", worker: w, how: "agent_end" })
        }
        return
      }
      case "StartWorker": {
        const reportCut = s.journalBusy ? (a.interruptedReason ?? "daemon_restarted") : undefined
        this.startWorker(i, a.epoch, a.restore, reportCut)
        return
      }
      case "Pump": {
        // (A worker that died before its session took it: its exit follows in the mailbox.)
        const p = this.byId.get(a.worker)
        if (p !== undefined) p.adopted = true
        return
      }
      case "StopWorker": {
        const p = this.byId.get(a.worker)
        if (p !== undefined && p.alive) this.exit(p, true)
        return
      }
      case "KillWorker": {
        const p = this.byId.get(a.worker)
        if (p !== undefined && p.alive) this.exit(p, false)
        return
      }
      case "SlotLeaving":
        this.book.leaving(a.worker)
        return
      case "Settle":
        return this.settle(a.req)
      case "RunCheckpoint":
        for (const r of a.waiters) this.settle(r)
        return
      case "ShutdownDone":
        return this.settle(a.done)
      case "Archive":
      case "Rename":
        return this.settle(a.req)
      case "ScheduleRestart":
        s.timers.push({ _tag: "RestartDue", epoch: a.epoch })
        return
      case "ScheduleStorageRetry":
        s.timers.push({ _tag: "StorageRetry", epoch: a.epoch })
        return
      case "CloseScope": {
        // The session's acquisitions end: a wait for a slot, a spawn under way.
        for (const acq of this.acquisitions.filter((x) => x.session === i)) {
          this.acquisitions.splice(this.acquisitions.indexOf(acq), 1)
          if (acq.taken) this.releaseSlot(undefined)
          else this.book.waiting--
        }
        s.timers.length = 0
        return
      }
      case "CheckpointIfGrown":
      case "RewriteFrame":
      case "AbandonRewrite":
        return
    }
  }

  turnEnd(i: number, s: Sess) {
    if (!s.openTurn) this.fail(`session ${i}: a turn's end published where no turn is owed one`)
    s.openTurn = false
    s.endPending = true
  }

  startWorker(i: number, epoch: number, restore: boolean, reportCut: TurnEnd | undefined) {
    const acq: Acquisition = { session: i, epoch, restore, reportCut, taken: false }
    this.acquisitions.push(acq)
    if (this.book.free()) {
      this.book.held++
      acq.taken = true
      return
    }
    this.book.waiting++
    // Idle sessions are asked to give their workers up, least recently used first.
    const idle = this.sessions
      .map((s, j) => ({ s, j }))
      .filter(({ j, s }) => j !== i && s.state._tag === "Idle")
      .sort((a, b) => a.s.lastUsed - b.s.lastUsed)
    for (const { j } of idle.slice(0, this.book.wanted())) this.post(j, { _tag: "Passivate" })
  }

  releaseSlot(worker: WorkerId | undefined) {
    this.book.release(worker)
    const next = this.acquisitions.find((x) => !x.taken)
    if (next !== undefined && this.book.held < this.book.max) {
      next.taken = true
      this.book.waiting--
      this.book.held++
    }
  }

  /** A worker's process ends: its slot is free at once; its pump reports the exit. */
  exit(p: Proc, asked: boolean) {
    p.alive = false
    p.stopAsked = asked
    p.outbox.length = 0
    this.procs.splice(this.procs.indexOf(p), 1)
    this.byId.delete(p.id)
    this.releaseSlot(p.id)
    this.post(p.session, { _tag: "Exited", worker: p.id, asked })
  }

  check() {
    // A worker counted on its way out holds a slot (else it hides a waiting spawn for good).
    for (const w of this.book.onTheirWayOut) if (!this.book.holders.has(w)) this.fail(`worker ${w} counted on its way out holds no slot`)
    if (this.book.held < 0 || this.book.waiting < 0) this.fail(`slots: held ${this.book.held}, waiting ${this.book.waiting}`)
    const count = this.count
    for (let i = 0; i < this.sessions.length; i++) count[i] = 0
    for (const p of this.procs) {
      if (!p.adopted) continue
      count[p.session]!++
      this.named[p.session] = p.id
    }
    this.sessions.forEach((s, i) => {
      const workers = count[i]!
      if (workers > 1) this.fail(`session ${i}: ${workers} workers`)
      if (s.state._tag === "Closed" && workers > 0) this.fail(`session ${i}: a worker left after Closed`)
      const w = workerOf(s.state)
      if (w !== undefined && workers === 1 && this.named[i] !== w) this.fail(`session ${i}: runs worker ${this.named[i]}, its state names ${w}`)
      if (s.state._tag === "Closed" || s.state._tag === "Stalled") return
      const prompt = s.heldPrompts.size > 0
      const busy = busyOf(s.state)
      // A turn's end that is out but whose status is not yet: still busy until that status.
      if (busy !== (prompt || s.openTurn || s.endPending)) {
        this.fail(
          `session ${i}: busy ${busy} in ${s.state._tag}, but ${prompt ? "a prompt is reserved" : "no prompt is reserved"}, ${
            s.openTurn ? "a turn runs" : "no turn runs"
          } and ${s.endPending ? "a turn's status is owed" : "no status is owed"}`
        )
      }
    })
  }

  /** No more commands, crashes or faults: everything in flight runs out. */
  runOut() {
    this.full = false
    for (let round = 0; round < 10_000; round++) {
      let moved = false
      for (let i = 0; i < this.sessions.length; i++) {
        const s = this.sessions[i]!
        while (s.mailbox.length > 0) {
          this.deliver(i)
          this.check()
          moved = true
        }
      }
      for (const p of this.procs) {
        if (p.outbox.length > 0) {
          this.sessions[p.session]!.mailbox.push(p.outbox.shift()!)
          moved = true
        }
      }
      if (this.acquisitions.some((x) => x.taken)) {
        this.apply({ k: "spawn", fail: false })
        moved = true
      }
      if (!moved) {
        const s = this.sessions.find((x) => x.timers.length > 0)
        if (s === undefined) return
        this.now += 60_000
        s.mailbox.push(s.timers.shift()!)
      }
    }
    this.fail("the world did not settle")
  }

  checkEnd() {
    for (const [r, q] of this.requests) if (q.settled !== 1) this.fail(`request ${r} (${q.kind}, session ${q.session}) never settled`)
    this.sessions.forEach((s, i) => {
      // A turn whose end storage still refuses when the daemon stops stays owed: the journal
      // must say busy, so that the next start ends it (daemon_restarted).
      if (s.state._tag !== "Closed" && s.openTurn && !(this.stopping && s.journalBusy)) {
        this.fail(`session ${i}: an accepted prompt's turn never ended (${s.state._tag})`)
      }
      if (s.state._tag === "Closed" && this.procs.some((p) => p.session === i)) this.fail(`session ${i}: a worker left after Closed`)
    })
    // (Once the daemon stops nothing gives its worker up: what waits is the daemon's end.)
    if (!this.stopping && this.book.waiting > 0 && this.sessions.some((s) => s.state._tag === "Idle")) {
      this.fail(`a spawn waits for a slot while a session sits idle with its worker`)
    }
  }
}

/** A small seeded PRNG (mulberry32). */
export const rng = (seed: number) => {
  let a = seed >>> 0
  return () => {
    a = (a + 0x6d2b79f5) >>> 0
    let t = a
    t = Math.imul(t ^ (t >>> 15), t | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }
}

/**
 * A random run of `length` world events. `renames`: commands include `rename` (off by default,
 * so that a seed names the same run it named before rename was an input).
 */
export const generate = (seed: number, length: number, options: { readonly renames?: boolean } = {}): Array<WorldEvent> => {
  const r = rng(seed)
  const int = (n: number) => Math.floor(r() * n)
  const out: Array<WorldEvent> = []
  const kinds = options.renames === true ? [0, 0, 0, 1, 2, 2, 3, 5, 0, 1, 4] : [0, 0, 0, 1, 2, 2, 3, 0, 1, 4]
  const common = kinds.length - 1
  for (let i = 0; i < length; i++) {
    const x = r()
    if (x < 0.3) out.push({ k: "cmd", s: int(8), c: kinds[int(r() < 0.03 ? kinds.length : common)] as 0 | 1 | 2 | 3 | 4 | 5 })
    else if (x < 0.65) out.push({ k: "deliver", s: int(8) })
    else if (x < 0.9) out.push({ k: "emit", p: int(8) })
    else if (x < 0.925) out.push({ k: "crash", p: int(8) })
    else if (x < 0.97) out.push({ k: "spawn", fail: r() < 0.1 })
    else if (x < 0.985) out.push({ k: "timer", s: int(8) })
    else if (x < 0.993) out.push({ k: "time", ms: int(8000) })
    else if (x < 0.998) out.push({ k: "disk", full: r() < 0.5 })
    else out.push({ k: "shutdown", force: r() < 0.5 })
  }
  return out
}

/** The shortest sub-list of `events` found that still breaks an invariant (delta debugging). */
export const shrink = (events: ReadonlyArray<WorldEvent>, budget = 3000): { events: ReadonlyArray<WorldEvent>; violation: string } => {
  let current = events
  let violation = run(current).violation!
  // A shorter run counts only if it breaks the same invariant (numbers aside).
  const kind = (v: string) => v.replace(/\d+/g, "#").slice(0, 48)
  const wanted = kind(violation)
  let tries = 0
  for (let chunk = Math.max(1, current.length >> 1); chunk >= 1; chunk = chunk === 1 ? 0 : chunk >> 1) {
    let i = 0
    while (i < current.length && tries < budget) {
      const candidate = [...current.slice(0, i), ...current.slice(i + chunk)]
      tries++
      const result = run(candidate).violation
      if (result !== undefined && kind(result) === wanted) {
        current = candidate
        violation = result
      } else {
        i += chunk
      }
    }
  }
  return { events: current, violation }
}
