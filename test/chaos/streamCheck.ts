/**
 * What one client sees of one session, checked message by message against the protocol's
 * delivery promises (every sequenced event in cursor order, each once, no gap that a `resync`
 * or `replacement` snapshot does not explain, frames and `session_attached` in their place),
 * and the session's transcript as the client folds it.
 *
 * A gap between two generations cannot be seen from one client alone (a generation may end at
 * any sequence), so every event seen by any client goes into the session's {@link Truth}, and
 * every generation jump a client made is checked against it: no event seen by anyone may lie
 * strictly between the two cursors of a jump.
 *
 * Plain TypeScript, no I/O: the unit test feeds it hand-made message sequences.
 */

// eslint-disable-next-line @typescript-eslint/no-explicit-any
export type Msg = Record<string, any>

export interface Cursor {
  readonly generation: number
  readonly sequence: number
}

export const compareCursor = (a: Cursor, b: Cursor): number =>
  a.generation !== b.generation ? a.generation - b.generation : a.sequence - b.sequence

export const fmtCursor = (c: Cursor | undefined): string => (c === undefined ? "-" : `${c.generation}:${c.sequence}`)

const SEQUENCED = new Set(["session_event", "session_status", "session_closed"])
export const isSequenced = (m: Msg): boolean => SEQUENCED.has(m["type"])
const SNAPSHOT_FRAMES = new Set(["session_snapshot_begin", "session_snapshot_chunk", "session_snapshot_end", "session_snapshot_failed"])
export const isSnapshotFrame = (m: Msg): boolean => SNAPSHOT_FRAMES.has(m["type"])

/** A short description of a message, for failure output. */
export const describeMsg = (m: Msg): string => {
  const c = m["meta"]?.cursor as Cursor | undefined
  const cur = c !== undefined ? `@${fmtCursor(c)}${m["meta"]?.replayed === true ? "r" : ""}` : ""
  switch (m["type"]) {
    case "session_event": {
      const e = m["event"] ?? {}
      return `ev:${e.type}${e.type === "turn_interrupted" ? `(${e.reason})` : ""}${cur}`
    }
    case "session_status":
      return `status(busy=${m["state"]?.busy},worker=${m["state"]?.worker})${cur}`
    case "session_closed":
      return `closed(${m["reason"]})${cur}`
    case "response":
      return `resp(${m["command"]},${m["success"] === true ? "ok" : m["error"]?.code})`
    case "session_snapshot_begin":
      return `snap_begin(${m["purpose"]},${m["snapshotId"]},cursor=${fmtCursor(m["cursor"])})`
    case "session_snapshot_chunk":
      return `snap_chunk(${m["index"]})`
    case "session_attached":
      return `attached(${m["replay"]?.status}${m["replay"]?.reason === undefined ? "" : `/${m["replay"].reason}`},${m["replay"]?.eventCount ?? "-"} events,${m["snapshot"]?.messages?.length ?? "-"} msgs)`
    default:
      return String(m["type"])
  }
}

/** A broken promise: which invariant, and what was seen. */
export class Violation extends Error {
  constructor(readonly invariant: string, readonly details: string) {
    super(`${invariant}: ${details}`)
  }
}

/** A transcript message as a client folds it (what `get_messages` must return too). */
export interface FoldedMessage {
  readonly id: string
  readonly role: string
  readonly content: string
}

const foldedOf = (m: Msg): FoldedMessage => ({ id: String(m["id"]), role: String(m["role"]), content: String(m["content"]) })

const sameFold = (a: ReadonlyArray<FoldedMessage>, b: ReadonlyArray<FoldedMessage>): boolean =>
  a.length === b.length && a.every((m, i) => m.id === b[i]!.id && m.role === b[i]!.role && m.content === b[i]!.content)

const sameCursor = (a: Cursor | undefined, b: Cursor | undefined): boolean =>
  a === undefined || b === undefined ? a === b : compareCursor(a, b) === 0

/** The prompt that makes echo rewrite its history (docs/protocol.md section 7). */
export const COMPACT_PROMPT = "/compact"

/**
 * N of echo's compaction message (`compacted N messages`, role assistant), the whole transcript
 * a `/compact` leaves; undefined for any other message.
 */
export const compactedCount = (m: { readonly role: string; readonly content: string } | undefined): number | undefined => {
  if (m === undefined || m.role !== "assistant") return undefined
  const match = /^compacted (\d+) messages$/.exec(m.content)
  return match === null ? undefined : Number(match[1])
}

const describeFold = (fold: ReadonlyArray<FoldedMessage>): string =>
  `${fold.length} message(s)${fold.length === 0 ? "" : `, first ${JSON.stringify(fold[0]!.content.slice(0, 40))}, last ${fold.at(-1)!.role} ${JSON.stringify(fold.at(-1)!.content.slice(0, 40))}`}`

/** A generation jump a client made (or the start of a baseline), to check against the truth. */
export interface Jump {
  /** The last cursor before the jump (undefined: the very start of the session). */
  readonly from: Cursor | undefined
  readonly to: Cursor
  readonly where: string
  /**
   * `continue`: the client went on from an event to the next generation's first with no
   * snapshot between (it must not cross a history rewrite); `baseline`: the first event after a
   * snapshot (attach, resync or replacement) whose cursor is `from`.
   */
  readonly kind: "continue" | "baseline"
}

/**
 * The reasons a turn may end with `turn_interrupted` (docs/protocol.md section 4), each a turn's
 * end like `agent_end`: `daemon_shutdown` when a graceful stop cut it.
 */
export const INTERRUPT_REASONS: ReadonlySet<string> = new Set(["worker_crashed", "aborted", "daemon_restarted", "daemon_shutdown", "storage_failed"])

/** Every event of a session that any client saw, by cursor; and the jumps to check. */
export class Truth {
  private readonly byCursor = new Map<string, string>()
  private sorted: Array<Cursor> | undefined
  readonly jumps: Array<Jump> = []
  private checkedJumps = 0
  /**
   * History rewrites known for sure, by the cursor of the last event before them: a client that
   * had every event up to that cursor was sent the rewrite's snapshot (the compaction of what it
   * held) right there. Value: the N of its `compacted N messages`. Nobody may go on from such a
   * cursor into the next generation without that snapshot (replay never crosses a rewrite).
   */
  readonly rewrites = new Map<string, number>()
  /** The compaction messages whose N some client checked against its fold: message id -> N. */
  readonly compactions = new Map<string, number>()
  /** Some client was sent a `replacement` snapshot of this session: its history was rewritten. */
  rewritten = false

  constructor(readonly activeSessionId: string) {}

  get size(): number {
    return this.byCursor.size
  }

  /** Records an event; a cursor that names two different events is a violation. */
  see(m: Msg, where: string): void {
    const c = m["meta"].cursor as Cursor
    const key = fmtCursor(c)
    const signature = `${m["type"]}/${m["event"]?.type ?? m["state"]?.worker ?? m["reason"] ?? ""}/${m["meta"].emittedAt}`
    const known = this.byCursor.get(key)
    if (known === undefined) {
      this.byCursor.set(key, signature)
      this.sorted = undefined
    } else if (known !== signature) {
      throw new Violation("one event per cursor", `${where}: cursor ${key} of ${this.activeSessionId} names ${signature}, seen before as ${known}`)
    }
  }

  /** The seen cursors strictly between `from` and `to` (from undefined: everything before `to`). */
  between(from: Cursor | undefined, to: Cursor): Array<Cursor> {
    if (this.sorted === undefined) {
      this.sorted = [...this.byCursor.keys()].map((k) => {
        const [g, s] = k.split(":")
        return { generation: Number(g), sequence: Number(s) }
      }).sort(compareCursor)
    }
    return this.sorted.filter((c) => (from === undefined || compareCursor(c, from) > 0) && compareCursor(c, to) < 0)
  }

  /** Checks the jumps recorded since the last call (`all`: every jump again, the truth having grown). */
  checkJumps(all = false): void {
    const start = all ? 0 : this.checkedJumps
    for (let i = start; i < this.jumps.length; i++) {
      const j = this.jumps[i]!
      if (j.kind === "continue" && j.from !== undefined && this.rewrites.has(fmtCursor(j.from))) {
        throw new Violation(
          "replay never crosses a rewrite",
          `${j.where}: went on from ${fmtCursor(j.from)} to ${fmtCursor(j.to)} of ${this.activeSessionId} without a replacement snapshot, ` +
            `but history was rewritten right after ${fmtCursor(j.from)} (compacted ${this.rewrites.get(fmtCursor(j.from))} messages)`
        )
      }
      const skipped = this.between(j.from, j.to)
      if (skipped.length > 0) {
        throw new Violation(
          "no gap",
          `${j.where}: jumped from ${fmtCursor(j.from)} to ${fmtCursor(j.to)} of ${this.activeSessionId} without a resync, ` +
            `skipping ${skipped.length} event(s) that exist (${skipped.slice(0, 5).map(fmtCursor).join(", ")}${skipped.length > 5 ? ", ..." : ""})`
        )
      }
    }
    this.checkedJumps = this.jumps.length
  }
}

type Phase =
  /** Not attached: no event of the session may arrive. */
  | { readonly kind: "detached" }
  /** An attach was sent; until its response, events still belong to the earlier attachment. */
  | { readonly kind: "attaching"; readonly previous: Phase; readonly resumeCursor: Cursor | undefined }
  /** The attach response came with a baseline to stream (with this purpose): frames, then `session_attached`. */
  | { readonly kind: "awaitFrames"; readonly purpose: string; readonly lastAtAttach: Cursor | undefined }
  /** Frames came (or none were needed): `session_attached` is next. */
  | { readonly kind: "awaitAttached"; readonly next: Expectation; readonly lastAtAttach: Cursor | undefined }
  /** Attached: events flow. */
  | { readonly kind: "flowing"; readonly next: Expectation; readonly lastAtAttach: Cursor | undefined }
  /** A snapshot is streaming (attach, resync or replacement): no event until its end. */
  | {
    readonly kind: "snapshot"
    readonly purpose: string
    readonly snapshotId: string
    readonly cursor: Cursor | undefined
    readonly messageCount: number
    readonly messages: Array<FoldedMessage>
    chunks: number
    readonly attaching: boolean
    readonly lastAtAttach: Cursor | undefined
  }
  /** The session was closed (`session_closed`): nothing more. */
  | { readonly kind: "closed" }

/** What the next event must be. */
type Expectation =
  /** The successor of this cursor (same generation + 1, or sequence 0 of a later one). */
  | { readonly kind: "after"; readonly cursor: Cursor }
  /** The first event after a baseline whose snapshot ends at `cursor`: sequence 0 of a later generation. */
  | { readonly kind: "start"; readonly cursor: Cursor | undefined }

/**
 * One client's view of one session across its attaches (on one or several connections: a
 * client that reconnects keeps its fold and its last cursor, as a real client does).
 */
export class SessionStream {
  private phase: Phase = { kind: "detached" }
  /** The client's folded transcript; undefined until a baseline or a resume gives one. */
  fold: Array<FoldedMessage> | undefined
  /** The last sequenced event received (what a resume would start after). */
  last: Cursor | undefined
  /** How many `resync`/`replacement` snapshots replaced this client's state. */
  resyncs = 0
  /** How many of them were `replacement`s (history rewrites), frames or an inline baseline. */
  replacements = 0
  /**
   * How many baselines moved the client's state past its last cursor: events it never saw (its
   * own turn's end, say) may be inside the snapshot. A replacement sent right where the client
   * is (the usual live rewrite) is not one: the rewrite's generation's events follow it.
   */
  skips = 0
  /** Compactions whose N this client checked against its own fold (it had every event up to the rewrite). */
  compactionsChecked = 0
  /** Resumes answered `partial`/`transcript_replaced` (the client's cursor was from before a rewrite). */
  transcriptReplaced = 0
  /** Sequenced events received. */
  events = 0
  /** The replay status (and reason) of the last successful attach. */
  lastReplayStatus: string | undefined
  /** Recent messages, for failure output. */
  private readonly recent: Array<string> = []
  /**
   * The last sequenced event was a turn's end (`agent_end`/`turn_interrupted`) and no status
   * has come since: the next status must say `busy: false`.
   */
  private turnEnded = false
  /** Called for every sequenced event accepted (drivers watch their turns through it). */
  onEvent: ((m: Msg) => void) | undefined

  constructor(readonly activeSessionId: string, readonly label: string, private readonly truth: Truth) {}

  get attached(): boolean {
    return this.phase.kind !== "detached" && this.phase.kind !== "closed"
  }

  get closed(): boolean {
    return this.phase.kind === "closed"
  }

  /** Attached, no snapshot streaming: the fold is the client's whole state. */
  get settled(): boolean {
    return this.phase.kind === "flowing"
  }

  private fail(invariant: string, what: string): never {
    throw new Violation(invariant, `[${this.label} / ${this.activeSessionId}] ${what}; last messages: ${this.recent.join(", ")}`)
  }

  /** The last few messages received, described. */
  recentMessages(): ReadonlyArray<string> {
    return this.recent
  }

  private note(m: Msg): void {
    this.recent.push(describeMsg(m))
    if (this.recent.length > 40) this.recent.shift()
  }

  /** The client sent `attach` (with this resume cursor, if any). */
  attachSent(resumeCursor: Cursor | undefined): void {
    if (this.phase.kind === "closed") return
    this.phase = { kind: "attaching", previous: this.phase, resumeCursor }
  }

  /** The client's connection dropped: whatever was attached is gone. */
  connectionLost(): void {
    if (this.phase.kind === "closed") return
    this.phase = { kind: "detached" }
  }

  /** `detach` was answered. */
  detached(): void {
    if (this.phase.kind === "closed") return
    this.phase = { kind: "detached" }
  }

  /** The response to this client's attach. */
  attachResponse(r: Msg): void {
    const phase = this.phase
    if (phase.kind === "closed") {
      // An attach sent once the session was closed (a client coming back after a kill it had not
      // read yet): it must be refused, never attach to a killed session.
      if (r["success"] === true) this.fail("closed for good", "an attach to a killed session succeeded")
      return
    }
    if (phase.kind !== "attaching") this.fail("attach order", `an attach response without an attach in flight (${phase.kind})`)
    if (r["success"] !== true) {
      this.phase = phase.previous
      return
    }
    const data = r["data"] as Msg
    const replay = data["replay"] as Msg
    const lastAtAttach = data["lastEventCursor"] as Cursor | undefined
    this.lastReplayStatus = replay["reason"] === undefined ? replay["status"] : `${replay["status"]}/${replay["reason"]}`
    if (replay["reason"] === "transcript_replaced") {
      if (phase.resumeCursor === undefined) this.fail("replay decision", "transcript_replaced for an attach without a resume cursor")
      this.transcriptReplaced++
    }
    if (replay["status"] === "complete") {
      const from = phase.resumeCursor
      if (from === undefined) this.fail("replay decision", "replay complete for an attach without a resume cursor")
      if (this.fold === undefined || this.last === undefined || compareCursor(this.last, from) !== 0) {
        // The harness resumes only from the client's own last cursor.
        this.fail("harness", `resumed from ${fmtCursor(from)} but the client's last cursor is ${fmtCursor(this.last)}`)
      }
      if ((data["snapshot"]?.messages?.length ?? 0) !== 0) this.fail("replay complete", "a complete replay came with snapshot messages")
      if (data["snapshotStream"] !== undefined) this.fail("replay complete", "a complete replay came with a snapshot stream")
      this.phase = { kind: "awaitAttached", next: { kind: "after", cursor: from }, lastAtAttach }
      return
    }
    if (phase.resumeCursor !== undefined && replay["status"] === "partial" && replay["reason"] !== "cursor_expired" && replay["reason"] !== "transcript_replaced") {
      this.fail("replay decision", `partial with reason ${replay["reason"]}`)
    }
    // A baseline after a history rewrite is a replacement; after pruned generations, a resync.
    const purpose = replay["reason"] === "transcript_replaced" ? "replacement" : replay["status"] === "partial" ? "resync" : "attach"
    if (data["snapshotStream"] !== undefined) {
      this.phase = { kind: "awaitFrames", purpose, lastAtAttach }
      return
    }
    const snap = data["snapshot"] as Msg
    const messages = (snap["messages"] as Array<Msg>).map(foldedOf)
    if (snap["messageCount"] !== messages.length) this.fail("attach baseline", `snapshot.messageCount ${snap["messageCount"]} but ${messages.length} messages inline`)
    this.baseline(messages, snap["cursor"] as Cursor | undefined, purpose)
    if (purpose !== "attach") this.resyncs++
    this.phase = { kind: "awaitAttached", next: { kind: "start", cursor: snap["cursor"] as Cursor | undefined }, lastAtAttach }
  }

  /**
   * A snapshot's messages (at `cursor`) replace the client's state. What the client held is
   * checked against it where they meet: a snapshot at the client's own last cursor is the state
   * the client holds (it may have been sent that very snapshot already), or (a history rewrite)
   * exactly its compaction, `compacted N messages` with
   * N the messages it held, the `/compact` user message last among them. A replacement always
   * starts with a compaction message; a resync or replacement never moves a client back.
   */
  private baseline(messages: Array<FoldedMessage>, cursor: Cursor | undefined, purpose: string): void {
    const fold = this.fold
    const last = this.last
    if (purpose === "replacement") {
      this.replacements++
      this.truth.rewritten = true
      if (compactedCount(messages[0]) === undefined) {
        this.fail("transcript after a rewrite", `a replacement snapshot at ${fmtCursor(cursor)} does not start with \`compacted N messages\`: ${describeFold(messages)}`)
      }
    }
    if (fold !== undefined && last !== undefined && purpose !== "attach" && (cursor === undefined || compareCursor(cursor, last) < 0)) {
      this.fail("a resync or replacement never rewinds", `a ${purpose} snapshot at ${fmtCursor(cursor)} but the client already had events up to ${fmtCursor(last)}`)
    }
    // The same snapshot again is fine: a client cut off after a replacement resumes from its
    // cursor, which is still before the rewrite's generation, and is sent it once more.
    if (fold !== undefined && sameCursor(cursor, last) && !sameFold(messages, fold)) {
      const n = compactedCount(messages[0])
      const user = fold.at(-1)
      if (messages.length !== 1 || n !== fold.length || user?.role !== "user" || user.content !== COMPACT_PROMPT) {
        this.fail(
          "transcript after a rewrite",
          `a ${purpose} snapshot at the client's own last cursor ${fmtCursor(cursor)} is neither what it folded nor its compaction ` +
            `(\`compacted ${fold.length} messages\` after the /compact user message): it holds ${describeFold(messages)}; the client folded ${describeFold(fold)}`
        )
      }
      this.compactionsChecked++
      if (cursor !== undefined) this.truth.rewrites.set(fmtCursor(cursor), n)
      this.truth.compactions.set(messages[0]!.id, n)
    }
    if (fold !== undefined && cursor !== undefined && (last === undefined || compareCursor(cursor, last) > 0)) this.skips++
    this.fold = messages
    this.turnEnded = false
    // The client's state is now the snapshot: a resume starts after the snapshot's cursor, not
    // after an event seen before it (an event the snapshot rewound, or one before a resync).
    this.last = cursor
  }

  /** Any message of this session other than a response. */
  receive(m: Msg): void {
    this.note(m)
    const phase = this.phase
    if (phase.kind === "attaching") {
      // Until the attach is answered, what arrives belongs to the earlier attachment of this
      // connection (the daemon ends it when it takes the attach, before the response).
      this.phase = phase.previous
      try {
        this.receiveInPhase(m)
      } finally {
        this.phase = { ...phase, previous: this.phase }
      }
      return
    }
    this.receiveInPhase(m)
  }

  private receiveInPhase(m: Msg): void {
    const type = m["type"] as string
    if (isSequenced(m)) return this.sequenced(m)
    if (type === "session_attached") {
      if (this.phase.kind !== "awaitAttached") this.fail("attach order", `session_attached in phase ${this.phase.kind}`)
      this.phase = { kind: "flowing", next: this.phase.next, lastAtAttach: this.phase.lastAtAttach }
      return
    }
    if (isSnapshotFrame(m)) return this.frame(m)
  }

  private frame(m: Msg): void {
    // (Frames of an attachment being replaced reach its earlier phase through receive().)
    const type = m["type"] as string
    const phase = this.phase
    if (type === "session_snapshot_begin") {
      const purpose = m["purpose"] as string
      if (phase.kind === "awaitFrames") {
        if (purpose !== phase.purpose) this.fail("snapshot frames", `purpose ${purpose} for an attach whose baseline is a(n) ${phase.purpose} (replay ${this.lastReplayStatus})`)
      } else if (phase.kind === "flowing") {
        if (purpose !== "resync" && purpose !== "replacement") this.fail("snapshot frames", `an unsolicited snapshot with purpose ${purpose}`)
      } else {
        this.fail("snapshot frames", `snapshot_begin in phase ${phase.kind}`)
      }
      this.phase = {
        kind: "snapshot",
        purpose,
        snapshotId: String(m["snapshotId"]),
        cursor: m["cursor"] as Cursor | undefined,
        messageCount: m["messageCount"] as number,
        messages: [],
        chunks: 0,
        attaching: phase.kind === "awaitFrames",
        lastAtAttach: phase.lastAtAttach
      }
      return
    }
    if (type === "session_snapshot_failed" && (phase.kind === "flowing" || phase.kind === "awaitFrames")) {
      // A resync that could not even begin: the client attaches again.
      this.phase = { kind: "detached" }
      return
    }
    if (phase.kind !== "snapshot") this.fail("snapshot frames", `${type} outside a snapshot (${phase.kind})`)
    if (m["snapshotId"] !== phase.snapshotId) this.fail("snapshot frames", `${type} of ${m["snapshotId"]} inside ${phase.snapshotId}`)
    if (type === "session_snapshot_chunk") {
      if (m["index"] !== phase.chunks) this.fail("snapshot frames", `chunk ${m["index"]}, expected ${phase.chunks}`)
      phase.chunks++
      for (const x of m["messages"] as Array<Msg>) phase.messages.push(foldedOf(x))
      return
    }
    if (type === "session_snapshot_failed") {
      // The client must attach again; the harness does (from no cursor).
      this.phase = { kind: "detached" }
      return
    }
    // end
    if (m["chunkCount"] !== phase.chunks) this.fail("snapshot frames", `end says ${m["chunkCount"]} chunks, ${phase.chunks} came`)
    if (phase.messages.length !== phase.messageCount) this.fail("snapshot frames", `begin says ${phase.messageCount} messages, ${phase.messages.length} came`)
    this.baseline(phase.messages, phase.cursor, phase.purpose)
    if (phase.purpose !== "attach") this.resyncs++
    const next: Expectation = { kind: "start", cursor: phase.cursor }
    this.phase = phase.attaching
      ? { kind: "awaitAttached", next, lastAtAttach: phase.lastAtAttach }
      : { kind: "flowing", next, lastAtAttach: phase.lastAtAttach }
  }

  private sequenced(m: Msg): void {
    const c = m["meta"]?.cursor as Cursor | undefined
    if (c === undefined || !Number.isInteger(c.generation) || !Number.isInteger(c.sequence)) this.fail("event shape", `${describeMsg(m)} has no valid meta.cursor`)
    const where = `[${this.label}] ${describeMsg(m)}`
    const phase = this.phase
    if (phase.kind !== "flowing") this.fail("attach order", `sequenced event ${describeMsg(m)} in phase ${phase.kind}`)
    this.truth.see(m, where)
    const next = phase.next
    if (next.kind === "after") {
      const p = next.cursor
      const sameGen = c.generation === p.generation && c.sequence === p.sequence + 1
      const laterGen = c.generation > p.generation && c.sequence === 0
      // A kill ends a client still catching up with session_closed right after what it was
      // sent (the history it lacked moves to the archive): a jump forward to it is no gap.
      const closedAhead = m["type"] === "session_closed" && compareCursor(c, p) > 0
      if (!sameGen && !laterGen && !closedAhead) this.fail("cursor order, each once, no gap", `${describeMsg(m)} does not follow ${fmtCursor(p)}`)
      if (laterGen && !closedAhead) this.truth.jumps.push({ from: p, to: c, where: `${where} (after ${this.recent.slice(-6, -1).join(", ")})`, kind: "continue" })
    } else if (!(m["type"] === "session_closed" && (next.cursor === undefined || compareCursor(c, next.cursor) > 0))) {
      if (c.sequence !== 0 || (next.cursor !== undefined && c.generation <= next.cursor.generation)) {
        this.fail("no gap after a baseline", `${describeMsg(m)} is not the start of a generation after the snapshot's cursor ${fmtCursor(next.cursor)}`)
      }
      this.truth.jumps.push({ from: next.cursor, to: c, where: `${where} (after ${this.recent.slice(-40, -1).join(", ")})`, kind: "baseline" })
    }
    if (phase.lastAtAttach !== undefined && compareCursor(c, phase.lastAtAttach) <= 0 && m["meta"].replayed !== true) {
      this.fail("replayed flag", `${describeMsg(m)} existed at attach (last ${fmtCursor(phase.lastAtAttach)}) but is not flagged replayed`)
    }
    if (m["type"] === "session_status") {
      if (this.turnEnded && m["state"]?.busy !== false) {
        this.fail("an idle status after a turn's end", `${describeMsg(m)} is the first status after the turn's end`)
      }
      this.turnEnded = false
    } else if (m["type"] === "session_event" && (m["event"]?.type === "agent_end" || m["event"]?.type === "turn_interrupted")) {
      if (m["event"].type === "turn_interrupted" && !INTERRUPT_REASONS.has(m["event"].reason)) {
        this.fail("turn_interrupted reasons", `${describeMsg(m)} names no documented reason`)
      }
      this.turnEnded = true
    }
    this.phase = { kind: "flowing", next: { kind: "after", cursor: c }, lastAtAttach: phase.lastAtAttach }
    this.last = c
    this.events++
    if (m["type"] === "session_event" && m["event"]?.type === "message_end") this.fold?.push(foldedOf(m["event"].message))
    if (m["type"] === "session_closed") this.phase = { kind: "closed" }
    this.onEvent?.(m)
  }
}
